"""SmoothQuant (Xiao et al., "SmoothQuant: Accurate and Efficient Post-Training Quantization for Large Language
Models", 2023): an int8 activation is hard to quantize when a few input channels carry outliers, an int8 weight is
easy. Dividing input channel c by s_c = max|x_c|^α / max|W_c|^(1-α) and multiplying the weight's column c by s_c
leaves the product unchanged and moves part of the activation's range into the weight.

Where the division goes (ModelOpt's export, `fuse_prequant_layernorm` in modelopt/torch/export): into the weight
(and bias) of the norm that feeds the linears, when there is one — the norm that feeds them, from the spec
(`LayerSpec.smoothing_groups`: qkv's attention norm; the MLP norm in front of fc and gate, which share one scale)
— and otherwise into the linear's `prequant_scaling_factor` (= 1/s,
multiplying the input at run time): attention.dense and mlp.proj. Our own implementation.

α per group of linears (`alpha="auto"`): ModelOpt's `smoothquant` (modelopt/torch/quantization/model_calib.py)
applies one fixed α to every linear; its per-layer search is `awq_lite`'s — α on a grid, the loss the squared error
of each quantized linear's output against the float one on calibration inputs. We do that search for SmoothQuant:
α in {0, 0.05, ..., 1}, per group of linears sharing one s, the loss summed over the group's linears on the
calibration row sample, each computed as the engine will: int8 per-tensor activations (scale from the calibration
maximum of x/s) times int8 per-channel weights of W·s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from toolchain.checkpoint.spec import LayerSpec
from toolchain.quantize.calibrate import Calibration
from toolchain.quantize.core import fake_quant, quantize_per_channel

S_MIN = 1e-5  # the paper's reference code clamps both statistics to this before taking powers
ALPHA_GRID = tuple(i / 20 for i in range(21))  # 0, 0.05, ..., 1: includes the default 0.5
Alpha = float | Literal["auto"]


@dataclass(frozen=True)
class AlphaChoice:
    """What the search chose for one group of linears: α, and its output error relative to α = 0.5's."""

    alpha: float
    error_ratio: float

    def summary(self) -> dict[str, float]:
        return {"alpha": self.alpha, "error_ratio": round(self.error_ratio, 4)}


def smoothing_scales(x_amax: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """s [in] (float64) for linears sharing one input. A channel that calibration never saw non-zero, or whose
    weight column is zero, keeps s = 1: no statistic to migrate, and no huge division waiting for a later input."""
    w_amax = torch.stack([w.double().abs().amax(0) for w in weights]).amax(0)
    x_amax = x_amax.double()
    s = x_amax.clamp_min(S_MIN).pow(alpha) / w_amax.clamp_min(S_MIN).pow(1 - alpha)
    s = torch.where((x_amax > 0) & (w_amax > 0), s, torch.ones_like(s))
    # rounded to float32 once: `pow`'s last float64 bit follows the CPU's vector math library, and W·s of a float32
    # W and a float32 s is exact in float64, so the migrated weights round once, alike on every machine
    return s.float().double()


def smoothing_error(
    x: torch.Tensor, x_amax: torch.Tensor, weights: list[torch.Tensor], s: torch.Tensor, reference: list[torch.Tensor]
) -> float:
    """Summed squared output error, over the linears sharing input rows x [rows, in], of int8(x/s) · int8(W·s)ᵀ
    against `reference` (x · Wᵀ per linear); the activation scale is the calibration maximum of x/s over 127, as
    the stage sets it. Products in float64, as AWQ's search: the errors rank α, and in float32 their last bits followed
    the CPU's matmul kernels."""
    act = (x_amax.double() / s).max().item() / 127
    xq = fake_quant(x.double() / s, act if act > 0 else 1.0, "INT8")
    error = 0.0
    for w, ref in zip(weights, reference, strict=True):
        codes, scale = quantize_per_channel((w.double() * s).to(w.dtype))
        error += (xq @ (codes.double() * scale.double()[:, None]).T - ref).pow(2).sum().item()
    return error


def search_alpha(x: torch.Tensor, x_amax: torch.Tensor, weights: list[torch.Tensor]) -> AlphaChoice:
    """The α of ALPHA_GRID with the least `smoothing_error` on x (the first of equals)."""
    x = x.double()
    reference = [x @ w.double().T for w in weights]
    errors = {
        a: smoothing_error(x, x_amax, weights, smoothing_scales(x_amax, weights, a), reference) for a in ALPHA_GRID
    }
    best = min(errors, key=lambda a: errors[a])
    return AlphaChoice(best, errors[best] / errors[0.5] if errors[0.5] > 0 else 1.0)


def smooth_layer(
    weights: dict[str, torch.Tensor], layer: LayerSpec, calib: Calibration, alpha: Alpha, chosen: set[str]
) -> tuple[dict[str, torch.Tensor], dict[str, AlphaChoice]]:
    """Rewrite `weights` in place for one decoder layer, along its spec's norm -> linear pairs
    (`LayerSpec.smoothing_groups`); return the `prequant_scaling_factor` tensors (float64) of the linears with no
    norm in front, and (alpha="auto") the searched α per linear. Groups with an excluded linear are left alone
    (their float linears would see the smoothed input otherwise)."""
    groups = [(n.name if n else None, linears) for n, linears in layer.smoothing_groups()]
    prequant: dict[str, torch.Tensor] = {}
    searched: dict[str, AlphaChoice] = {}
    for norm, linears in groups:
        if not all(p in chosen for p in linears):
            continue
        x_amax = calib.input_channel_amax[linears[0]]
        group = [weights[f"{p}.weight"] for p in linears]
        if isinstance(alpha, str):  # "auto"
            choice = search_alpha(calib.input_sample[linears[0]], x_amax, group)
            searched.update(dict.fromkeys(linears, choice))
        s = smoothing_scales(x_amax, group, alpha if not isinstance(alpha, str) else choice.alpha)
        for p in linears:
            w = weights[f"{p}.weight"]
            weights[f"{p}.weight"] = (w.double() * s).to(w.dtype)
            calib.input_channel_amax[p] = x_amax / s  # what the linear sees from now on
            calib.input_amax[p] = (x_amax / s).max().item()
        if norm is None:
            prequant[linears[0]] = 1 / s
            continue
        for suffix in ("weight", "bias"):
            if f"{norm}.{suffix}" in weights:
                t = weights[f"{norm}.{suffix}"]
                weights[f"{norm}.{suffix}"] = (t.double() / s).to(t.dtype)
    return prequant, searched
