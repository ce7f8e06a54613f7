"""FP8: E4M3 weights and activations, per-tensor static scales. PREFIX.weight float8_e4m3fn [out, in];
PREFIX.weights_scaling_factor and PREFIX.activation_scaling_factor float32 [1].

mlp.fc and mlp.gate share their scales where both are quantized: TensorRT-LLM fuses the two into one GEMM with
one per-tensor scale, max(gate scale, fc scale), re-quantizing the FP8 weights to it (`fuse_gate_mlp`,
tensorrt_llm/models/modeling_utils.py); ModelOpt's export gives both that max amax up front
(`preprocess_linear_fusion`, modelopt/torch/export/quant_utils.py). So `prepare` takes the max |w| of the two
before either is quantized, and the fused pair's activation scale is the max of the two inputs' too.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import reduce
from typing import Any

import torch

from toolchain.checkpoint.safetensors_io import TensorInfo
from toolchain.quantize.core import FP8_E4M3_MAX, quantize_fp8
from toolchain.quantize.methods.base import (
    ACTIVATION_SCALE,
    WEIGHT,
    WEIGHT_SCALE,
    Context,
    GraphBuilder,
    Layer,
    QuantMethod,
    Stored,
    info,
)
from toolchain.quantize.methods.w8a8_sq import activation_scale


@dataclass(frozen=True)
class Fused:
    """What linears fused into one GEMM (the spec's group reading one input: mlp.fc with mlp.gate) share: the
    largest |w| of them all, and the linears whose input maxima set the one activation scale."""

    weight_amax: torch.Tensor
    linears: tuple[str, ...]


class FP8(QuantMethod):
    quant_algo = "FP8"
    suffixes = (WEIGHT, WEIGHT_SCALE, ACTIVATION_SCALE)
    needs_calibration = True
    streamable = False
    activation_kind = "FP8"

    def plan(self, prefix: str, shape: tuple[int, ...], ctx: Context) -> dict[str, TensorInfo]:
        out_dim, in_dim = shape
        return {
            **info(f"{prefix}.{WEIGHT}", torch.float8_e4m3fn, out_dim, in_dim),
            **info(f"{prefix}.{WEIGHT_SCALE}", torch.float32, 1),
            **info(f"{prefix}.{ACTIVATION_SCALE}", torch.float32, 1),
        }

    def prepare(self, layer: Layer, ctx: Context) -> dict[str, Any]:
        """What each linear of a fused group (the layer spec's linears reading one input, more than one and all
        quantized: mlp.fc with mlp.gate) shares with the others, by prefix."""
        shared: dict[str, Fused] = {}
        for group in layer.spec.input_groups() if layer.spec else []:
            if len(group) > 1 and all(p in layer.linears for p in group):
                amax = reduce(torch.maximum, [layer.tensors[f"{p}.weight"].abs().amax() for p in group])
                shared.update(dict.fromkeys(group, Fused(amax, tuple(group))))
        return shared

    def quantize(
        self, prefix: str, weight: torch.Tensor, ctx: Context, prepared: Any = None
    ) -> dict[str, torch.Tensor]:
        fused = prepared if isinstance(prepared, Fused) else None
        codes, scale = quantize_fp8(weight, fused.weight_amax if fused else None)
        linears = fused.linears if fused else (prefix,)  # fused: one activation scale too (the max)
        act = activation_scale(max(ctx.calib.input_amax[p] for p in linears), FP8_E4M3_MAX)
        return {
            f"{prefix}.{WEIGHT}": codes,
            f"{prefix}.{WEIGHT_SCALE}": scale,
            f"{prefix}.{ACTIVATION_SCALE}": act,
        }

    def dequantize(self, s: Stored) -> torch.Tensor:
        return s[WEIGHT].float() * s.weight_scale()

    def export_weight(self, b: GraphBuilder, s: Stored) -> str:
        scale = b.const(s.name(WEIGHT_SCALE), s.weight_scale().reshape(()))
        return b.op("DequantizeLinear", [b.const(s.name(WEIGHT), s[WEIGHT]), scale], f"{s.prefix}.weight_dq")
