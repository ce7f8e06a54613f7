"""AWQ (Lin et al., "AWQ: Activation-aware Weight Quantization", 2023), in the paper's two searches, per group of
linears that read the same input (the layer's spec says which, `LayerSpec.input_groups`: one fused qkv; mlp.fc
with mlp.gate; attention.dense; mlp.proj; and lm_head alone):

1. Scale search: input channel c of every weight in the group is multiplied by s_c and the input divided by s_c at
   run time, so the channels that carry large activations lose less precision. Two families of candidates, with
   x_c = mean|x_c| over all calibration tokens of the linear's own input: the paper's s_c = x_c^α (α in 0, 0.05,
   ..., 0.95) and ModelOpt awq_lite's s_c = x_c^α / w_c^(1-α) (α in 0, 0.05, ..., 1), w_c = |w| over its block's
   max |w|, averaged over the output rows of the group's linears, which divides the low-|w| channels back down.
   The candidate with the least summed squared output error of the group's linears on calibration inputs wins
   (the first of equals, the paper's family first); one s for the whole group, because linears that read one
   input read it through one multiplier (TensorRT-LLM fuses qkv, and fc with gate).
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

from toolchain.checkpoint.spec import LayerSpec
from toolchain.quantize.core import dequantize_groupwise, quantize_groupwise

GRID = 20  # α in {0, 0.05, ..., 0.95} for s = x^α, as the paper's search; {0, ..., 1} for s = x^α / w^(1-α)
X_ONLY, X_OVER_W = "x^a", "x^a/w^(1-a)"  # the two families of scale candidates, as the manifest names them
FORMULAS = (X_ONLY, X_OVER_W)
CLIP_GRID = 20  # clip ratios 1 - k / CLIP_GRID ...
CLIP_MAX_SHRINK = 0.5  # ... for k < CLIP_GRID * CLIP_MAX_SHRINK: 1, 0.95, ..., 0.55, as the paper's reference code


@dataclass(frozen=True)
class AwqChoice:
    """What the searches chose for one linear: s (float64 [in]) as the run time will apply it, the clip ratio per
    output channel and group (float32 [out, groups]), α, the output error against round-to-nearest, and which
    family of scales won (`FORMULAS`)."""

    scale: torch.Tensor
    clip: torch.Tensor
    alpha: float
    error_ratio: float
    formula: str = X_ONLY

    def summary(self) -> dict[str, float | str]:
        return {
            "alpha": self.alpha,
            "error_ratio": round(self.error_ratio, 4),
            "clip_mean": round(self.clip.mean().item(), 4),
            "clipped_groups": round((self.clip < 1).float().mean().item(), 4),
            "scale_formula": self.formula,
        }


@dataclass(frozen=True)
class ScaleSearch:
    """The scale search's winner for one group of linears: s (float64 [in]), its α and family, its summed squared
    output error and that error over round-to-nearest's (s = 1)."""

    scale: torch.Tensor
    alpha: float
    formula: str
    error: float
    error_ratio: float


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


