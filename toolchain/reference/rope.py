"""Rotary position embedding frequencies, including the scaled variants our families use.

Llama-3 scaling follows Meta's reference (llama3 `apply_scaling`), the same rule transformers implements as
`_compute_llama3_parameters`: wavelengths longer than original_max/low_freq_factor are divided by `factor`,
shorter than original_max/high_freq_factor are kept, and the band between is interpolated smoothly.
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


def cos_sin(
    positions: torch.Tensor, head_size: int, base: float, scaling: dict[str, Any] | None, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape [T, head_size] in the rotate-half (GPT-NeoX) layout."""
    angles = positions.to(dtype)[:, None] * inv_freq(head_size, base, scaling, dtype)[None, :]
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [..., T, head_size]; rotate-half convention (TensorRT-LLM's rope_gpt_neox)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
