"""Which modules a quantized checkpoint quantizes, and how their tensors are read back.

Layout (TensorRT-LLM's, read from its sources in docs/research/trtllm-quantized-layouts.md; how the engine graph
reads it: docs/engine.md): each method's module under methods/ states its tensors (w8a16.py, w4a16.py,
w4a16_awq.py, w8a8_sq.py, fp8.py, kv_cache.py). Every scale is a dequantization factor: value = code * scale.
"""

from __future__ import annotations

import fnmatch

import torch

from toolchain.checkpoint.spec import ModelSpec
from toolchain.checkpoint.trtllm import ModelConfig
from toolchain.errors import UserError
from toolchain.quantize.methods.registry import by_algo

GROUP_SIZES = (32, 64, 128)
DEFAULT_EXCLUDE = ("lm_head",)


def quantizable(spec: ModelSpec) -> list[str]:
    """Linear-layer prefixes that may be quantized, from the model description: every layer's linears, and
    lm_head."""
    return [*sorted(p for layer in spec.layers for p in layer.linears()), "lm_head"]


def excluded(prefix: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(prefix, p) or fnmatch.fnmatchcase(prefix, f"*{p}") for p in patterns)


def dequantize(cfg: ModelConfig, spec: ModelSpec, weights: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    """The float weight [out, in] a quantized PREFIX stores; a `prequant_scaling_factor`, when there is one, still
    multiplies the input (the engine applies it to the input before any activation quantization)."""
    method = by_algo(cfg.quantization.quant_algo)
    if method is None:
        raise UserError(f"config.json: quantization.quant_algo is null, yet {prefix} has weights_scaling_factor")
    scale = weights[f"{prefix}.weights_scaling_factor"].float()
    return method.dequantize(weights[f"{prefix}.weight"], scale, spec.in_features(prefix))
