"""`quantize --format hf`: a quantized TensorRT-LLM checkpoint written as NVIDIA ModelOpt's unified Hugging Face
checkpoint, the layout vLLM, SGLang and TensorRT-LLM's PyTorch backend load (docs/quantization.md, "Handing weights
to another runtime"). The inverse of what convert reads (checkpoint/prequant/modelopt.py); every fact is ModelOpt
0.47's own code (modelopt/torch/export/, read in trtbuild's .venv):

- Files: `model.safetensors`, `config.json` (the model's Hugging Face config with `quantization_config`),
  `hf_quant_config.json` {"producer": {"name", "version"}, "quantization": {...}} (unified_export_hf.py, the
  writer of hf_quant_config.json; quant_utils.py `get_quant_config`). `quantization` holds quant_algo,
  kv_cache_quant_algo and exclude_modules, plus group_size, has_zero_point false and pre_quant_scale true for
  W4A16_AWQ and W4A8_AWQ, and group_size 16 for NVFP4 (quant_utils.py `process_layer_quant_config`).
  config.json's `quantization_config` is `convert_hf_quant_config_format` of it (convert_hf_config.py):
  config_groups for FP8 and NVFP4 only, `ignore`, `quant_algo`, `kv_cache_scheme`, `producer`,
  `quant_method: "modelopt"`. The producer is trtbuild.
- Tensors per quantized linear H (an HF module name; unified_export_hf.py `_export_quantized_weight`,
  quant_utils.py `to_quantized_weight`):
  FP8: H.weight float8_e4m3fn = w / weight_scale; H.weight_scale and H.input_scale float32 0-d (amax / 448).
  W4A16_AWQ: H.weight uint8 [out/2, in], int4 codes round(w / weight_scale) in [-8, 7], output row 2j in the low
  nibble and 2j+1 in the high one (`pack_int4_in_uint8`: the bytes of our w4a16 packing, reinterpreted);
  H.weight_scale float32 [out, in/G]; H.pre_quant_scale [in] (multiplies the input, as our prequant_scaling_factor).
  W4A8_AWQ: those plus H.weight_scale_2 (the FP8 stage's scale) and H.input_scale, float32 0-d.
  W8A16: H.weight int8 = round(w / weight_scale[:, None]); H.weight_scale float32 [out].
  NVFP4: H.weight uint8 [out, in/2] (two E2M1 a byte, the even input column low); H.weight_scale float8_e4m3fn
  [out, in/16]; H.weight_scale_2 and H.input_scale float32 0-d, both multiplying ("Dequant is ``nibble *
  weight_scale * weight_scale_2``") — our nvfp4 bytes under ModelOpt's names.
  FP8 KV cache: self_attn.k_proj.k_scale and self_attn.v_proj.v_scale float32 0-d (`postprocess_state_dict`:
  amax / 448); our one scale per layer is written to both (a reader takes max(k, v)).
- A fused linear of ours (q/k/v in attention.qkv) is split back into its projections by the family's own table
  (`weight_table`, each part's rows from `source_shapes`): its per-tensor scales go to every part, or one value
  each where the checkpoint keeps per-part scales (PREFIX.parts).

Refused by name: families other than Llama, Mistral, Qwen2 and Qwen3 (their inverse maps — Phi-3's fused rows,
Gemma's +1 norms, GPT-2's transposes, experts — are not written yet); methods ModelOpt's layout has no name for
here (w4a16: no AWQ scales; w8a8_sq and mxfp8: not yet); INT8 KV caches (ModelOpt's HF export has none); int4
linears whose input is not whole groups (ModelOpt's `_validate_int4_block_size`); a quantized lm_head tied to the
embedding.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from toolchain import __version__
from toolchain.checkpoint.registry import family_for
from toolchain.checkpoint.safetensors_io import SafetensorsWriter, TensorInfo, read_header, read_tensor
from toolchain.checkpoint.sharding import Rule
from toolchain.checkpoint.spec import spec_of
from toolchain.checkpoint.trtllm import ModelConfig, rank_file, read_config
from toolchain.errors import UserError
from toolchain.quantize.methods.base import ACTIVATION_SCALE, PARTS, PREQUANT, WEIGHT, WEIGHT_SCALE, WEIGHT_SCALE_2
from toolchain.quantize.methods.kv_cache import KV_SCALE
from toolchain.quantize.methods.nvfp4 import BLOCK as NVFP4_BLOCK

# architecture -> transformers' model_type: the families whose inverse maps are written
FAMILIES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
ALGOS = ("FP8", "W4A16_AWQ", "W8A16", "NVFP4", "W4A8_AWQ")  # quant_algo written (ModelOpt's names are the same)
INT4 = ("W4A16_AWQ", "W4A8_AWQ")  # two output rows a byte, whole groups of the input
KV_ALGOS = ("FP8",)
HF_QUANT_CONFIG = "hf_quant_config.json"
WEIGHTS_FILE = "model.safetensors"


@dataclass(frozen=True)
class _Out:
    """One tensor of the HF checkpoint: what it is, and how it is made from the rank file's tensors."""

    info: TensorInfo
    make: Callable[[Callable[[str], torch.Tensor]], torch.Tensor]


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """The Hugging Face config.json our converter reads back as `cfg` (the inverse of llama.llama_style_config
    and the Mistral / Qwen2 / Qwen3 additions)."""
    arch = cfg.architecture
    hf: dict[str, Any] = {
        "architectures": [arch],
        "model_type": FAMILIES[arch],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_size,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.norm_epsilon,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": cfg.rotary_base,
        "rope_scaling": cfg.rotary_scaling,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "torch_dtype": cfg.dtype,
    }
    if arch != "Qwen2ForCausalLM":  # Qwen2 always has q/k/v biases and no attention_bias field
        hf["attention_bias"] = cfg.attn_bias
    if arch == "LlamaForCausalLM":
        hf["mlp_bias"] = cfg.mlp_bias
    if arch == "MistralForCausalLM":
        hf["sliding_window"] = cfg.sliding_window
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        types = cfg.family_fields.get("layer_types")
        hf["use_sliding_window"] = types is not None
        if types is not None:
            hf.update(sliding_window=cfg.sliding_window, layer_types=list(types))
    return hf


