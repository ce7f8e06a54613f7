"""SmoothQuant (Xiao et al., "SmoothQuant: Accurate and Efficient Post-Training Quantization for Large Language
Models", 2023): an int8 activation is hard to quantize when a few input channels carry outliers, an int8 weight is
easy. Dividing input channel c by s_c = max|x_c|^α / max|W_c|^(1-α) and multiplying the weight's column c by s_c
leaves the product unchanged and moves part of the activation's range into the weight.

Where the division goes (ModelOpt's export, `fuse_prequant_layernorm` in modelopt/torch/export): into the weight
(and bias) of the norm that feeds the linears, when there is one — qkv after input_layernorm, fc and gate (which
share one scale) after post_layernorm — and otherwise into the linear's `prequant_scaling_factor` (= 1/s,
multiplying the input at run time): attention.dense and mlp.proj. Our own implementation.
"""

from __future__ import annotations

import torch

from toolchain.quantize.calibrate import Calibration

S_MIN = 1e-5  # the paper's reference code clamps both statistics to this before taking powers


def smoothing_scales(x_amax: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """s [in] (float64) for linears sharing one input. A channel that calibration never saw non-zero, or whose
    weight column is zero, keeps s = 1: no statistic to migrate, and no huge division waiting for a later input."""
    w_amax = torch.stack([w.double().abs().amax(0) for w in weights]).amax(0)
    x_amax = x_amax.double()
    s = x_amax.clamp_min(S_MIN).pow(alpha) / w_amax.clamp_min(S_MIN).pow(1 - alpha)
    return torch.where((x_amax > 0) & (w_amax > 0), s, torch.ones_like(s))


def smooth_layer(
    weights: dict[str, torch.Tensor], layer: str, calib: Calibration, alpha: float, chosen: set[str]
) -> dict[str, torch.Tensor]:
    """Rewrite `weights` in place for one decoder layer; return the `prequant_scaling_factor` tensors (float64)
    of the linears with no norm in front. Groups with an excluded linear are left alone (their float linears
    would see the smoothed input otherwise)."""
    groups = [
        (f"{layer}.input_layernorm", [f"{layer}.attention.qkv"]),
        (f"{layer}.post_layernorm", [f"{layer}.mlp.fc", f"{layer}.mlp.gate"]),
        (None, [f"{layer}.attention.dense"]),
        (None, [f"{layer}.mlp.proj"]),
    ]
    prequant: dict[str, torch.Tensor] = {}
    for norm, linears in groups:
        linears = [p for p in linears if f"{p}.weight" in weights]
        if not linears or not all(p in chosen for p in linears):
            continue
        x_amax = calib.input_channel_amax[linears[0]]
        s = smoothing_scales(x_amax, [weights[f"{p}.weight"] for p in linears], alpha)
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
    return prequant
