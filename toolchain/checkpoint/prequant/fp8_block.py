"""Block-scaled FP8 checkpoints (`quant_method: "fp8"` with `weight_block_size`: Qwen3-*-FP8, DeepSeek-V3, what
transformers' FineGrainedFP8 writes and reads), read into the fp8_block layout (quantize/methods/fp8_block.py).

The format (transformers 5.25: utils/quantization_config.py `FineGrainedFP8Config`, integrations/finegrained_fp8.py
`FP8Linear` and `Fp8Dequantize._dequantize_one`): config.json `quantization_config` {quant_method "fp8",
activation_scheme "dynamic" | "static", weight_block_size [B0, B1], modules_to_not_convert}; per quantized linear
PREFIX.weight float8_e4m3fn [out, in] and PREFIX.weight_scale_inv float32 [ceil(out/B0), ceil(in/B1)], which —
despite its name — multiplies: w = weight · weight_scale_inv over each block (`_dequantize_one`: `q * s`).
Activations are quantized at run time per token in groups of B1 input channels (`FP8Linear.forward`,
`act_quant`), which is what `activation_scheme: dynamic` means and what our fp8_block method does.

We read square blocks B0 = B1 = B (config.json's group_size); TensorRT-LLM reads 128 x 128 only (it asserts
`weight_block_size == [128, 128]` in `ModelConfig.load_hf_quant_config`, tensorrt_llm/_torch/model_config.py).
Non-square blocks, static activation scales and a fused linear whose parts are not whole blocks are refused by name.
Linears without weight_scale_inv (modules_to_not_convert) stay float.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from toolchain.checkpoint.hf import HFCheckpoint, TensorReader
from toolchain.checkpoint.prequant import Array, Made, file_of, hf_prefix
from toolchain.checkpoint.safetensors_io import TORCH_NAMES
from toolchain.checkpoint.sharding import Rule
from toolchain.checkpoint.trtllm import ModelConfig, QuantConfig
from toolchain.errors import UserError

SCALE = "weight_scale_inv"
FLOAT_WEIGHTS = ("F64", "F32", "F16", "BF16")


def _blocks(n: int, b: int) -> int:
    return -(-n // b)


class BlockFP8:
    """A block-FP8 checkpoint (prequant.Format)."""

    name = "fp8-block"

    def __init__(self, ckpt: HFCheckpoint, q: dict[str, Any], source: str) -> None:
        self.warnings: list[str] = []
        self.ckpt, self.file, self.settings = ckpt, source, q
        block = q.get("weight_block_size")
        if block is None:
            raise UserError(
                f"{source}: quant_method fp8 without weight_block_size (per-tensor FP8 in transformers' form) is not "
                "one trtbuild reads; block-scaled FP8 (weight_block_size [128, 128]) and ModelOpt's FP8 export are"
            )
        pair = isinstance(block, list | tuple) and len(block) == 2
        if not (pair and all(isinstance(b, int) and b > 0 for b in block)):
            raise UserError(f"{source}: weight_block_size {block!r} must be two positive integers, e.g. [128, 128]")
        if block[0] != block[1]:
            raise UserError(
                f"{source}: weight_block_size {list(block)} is not square; trtbuild reads square blocks (TensorRT-LLM "
                "asserts [128, 128]). Re-quantize with square blocks"
            )
        scheme = str(q.get("activation_scheme", "dynamic")).lower()
        if scheme != "dynamic":
            raise UserError(
                f"{source}: activation_scheme {scheme!r}; block FP8 is read with dynamic activations (per token, "
                f"1 x {block[0]}) only, as TensorRT-LLM runs FP8_BLOCK_SCALES"
            )
        self.block = int(block[0])
        experts = sorted(n for n in ckpt.tensors if ".experts." in n and n.endswith(f".{SCALE}"))
        if experts:
            raise UserError(
                f"{ckpt.root}: quantized experts in a block-FP8 checkpoint ({experts[0]}, ...): not yet; convert a "
                "float checkpoint"
            )

    def quantization(self) -> QuantConfig:
        return QuantConfig(quant_algo="FP8_BLOCK_SCALES", group_size=self.block)

    def source(self) -> dict[str, Any]:
        return {
            "format": self.name,
            "quant_method": "fp8",
            "producer": "transformers FineGrainedFP8 layout",
            "version": None,
            "quant_algo": "FP8_BLOCK_SCALES",
            "file": self.file,
            "settings": self.settings,
        }

    def extras(self, cfg: ModelConfig) -> list[Made]:
        return []

    def linear(self, rule: Rule) -> list[Made] | None:
        prefixes = [hf_prefix(s) for s in rule.srcs]
        quantized = [f"{p}.{SCALE}" in self.ckpt.tensors for p in prefixes]
        if not any(quantized):
            for src in rule.srcs:
                info = self.ckpt.tensors.get(src)
                if info is not None and info.code not in FLOAT_WEIGHTS:
                    raise UserError(
                        f"{file_of(self.ckpt, src)}: {src} is {TORCH_NAMES[info.code]} but {hf_prefix(src)}.{SCALE} "
                        "is missing; a quantized weight needs its scale"
                    )
            return None
        if not all(quantized) or rule.transpose or rule.offset or rule.halves_swapped:
            raise UserError(
                f"{self.ckpt.root}: {rule.dst} fuses {', '.join(rule.srcs)}, of which only some are quantized; "
                "the parts of one GEMM are quantized together"
            )
        b = self.block
        weights, scales = list(rule.srcs), [f"{p}.{SCALE}" for p in prefixes]
        rows, width = 0, None
        for w, s in zip(weights, scales, strict=True):
            wi, si = self.ckpt.tensors[w], self.ckpt.tensors[s]
            if wi.code != "F8_E4M3" or len(wi.shape) != 2:
                raise UserError(
                    f"{file_of(self.ckpt, w)}: tensor {w} is {TORCH_NAMES[wi.code]}{list(wi.shape)}; block FP8 "
                    "stores float8_e4m3fn [out, in]"
                )
            out, inn = wi.shape
            want = (_blocks(out, b), _blocks(inn, b))
            if tuple(si.shape) != want or si.code not in FLOAT_WEIGHTS:
                raise UserError(
                    f"{file_of(self.ckpt, s)}: tensor {s} is {TORCH_NAMES[si.code]}{list(si.shape)}; weight {w} "
                    f"[{out}, {inn}] in blocks of {b} needs a float {list(want)}"
                )
            if len(weights) > 1 and out % b:
                raise UserError(
                    f"{self.ckpt.root}: {w} has {out} rows, not whole blocks of {b}: fused into {rule.dst} its last "
                    "block would straddle the next part. Not read"
                )
            if width is not None and inn != width:
                raise UserError(f"{self.ckpt.root}: {', '.join(weights)} disagree in input width")
            rows, width = rows + out, inn
        assert width is not None
        out_prefix = rule.dst.removesuffix(".weight")
        return [
            Made(f"{out_prefix}.weight", (rows, width), "float8_e4m3fn", tuple(weights), _concat(weights, None)),
            Made(
                f"{out_prefix}.weights_scaling_factor",
                (_blocks(rows, b), _blocks(width, b)),
                "float32",
                tuple(scales),
                _concat(scales, np.float32),
            ),
        ]


def _concat(names: list[str], cast: Any) -> Any:
    def make(reader: TensorReader) -> Array:
        parts = []
        for n in names:
            a = reader.get(n)
            if cast is not None:
                a = a.astype(cast)  # float32 holds every bfloat16 / float16 scale exactly
                if not np.isfinite(a).all() or (a <= 0).any():
                    raise UserError(
                        f"{reader.file_of(n)}: tensor {n} has NaN, infinite or non-positive scales; re-export it"
                    )
            parts.append(a)
        joined: Array = np.concatenate(parts, axis=0) if len(parts) > 1 else parts[0]
        return np.ascontiguousarray(joined)

    return make