def quant_config(cfg: ModelConfig, exclude: list[str]) -> dict[str, Any]:
    """hf_quant_config.json, as ModelOpt's `get_quant_config` writes it for a model of one quant_algo."""
    q = cfg.quantization
    body: dict[str, Any] = {"quant_algo": q.quant_algo, "kv_cache_quant_algo": q.kv_cache_quant_algo}
    if q.quant_algo in INT4:
        body.update(group_size=q.group_size, has_zero_point=False, pre_quant_scale=True)
    if q.quant_algo == "NVFP4":
        body["group_size"] = NVFP4_BLOCK
    body["exclude_modules"] = sorted(exclude)
    return {"producer": {"name": "trtbuild", "version": __version__}, "quantization": body}


def quantization_config(hf_quant: dict[str, Any]) -> dict[str, Any]:
    """config.json's quantization_config: ModelOpt's `convert_hf_quant_config_format` of hf_quant_config.json for
    the algorithms written here."""
    body = hf_quant["quantization"]
    out: dict[str, Any] = {}
    if body["quant_algo"] == "FP8":
        out["config_groups"] = {
            "group_0": {
                "input_activations": {"dynamic": False, "num_bits": 8, "type": "float"},
                "weights": {"dynamic": False, "num_bits": 8, "type": "float"},
                "targets": ["Linear"],
            }
        }
    if body["quant_algo"] == "NVFP4":
        fp4 = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": body["group_size"]}
        out["config_groups"] = {"group_0": {"input_activations": fp4, "weights": dict(fp4), "targets": ["Linear"]}}
    out["ignore"] = body["exclude_modules"]
    if body["quant_algo"]:
        out["quant_algo"] = body["quant_algo"]
    if body["kv_cache_quant_algo"] == "FP8":
        out["kv_cache_scheme"] = {"dynamic": False, "num_bits": 8, "type": "float"}
    out["producer"] = hf_quant["producer"]
    out["quant_method"] = "modelopt"
    return out


