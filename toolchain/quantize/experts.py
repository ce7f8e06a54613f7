"""Quantization of a mixture of experts' stacked weights, each expert by itself: weight-only (w8a16, w4a16) or FP8
with routed calibration.

A MoE layer's mlp.fc [E, 2I, H] and mlp.proj [E, H, I] (docs/conversion.md) are E linears stacked. A weight-only
method (w8a16, w4a16: `QuantMethod.streamable`) quantizes each expert's [out, in] slice exactly as it quantizes a
dense linear, and the slices' tensors are stacked again along a leading expert axis: PREFIX.weight [E, ...] and
PREFIX.weights_scaling_factor [E, ...] with the dense method's per-expert shapes (w8a16: int8 [E, out, in] and
float32 [E, out]; w4a16: packed int8 [E, out/2, in'] and float32 [E, out, in'/group]). So every expert has its own
scales, per output channel or per group, never shared across experts. The router is not quantized (scheme.py).
The ONNX graph dequantizes the stacked codes with one blocked DequantizeLinear along the input axis (`export`),
as the dense path dequantizes a linear's, and the MoE op reads the float weights (docs/quantization.md, "Mixture of
experts").

FP8 (`fp8`): each expert's [out, in] slice E4M3 with its own per-tensor weight scale, and its own static activation
scale for its fc input and its proj input from the ROUTED calibration maxima (calibrate.RoutedStats: the tokens
routed to it; the layer's maximum for an expert routed fewer than MIN_EXPERT_TOKENS): weight float8_e4m3fn
[E, out, in], weights_scaling_factor and activation_scaling_factor float32 [E, 1]. The MoE op quantize-dequantizes
each expert's routed rows at its activation scale before the GEMM, as the dense FP8 graph does a linear's input.
"""

from __future__ import annotations

import torch

from toolchain.checkpoint.safetensors_io import TensorInfo
from toolchain.errors import UserError
from toolchain.quantize.core import FP8_E4M3_MAX, int4_proto, quantize_fp8, unpack_int4
from toolchain.quantize.methods.base import (
    ACTIVATION_SCALE,
    WEIGHT,
    WEIGHT_SCALE,
    Context,
    GraphBuilder,
    QuantMethod,
    Stored,
)
from toolchain.quantize.methods.fp8 import FP8
from toolchain.quantize.methods.w4a16 import GroupwiseInt4
from toolchain.quantize.methods.w8a8_sq import activation_scale
from toolchain.quantize.methods.w8a16 import PerChannelInt8


def stacked(shape: tuple[int, ...]) -> bool:
    """Whether a linear's weight of `shape` is a stack of experts' [E, out, in] (else a dense [out, in])."""
    return len(shape) == 3


def check_method(qm: QuantMethod, prefix: str) -> None:
    if not ((isinstance(qm, PerChannelInt8 | GroupwiseInt4) and qm.streamable) or type(qm) is FP8):
        raise UserError(
            f"{prefix}: stacked experts are quantized by w8a16, w4a16 and fp8 only, not {qm.name!r}; choose "
            "--method w8a16, w4a16 or fp8 for a mixture-of-experts model"
        )


def plan(qm: QuantMethod, prefix: str, shape: tuple[int, ...], ctx: Context) -> dict[str, TensorInfo]:
    """The tensors `quantize` makes of PREFIX.weight [E, out, in]: the dense method's per expert, stacked."""
    check_method(qm, prefix)
    experts, *one = shape
    return {
        name: TensorInfo(name, info.dtype, (experts, *info.shape))
        for name, info in qm.plan(prefix, tuple(one), ctx).items()
    }


def quantize(qm: QuantMethod, prefix: str, weight: torch.Tensor, ctx: Context) -> dict[str, torch.Tensor]:
    """Each expert's [out, in] slice quantized as a dense linear, the results stacked along the expert axis."""
    check_method(qm, prefix)
    if isinstance(qm, FP8):
        return _fp8(prefix, weight, ctx)
    parts = [qm.quantize(prefix, expert, ctx) for expert in weight]
    return {name: torch.stack([part[name] for part in parts]) for name in parts[0]}


def _fp8(prefix: str, weight: torch.Tensor, ctx: Context) -> dict[str, torch.Tensor]:
    """Each expert's slice E4M3 at its own max |w|; its activation scale its routed input maximum / 448."""
    routed = ctx.calib.routed.get(prefix)
    if routed is None:
        raise UserError(f"{prefix}: fp8 experts need the routed calibration of this layer, and it saw no tokens")
    parts = [quantize_fp8(expert) for expert in weight]
    acts = [activation_scale(amax, FP8_E4M3_MAX) for amax in routed.input_amax(weight.shape[0])]
    return {
        f"{prefix}.{WEIGHT}": torch.stack([codes for codes, _ in parts]),
        f"{prefix}.{WEIGHT_SCALE}": torch.stack([scale for _, scale in parts]),
        f"{prefix}.{ACTIVATION_SCALE}": torch.stack(acts),
    }


def activation_scales(qm: QuantMethod, s: Stored) -> torch.Tensor | None:
    """A stacked linear's per-expert static input scales [E] (fp8), else None (weight-only)."""
    return s[ACTIVATION_SCALE].float().reshape(-1) if isinstance(qm, FP8) else None


def _expert(s: Stored, e: int) -> Stored:
    """Expert e of a stacked quantized linear, as the dense method reads one linear."""
    names = [s.name(suffix) for suffix in (WEIGHT, WEIGHT_SCALE)]
    return Stored(s.prefix, {n: s.tensors[n][e] for n in names}, s.in_features, s.group_size)


def dequantize(qm: QuantMethod, s: Stored) -> torch.Tensor:
    """The float weight of a stored linear: [out, in] for a dense one, [E, out, in] for stacked experts."""
    if not stacked(tuple(s[WEIGHT].shape)):
        return qm.dequantize(s)
    check_method(qm, s.prefix)
    return torch.stack([qm.dequantize(_expert(s, e)) for e in range(s[WEIGHT].shape[0])])


def export(qm: QuantMethod, b: GraphBuilder, s: Stored) -> str:
    """The stacked experts' DequantizeLinear: blocked along the input axis (2), each expert's scales its own —
    w8a16 one block per output row (the whole input), w4a16 one per group; returns the float32 [E, out, in]."""
    check_method(qm, s.prefix)
    scale = s.weight_scale()
    if isinstance(qm, FP8):  # one scale per expert: per-axis along the expert axis
        w = b.const(s.name(WEIGHT), s[WEIGHT])
        return b.op("DequantizeLinear", [w, b.const(s.name(WEIGHT_SCALE), scale.reshape(-1))], f"{s.prefix}.weight_dq",
                    axis=0)  # fmt: skip
    if isinstance(qm, GroupwiseInt4):
        codes = torch.stack([unpack_int4(c)[:, : s.in_features] for c in s[WEIGHT]])
        name, block = b.add_initializer(int4_proto(s.name(WEIGHT), codes)), s.group_size
    else:
        name, block, scale = b.const(s.name(WEIGHT), s[WEIGHT]), s.in_features, scale[..., None]
    return b.op("DequantizeLinear", [name, b.const(s.name(WEIGHT_SCALE), scale)], f"{s.prefix}.weight_dq", axis=2,
                block_size=block)  # fmt: skip
