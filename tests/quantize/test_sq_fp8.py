"""SmoothQuant's per-layer α search (`--sq-alpha auto`) and FP8's shared mlp.fc / mlp.gate weight scale."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import WIKI, one_line_error
from safetensors.torch import load_file

from toolchain.checkpoint.convert import convert
from toolchain.checkpoint.trtllm import read_config
from toolchain.quantize.core import FP8_E4M3_MAX
from toolchain.quantize.smoothquant import ALPHA_GRID, search_alpha, smoothing_error, smoothing_scales
from toolchain.quantize.stage import QuantizeOptions, quantize_checkpoint

CALIB = ("--calib-data", str(WIKI / "valid.txt"), "--calib-samples", "4", "--calib-seq-len", "64")


@pytest.fixture
def ckpt(stories: Path, tmp_path: Path) -> Path:
    convert(stories, tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_alpha_search_picks_the_least_output_error() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(512, 32, generator=gen)
    x[:, 3] *= 40  # an outlier channel: int8 per-tensor activations need the migration
    w = [torch.randn(24, 32, generator=gen), torch.randn(16, 32, generator=gen)]
    x_amax = x.abs().amax(0)
    choice = search_alpha(x, x_amax, w)
    reference = [x @ wi.T for wi in w]
    errors = {a: smoothing_error(x, x_amax, w, smoothing_scales(x_amax, w, a), reference) for a in ALPHA_GRID}
    assert choice.alpha in ALPHA_GRID and errors[choice.alpha] == min(errors.values())
    assert choice.error_ratio == pytest.approx(errors[choice.alpha] / errors[0.5]) and choice.error_ratio <= 1
    assert errors[choice.alpha] < errors[0.0] / 4  # no smoothing is far worse with that outlier


def test_sq_alpha_auto_records_each_layers_alpha(cli: Any, ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "auto"
    result = cli("quantize", ckpt, "-o", out, "--method", "w8a8_sq", "--sq-alpha", "auto", *CALIB)
    assert result.exit_code == 0, result.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    searched = manifest["details"]["smoothquant"]
    linears = ("attention.qkv", "attention.dense", "mlp.fc", "mlp.gate", "mlp.proj")
    assert set(searched) == {f"transformer.layers.{i}.{m}" for i in range(5) for m in linears}
    assert all(c["alpha"] in ALPHA_GRID and 0 < c["error_ratio"] <= 1 for c in searched.values())
    for i in range(5):  # fc and gate read one input through one s: one α
        assert searched[f"transformer.layers.{i}.mlp.fc"] == searched[f"transformer.layers.{i}.mlp.gate"]
    assert len({c["alpha"] for c in searched.values()}) > 1  # per layer, not one α for all
    assert manifest["details"]["smoothquant_alpha"] == "auto"
    assert read_config(out).quantization.smoothquant_val == 0.5  # TensorRT-LLM's default; α per layer is above


def test_sq_alpha_bad_values_are_one_line(cli: Any, ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "o"
    for value, expected in (("1.5", "outside [0, 1]"), ("best", "neither a number in [0, 1] nor 'auto'")):
        line = one_line_error(cli("quantize", ckpt, "-o", out, "--method", "w8a8_sq", "--sq-alpha", value, *CALIB))
        assert expected in line and value in line
    assert not out.exists()


@pytest.mark.slow
def test_fp8_fc_and_gate_share_one_weight_scale(ckpt: Path, tmp_path: Path) -> None:
    """TensorRT-LLM fuses mlp.gate and mlp.fc into one FP8 GEMM with one scale, the larger of the two."""
    opts = QuantizeOptions("fp8", calib_data=WIKI / "valid.txt", calib_samples=4, calib_seq_len=64)
    quantize_checkpoint(ckpt, tmp_path / "fp8", opts)
    base = load_file(str(ckpt / "rank0.safetensors"))
    w = load_file(str(tmp_path / "fp8" / "rank0.safetensors"))
    distinct = 0
    for i in range(5):
        mlp = f"transformer.layers.{i}.mlp"
        fc, gate = base[f"{mlp}.fc.weight"].abs().max(), base[f"{mlp}.gate.weight"].abs().max()
        distinct += fc != gate
        shared = torch.maximum(fc, gate) / FP8_E4M3_MAX
        for linear in ("fc", "gate"):
            assert torch.equal(w[f"{mlp}.{linear}.weights_scaling_factor"], shared.reshape(1))
            dequant = w[f"{mlp}.{linear}.weight"].float() * shared
            assert (dequant - base[f"{mlp}.{linear}.weight"]).abs().max() <= shared * 16  # half an E4M3 step at 448
        assert torch.equal(w[f"{mlp}.fc.activation_scaling_factor"], w[f"{mlp}.gate.activation_scaling_factor"])
        proj = base[f"{mlp}.proj.weight"].abs().max() / FP8_E4M3_MAX  # unfused linears keep their own scale
        assert torch.equal(w[f"{mlp}.proj.weights_scaling_factor"], proj.reshape(1))
    assert distinct  # the test means something: somewhere the two amaxes differ

    # gate left unquantized: nothing to fuse with, fc keeps its own scale
    opts = QuantizeOptions(
        "fp8", calib_data=WIKI / "valid.txt", calib_samples=4, calib_seq_len=64, exclude=("lm_head", "*gate")
    )
    quantize_checkpoint(ckpt, tmp_path / "nogate", opts)
    w = load_file(str(tmp_path / "nogate" / "rank0.safetensors"))
    fc = base["transformer.layers.0.mlp.fc.weight"].abs().max() / FP8_E4M3_MAX
    assert torch.equal(w["transformer.layers.0.mlp.fc.weights_scaling_factor"], fc.reshape(1))
    assert w["transformer.layers.0.mlp.gate.weight"].dtype == torch.float32