def check_exportable(cfg: ModelConfig, source: str, linears: list[str] | None = None) -> None:
    """Refuse, naming it, what this writer does not write (before anything is quantized or written); `linears`:
    those to be quantized, whose input must be whole int4 groups."""
    if cfg.architecture not in FAMILIES:
        raise UserError(
            f"{source}: --format hf writes {', '.join(FAMILIES)} checkpoints, not {cfg.architecture} (its inverse "
            "name map is not written yet); use --format trtllm"
        )
    q = cfg.quantization
    if q.quant_algo is not None and q.quant_algo not in ALGOS:
        raise UserError(
            f"{source}: --format hf writes quant_algo {', '.join(ALGOS)} (methods fp8, w4a16_awq, w8a16, nvfp4, "
            f"w4a8_awq), not {q.quant_algo}; use --format trtllm or one of those methods"
        )
    if q.kv_cache_quant_algo is not None and q.kv_cache_quant_algo not in KV_ALGOS:
        raise UserError(
            f"{source}: --format hf writes an FP8 KV cache or none, not {q.kv_cache_quant_algo} (ModelOpt's HF "
            "layout has no INT8 KV cache scales; its NVFP4 k_scale / v_scale, amax / 448, is not written yet); use "
            "--kv-cache fp8, --kv-cache none or --format trtllm"
        )
    if cfg.tie_word_embeddings and "lm_head" in (linears or []):
        raise UserError(
            f"{source}: lm_head is tied to the embedding, and a Hugging Face checkpoint has no lm_head of its own to "
            "hold it quantized; keep it excluded (the default --exclude) or use --format trtllm"
        )
    if q.quant_algo in INT4:
        spec, g = spec_of(cfg), q.group_size
        for prefix in linears or []:
            if spec.in_features(prefix) % g:
                raise UserError(
                    f"{source}: {prefix} has {spec.in_features(prefix)} input channels, not whole groups of {g}; "
                    "ModelOpt's int4 layout has no partial groups (`_validate_int4_block_size`): choose a group "
                    "size that divides it, --exclude it, or use --format trtllm"
                )


def _hf_prefix(name: str) -> str:
    return name.removesuffix(".weight")


