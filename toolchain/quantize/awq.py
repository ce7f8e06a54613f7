"""AWQ (Lin et al., "AWQ: Activation-aware Weight Quantization", 2023): before quantizing a linear layer group-wise,
scale each input channel c of its weight by s_c = mean|x_c|^α, and divide the input by s_c at run time, so the
channels that carry large activations lose less precision. α is searched on a grid per layer, minimising the
layer's output error on calibration inputs. Our own implementation of the paper's search; the runtime division
is TensorRT-LLM's `prequant_scaling_factor` (= 1/s, multiplying the input)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from toolchain.quantize.core import dequantize_groupwise, quantize_groupwise

GRID = 20  # α in {0, 0.05, ..., 0.95}, as the paper's search


def fake_groupwise(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """Quantize-dequantize [out, in] group-wise int4, padding `in` to whole groups and cutting it back."""
    pad = -weight.shape[1] % group_size
    codes, scale = quantize_groupwise(F.pad(weight, (0, pad)), group_size)
    return dequantize_groupwise(codes, scale)[:, : weight.shape[1]]


def search_scales(
    weight: torch.Tensor, inputs: torch.Tensor, mean_abs: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, float, float]:
    """Per-input-channel scales s (float64 [in]) minimising ||x Wᵀ - (x / s) Q(W s)ᵀ||²; also the best α and the
    error ratio against plain round-to-nearest (α = 0, s = 1). The products run in float32 (the search's cost is
    20 of them per layer; int4 rounding error is orders of magnitude above float32's), the scales in float64."""
    w, x = weight.float(), inputs.float()
    reference = x @ w.T
    stats = mean_abs.double().clamp_min(1e-8)
    best: tuple[float, torch.Tensor, float] | None = None
    rtn_error = 0.0
    for step in range(GRID):
        alpha = step / GRID
        s = stats.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()  # keep the scales centred around 1, as the reference code does
        scaled = (w.double() * s).float()
        error = (reference - (x / s.float()) @ fake_groupwise(scaled, group_size).T).pow(2).double().mean().item()
        if step == 0:
            rtn_error = error
        if best is None or error < best[2]:
            best = (alpha, s, error)
    assert best is not None
    return best[1], best[0], best[2] / rtn_error if rtn_error else 1.0
