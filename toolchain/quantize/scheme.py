"""Which modules a quantized checkpoint quantizes, and how their tensors are named, shaped and read back.

Layout (TensorRT-LLM's, read from its sources in docs/research/trtllm-quantized-layouts.md; how the engine graph
reads it: docs/engine.md), per quantized linear PREFIX:
- W8A16: PREFIX.weight int8 [out, in]; PREFIX.weights_scaling_factor float32 [out] (per output channel).
- W4A16: PREFIX.weight int8 [out/2, in'] — int4 codes packed two output rows per byte, row 2j in the low nibble —
  and PREFIX.weights_scaling_factor float32 [out, in'/group]; in' = in rounded up to a multiple of the group, the
  extra input channels zero (exact for any input, since they multiply zeros).
- W4A16_AWQ: as W4A16, of the weight scaled per input channel by AWQ's s, plus PREFIX.prequant_scaling_factor
  [in] = 1/s in the model dtype, which multiplies the input at run time.
- W8A8_SQ_PER_CHANNEL (SmoothQuant): PREFIX.weight int8 [out, in] of the smoothed weight; weights_scaling_factor
  float32 [out]; activation_scaling_factor float32 [1] (static, per tensor, of the smoothed input); and, for the
  linears with no norm in front (attention.dense, mlp.proj), prequant_scaling_factor [in] = 1/s in the model dtype
  — the others' 1/s is folded into their norm's weight (and bias).
- FP8: PREFIX.weight float8_e4m3fn [out, in]; PREFIX.weights_scaling_factor and PREFIX.activation_scaling_factor
  float32 [1].
- KV cache (INT8 / FP8): LAYER.attention.kv_cache_scaling_factor float32 [1].
Every scale is a dequantization factor: value = code * scale.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Collection

import torch

from toolchain.checkpoint.trtllm import ModelConfig
from toolchain.quantize.core import FP8_E4M3_MAX, dequantize_groupwise, unpack_int4

METHODS = {
    "w8a16": "W8A16",
    "w4a16": "W4A16",
    "w4a16_awq": "W4A16_AWQ",
    "w8a8_sq": "W8A8_SQ_PER_CHANNEL",
    "fp8": "FP8",
}
# quant_algo -> how its activations are quantized at run time (static per-tensor scale), when they are
ACTIVATION_KIND = {"W8A8_SQ_PER_CHANNEL": "INT8", "FP8": "FP8"}
KV_CACHE = {"none": None, "int8": "INT8", "fp8": "FP8"}
KV_MAXBOUND = {"INT8": 127.0, "FP8": FP8_E4M3_MAX}
GROUP_SIZES = (32, 64, 128)
DEFAULT_EXCLUDE = ("lm_head",)
_LINEARS = ("attention.qkv", "attention.dense", "mlp.fc", "mlp.gate", "mlp.proj")


def quantizable(weights: Collection[str]) -> list[str]:
    """Linear-layer prefixes that may be quantized, from the tensor names: every layer's linears, and lm_head."""
    prefixes = [n.removesuffix(".weight") for n in weights if n.endswith(tuple(f"{m}.weight" for m in _LINEARS))]
    return sorted(prefixes) + (["lm_head"] if "lm_head.weight" in weights else [])


def excluded(prefix: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(prefix, p) or fnmatch.fnmatchcase(prefix, f"*{p}") for p in patterns)


def in_features(cfg: ModelConfig, prefix: str) -> int:
    if prefix.endswith("attention.dense"):
        return cfg.num_attention_heads * cfg.head_size
    if prefix.endswith("mlp.proj"):
        return cfg.intermediate_size
    return cfg.hidden_size  # qkv, fc, gate, lm_head


def dequantize(cfg: ModelConfig, weights: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    """The float weight [out, in] a quantized PREFIX stores; a `prequant_scaling_factor`, when there is one, still
    multiplies the input (the engine applies it to the input before any activation quantization)."""
    algo = cfg.quantization.quant_algo
    codes, scale = weights[f"{prefix}.weight"], weights[f"{prefix}.weights_scaling_factor"].float()
    if algo in ("W8A16", "W8A8_SQ_PER_CHANNEL"):
        return codes.float() * scale[:, None]
    if algo in ("W4A16", "W4A16_AWQ"):
        return dequantize_groupwise(unpack_int4(codes), scale)[:, : in_features(cfg, prefix)]
    if algo == "FP8":
        return codes.float() * scale
    raise AssertionError(f"unknown quant_algo {algo}")
