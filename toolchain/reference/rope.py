"""Rotary position embedding frequencies, including the scaled variants our families use.

Llama-3 scaling follows Meta's reference (llama3 `apply_scaling`), the same rule transformers implements as
`_compute_llama3_parameters`: wavelengths longer than original_max/low_freq_factor are divided by `factor`,
shorter than original_max/high_freq_factor are kept, and the band between is interpolated smoothly.

YaRN (gpt-oss) follows transformers' `_compute_yarn_parameters` (modeling_rope_utils.py; the YaRN paper,
arXiv 2309.00071): frequencies blend the interpolated (/ factor) and the original ones over a linear ramp between the
correction dimensions of `beta_fast` and `beta_slow` rotations (floored / ceiled unless `truncate` is false), and cos
and sin are multiplied by the attention factor (0.1 ln(factor) + 1 unless the config gives it or mscale pairs).
"""

from __future__ import annotations

import math
from typing import Any

import torch


def inv_freq(head_size: int, base: float, scaling: dict[str, Any] | None, dtype: torch.dtype) -> torch.Tensor:
    freqs = 1.0 / (base ** (torch.arange(0, head_size, 2, dtype=torch.float64) / head_size))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "linear":
        assert scaling is not None
        freqs = freqs / float(scaling["factor"])
    elif kind == "llama3":
        assert scaling is not None
        freqs = _llama3(freqs, scaling)
    elif kind == "yarn":
        assert scaling is not None
        freqs = _yarn(freqs, head_size, base, scaling)
    elif kind != "default":
        raise ValueError(f"rope scaling {kind!r} has no reference implementation")
    return freqs.to(dtype)


def _llama3(freqs: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    original = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / freqs
    smooth = (original / wavelen - low) / (high - low)
    interpolated = (1 - smooth) * freqs / factor + smooth * freqs
    out = torch.where(wavelen > original / low, freqs / factor, freqs)
    mid = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(mid, interpolated, out)


def _yarn(freqs: torch.Tensor, head_size: int, base: float, scaling: dict[str, Any]) -> torch.Tensor:
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])
    fast, slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return head_size * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(fast), correction_dim(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_size - 1)
    high = high + 0.001 if low == high else high  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(head_size // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return freqs / factor * ramp + freqs * (1 - ramp)


def attention_factor(scaling: dict[str, Any] | None) -> float:
    """The factor YaRN multiplies cos and sin by (1.0 for every other scaling), as transformers computes it."""
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind != "yarn":
        return 1.0
    assert scaling is not None
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, mscale, all_dim = float(scaling["factor"]), scaling.get("mscale"), scaling.get("mscale_all_dim")

    def get_mscale(m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    return get_mscale(float(mscale)) / get_mscale(float(all_dim)) if mscale and all_dim else get_mscale(1.0)


def cos_sin(
    positions: torch.Tensor, head_size: int, base: float, scaling: dict[str, Any] | None, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape [T, head_size] in the rotate-half (GPT-NeoX) layout."""
    angles = positions.to(dtype)[:, None] * inv_freq(head_size, base, scaling, dtype)[None, :]
    emb = torch.cat([angles, angles], dim=-1)
    scale = attention_factor(scaling)
    if scale == 1.0:
        return emb.cos(), emb.sin()
    return emb.cos() * scale, emb.sin() * scale


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [..., T, head_size]; rotate-half convention (TensorRT-LLM's rope_gpt_neox)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