class _Writer:
    def __init__(self, src: Path) -> None:
        self.src, self.cfg = src, read_config(src)
        check_exportable(self.cfg, str(src))
        self.header, _ = read_header(src / rank_file(0))
        self.used: set[str] = set()
        self.out: dict[str, _Out] = {}
        self.hf_modules: dict[str, list[str]] = {"lm_head": ["lm_head"]}  # our module -> the HF modules it holds
        self.spec = spec_of(self.cfg)

    def tensor(self, name: str) -> TensorInfo:
        if name not in self.header:
            raise UserError(f"{self.src / rank_file(0)}: {name} missing; re-run quantize")
        self.used.add(name)
        return self.header[name]

    def add(self, name: str, dtype: torch.dtype, shape: tuple[int, ...], make: Callable[..., torch.Tensor]) -> None:
        self.out[name] = _Out(TensorInfo(name, dtype, shape), make)

    def rows(self, hf: str, src: str, start: int, stop: int, as_dtype: torch.dtype | None = None) -> None:
        """HF tensor `hf` = rows [start, stop) of rank tensor `src` (its bytes reinterpreted as `as_dtype`)."""
        info = self.tensor(src)
        dtype = as_dtype or info.dtype

        def make(read: Callable[[str], torch.Tensor]) -> torch.Tensor:
            return read(src)[start:stop].view(dtype)

        self.add(hf, dtype, (stop - start, *info.shape[1:]), make)

    def scalar(self, hf: str, src: str, index: int) -> None:
        """A 0-d float32 HF scale: value `index` of rank tensor `src` ([1], or one per part)."""
        self.tensor(src)
        self.add(hf, torch.float32, (), lambda read: read(src).float().reshape(-1)[index].clone())

    def copy(self, hf: str, src: str) -> None:
        info = self.tensor(src)
        self.add(hf, info.dtype, info.shape, lambda read: read(src))

    def rule(self, rule: Rule, shapes: dict[str, tuple[int, ...]]) -> None:
        if rule.transpose or rule.offset or rule.halves_swapped or rule.experts or rule.packing or rule.interleaved:
            raise UserError(f"--format hf: {rule.dst} is not a plain concatenation of {', '.join(rule.srcs)}")
        if rule.dst == "lm_head.weight" and rule.srcs == ("model.embed_tokens.weight",):  # tied: HF has no lm_head
            if f"lm_head.{WEIGHT_SCALE}" in self.header:
                raise UserError(
                    f"{self.src}: lm_head is quantized but tied to the embedding; re-quantize with lm_head "
                    "excluded (the default) or untie the embedding"
                )
            self.tensor(rule.dst)
            return
        prefix = rule.dst.removesuffix(".weight")
        self.hf_modules.setdefault(prefix, [_hf_prefix(s) for s in rule.srcs])
        counts = [shapes[s][0] for s in rule.srcs]
        bounds = [sum(counts[:i]) for i in range(len(counts) + 1)]
        parts = list(zip(rule.srcs, bounds, bounds[1:], strict=False))
        if rule.dst.endswith(".weight") and f"{prefix}.{WEIGHT_SCALE}" in self.header:
            self.quantized(prefix, parts)
            return
        if len(rule.srcs) == 1:
            self.copy(rule.srcs[0], rule.dst)
        else:
            for hf, start, stop in parts:
                self.rows(hf, rule.dst, start, stop)

    def quantized(self, prefix: str, parts: list[tuple[str, int, int]]) -> None:
        algo, w = self.cfg.quantization.quant_algo, f"{prefix}.{WEIGHT}"
        per_part = f"{prefix}.{PARTS}" in self.header
        if per_part:
            self.tensor(f"{prefix}.{PARTS}")
        for i, (src, start, stop) in enumerate(parts):
            h = _hf_prefix(src)
            index = i if per_part else 0
            if algo == "FP8":
                self.rows(f"{h}.weight", w, start, stop)
                self.scalar(f"{h}.weight_scale", f"{prefix}.{WEIGHT_SCALE}", index)
                self.scalar(f"{h}.input_scale", f"{prefix}.{ACTIVATION_SCALE}", index)
            elif algo == "W8A16":
                self.rows(f"{h}.weight", w, start, stop)
                self.rows(f"{h}.weight_scale", f"{prefix}.{WEIGHT_SCALE}", start, stop)
            elif algo == "NVFP4":  # the same bytes: uint8 E2M1 pairs, E4M3 block scales, two float32 globals
                self.rows(f"{h}.weight", w, start, stop)
                self.rows(f"{h}.weight_scale", f"{prefix}.{WEIGHT_SCALE}", start, stop)
                self.scalar(f"{h}.weight_scale_2", f"{prefix}.{WEIGHT_SCALE_2}", index)
                self.scalar(f"{h}.input_scale", f"{prefix}.{ACTIVATION_SCALE}", index)
            else:  # W4A16_AWQ, W4A8_AWQ: two output rows a byte, the input whole groups
                in_dim, stored = self._in_features(prefix), self.tensor(w).shape[1]
                if stored != in_dim or (start % 2 or stop % 2):
                    raise UserError(
                        f"{self.src}: {prefix} has {in_dim} input channels, padded to {stored} (whole groups of "
                        f"{self.cfg.quantization.group_size}), or parts of odd rows; ModelOpt's int4 layout needs "
                        "whole groups and even rows (`pack_int4_in_uint8`): use --format trtllm or a group size "
                        "that divides the input"
                    )
                self.rows(f"{h}.weight", w, start // 2, stop // 2, as_dtype=torch.uint8)
                self.rows(f"{h}.weight_scale", f"{prefix}.{WEIGHT_SCALE}", start, stop)
                if f"{prefix}.{PREQUANT}" in self.header:
                    self.copy(f"{h}.pre_quant_scale", f"{prefix}.{PREQUANT}")
                if algo == "W4A8_AWQ":
                    self.scalar(f"{h}.weight_scale_2", f"{prefix}.{WEIGHT_SCALE_2}", index)
                    self.scalar(f"{h}.input_scale", f"{prefix}.{ACTIVATION_SCALE}", index)

    def _in_features(self, prefix: str) -> int:
        return self.spec.in_features(prefix)

    def kv_scales(self, hf_qkv: dict[int, tuple[str, str]]) -> None:
        if self.cfg.quantization.kv_cache_quant_algo is None:
            return
        for layer, (k, v) in sorted(hf_qkv.items()):
            src = f"transformer.layers.{layer}.{KV_SCALE}"
            self.scalar(f"{k}.k_scale", src, 0)
            self.scalar(f"{v}.v_scale", src, 0)

    def plan(self) -> None:
        _, family = family_for({"architectures": [self.cfg.architecture]}, str(self.src))
        available = set() if self.cfg.tie_word_embeddings else {"lm_head.weight"}
        shapes = family.source_shapes(self.cfg, available)
        table = family.weight_table(self.cfg, available)
        hf_qkv: dict[int, tuple[str, str]] = {}
        for rule in table:
            if rule.dst not in self.header:
                continue  # a bias or norm this model does not have
            self.rule(rule, shapes)
            if rule.dst.endswith(".attention.qkv.weight"):
                layer = int(rule.dst.split(".")[2])
                hf_qkv[layer] = (_hf_prefix(rule.srcs[1]), _hf_prefix(rule.srcs[2]))
        self.kv_scales(hf_qkv)
        left = sorted(set(self.header) - self.used)
        if left:
            raise UserError(
                f"{self.src / rank_file(0)}: {', '.join(left[:4])} not written by --format hf; use --format trtllm"
            )

    def excluded(self) -> list[str]:
        """config.json's exclude_modules in HF names, as ModelOpt lists them: the float linears and the embedding
        (its `get_quant_config` names every module that has quantizers and none enabled)."""
        names: list[str] = []
        for module in self.cfg.quantization.exclude_modules or []:
            if module not in self.hf_modules:
                raise UserError(f"{self.src}: exclude_modules entry {module!r} is no module of this model")
            names.extend(self.hf_modules[module])
        return sorted(set(names))

    def write(self, dst: Path) -> None:
        names = sorted(self.out)
        path = self.src / rank_file(0)
        with (
            path.open("rb") as f,
            SafetensorsWriter(dst / WEIGHTS_FILE, [self.out[n].info for n in names], {"format": "pt"}) as writer,
        ):

            def read(name: str) -> torch.Tensor:
                return read_tensor(f, self.header[name])

            for name in names:
                writer.write(name, self.out[name].make(read).contiguous())
        hf_quant = quant_config(self.cfg, self.excluded())
        config = {**hf_config(self.cfg), "quantization_config": quantization_config(hf_quant)}
        if self.cfg.quantization.quant_algo or self.cfg.quantization.kv_cache_quant_algo:
            (dst / HF_QUANT_CONFIG).write_text(json.dumps(hf_quant, indent=4) + "\n")
        else:  # a float checkpoint: no quantization to describe
            del config["quantization_config"]
        (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def write_hf(src: Path, dst: Path) -> list[str]:
    """Write TensorRT-LLM checkpoint `src` (ours, one rank) into the existing directory `dst` as ModelOpt's unified
    HF checkpoint; returns the files written."""
    writer = _Writer(src)
    writer.plan()
    writer.write(dst)
    written = [WEIGHTS_FILE, "config.json"]
    return [*written, HF_QUANT_CONFIG] if (dst / HF_QUANT_CONFIG).exists() else written
