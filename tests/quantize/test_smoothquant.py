"""SmoothQuant (w8a8_sq): the migration is an identity in exact arithmetic, the layout is TensorRT-LLM's, and
migrating outliers into the weights is what makes int8 activations affordable."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import WIKI
from models import save_random
from safetensors.torch import load_file

from toolchain.checkpoint.convert import convert
from toolchain.checkpoint.trtllm import load_rank, read_config
from toolchain.quantize.calibrate import LayerwiseCalibration
from toolchain.quantize.fake import FakeQuant
from toolchain.quantize.scheme import quantizable
from toolchain.quantize.smoothquant import smooth_layer, smoothing_scales
from toolchain.quantize.stage import QuantizeOptions, quantize_checkpoint
from toolchain.reference.model import ReferenceModel


@pytest.mark.parametrize("arch", ["qwen2", "gpt2", "gemma3"])  # RMSNorm; LayerNorm (bias too); sandwich norms
def test_smoothing_alone_leaves_the_logits_unchanged(arch: str, tmp_path: Path) -> None:
    convert(save_random(tmp_path / "hf", arch), tmp_path / "ckpt")
    cfg, weights = read_config(tmp_path / "ckpt"), load_rank(tmp_path / "ckpt", 0)
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    base = ReferenceModel(cfg, weights, torch.float64)
    run = LayerwiseCalibration(cfg, weights, ids)
    for i in range(cfg.num_hidden_layers):
        run.layer(i)
    calib = run.finish()
    smoothed = {n: t.double() for n, t in weights.items()}
    chosen = set(quantizable(base.spec))
    prequant = {}
    for i in range(cfg.num_hidden_layers):
        scales, searched = smooth_layer(smoothed, base.spec.layers[i], calib, 0.5, chosen)
        prequant.update(scales)
        assert searched == {}  # a fixed α searches nothing
    assert set(prequant) == {f"transformer.layers.{i}.{m}" for i in range(2) for m in ("attention.dense", "mlp.proj")}
    changed = [n for n in weights if not torch.equal(weights[n].double(), smoothed[n])]
    feeding = {
        f"{n.name}.{k}" for ls in base.spec.layers for n in (ls.attn_norm, ls.mlp_norm) for k in ("weight", "bias")
    }
    assert {n for n in changed if "norm" in n} == feeding & set(weights)  # the spec's pairs, sandwich norms untouched
    model = ReferenceModel(cfg, smoothed, torch.float64)
    model.hooks = FakeQuant({p: s.double() for p, s in prequant.items()}, {}, None, {}, None)
    torch.testing.assert_close(model.forward(ids), base.forward(ids), rtol=0, atol=1e-10)


def test_scales_leave_silent_channels_alone() -> None:
    x = torch.tensor([4.0, 0.0, 1.0, 9.0])
    w = torch.tensor([[1.0, 2.0, 0.0, 0.5], [-2.0, 1.0, 0.0, 0.1]])
    s = smoothing_scales(x, [w], 0.5)
    assert s[1] == 1 and s[2] == 1  # never-active input channel; all-zero weight column
    assert s[0] == pytest.approx(2 / 2**0.5) and s[3] == pytest.approx(3 / 0.5**0.5)


def test_w8a8_sq_layout(stories: Path, tmp_path: Path) -> None:
    convert(stories, tmp_path / "ckpt")
    opts = QuantizeOptions("w8a8_sq", calib_data=WIKI / "valid.txt", calib_samples=4, calib_seq_len=64)
    quantize_checkpoint(tmp_path / "ckpt", tmp_path / "sq", opts)
    q = read_config(tmp_path / "sq").quantization
    assert q.quant_algo == "W8A8_SQ_PER_CHANNEL" and q.smoothquant_val == 0.5 and q.pre_quant_scale
    w = load_file(str(tmp_path / "sq" / "rank0.safetensors"))
    for linear in ("attention.qkv", "attention.dense", "mlp.fc", "mlp.gate", "mlp.proj"):
        p = f"transformer.layers.1.{linear}"
        assert w[f"{p}.weight"].dtype == torch.int8
        assert w[f"{p}.weights_scaling_factor"].shape == (w[f"{p}.weight"].shape[0],)
        assert w[f"{p}.activation_scaling_factor"].shape == (1,) and w[f"{p}.activation_scaling_factor"] > 0
        has_prequant = linear in ("attention.dense", "mlp.proj")  # no norm in front to fold 1/s into
        assert (f"{p}.prequant_scaling_factor" in w) == has_prequant
    assert w["transformer.layers.1.mlp.proj.prequant_scaling_factor"].shape == (172,)
    base = load_file(str(tmp_path / "ckpt" / "rank0.safetensors"))
    assert not torch.equal(
        w["transformer.layers.1.input_layernorm.weight"], base["transformer.layers.1.input_layernorm.weight"]
    )


@pytest.mark.slow
def test_smoothing_is_what_makes_int8_activations_work(stories: Path, tmp_path: Path) -> None:
    """α = 0 is plain W8A8 (per-tensor int8 activations): stories260K's outlier channels cost it dearly."""
    convert(stories, tmp_path / "ckpt")
    kld = {}
    for alpha in (0.0, 0.5):
        opts = QuantizeOptions(
            "w8a8_sq", calib_data=WIKI / "valid.txt", calib_samples=16, calib_seq_len=128, sq_alpha=alpha
        )
        r = quantize_checkpoint(tmp_path / "ckpt", tmp_path / f"sq{alpha}", opts, WIKI / "test.txt", 2048)
        kld[alpha] = r.to_json()["quality"]["kld_mean"]
    assert kld[0.5] < kld[0.0] / 2, kld
