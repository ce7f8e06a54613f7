"""W8A16: int8 weights per output channel, float activations. PREFIX.weight int8 [out, in] and
PREFIX.weights_scaling_factor float32 [out]; the graph dequantizes along axis 0."""

from __future__ import annotations

from typing import Any

import torch

from toolchain.checkpoint.safetensors_io import TensorInfo
from toolchain.quantize.core import quantize_per_channel
from toolchain.quantize.methods.base import Context, GraphBuilder, QuantMethod, info


class PerChannelInt8(QuantMethod):
    """int8 codes with one scale per output channel: W8A16's weights, and SmoothQuant's (of the smoothed weight)."""

    def plan(self, prefix: str, shape: tuple[int, ...], ctx: Context) -> dict[str, TensorInfo]:
        out_dim, in_dim = shape
        return {
            **info(f"{prefix}.weight", torch.int8, out_dim, in_dim),
            **info(f"{prefix}.weights_scaling_factor", torch.float32, out_dim),
        }

    def quantize(
        self, prefix: str, weight: torch.Tensor, ctx: Context, prepared: Any = None
    ) -> dict[str, torch.Tensor]:
        codes, scale = quantize_per_channel(weight)
        return {f"{prefix}.weight": codes, f"{prefix}.weights_scaling_factor": scale}

    def dequantize(self, codes: torch.Tensor, scale: torch.Tensor, in_features: int) -> torch.Tensor:
        return codes.float() * scale[:, None]

    def export(
        self, b: GraphBuilder, prefix: str, codes: torch.Tensor, scale: torch.Tensor, in_features: int, group_size: int
    ) -> str:
        sname = b.const(f"{prefix}.weights_scaling_factor", scale)
        return b.op("DequantizeLinear", [b.const(f"{prefix}.weight", codes), sname], f"{prefix}.weight_dq", axis=0)


class W8A16(PerChannelInt8):
    quant_algo = "W8A16"
