"""AWQ (Lin et al., "AWQ: Activation-aware Weight Quantization", 2023), in the paper's two searches, per group of
linears that read the same input (one fused qkv; mlp.fc with mlp.gate; attention.dense; mlp.proj; lm_head):

1. Scale search: input channel c of every weight in the group is multiplied by s_c = mean|x_c|^α (the mean over all
   calibration tokens of the linear's own input) and the input divided by s_c at run time, so the channels that
   carry large activations lose less precision. α is searched on a 20-point grid, minimising the summed squared
   output error of the group's linears on calibration inputs; one s for the whole group, because linears that read
   one input read it through one multiplier (TensorRT-LLM fuses qkv, and fc with gate).
2. Clip search, after scaling: per output channel and group, the group's largest |w| is shrunk by a ratio on a grid
   (1, 0.95, ..., 0.55) and the ratio with the least error of that group's partial dot products on the (scaled)
   calibration inputs kept; weights beyond it saturate.

Our own implementation of the paper's searches. The run-time division is TensorRT-LLM's `prequant_scaling_factor`
(= 1/s, multiplying the input); the clipping lives in the weight scales (clipped amax / 7).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from toolchain.quantize.core import dequantize_groupwise, quantize_groupwise

GRID = 20  # α in {0, 0.05, ..., 0.95}, as the paper's search
CLIP_GRID = 20  # clip ratios 1 - k / CLIP_GRID ...
CLIP_MAX_SHRINK = 0.5  # ... for k < CLIP_GRID * CLIP_MAX_SHRINK: 1, 0.95, ..., 0.55, as the paper's reference code
# Linears that read the same input, by their name inside a decoder layer; any other linear is a group of its own.
SHARED_INPUT = (("attention.qkv",), ("attention.dense",), ("mlp.fc", "mlp.gate"), ("mlp.proj",))


@dataclass(frozen=True)
class AwqChoice:
    """What the searches chose for one linear: s (float64 [in]) as the run time will apply it, the clip ratio per
    output channel and group (float32 [out, groups]), α, and the output error against round-to-nearest."""

    scale: torch.Tensor
    clip: torch.Tensor
    alpha: float
    error_ratio: float

    def summary(self) -> dict[str, float]:
        return {
            "alpha": self.alpha,
            "error_ratio": round(self.error_ratio, 4),
            "clip_mean": round(self.clip.mean().item(), 4),
            "clipped_groups": round((self.clip < 1).float().mean().item(), 4),
        }


def _padded(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    return F.pad(weight.float(), (0, -weight.shape[1] % group_size))


def clip_groups(weight: torch.Tensor, clip: torch.Tensor, group_size: int) -> torch.Tensor:
    """weight [out, in'] (in' whole groups) with each group saturated at `clip` [out, groups] times its max |w|."""
    out_dim, in_dim = weight.shape
    groups = weight.reshape(out_dim, in_dim // group_size, group_size)
    bound = groups.abs().amax(2, keepdim=True) * clip[..., None]
    return torch.maximum(torch.minimum(groups, bound), -bound).reshape(out_dim, in_dim)


def fake_groupwise(weight: torch.Tensor, group_size: int, clip: torch.Tensor | None = None) -> torch.Tensor:
    """Quantize-dequantize [out, in] group-wise int4, padding `in` to whole groups and cutting it back."""
    padded = _padded(weight, group_size)
    if clip is not None:
        padded = clip_groups(padded, clip, group_size)
    codes, scale = quantize_groupwise(padded, group_size)
    return dequantize_groupwise(codes, scale)[:, : weight.shape[1]]


def quantize_awq(weight: torch.Tensor, choice: AwqChoice, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The stored form of one linear: int4 codes [out, in'] and scales [out, in'/G] of W·diag(s), clipped."""
    padded = clip_groups(_padded((weight.double() * choice.scale).float(), group_size), choice.clip, group_size)
    return quantize_groupwise(padded, group_size)


