"""W4A16: int4 weights per group of input channels, float activations, round to nearest.

PREFIX.weight int8 [out/2, in'] — int4 codes packed two output rows per byte, row 2j in the low nibble — and
PREFIX.weights_scaling_factor float32 [out, in'/group]; in' = in rounded up to whole groups, the extra input
channels zero (exact for any input, since they multiply zeros). The graph takes the codes cut back to `in`
(ONNX's blocked DequantizeLinear accepts a partial last block), so no Slice sits between weight and GEMM.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from toolchain.checkpoint.safetensors_io import TensorInfo
from toolchain.errors import UserError
from toolchain.quantize.core import dequantize_groupwise, int4_proto, pack_int4, quantize_groupwise, unpack_int4
from toolchain.quantize.methods.base import WEIGHT, WEIGHT_SCALE, Context, GraphBuilder, QuantMethod, Stored, info


class GroupwiseInt4(QuantMethod):
    """The int4 group-wise layout W4A16 and W4A16_AWQ share."""

    grouped = True
    suffixes: ClassVar[tuple[str, ...]] = (WEIGHT, WEIGHT_SCALE)

    def plan(self, prefix: str, shape: tuple[int, ...], ctx: Context) -> dict[str, TensorInfo]:
        out_dim, in_dim = shape
        _check_even(prefix, out_dim)
        padded = in_dim + (-in_dim % ctx.group_size)
        return {
            **info(f"{prefix}.{WEIGHT}", torch.int8, out_dim // 2, padded),
            **info(f"{prefix}.{WEIGHT_SCALE}", torch.float32, out_dim, padded // ctx.group_size),
        }

    def dequantize(self, s: Stored) -> torch.Tensor:
        return dequantize_groupwise(unpack_int4(s[WEIGHT]), s.weight_scale())[:, : s.in_features]

    def export_weight(self, b: GraphBuilder, s: Stored) -> str:
        codes = b.add_initializer(int4_proto(s.name(WEIGHT), unpack_int4(s[WEIGHT])[:, : s.in_features]))
        scale = b.const(s.name(WEIGHT_SCALE), s.weight_scale())
        return b.op("DequantizeLinear", [codes, scale], f"{s.prefix}.weight_dq", axis=1, block_size=s.group_size)


def _check_even(prefix: str, out_dim: int) -> None:
    if out_dim % 2:
        raise UserError(f"{prefix}: {out_dim} output channels; int4 packing needs an even number")


class W4A16(GroupwiseInt4):
    quant_algo = "W4A16"

    def quantize(
        self, prefix: str, weight: torch.Tensor, ctx: Context, prepared: Any = None
    ) -> dict[str, torch.Tensor]:
        _check_even(prefix, weight.shape[0])
        pad = -weight.shape[1] % ctx.group_size  # zero input channels: exact whatever the input
        codes, scale = quantize_groupwise(F.pad(weight.float(), (0, pad)), ctx.group_size)
        return {f"{prefix}.{WEIGHT}": pack_int4(codes), f"{prefix}.{WEIGHT_SCALE}": scale}
