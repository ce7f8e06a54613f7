"""Which modules a quantized checkpoint quantizes, and which method reads a quantized linear's tensors back.

Layout (TensorRT-LLM's, read from its sources in docs/research/trtllm-quantized-layouts.md; how the engine graph
reads it: docs/engine.md): each method's module under methods/ states and reads its tensors (w8a16.py, w4a16.py,
w4a16_awq.py, w8a8_sq.py, fp8.py, kv_cache.py). Every scale is a dequantization factor: value = code * scale.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping

import torch

from toolchain.checkpoint.spec import ExpertsFFN, ModelSpec
from toolchain.checkpoint.trtllm import ModelConfig
from toolchain.errors import UserError
from toolchain.quantize.methods.base import WEIGHT_SCALE, QuantMethod, Stored

DEFAULT_EXCLUDE = ("lm_head",)


def routers(spec: ModelSpec) -> list[str]:
    """The mixture-of-experts layers' routers: kept float32, as TensorRT-LLM keeps its router (config.json's
    exclude_modules lists them)."""
    return [f"{ls.prefix}.mlp.router" for ls in spec.layers if isinstance(ls.ffn, ExpertsFFN)]


def quantizable(spec: ModelSpec) -> list[str]:
    """Linear-layer prefixes that may be quantized, from the model description: every layer's linears but a
    router, and lm_head."""
    kept = set(routers(spec))
    return [*sorted(p for layer in spec.layers for p in layer.linears() if p not in kept), "lm_head"]


def excluded(prefix: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(prefix, p) or fnmatch.fnmatchcase(prefix, f"*{p}") for p in patterns)


def stored(
    method: QuantMethod | None, cfg: ModelConfig, spec: ModelSpec, tensors: Mapping[str, torch.Tensor], prefix: str
) -> tuple[QuantMethod, Stored]:
    """Quantized linear PREFIX of a checkpoint (config.json `cfg`, `method` its quant_algo's) and what its method
    reads it back from; refused where quant_algo is null (no method owns its tensors)."""
    if method is None:
        raise UserError(f"config.json: quantization.quant_algo is null, yet {prefix} has {WEIGHT_SCALE}")
    return method, Stored(prefix, tensors, spec.in_features(prefix), cfg.quantization.group_size)
