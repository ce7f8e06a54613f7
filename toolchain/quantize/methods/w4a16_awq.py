"""W4A16_AWQ: W4A16's layout of the weight scaled per input channel by AWQ's s (awq.py: scale search per group of
linears reading one input over s = x^α and s = x^α / w^(1-α), then clip search per group of weights), plus
PREFIX.prequant_scaling_factor [in] = 1/s in the model dtype, which multiplies the input at run time."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from toolchain.checkpoint.safetensors_io import TensorInfo
from toolchain.quantize.awq import AwqChoice, quantize_awq, search_group, shared_input_groups
from toolchain.quantize.core import pack_int4
from toolchain.quantize.methods.base import PREQUANT, WEIGHT, WEIGHT_SCALE, Context, Layer, info
from toolchain.quantize.methods.w4a16 import GroupwiseInt4, _check_even


class W4A16Awq(GroupwiseInt4):
    quant_algo = "W4A16_AWQ"
    suffixes: ClassVar[tuple[str, ...]] = (WEIGHT, WEIGHT_SCALE, PREQUANT)
    needs_calibration = True
    streamable = False
    pre_quant_scale = True
    # per linear: α, output error vs round-to-nearest, mean clip ratio, share of groups clipped, and which family of
    # scales won (scale_formula: s = x^α, "x^a", or x^α / w^(1-α), "x^a/w^(1-a)"; awq.py)
    details_key = "awq"

    def plan(self, prefix: str, shape: tuple[int, ...], ctx: Context) -> dict[str, TensorInfo]:
        return {**super().plan(prefix, shape, ctx), **info(f"{prefix}.{PREQUANT}", ctx.dtype, shape[1])}

    def prepare(self, layer: Layer, ctx: Context) -> dict[str, Any]:
        """AWQ's searches for the layer's linears, by groups that read one input and share one scale vector."""
        choices: dict[str, AwqChoice] = {}
        for group in shared_input_groups(layer.spec, layer.linears):
            x, mean_abs = ctx.calib.input_sample[group[0]], ctx.calib.mean_abs(group[0])
            weights = {p: layer.tensors[f"{p}.weight"] for p in group}
            choices.update(search_group(weights, x, mean_abs, ctx.group_size, ctx.dtype))
        return choices

    def quantize(
        self, prefix: str, weight: torch.Tensor, ctx: Context, prepared: Any = None
    ) -> dict[str, torch.Tensor]:
        _check_even(prefix, weight.shape[0])
        assert isinstance(prepared, AwqChoice), f"{prefix}: AWQ quantizes with its search's choice"
        codes, scale = quantize_awq(weight, prepared, ctx.group_size)
        return {
            f"{prefix}.{WEIGHT}": pack_int4(codes),
            f"{prefix}.{WEIGHT_SCALE}": scale,
            f"{prefix}.{PREQUANT}": (1 / prepared.scale).to(ctx.dtype),
        }
