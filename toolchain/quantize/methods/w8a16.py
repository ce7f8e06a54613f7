"""W8A16: int8 weights per output channel, float activations. PREFIX.weight int8 [out, in] and
PREFIX.weights_scaling_factor float32 [out]; the graph dequantizes along axis 0."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from toolchain.checkpoint.safetensors_io import TensorInfo
from toolchain.quantize.core import quantize_per_channel
from toolchain.quantize.methods.base import WEIGHT, WEIGHT_SCALE, Context, GraphBuilder, QuantMethod, Stored, info


class PerChannelInt8(QuantMethod):
    """int8 codes with one scale per output channel: W8A16's weights, and SmoothQuant's (of the smoothed weight)."""

    suffixes: ClassVar[tuple[str, ...]] = (WEIGHT, WEIGHT_SCALE)

    def plan(self, prefix: str, shape: tuple[int, ...], ctx: Context) -> dict[str, TensorInfo]:
        out_dim, in_dim = shape
        return {
            **info(f"{prefix}.{WEIGHT}", torch.int8, out_dim, in_dim),
            **info(f"{prefix}.{WEIGHT_SCALE}", torch.float32, out_dim),
        }

    def quantize(
        self, prefix: str, weight: torch.Tensor, ctx: Context, prepared: Any = None
    ) -> dict[str, torch.Tensor]:
        codes, scale = quantize_per_channel(weight)
        return {f"{prefix}.{WEIGHT}": codes, f"{prefix}.{WEIGHT_SCALE}": scale}

    def dequantize(self, s: Stored) -> torch.Tensor:
        return s[WEIGHT].float() * s.weight_scale()[:, None]

    def export_weight(self, b: GraphBuilder, s: Stored) -> str:
        scale = b.const(s.name(WEIGHT_SCALE), s.weight_scale())
        return b.op("DequantizeLinear", [b.const(s.name(WEIGHT), s[WEIGHT]), scale], f"{s.prefix}.weight_dq", axis=0)


class W8A16(PerChannelInt8):
    quant_algo = "W8A16"
