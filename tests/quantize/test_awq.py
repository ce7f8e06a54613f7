"""AWQ's two searches (toolchain/quantize/awq.py) on tiny random layers where the benefit is certain, and the stage's
output on stories260K: shared scales per input, clipped weight scales, choices in the manifest, and the held-out
gain over round-to-nearest."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from conftest import WIKI
from safetensors.torch import load_file

from toolchain.checkpoint.convert import convert
from toolchain.checkpoint.spec import DenseFFN, LayerSpec, Norm
from toolchain.checkpoint.trtllm import read_config
from toolchain.errors import UserError
from toolchain.quantize.awq import (
    FORMULAS,
    GRID,
    X_ONLY,
    X_OVER_W,
    clip_groups,
    fake_groupwise,
    search_clip,
    search_group,
    search_scale,
    search_shared_scales,
    shared_input_groups,
    weight_stat,
)
from toolchain.quantize.core import quantize_groupwise
from toolchain.quantize.stage import QuantizeOptions, quantize_checkpoint


def _layer(seed: int, out_dim: int = 16, in_dim: int = 64, rows: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out_dim, in_dim, generator=g), torch.randn(rows, in_dim, generator=g)


def _error(weights: list[torch.Tensor], x: torch.Tensor, s: torch.Tensor, group: int) -> float:
    return sum(
        (x @ w.T - (x / s.float()) @ fake_groupwise((w.double() * s).float(), group).T).pow(2).sum().item()
        for w in weights
    )


def test_scale_search_protects_a_planted_outlier_channel() -> None:
    weight, x = _layer(0)
    x[:, 5] *= 40  # one loud input channel: round-to-nearest spends its error there
    s, alpha, ratio = search_shared_scales([weight], x, x.abs().mean(0), 32, torch.float32)
    assert alpha > 0 and s.argmax().item() == 5
    assert ratio < 0.5
    assert _error([weight], x, s, 32) < 0.5 * _error([weight], x, torch.ones(64, dtype=torch.float64), 32)


def test_weight_term_wins_for_a_weight_with_one_huge_column() -> None:
    """Equal mean |x| on every channel: s = x^α is s = 1 (round-to-nearest) at every α. One input column 30 times
    the rest sets every group's int4 step; s = x^α / w^(1-α) scales the other columns up past it and wins."""
    weight, x = _layer(6, out_dim=32)
    weight[:, 9] *= 30
    flat = torch.ones(64)
    w_stat = weight_stat([weight], 32)
    assert w_stat.argmax().item() == 9 and w_stat[9] > 0.9 and w_stat.shape == (64,)
    x_only = search_scale([weight], x, flat, 32, torch.float32, (X_ONLY,))
    both = search_scale([weight], x, flat, 32, torch.float32)
    assert x_only.alpha == 0 and x_only.error_ratio == 1  # every x^α candidate is s = 1; the first of equals
    assert both.formula == X_OVER_W and both.alpha < 1 and both.scale.argmin().item() == 9
    assert both.error_ratio < 0.5
    assert both.error == pytest.approx(_error([weight], x, both.scale, 32), rel=1e-6)
    choice = search_group({"L.mlp.proj": weight}, x, flat, 32, torch.float32)["L.mlp.proj"]
    assert choice.formula == X_OVER_W and choice.summary()["scale_formula"] == X_OVER_W


def test_search_over_both_families_never_loses_to_either_alone() -> None:
    """On its own objective (the summed output error of the group) the search over both families is the better of
    the two searched alone, exactly, and takes that family's s; here each family wins somewhere."""
    winners = set()
    for seed in range(8):
        weights = [_layer(10 + seed, out_dim=24)[0], _layer(20 + seed, out_dim=8)[0]]
        _, x = _layer(30 + seed)
        x[:, seed] *= 5 + 10 * seed  # a loud channel of varying strength
        if seed % 2:
            weights[0][:, 40 + seed] *= 1 + 4 * seed  # and, in half the cases, a large weight column
        alone = [search_scale(weights, x, x.abs().mean(0), 32, torch.float32, (f,)) for f in FORMULAS]
        both = search_scale(weights, x, x.abs().mean(0), 32, torch.float32)
        best = min(alone, key=lambda r: r.error)  # the first of equals: the paper's family
        assert both.error == best.error and both.formula == best.formula and torch.equal(both.scale, best.scale)
        assert both.alpha == best.alpha and both.error_ratio <= 1
        winners.add(both.formula)
    assert winners == set(FORMULAS)


def test_scale_is_shared_by_linears_reading_one_input() -> None:
    """q, k and v searched as three linears with the summed loss choose what their fused qkv chooses; fc and gate
    get one scale vector (one prequant_scaling_factor)."""
    qkv, x = _layer(1, out_dim=32)
    x[:, 3] *= 20
    fused = search_shared_scales([qkv], x, x.abs().mean(0), 32, torch.float32)
    split = search_shared_scales(list(torch.split(qkv, [16, 8, 8])), x, x.abs().mean(0), 32, torch.float32)
    assert fused[1] == split[1] and torch.equal(fused[0], split[0])
    gate, _ = _layer(2)
    choices = search_group({"L.mlp.fc": qkv[:16], "L.mlp.gate": gate}, x, x.abs().mean(0), 32, torch.float32)
    assert torch.equal(choices["L.mlp.fc"].scale, choices["L.mlp.gate"].scale)
    assert choices["L.mlp.fc"].alpha == choices["L.mlp.gate"].alpha


