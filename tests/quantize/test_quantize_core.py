"""Quantization primitives: error bounds, saturation, zero channels, packing, against float64 references."""

from __future__ import annotations

import pytest
import torch

from toolchain.quantize.calibrate import KV_CLIP, Calibration, kv_cache_clip
from toolchain.quantize.core import (
    FP8_E4M3_MAX,
    dequantize_groupwise,
    fake_quant,
    pack_int4,
    quantize_fp8,
    quantize_groupwise,
    quantize_per_channel,
    unpack_int4,
)


def weights(out: int = 16, inp: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randn(out, inp, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_int8_per_channel_error_is_within_half_a_step() -> None:
    w = weights()
    codes, scale = quantize_per_channel(w)
    assert codes.dtype == torch.int8 and scale.shape == (16,)
    error = (codes.double() * scale.double()[:, None] - w).abs()
    assert (error <= scale.double()[:, None] / 2 + 1e-6).all()
    assert (codes.abs().amax(dim=1) == 127).all()  # each row's extreme maps to the top code


def test_int4_groupwise_bounds_and_groups_that_do_not_divide() -> None:
    w = weights(8, 128)
    codes, scale = quantize_groupwise(w, 32)
    assert scale.shape == (8, 4) and codes.min() >= -8 and codes.max() <= 7
    error = (dequantize_groupwise(codes, scale).double() - w).abs().reshape(8, 4, 32)
    assert (error <= scale.double()[..., None] / 2 + 1e-6).all()
    with pytest.raises(ValueError, match="172 is not a multiple of group size 64"):
        quantize_groupwise(weights(4, 172), 64)


def test_all_zero_channels_and_outliers() -> None:
    w = weights(4, 64)
    w[1] = 0
    w[2, 3] = 1e4  # one extreme outlier: its row's scale grows, other rows are untouched
    codes, scale = quantize_per_channel(w)
    assert scale[1] == 1 and (codes[1] == 0).all()
    assert torch.isfinite(scale).all()
    assert scale[2] > 50 * scale[0]
    g_codes, g_scale = quantize_groupwise(w, 16)
    assert (dequantize_groupwise(g_codes, g_scale)[1] == 0).all()


def test_fp8_saturates_never_nan() -> None:
    w = weights()
    codes, scale = quantize_fp8(w)
    assert codes.dtype == torch.float8_e4m3fn and scale.shape == (1,)
    assert (codes.float().abs().max() - FP8_E4M3_MAX).abs() < 1e-3
    relative = ((codes.double() * scale.double() - w).abs() / w.abs().clamp_min(1e-3)).max()
    assert relative < 0.07  # E4M3 has 3 mantissa bits: half an ulp is 1/16
    # A calibrated amax smaller than the data: out-of-range values saturate instead of becoming NaN.
    saturated, _ = quantize_fp8(w, amax=torch.tensor(0.5))
    assert not torch.isnan(saturated.float()).any()
    assert saturated.float().abs().max() == FP8_E4M3_MAX
    zero_codes, zero_scale = quantize_fp8(torch.zeros(3, 3))
    assert zero_scale.item() == 1 and (zero_codes.float() == 0).all()


def test_int4_packing_round_trips_and_layout() -> None:
    codes = torch.randint(-8, 8, (6, 10), generator=torch.Generator().manual_seed(1), dtype=torch.int8)
    packed = pack_int4(codes)
    assert packed.shape == (3, 10) and packed.dtype == torch.int8
    assert torch.equal(unpack_int4(packed), codes)
    byte = int(packed.view(torch.uint8)[0, 0])
    assert byte & 0xF == int(codes[0, 0]) & 0xF and byte >> 4 == int(codes[1, 0]) & 0xF
    with pytest.raises(ValueError, match="must be even"):
        pack_int4(codes[:5])


def test_int8_kv_clip_search() -> None:
    """A few large |k| set the max; the clip ratio that minimises the squared error of the sampled values is kept,
    and no clipping when every value is alike in size."""
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(1024, 16, generator=gen)
    rows[0, :2] = 40.0  # an attention-sink-like outlier row
    calib = Calibration(kv_amax={"l": rows.abs().max().item()}, kv_sample={"l": rows})
    r = kv_cache_clip(calib, "l")
    errors = {c: (fake_quant(rows, 40.0 * c / 127, "INT8") - rows).pow(2).sum().item() for c in KV_CLIP}
    assert r == min(errors, key=lambda c: errors[c]) and r < 1 and errors[r] < errors[1.0]
    flat = torch.full((64, 16), 3.0)
    flat[::2] = -3.0
    assert kv_cache_clip(Calibration(kv_amax={"l": 3.0}, kv_sample={"l": flat}), "l") == 1.0
    assert kv_cache_clip(Calibration(kv_amax={"l": 0.0}), "l") == 1.0  # never-seen layer: nothing to search
