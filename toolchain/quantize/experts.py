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

AWQ (`w4a16_awq`) and SmoothQuant (`w8a8_sq`) search each expert on the rows routed to it (calibrate.RoutedStats:
a bounded sample of them, its activation means / channel maxima; an expert routed fewer than MIN_EXPERT_TOKENS
searches on the layer's routed rows and statistics instead): AWQ the dense scale then clip search (awq.py) on the
expert's [out, in] slice — fc's [up; gate] share one s, as they read one input — stored as W4A16's layout of W·s;
SmoothQuant the dense α (fixed, or searched on the routed rows with --sq-alpha auto) and s from the expert's routed
channel maxima, int8 per output channel of W·s and a static per-tensor int8 activation scale from the routed maximum
of x/s (the dense method's scheme). Either way the expert's 1/s is PREFIX.prequant_scaling_factor float32 [E, in],
which the MoE op multiplies each expert's routed rows by before its GEMM (SmoothQuant then quantize-dequantizes them
to int8 at the expert's own scale): no norm sits between the router's choice and an expert, so neither method can
fold an expert's 1/s into one. TensorRT-LLM's MoE (`MOEWeightWrapper`, tensorrt_llm/layers/moe.py) gives group-wise
(AWQ) experts one `prequant_scaling_factor` of shape (1, in_features) in the activation dtype, shared by every
expert of the stacked linear; ours is per expert, the point of routed calibration, and float32 (as the router), so a
writer for its layout would have to re-scale each expert's weights to one shared s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from toolchain.checkpoint.safetensors_io import TensorInfo
from toolchain.errors import UserError
from toolchain.quantize.awq import AwqChoice, quantize_awq, search_group
from toolchain.quantize.calibrate import RoutedStats
from toolchain.quantize.core import FP8_E4M3_MAX, int4_proto, pack_int4, quantize_fp8, quantize_per_channel, unpack_int4
from toolchain.quantize.methods.base import (
    ACTIVATION_SCALE,
    PREQUANT,
    WEIGHT,
    WEIGHT_SCALE,
    Context,
    GraphBuilder,
    QuantMethod,
    Stored,
)
from toolchain.quantize.methods.fp8 import FP8
from toolchain.quantize.methods.w4a16 import GroupwiseInt4, _check_even
from toolchain.quantize.methods.w4a16_awq import W4A16Awq
from toolchain.quantize.methods.w8a8_sq import W8A8SQ, activation_scale
from toolchain.quantize.methods.w8a16 import PerChannelInt8
from toolchain.quantize.smoothquant import AlphaChoice, search_alpha, smoothing_scales

PREQUANT_DTYPE = torch.float32  # an expert's 1/s, as stored and as the MoE op multiplies by it (module docstring)
SEARCHED = (W4A16Awq, W8A8SQ)  # the methods that search each expert on its routed rows


@dataclass(frozen=True)
class ExpertChoices:
    """What the per-expert searches chose for one stacked linear (the manifest's entry for it): each field of the
    dense method's per-linear summary as a list over the experts, and the experts that searched on the layer's rows."""

    choices: tuple[AwqChoice | AlphaChoice, ...]
    fell_back: tuple[int, ...]

    def summary(self) -> dict[str, Any]:
        per = [c.summary() for c in self.choices]
        return {**{k: [p[k] for p in per] for k in per[0]}, "fell_back": list(self.fell_back)}


def stacked(shape: tuple[int, ...]) -> bool:
    """Whether a linear's weight of `shape` is a stack of experts' [E, out, in] (else a dense [out, in])."""
    return len(shape) == 3


def check_method(qm: QuantMethod, prefix: str) -> None:
    known = (isinstance(qm, PerChannelInt8 | GroupwiseInt4) and qm.streamable) or type(qm) in (FP8, *SEARCHED)
    if not known:
        raise UserError(
            f"{prefix}: stacked experts are quantized by w8a16, w4a16, fp8, w4a16_awq and w8a8_sq only, not "
            f"{qm.name!r}; choose one of those --method values for a mixture-of-experts model"
        )


def plan(qm: QuantMethod, prefix: str, shape: tuple[int, ...], ctx: Context) -> dict[str, TensorInfo]:
    """The tensors `quantize` makes of PREFIX.weight [E, out, in]: the dense method's per expert, stacked; for AWQ
    and SmoothQuant, PREFIX.prequant_scaling_factor float32 [E, in] besides."""
    check_method(qm, prefix)
    experts, *one = shape
    out = {
        name: TensorInfo(name, info.dtype, (experts, *info.shape))
        for name, info in qm.plan(prefix, tuple(one), ctx).items()
    }
    if isinstance(qm, SEARCHED):
        name = f"{prefix}.{PREQUANT}"
        out[name] = TensorInfo(name, PREQUANT_DTYPE, (experts, one[1]))
    return out


def quantize(qm: QuantMethod, prefix: str, weight: torch.Tensor, ctx: Context) -> dict[str, torch.Tensor]:
    """Each expert's [out, in] slice quantized as a dense linear, the results stacked along the expert axis."""
    return quantize_with_choices(qm, prefix, weight, ctx)[0]


def quantize_with_choices(
    qm: QuantMethod, prefix: str, weight: torch.Tensor, ctx: Context
) -> tuple[dict[str, torch.Tensor], ExpertChoices | None]:
    """`quantize`, and what AWQ's / SmoothQuant's per-expert searches chose (None for the other methods, and for
    SmoothQuant at a fixed α)."""
    check_method(qm, prefix)
    if isinstance(qm, FP8):
        return _fp8(prefix, weight, ctx), None
    if isinstance(qm, W4A16Awq):
        return _awq(prefix, weight, ctx)
    if isinstance(qm, W8A8SQ):
        return _smoothquant(prefix, weight, ctx)
    parts = [qm.quantize(prefix, expert, ctx) for expert in weight]
    return {name: torch.stack([part[name] for part in parts]) for name in parts[0]}, None


def _routed(prefix: str, ctx: Context, method: str) -> RoutedStats:
    routed = ctx.calib.routed.get(prefix)
    if routed is None:
        raise UserError(f"{prefix}: {method} experts need the routed calibration of this layer, and it saw no tokens")
    return routed


def _awq(prefix: str, weight: torch.Tensor, ctx: Context) -> tuple[dict[str, torch.Tensor], ExpertChoices]:
    """Per expert, AWQ's scale then clip search (awq.search_group) on its routed rows and activation means (the
    layer's where it fell back); fc's [up; gate] slice is one weight, so gate and up share one s."""
    routed = _routed(prefix, ctx, "w4a16_awq")
    _check_even(prefix, weight.shape[1])
    codes, scales, prequant, choices = [], [], [], []
    for e, w in enumerate(weight):
        choice = search_group({prefix: w}, routed.rows(e), routed.mean_abs(e), ctx.group_size, PREQUANT_DTYPE)[prefix]
        c, scale = quantize_awq(w, choice, ctx.group_size)
        codes.append(pack_int4(c))
        scales.append(scale)
        prequant.append((1 / choice.scale).to(PREQUANT_DTYPE))
        choices.append(choice)
    tensors = {
        f"{prefix}.{WEIGHT}": torch.stack(codes),
        f"{prefix}.{WEIGHT_SCALE}": torch.stack(scales),
        f"{prefix}.{PREQUANT}": torch.stack(prequant),
    }
    return tensors, ExpertChoices(tuple(choices), tuple(routed.fell_back(weight.shape[0])))


def _smoothquant(
    prefix: str, weight: torch.Tensor, ctx: Context
) -> tuple[dict[str, torch.Tensor], ExpertChoices | None]:
    """Per expert, SmoothQuant's s from its routed channel maxima (the layer's where it fell back) at the fixed α or
    the α searched on its routed rows; int8 per output channel of W·s; its static int8 input scale the routed
    maximum of x/s over 127, as the dense method sets a linear's."""
    routed = _routed(prefix, ctx, "w8a8_sq")
    codes, scales, acts, prequant, choices = [], [], [], [], []
    for e, w in enumerate(weight):
        x_amax = routed.channel_max(e)
        if isinstance(ctx.sq_alpha, str):  # "auto"
            choice = search_alpha(routed.rows(e), x_amax, [w])
            choices.append(choice)
        s = smoothing_scales(x_amax, [w], choices[-1].alpha if isinstance(ctx.sq_alpha, str) else ctx.sq_alpha)
        c, scale = quantize_per_channel((w.double() * s).to(w.dtype))
        codes.append(c)
        scales.append(scale)
        acts.append(activation_scale((x_amax.double() / s).max().item(), 127))
        prequant.append((1 / s).to(PREQUANT_DTYPE))
    tensors = {
        f"{prefix}.{WEIGHT}": torch.stack(codes),
        f"{prefix}.{WEIGHT_SCALE}": torch.stack(scales),
        f"{prefix}.{ACTIVATION_SCALE}": torch.stack(acts),
        f"{prefix}.{PREQUANT}": torch.stack(prequant),
    }
    fell_back = tuple(routed.fell_back(weight.shape[0]))
    return tensors, ExpertChoices(tuple(choices), fell_back) if choices else None


def _fp8(prefix: str, weight: torch.Tensor, ctx: Context) -> dict[str, torch.Tensor]:
    """Each expert's slice E4M3 at its own max |w|; its activation scale its routed input maximum / 448."""
    routed = _routed(prefix, ctx, "fp8")
    parts = [quantize_fp8(expert) for expert in weight]
    acts = [activation_scale(amax, FP8_E4M3_MAX) for amax in routed.input_amax(weight.shape[0])]
    return {
        f"{prefix}.{WEIGHT}": torch.stack([codes for codes, _ in parts]),
        f"{prefix}.{WEIGHT_SCALE}": torch.stack([scale for _, scale in parts]),
        f"{prefix}.{ACTIVATION_SCALE}": torch.stack(acts),
    }


def activation_scales(qm: QuantMethod, s: Stored) -> torch.Tensor | None:
    """A stacked linear's per-expert static input scales [E] (fp8, w8a8_sq), else None (weight-only, AWQ)."""
    return s[ACTIVATION_SCALE].float().reshape(-1) if isinstance(qm, FP8 | W8A8SQ) else None


def prequant_scales(qm: QuantMethod, s: Stored) -> torch.Tensor | None:
    """A stacked linear's per-expert 1/s [E, in] float32 (w4a16_awq, w8a8_sq), else None."""
    return s[PREQUANT].to(PREQUANT_DTYPE) if isinstance(qm, SEARCHED) else None


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