def test_groups_of_linears_reading_one_input_come_from_the_spec() -> None:
    """The layer's spec groups its linears (fc with gate); an excluded linear leaves its partner alone; a layer
    without a gate has fc alone; lm_head (no layer spec) is a group of its own."""
    gated = LayerSpec(3, Norm("transformer.layers.3.input_layernorm"), Norm("transformer.layers.3.post_layernorm"))
    qkv, dense, fc, gate, proj = gated.linears()
    assert shared_input_groups(gated, [qkv, dense, fc, gate, proj]) == [[qkv], [fc, gate], [dense], [proj]]
    assert shared_input_groups(gated, [dense, fc, proj]) == [[fc], [dense], [proj]]
    plain = dataclasses.replace(gated, ffn=DenseFFN(gated=False))
    assert shared_input_groups(plain, plain.linears()) == [[qkv], [fc], [dense], [proj]]
    assert shared_input_groups(None, ["lm_head"]) == [["lm_head"]]


def test_clip_search_lowers_the_output_error() -> None:
    weight, x = _layer(3, out_dim=32)
    weight[torch.rand(weight.shape, generator=torch.Generator().manual_seed(4)) < 0.03] *= 6  # heavy-tailed rows
    clip = search_clip(weight, x, 32)
    assert clip.shape == (32, 2) and (clip <= 1).all() and (clip >= 0.55 - 1e-6).all() and (clip < 1).any()
    clipped = (x @ (weight - fake_groupwise(weight, 32, clip)).T).pow(2).mean()
    plain = (x @ (weight - fake_groupwise(weight, 32)).T).pow(2).mean()
    assert clipped < 0.95 * plain  # ratio 1 is a candidate for every group: never worse, here clearly better
    codes, scale = quantize_groupwise(clip_groups(weight, clip, 32), 32)
    assert codes.abs().max() <= 7 and (scale <= weight.abs().reshape(32, 2, 32).amax(2) / 7 + 1e-7).all()


def test_scales_round_trip_through_the_model_dtype() -> None:
    weight, x = _layer(5)
    s, _, _ = search_shared_scales([weight], x * torch.logspace(-1, 1, 64), x.abs().mean(0), 32, torch.float16)
    prequant = (1 / s).to(torch.float16)  # what the checkpoint stores and the run time multiplies by
    assert torch.allclose(prequant.double() * s, torch.ones_like(s), rtol=1e-12, atol=0)


@pytest.fixture
def stories_ckpt(stories: Path, tmp_path: Path) -> Path:
    convert(stories, tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_stage_shares_scales_clips_and_records_choices(stories_ckpt: Path, tmp_path: Path) -> None:
    opts = QuantizeOptions("w4a16_awq", group_size=32, calib_data=WIKI / "valid.txt", calib_samples=8, calib_seq_len=64)
    quantize_checkpoint(stories_ckpt, tmp_path / "awq", opts)
    w = load_file(str(tmp_path / "awq" / "rank0.safetensors"))
    awq = json.loads((tmp_path / "awq" / "manifest.json").read_text())["details"]["awq"]
    assert len(awq) == 25  # 5 layers x (qkv, dense, fc, gate, proj); lm_head excluded
    for i in range(5):
        layer = f"transformer.layers.{i}"
        assert torch.equal(w[f"{layer}.mlp.fc.prequant_scaling_factor"], w[f"{layer}.mlp.gate.prequant_scaling_factor"])
        assert awq[f"{layer}.mlp.fc"]["alpha"] == awq[f"{layer}.mlp.gate"]["alpha"]
    for choice in awq.values():
        assert choice["scale_formula"] in FORMULAS and choice["error_ratio"] <= 1
        top = GRID if choice["scale_formula"] == X_OVER_W else GRID - 1
        assert choice["alpha"] in [k / GRID for k in range(top + 1)]
        assert 0.55 <= choice["clip_mean"] <= 1 and 0 <= choice["clipped_groups"] <= 1
    assert any(c["clipped_groups"] > 0 for c in awq.values())


@pytest.mark.slow
def test_awq_beats_round_to_nearest_on_held_out_raw_text(stories_ckpt: Path, tmp_path: Path) -> None:
    """Calibrated on WikiText-2 valid, evaluated on raw WikiText-2 test (other articles): ≥ 15 % lower mean KLD."""
    quality = {}
    for method in ("w4a16", "w4a16_awq"):
        opts = QuantizeOptions(method, group_size=64, calib_data=WIKI / "valid.txt", calib_samples=32)
        r = quantize_checkpoint(stories_ckpt, tmp_path / method, opts, WIKI / "wiki.test.raw", eval_tokens=4096)
        quality[method] = r.to_json()["quality"]
    assert quality["w4a16_awq"]["kld_mean"] < 0.85 * quality["w4a16"]["kld_mean"]
    assert quality["w4a16_awq"]["ppl_ratio"] < quality["w4a16"]["ppl_ratio"]
    w = load_file(str(tmp_path / "w4a16_awq" / "rank0.safetensors"))  # K = 172: scales for every input channel
    assert w["transformer.layers.0.mlp.proj.prequant_scaling_factor"].shape == (172,)
    assert read_config(tmp_path / "w4a16_awq").quantization.pre_quant_scale


def test_calibration_text_is_refused_as_evaluation_text(tmp_path: Path) -> None:
    text = tmp_path / "a.txt"
    text.write_text("the same words\n" * 50)
    (tmp_path / "copy.txt").write_bytes(text.read_bytes())
    opts = QuantizeOptions("w4a16_awq", calib_data=text)
    for eval_data in (text, tmp_path / "copy.txt"):
        with pytest.raises(UserError, match="same text"):
            quantize_checkpoint(tmp_path / "no-ckpt", tmp_path / "out", opts, eval_data)
    assert not (tmp_path / "out").exists()
