"""Pre-quantized Hugging Face checkpoints: found by `convert` from config.json's `quantization_config` (or
ModelOpt's `hf_quant_config.json`) and read into one of our quantization methods' checkpoint layouts without a
float detour (docs/conversion.md, "Pre-quantized checkpoints").

A `Format` (one module per producer: modelopt.py, compressed.py, gptq.py, awq.py, fp8_block.py) says which
TensorRT-LLM `quant_algo` the checkpoint becomes (hence which method of quantize/methods/ owns its linears) and, for
each weight rule of the family's table (checkpoint/sharding.py `Rule`), either None (the linear stays float: not
quantized, or excluded) or the tensors of our layout that replace it, each a `Made`: our name, shape and dtype,
the HF tensors it reads, and how (numpy: convert never imports torch). Everything else of convert is unchanged:
float tensors go through the family's rules, sources nobody reads are refused by name, nothing is half-written.

A reader must be exact: the method's `dequantize` of what it makes equals the producer's own dequantization, bit
for bit in float32 where the arithmetic allows (tests/prequant). A tensor that does not fit (shape, dtype, a
missing scale) is refused naming it; so is a `quant_method` we do not read, naming those we do.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from toolchain.checkpoint.hf import HFCheckpoint, TensorReader, load_json
from toolchain.checkpoint.sharding import Rule
from toolchain.checkpoint.trtllm import ModelConfig, QuantConfig
from toolchain.errors import UserError

Array = np.ndarray[Any, Any]
HF_QUANT_CONFIG = "hf_quant_config.json"  # ModelOpt's unified export writes it beside config.json

# quantization_config.quant_method -> the Format reading it ("module:Class" under this package)
READERS: dict[str, str] = {
    "modelopt": "modelopt:ModelOptHF",  # NVIDIA ModelOpt's unified HF export (export_hf_checkpoint)
    "compressed-tensors": "compressed:CompressedTensors",  # llm-compressor / compressed-tensors
    "gptq": "gptq:Gptq",  # gptqmodel (AutoGPTQ's format, v1 and v2)
    "awq": "awq:AwqGemm",  # AutoAWQ's GEMM packing
    "fp8": "fp8_block:BlockFP8",  # block-scaled FP8 (weight_block_size, weight_scale_inv): Qwen3-*-FP8, DeepSeek
}

# quant_methods a family reads itself: gpt-oss's MXFP4 experts, dequantized exactly by checkpoint/mxfp4.py
FAMILY_READ = ("mxfp4",)


@dataclass(frozen=True)
class Made:
    """One tensor of our layout a format makes: `name` (TensorRT-LLM's, as the method reads it), its shape and
    safetensors dtype name ("float32", "float8_e4m3fn", "uint8", "int8", "int64", ...), the HF tensors it reads
    (they count as consumed) and `make(reader)`, which reads them and returns the array."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    srcs: tuple[str, ...]
    make: Callable[[TensorReader], Array] = field(compare=False)


class Format(Protocol):
    """A pre-quantized checkpoint as a producer wrote it."""

    name: str  # the producer's format: "modelopt", "compressed-tensors", ...
    warnings: list[str]  # what the conversion reads other than exactly (convert prints them, the manifest keeps them)

    def quantization(self) -> QuantConfig:
        """config.json's `quantization` of the converted checkpoint: the method's quant_algo, KV cache, group size,
        zero points, prequant, excluded modules."""
        ...

    def source(self) -> dict[str, Any]:
        """What the manifest records (details.quantization_source): format, quant_method, producer and its
        version, our quant_algo, the producer's settings as written."""
        ...

    def linear(self, rule: Rule) -> list[Made] | None:
        """The tensors replacing weight rule `rule` (dst PREFIX.weight, srcs the HF weights it fuses), or None when
        those sources are stored unquantized (the rule then converts as a float one)."""
        ...

    def extras(self, cfg: ModelConfig) -> list[Made]:
        """Tensors that belong to no weight rule: KV cache scales."""
        ...


def quantization_config(ckpt: HFCheckpoint) -> tuple[dict[str, Any], str] | None:
    """The checkpoint's quantization description and the file it came from; None for a float checkpoint.
    ModelOpt's hf_quant_config.json is the more complete of its two (config.json's is derived from it)."""
    hf_quant = ckpt.root / HF_QUANT_CONFIG
    if hf_quant.is_file():
        data = load_json(hf_quant)
        return {"quant_method": "modelopt", **data}, str(hf_quant)
    q = ckpt.config.get("quantization_config")
    if q is None:
        return None
    source = str(ckpt.root / "config.json")
    if not isinstance(q, dict):
        raise UserError(f"{source}: quantization_config must be an object, got {type(q).__name__}")
    return q, source


def detect(ckpt: HFCheckpoint) -> Format | None:
    """The format of a pre-quantized checkpoint, None for a float one; an unknown quant_method is refused."""
    found = quantization_config(ckpt)
    if found is None:
        return None
    q, source = found
    method = q.get("quant_method")
    if method in FAMILY_READ:
        return None
    if method not in READERS:
        raise UserError(
            f"{source}: quantization_config.quant_method {method!r} is not one trtbuild reads; supported: "
            f"{', '.join(READERS)}. Convert a float checkpoint instead (and quantize it with `trtbuild quantize`)"
        )
    module, cls = READERS[method].split(":")
    reader: Callable[[HFCheckpoint, dict[str, Any], str], Format] = getattr(
        importlib.import_module(f"toolchain.checkpoint.prequant.{module}"), cls
    )
    return reader(ckpt, q, source)


def hf_prefix(src: str) -> str:
    """model.layers.0.self_attn.q_proj.weight -> model.layers.0.self_attn.q_proj"""
    return src.removesuffix(".weight")


def file_of(ckpt: HFCheckpoint, name: str) -> Path:
    return ckpt.files.get(name, ckpt.root)


def kv_merge_warning(where: str, scales: list[tuple[int, float, float]]) -> str | None:
    """The line convert prints where some layers' k_scale and v_scale differ (layer, k, v each): our KV cache holds
    one FP8 scale per layer, so it takes max(k, v) as TensorRT-LLM does (trtllm.kv_cache_scale), which re-rounds the
    other's values: what TensorRT-LLM runs, not bit for bit the producer's model (docs/conversion.md gives the cost
    measured). None where every layer's two agree."""
    differ = [(layer, k, v) for layer, k, v in scales if k != v]
    if not differ:
        return None
    ratio = max(max(k, v) / min(k, v) for _, k, v in differ)
    return (
        f"{where}: k_scale and v_scale differ in {len(differ)} of {len(scales)} layers (up to {ratio:.3g}x); "
        "the FP8 KV cache takes their max per layer, as TensorRT-LLM does, so KV values are re-rounded: "
        "not the producer's model bit for bit"
    )


def positive_scales(reader: TensorReader, name: str) -> Array:
    """Tensor `name` of scales as float32 (float16 / bfloat16 / float32 widen exactly), refused in one line unless
    every value is finite and positive: a zero scale divides by zero at run time and a negative one flips the
    weight's sign, so no producer writes either (they clamp to eps)."""
    values: Array = np.asarray(reader.get(name)).astype(np.float32)
    bad = ~np.isfinite(values) | (values <= 0)
    if bad.any():
        first = values.reshape(-1)[int(np.argmax(bad.reshape(-1)))]
        raise UserError(
            f"{reader.file_of(name)}: tensor {name} has {int(bad.sum())} scale(s) that are not finite and positive "
            f"(e.g. {first}); re-export the checkpoint"
        )
    return values