def weight_stat(weights: list[torch.Tensor], group_size: int) -> torch.Tensor:
    """w_c (float64 [in]) of the linears in `weights` stacked: |w| over the max |w| of its group of `group_size`
    input channels, averaged over all output rows (ModelOpt awq_lite's `get_weight_scale`)."""
    rows = []
    for w in weights:
        padded = _padded(w, group_size).abs()
        out_dim, in_dim = padded.shape
        groups = padded.reshape(out_dim, in_dim // group_size, group_size)
        rows.append((groups / groups.amax(2, keepdim=True).clamp_min(1e-30)).reshape(out_dim, in_dim)[:, : w.shape[1]])
    return torch.cat(rows).double().mean(0)


def _candidates(
    weights: list[torch.Tensor], mean_abs: torch.Tensor, group_size: int, formulas: tuple[str, ...]
) -> list[tuple[str, float, torch.Tensor]]:
    """(family, α, unrounded s) of every candidate, s = 1 (α = 0 of s = x^α) first."""
    stats = mean_abs.double().clamp_min(1e-8)
    out = [(X_ONLY, step / GRID, stats.pow(step / GRID)) for step in range(GRID)] if X_ONLY in formulas else []
    if X_OVER_W in formulas:
        w_stat = weight_stat(weights, group_size).clamp_min(1e-8)
        out += [
            (X_OVER_W, step / GRID, stats.pow(step / GRID) / w_stat.pow(1 - step / GRID)) for step in range(GRID + 1)
        ]
    return out


def search_scale(
    weights: list[torch.Tensor],
    inputs: torch.Tensor,
    mean_abs: torch.Tensor,
    group_size: int,
    dtype: torch.dtype,
    formulas: tuple[str, ...] = FORMULAS,
) -> ScaleSearch:
    """One s (float64 [in]) for linears sharing `inputs` [rows, in], minimising Σ ||x Wᵀ - (x / s) Q(W s)ᵀ||² over
    the candidates of `formulas` (the first of equals wins). s is rounded through 1/s in `dtype`, the
    `prequant_scaling_factor` the run time multiplies by, so weight and input scaling cancel exactly. Products,
    errors and scales in float64: the errors decide which candidate wins, and in float32 their last bits (and so,
    between close candidates, the winner) followed the CPU's matmul kernels (docs/conversion.md)."""
    unknown = set(formulas) - set(FORMULAS)
    assert formulas and not unknown, f"scale formulas {sorted(unknown)} are none of {FORMULAS}"
    x = inputs.double()
    wide = [w.double() for w in weights]  # once, not once per candidate
    references = [x @ w.T for w in wide]

    def error(s: torch.Tensor) -> float:
        x_scaled = x / s
        return sum(
            (ref - x_scaled @ fake_groupwise((w * s).float(), group_size).double().T).pow(2).sum().item()
            for w, ref in zip(wide, references, strict=True)
        )

    ones = torch.ones_like(mean_abs, dtype=torch.float64)
    rtn_error = error(ones)
    best: ScaleSearch | None = None
    for formula, alpha, s in _candidates(weights, mean_abs, group_size, formulas):
        s = s / (s.max() * s.min()).sqrt()  # keep the scales centred around 1, as the reference code does
        s = 1 / (1 / s).to(dtype).double()
        e = rtn_error if torch.equal(s, ones) else error(s)  # x^0 is s = 1: round-to-nearest, already scored
        if best is None or e < best.error:
            best = ScaleSearch(s, alpha, formula, e, e / rtn_error if rtn_error else 1.0)
    assert best is not None
    return best


def search_shared_scales(
    weights: list[torch.Tensor], inputs: torch.Tensor, mean_abs: torch.Tensor, group_size: int, dtype: torch.dtype
) -> tuple[torch.Tensor, float, float]:
    """`search_scale`'s s, α and error ratio against round-to-nearest (s = 1)."""
    found = search_scale(weights, inputs, mean_abs, group_size, dtype)
    return found.scale, found.alpha, found.error_ratio


def search_scales(
    weight: torch.Tensor, inputs: torch.Tensor, mean_abs: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, float, float]:
    """`search_shared_scales` for one linear in float32."""
    return search_shared_scales([weight], inputs, mean_abs, group_size, torch.float32)


def search_clip(weight: torch.Tensor, inputs: torch.Tensor, group_size: int) -> torch.Tensor:
    """Clip ratio per output channel and group (float32 [out, groups]) of `weight` [out, in] (already scaled)
    minimising E[(x_g · (w_g - Q(w_g)))²] over `inputs` [rows, in] (already divided by s), each group's partial
    dot product on its own, as the paper's reference code does. Ratio 1 (no clipping) is a candidate, so no group
    gets worse than round-to-nearest on these inputs. Errors in float64, the first of equals kept (as the scale
    search's)."""
    w, x = _padded(weight, group_size), F.pad(inputs.double(), (0, -inputs.shape[1] % group_size))
    out_dim, in_dim = w.shape
    groups = in_dim // group_size
    xg = x.reshape(-1, groups, group_size)
    gram = torch.einsum("ngi,ngj->gij", xg, xg) / max(x.shape[0], 1)  # per group: E[x_g x_gᵀ]
    best_error = best_ratio = None
    for k in range(int(CLIP_GRID * CLIP_MAX_SHRINK)):
        ratio = torch.full((out_dim, groups), 1 - k / CLIP_GRID)
        codes, scale = quantize_groupwise(clip_groups(w, ratio, group_size), group_size)
        d = (w - dequantize_groupwise(codes, scale)).double().reshape(out_dim, groups, group_size)
        error = torch.einsum("ogi,gij,ogj->og", d, gram, d)
        if best_error is None or best_ratio is None:
            best_error, best_ratio = error, ratio
            continue
        better = error < best_error
        best_error, best_ratio = torch.where(better, error, best_error), torch.where(better, ratio, best_ratio)
    assert best_ratio is not None
    return best_ratio


def shared_input_groups(layer: LayerSpec | None, linears: list[str]) -> list[list[str]]:
    """`linears` (one unit's linears to quantize) grouped by the input they read, in the spec's order: its
    `input_groups` cut down to `linears`; without a layer spec (lm_head) each linear is a group of its own."""
    groups = [[p] for p in linears] if layer is None else [[p for p in g if p in linears] for g in layer.input_groups()]
    groups = [g for g in groups if g]
    assert sorted(p for g in groups for p in g) == sorted(linears), f"{linears} are not all linears of {layer}"
    return groups


def search_group(
    weights: dict[str, torch.Tensor], inputs: torch.Tensor, mean_abs: torch.Tensor, group_size: int, dtype: torch.dtype
) -> dict[str, AwqChoice]:
    """Both searches for linears reading one input: a shared s, then each linear's own clip ratios."""
    found = search_scale(list(weights.values()), inputs, mean_abs, group_size, dtype)
    s = found.scale
    x_scaled = inputs.double() / s
    return {
        prefix: AwqChoice(
            s,
            search_clip((w.double() * s).float(), x_scaled, group_size),
            found.alpha,
            found.error_ratio,
            found.formula,
        )
        for prefix, w in weights.items()
    }
