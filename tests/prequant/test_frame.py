"""The shared pieces pre-quantized reading stands on: the number codecs (exact, both directions), detection and
its refusal of formats we do not read, and the reference forward of methods that compute their own linear."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch

from toolchain.checkpoint.hf import HFCheckpoint
from toolchain.checkpoint.prequant import READERS, detect
from toolchain.checkpoint.prequant.codecs import (
    AWQ_ORDER,
    AWQ_REVERSE_ORDER,
    E2M1_VALUES,
    e2m1_codes,
    e2m1_decode,
    e2m1_pack,
    e8m0_decode,
    int4_rows_pack,
    int4_rows_unpack,
    pack_int32,
    unpack_int32,
)
from toolchain.errors import UserError
from toolchain.quantize.methods.base import PARTS, Stored, per_row
from toolchain.quantize.methods.registry import IMPORTED, by_algo


def test_e2m1_every_code_round_trips_and_packs_low_nibble_first() -> None:
    codes = np.arange(16, dtype=np.uint8)
    assert np.array_equal(e2m1_codes(E2M1_VALUES), np.where(codes == 8, 0, codes))  # -0 encodes as +0
    packed = e2m1_pack(codes.reshape(1, 16))
    assert packed[0, 0] == 0x10  # element 0 (code 0) low, element 1 (code 1) high
    assert np.array_equal(e2m1_decode(packed), E2M1_VALUES.reshape(1, 16))


def test_e2m1_rounds_to_nearest_ties_to_even_and_saturates() -> None:
    x = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 100.0, -0.3, -5.0], dtype=np.float32)
    want = np.array([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, -0.5, -4.0], dtype=np.float32)
    assert np.array_equal(E2M1_VALUES[e2m1_codes(x)], want)


def test_e2m1_matches_brute_force_nearest_on_random_values() -> None:
    x = np.random.default_rng(0).normal(0, 3, 10000).astype(np.float32)
    got = E2M1_VALUES[e2m1_codes(x)]
    dist = np.abs(np.clip(x, -6, 6)[:, None] - E2M1_VALUES[None, :])
    assert np.allclose(np.abs(got - np.clip(x, -6, 6)), dist.min(1))


def test_e8m0_is_a_power_of_two_and_255_is_nan() -> None:
    got = e8m0_decode(np.array([0, 1, 126, 127, 128, 254, 255], dtype=np.uint8))
    assert got[3] == 1.0 and got[2] == 0.5 and got[4] == 2.0 and got[0] == np.float32(2.0**-127)
    assert got[5] == np.float32(2.0**127) and np.isnan(got[6])


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("axis", [0, 1])
def test_int32_packing_round_trips(bits: int, axis: int) -> None:
    values = np.random.default_rng(bits).integers(0, 1 << bits, (64, 96))
    packed = pack_int32(values, bits, axis)
    assert packed.dtype == np.int32 and packed.shape[axis] == values.shape[axis] * bits // 32
    assert np.array_equal(unpack_int32(packed, bits, axis), values)


def test_int32_low_bits_first_and_awq_order() -> None:
    word = np.array([[0x76543210]], dtype=np.uint32).view(np.int32)
    assert unpack_int32(word, 4, 1).tolist() == [[0, 1, 2, 3, 4, 5, 6, 7]]
    # AutoAWQ: slot k holds value AWQ_ORDER[k], so slot values 0..7 unpack to AWQ_REVERSE_ORDER's positions
    assert unpack_int32(word, 4, 1, AWQ_ORDER).tolist() == [list(AWQ_REVERSE_ORDER)]
    values = np.arange(8).reshape(1, 8)
    assert np.array_equal(unpack_int32(pack_int32(values, 4, 1, AWQ_ORDER), 4, 1, AWQ_ORDER), values)


def test_int4_rows_match_our_w4a16_packing() -> None:
    from toolchain.quantize.core import pack_int4, unpack_int4

    codes = torch.randint(-8, 8, (6, 5), generator=torch.Generator().manual_seed(0), dtype=torch.int8)
    ours = pack_int4(codes)
    assert np.array_equal(int4_rows_pack(codes.numpy()).view(np.int8), ours.numpy())
    assert np.array_equal(int4_rows_unpack(ours.numpy(), signed=True), unpack_int4(ours).numpy())
    unsigned = int4_rows_unpack(ours.numpy(), signed=False)
    assert unsigned.min() >= 0 and np.array_equal(unsigned, codes.numpy() & 0x0F)


def _ckpt(tmp_path: Path, quantization_config: Any) -> HFCheckpoint:
    from safetensors.numpy import save_file

    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": quantization_config}))
    save_file({"x": np.zeros(1, np.float32)}, str(tmp_path / "model.safetensors"))
    return HFCheckpoint.open(tmp_path)


def test_float_checkpoint_has_no_format(tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    (tmp_path / "config.json").write_text("{}")
    save_file({"x": np.zeros(1, np.float32)}, str(tmp_path / "model.safetensors"))
    assert detect(HFCheckpoint.open(tmp_path)) is None


@pytest.mark.parametrize("method", ["bitsandbytes", None, "hqq"])
def test_unknown_quant_method_refused_naming_it_and_the_known(tmp_path: Path, method: str | None) -> None:
    with pytest.raises(UserError) as e:
        detect(_ckpt(tmp_path, {"quant_method": method}))
    assert repr(method) in str(e.value) and all(m in str(e.value) for m in READERS)


def test_imported_methods_are_found_by_quant_algo_only() -> None:
    from toolchain.quantize.methods import METHOD_NAMES

    for name, m in IMPORTED.items():
        assert by_algo(m.quant_algo) is m
        assert name not in METHOD_NAMES  # `quantize --method` does not offer them until it can make them


def test_per_part_scales_expand_over_their_rows() -> None:
    s = Stored("p", {f"p.{PARTS}": torch.tensor([2, 3, 1])}, 4, 128)
    col = per_row(s, torch.tensor([1.0, 2.0, 4.0]), 6)
    assert col.reshape(-1).tolist() == [1, 1, 2, 2, 2, 4]
    assert per_row(Stored("p", {}, 4, 128), torch.tensor([3.0]), 2).reshape(-1).tolist() == [3, 3]


def test_imported_dequantize_reads_the_documented_layouts() -> None:
    """Each import-only layout's `dequantize` against the formula its module states, on hand-made tensors."""
    g = torch.Generator().manual_seed(0)
    out, inn = 4, 32
    codes = torch.randint(0, 256, (out, inn // 2), generator=g, dtype=torch.uint8)
    bs = torch.tensor(np.full((out, inn // 16), 0.5, ml_dtypes.float8_e4m3fn).view(np.uint8)).view(torch.float8_e4m3fn)
    s = Stored(
        "p",
        {"p.weight": codes, "p.weights_scaling_factor": bs, "p.weights_scaling_factor_2": torch.tensor([3.0])},
        inn,
        128,
    )
    want = torch.from_numpy(e2m1_decode(codes.numpy())) * 0.5 * 3.0
    assert torch.equal(by_algo("NVFP4").dequantize(s), want)  # type: ignore[union-attr]

    q = torch.randint(0, 16, (out, inn), generator=g)
    z = torch.randint(0, 16, (out, inn // 8), generator=g)
    sc = torch.rand(out, inn // 8, generator=g)
    perm = torch.randperm(inn, generator=g)
    packed = torch.from_numpy(int4_rows_pack(q.numpy()))
    t = {
        "p.weight": packed,
        "p.weights_scaling_factor": sc,
        "p.weights_zero_point": z.to(torch.uint8),
        "p.input_perm": perm,
    }
    stored = (q - z.repeat_interleave(8, 1)).float() * sc.repeat_interleave(8, 1)
    w = IMPORTED["w4a16_gptq"].dequantize(Stored("p", t, inn, 8))
    x = torch.randn(3, inn, generator=g)
    assert torch.allclose(x @ w.T, x[:, perm] @ stored.T, atol=1e-5)  # what the engine computes: x[..., perm]