def search_shared_scales(
    weights: list[torch.Tensor], inputs: torch.Tensor, mean_abs: torch.Tensor, group_size: int, dtype: torch.dtype
) -> tuple[torch.Tensor, float, float]:
    """One s (float64 [in]) for linears sharing `inputs` [rows, in], minimising Σ ||x Wᵀ - (x / s) Q(W s)ᵀ||²;
    also the best α and the error ratio against plain round-to-nearest (α = 0). s is rounded through 1/s in
    `dtype`, the `prequant_scaling_factor` the run time multiplies by, so weight and input scaling cancel exactly.
    Products in float32 (int4 rounding error is orders of magnitude above float32's), scales in float64."""
    x = inputs.float()
    references = [x @ w.float().T for w in weights]
    stats = mean_abs.double().clamp_min(1e-8)
    best: tuple[float, torch.Tensor, float] | None = None
    rtn_error = 0.0
    for step in range(GRID):
        alpha = step / GRID
        s = stats.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()  # keep the scales centred around 1, as the reference code does
        s = 1 / (1 / s).to(dtype).double()
        x_scaled = x / s.float()
        error = sum(
            (ref - x_scaled @ fake_groupwise((w.double() * s).float(), group_size).T).pow(2).double().sum().item()
            for w, ref in zip(weights, references, strict=True)
        )
        if step == 0:
            rtn_error = error
        if best is None or error < best[2]:
            best = (alpha, s, error)
    assert best is not None
    return best[1], best[0], best[2] / rtn_error if rtn_error else 1.0


def search_scales(
    weight: torch.Tensor, inputs: torch.Tensor, mean_abs: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, float, float]:
    """`search_shared_scales` for one linear in float32."""
    return search_shared_scales([weight], inputs, mean_abs, group_size, torch.float32)


def search_clip(weight: torch.Tensor, inputs: torch.Tensor, group_size: int) -> torch.Tensor:
    """Clip ratio per output channel and group (float32 [out, groups]) of `weight` [out, in] (already scaled)
    minimising E[(x_g · (w_g - Q(w_g)))²] over `inputs` [rows, in] (already divided by s), each group's partial
    dot product on its own, as the paper's reference code does. Ratio 1 (no clipping) is a candidate, so no group
    gets worse than round-to-nearest on these inputs."""
    w, x = _padded(weight, group_size), _padded(inputs, group_size)
    out_dim, in_dim = w.shape
    groups = in_dim // group_size
    xg = x.reshape(-1, groups, group_size)
    gram = torch.einsum("ngi,ngj->gij", xg, xg) / max(x.shape[0], 1)  # per group: E[x_g x_gᵀ]
    best_error = best_ratio = None
    for k in range(int(CLIP_GRID * CLIP_MAX_SHRINK)):
        ratio = torch.full((out_dim, groups), 1 - k / CLIP_GRID)
        codes, scale = quantize_groupwise(clip_groups(w, ratio, group_size), group_size)
        d = (w - dequantize_groupwise(codes, scale)).reshape(out_dim, groups, group_size)
        error = torch.einsum("ogi,gij,ogj->og", d, gram, d)
        if best_error is None or best_ratio is None:
            best_error, best_ratio = error, ratio
            continue
        better = error < best_error
        best_error, best_ratio = torch.where(better, error, best_error), torch.where(better, ratio, best_ratio)
    assert best_ratio is not None
    return best_ratio


def shared_input_groups(prefixes: list[str]) -> list[list[str]]:
    """`prefixes` (linears to quantize) grouped by the input they read, in a fixed order."""
    groups: dict[str, list[str]] = {}
    for prefix in sorted(prefixes):
        key = prefix
        for names in SHARED_INPUT:
            for name in names:
                if prefix.endswith(f".{name}"):
                    key = prefix.removesuffix(name) + names[0]
        groups.setdefault(key, []).append(prefix)
    return [groups[k] for k in sorted(groups)]


def search_group(
    weights: dict[str, torch.Tensor], inputs: torch.Tensor, mean_abs: torch.Tensor, group_size: int, dtype: torch.dtype
) -> dict[str, AwqChoice]:
    """Both searches for linears reading one input: a shared s, then each linear's own clip ratios."""
    s, alpha, ratio = search_shared_scales(list(weights.values()), inputs, mean_abs, group_size, dtype)
    x_scaled = (inputs.double() / s).float()
    return {
        prefix: AwqChoice(s, search_clip((w.double() * s).float(), x_scaled, group_size), alpha, ratio)
        for prefix, w in weights.items()
    }
