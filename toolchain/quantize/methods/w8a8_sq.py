"""W8A8_SQ_PER_CHANNEL (SmoothQuant, smoothquant.py): int8 weights per output channel of the smoothed weight,
int8 activations per tensor with a static scale. PREFIX.weight int8 [out, in]; weights_scaling_factor float32
[out]; activation_scaling_factor float32 [1] (of the smoothed input); and, for the linears with no norm in front
(attention.dense, mlp.proj), prequant_scaling_factor [in] = 1/s in the model dtype — the others' 1/s is folded
into their norm's weight (and bias)."""

from __future__ import annotations

from typing import Any

import torch

from toolchain.checkpoint.safetensors_io import TensorInfo
from toolchain.quantize.methods.base import ACTIVATION_SCALE, PREQUANT, WEIGHT, WEIGHT_SCALE, Context, Layer, info
from toolchain.quantize.methods.w8a16 import PerChannelInt8
from toolchain.quantize.smoothquant import smooth_layer


def activation_scale(amax: float, maxbound: float) -> torch.Tensor:
    """A static per-tensor activation scale [1] from a calibration maximum; 1 where calibration saw only zeros."""
    act = amax / maxbound
    return torch.tensor([act if act > 0 else 1.0], dtype=torch.float32)


class W8A8SQ(PerChannelInt8):
    quant_algo = "W8A8_SQ_PER_CHANNEL"
    suffixes = (WEIGHT, WEIGHT_SCALE, ACTIVATION_SCALE, PREQUANT)
    needs_calibration = True
    streamable = False
    activation_kind = "INT8"
    pre_quant_scale = True
    uses_sq_alpha = True
    details_key = "smoothquant"  # per linear (--sq-alpha auto): the searched α, its error relative to α = 0.5's

    def plan(self, prefix: str, shape: tuple[int, ...], ctx: Context) -> dict[str, TensorInfo]:
        return {**super().plan(prefix, shape, ctx), **info(f"{prefix}.{ACTIVATION_SCALE}", torch.float32, 1)}

    def prepare(self, layer: Layer, ctx: Context) -> dict[str, Any]:
        """Smooth a decoder layer in place (its linears' weights, its norms, the calibration maxima they see);
        lm_head is not smoothed. Returns the searched α per linear (`--sq-alpha auto`), for the manifest."""
        if layer.spec is None:
            return {}
        prequant, searched = smooth_layer(layer.tensors, layer.spec, ctx.calib, ctx.sq_alpha, layer.chosen)
        layer.tensors.update({f"{p}.{PREQUANT}": s.to(ctx.dtype) for p, s in prequant.items()})
        return searched

    def quantize(
        self, prefix: str, weight: torch.Tensor, ctx: Context, prepared: Any = None
    ) -> dict[str, torch.Tensor]:
        # `weight` is already smoothed, and the calibration maxima updated to match
        act = activation_scale(ctx.calib.input_amax[prefix], 127)
        return {**super().quantize(prefix, weight, ctx), f"{prefix}.{ACTIVATION_SCALE}": act}
