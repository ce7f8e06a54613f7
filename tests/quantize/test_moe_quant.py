"""Quantization of mixture-of-experts layers (quantize/experts.py): each expert's stacked slice quantized with its
own scales (weight-only, or fp8 with routed calibration: calibrate.RoutedStats), the router kept float32, the
checkpoint run by the fake-quant reference and the CPU engine. Parity cases of tests/models.py (Mixtral, Qwen3-MoE
with dense and sparse layers mixed)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import onnx
import pytest
import torch
from models import PARITY, build, run_alone, save_case, save_random

from toolchain.checkpoint.convert import convert
from toolchain.checkpoint.tiny import make_tiny_llama
from toolchain.checkpoint.trtllm import load_rank, read_config
from toolchain.errors import UserError
from toolchain.quantize.calibrate import CALIB_DTYPE, MIN_EXPERT_TOKENS, sample_windows
from toolchain.quantize.core import FP8_E4M3_MAX, dequantize_groupwise, unpack_int4
from toolchain.quantize.fake import load_quantized
from toolchain.quantize.stage import QuantizeOptions, quantize_checkpoint
from toolchain.reference.model import Hooks, ReferenceModel
from toolchain.text import tokenize

# Qwen3-MoE: dense layers 0, 2 (quantized as dense linears) and sparse 1, 3; Mixtral (8 experts, ~6 s): slow tier
CASES = [pytest.param("mixtral-top2-of-8", marks=pytest.mark.slow), "qwen3-moe-unnormalised-step2"]
METHODS = (("w8a16", 128), ("w4a16", 64))  # group 64: the experts' widths 32 and 48 end in a partial block


def _kld(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per row, in float64."""
    lp, lq = p.double().log_softmax(-1), q.double().log_softmax(-1)
    return (lp.exp() * (lp - lq)).sum(-1)


def _sparse(ckpt: Path) -> list[str]:
    """The MoE layers' mlp prefixes of a checkpoint (those with a router)."""
    return [k.removesuffix(".router.weight") for k in load_rank(ckpt, 0) if k.endswith(".mlp.router.weight")]


def _check_layout(src: Path, out: Path, method: str, group: int) -> None:
    """The router is the float one, float32 and excluded; each expert's fc and proj have their own scales (per row
    for w8a16, per row and group for w4a16) and every weight is within half a step of its round-to-nearest value."""
    cfg, raw, float_w = read_config(out), load_rank(out, 0), load_rank(src, 0)
    sparse = _sparse(out)
    assert sparse
    for mlp in sparse:
        assert (
            raw[f"{mlp}.router.weight"].dtype == torch.float32 and f"{mlp}.router" in cfg.quantization.exclude_modules
        )
        assert torch.equal(raw[f"{mlp}.router.weight"], float_w[f"{mlp}.router.weight"])
        for linear in ("fc", "proj"):
            w = float_w[f"{mlp}.{linear}.weight"].float()
            codes, scale = raw[f"{mlp}.{linear}.weight"], raw[f"{mlp}.{linear}.weights_scaling_factor"]
            e, rows, width = w.shape
            if method == "w8a16":  # per expert and output row: max |w| of that row / 127
                assert codes.dtype == torch.int8 and codes.shape == w.shape and scale.shape == (e, rows)
                torch.testing.assert_close(scale, w.abs().amax(-1) / 127, rtol=0, atol=0)
                deq, step = codes.float() * scale[..., None], scale[..., None].expand_as(w)
            else:  # per expert, output row and group of `group` inputs: max |w| of the group / 7
                groups = -(-width // group)
                assert codes.shape == (e, rows // 2, groups * group) and scale.shape == (e, rows, groups)
                deq = torch.stack(
                    [dequantize_groupwise(unpack_int4(c), s)[:, :width] for c, s in zip(codes, scale, strict=True)]
                )
                step = scale.repeat_interleave(group, -1)[..., :width]
            assert ((deq - w).abs() <= step / 2 * (1 + 1e-6)).all()


@pytest.mark.parametrize("case", CASES)
def test_quantized_experts_layout_engine_and_quality(case: str, tmp_path: Path) -> None:
    """Per method: the layout; the CPU engine equals the fake-quant reference (< 1e-4, same argmax: float32
    summation order only, the dense weight-only bound of tests/engine/test_engine.py); against float, the dense
    methods' bound (tests/quantize/test_quantize.py): quantization costs something, and w8a16 costs less than
    w4a16 in KLD and no more in top-1 agreement."""
    src = convert(save_case(tmp_path / "hf", case), tmp_path / "ckpt") and tmp_path / "ckpt"
    full = ReferenceModel.from_checkpoint(src)
    ids = [
        torch.randint(0, full.config.vocab_size, (40,), generator=torch.Generator().manual_seed(s)).tolist()
        for s in (6, 7)
    ]
    floats = torch.cat([full.forward(torch.tensor([i]))[0] for i in ids])
    quality = {}
    for method, group in METHODS:
        out = tmp_path / method
        quantize_checkpoint(src, out, QuantizeOptions(method, group_size=group))
        _check_layout(src, out, method, group)
        fake, engine = load_quantized(out), build(out, tmp_path / f"{method}-engine")
        graph = onnx.load(str(engine.spec.engine_dir / "model.onnx"), load_external_data=False).graph
        dq = {n.input[0] for n in graph.node if n.op_type == "DequantizeLinear"}
        assert {f"{mlp}.{lin}.weight" for mlp in _sparse(out) for lin in ("fc", "proj")} <= dq  # int codes in the graph
        g = torch.cat([torch.from_numpy(run_alone(engine, i)) for i in ids])
        e = torch.cat([fake.forward(torch.tensor([i]))[0] for i in ids])
        assert (g - e).abs().max() < 1e-4
        assert torch.equal(g.argmax(-1), e.argmax(-1))
        quality[method] = (_kld(floats, g).mean().item(), (floats.argmax(-1) == g.argmax(-1)).double().mean().item())
    assert 0 < quality["w8a16"][0] < quality["w4a16"][0], quality
    assert quality["w8a16"][1] >= quality["w4a16"][1], quality


def test_awq_and_smoothquant_refuse_experts(tmp_path: Path) -> None:
    """AWQ and SmoothQuant do not run experts yet: one clear error naming the methods that do, before any
    calibration text is read."""
    src = convert(save_case(tmp_path / "hf", "qwen3-moe-unnormalised-step2"), tmp_path / "ckpt") and tmp_path / "ckpt"
    for method in ("w4a16_awq", "w8a8_sq"):
        with pytest.raises(UserError, match=f"not '{method}'; choose --method w8a16, w4a16 or fp8"):
            quantize_checkpoint(src, tmp_path / method, QuantizeOptions(method))


@pytest.fixture(scope="module")
def moe_with_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The Qwen3-MoE parity case (sparse layers 1 and 3, 8 experts top 3) at the demo byte-level tokenizer's vocab
    (320), converted, and calibration text."""
    tmp = tmp_path_factory.mktemp("moe-fp8")
    case = PARITY["qwen3-moe-unnormalised-step2"]
    hf = save_random(tmp / "hf", case.arch, **{**case.config, "vocab_size": 320})
    make_tiny_llama(tmp / "demo")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tmp / "demo" / name, hf / name)
    convert(hf, tmp / "ckpt")
    words = ["the", "experts", "see", "only", "tokens", "routed", "to", "them", "and", "some", "none", "."]
    g = torch.Generator().manual_seed(5)
    (tmp / "calib.txt").write_text(" ".join(words[i] for i in torch.randint(len(words), (2500,), generator=g).tolist()))
    return tmp / "ckpt", tmp / "calib.txt"


class _Routed(Hooks):
    """The test's own record of each expert's routed inputs: max |x| and row count per (linear, expert)."""

    def __init__(self) -> None:
        self.amax: dict[tuple[str, int], float] = {}
        self.rows: dict[tuple[str, int], int] = {}

    def expert_input(self, prefix: str, expert: int, x: torch.Tensor) -> torch.Tensor:
        key = (prefix, expert)
        self.amax[key] = max(self.amax.get(key, 0.0), x.abs().max().item())
        self.rows[key] = self.rows.get(key, 0) + x.shape[0]
        return x


def test_fp8_experts_routed_calibration_engine_and_quality(
    moe_with_tokenizer: tuple[Path, Path], tmp_path: Path
) -> None:
    """fp8 experts: per expert, the weight scale is max |w_e| / 448 and the fc / proj input scales are the maxima
    of the tokens routed to that expert / 448 (recomputed here by a float64 forward over the same windows), the
    layer's maximum for an expert routed fewer than MIN_EXPERT_TOKENS; the counts (each token routed to top-k
    experts) and the fallbacks are in the result and the manifest; the graph quantize-dequantizes inside the MoE op
    (fp8_inputs); the CPU engine equals the fake-quant reference (< 1e-4, same argmax: float32 summation order, the
    dense bound of tests/engine/test_engine.py); against float, fp8 costs something and less than w4a16 in KLD, no
    more in top-1 (the dense methods' ordering, tests/quantize/test_quantize.py)."""
    src, text = moe_with_tokenizer
    samples, seq_len = 4, 32
    opts = QuantizeOptions("fp8", calib_data=text, calib_samples=samples, calib_seq_len=seq_len)
    r = quantize_checkpoint(src, tmp_path / "fp8", opts)
    manifest = json.loads((tmp_path / "fp8" / "manifest.json").read_text())
    assert r.routed_calibration == manifest["details"]["routed_calibration"]
    routed = r.routed_calibration
    assert routed is not None and routed["min_tokens"] == MIN_EXPERT_TOKENS
    # the test's own routed maxima, by a float64 forward over the same windows
    ref = ReferenceModel.from_checkpoint(src, dtype=CALIB_DTYPE)
    seen = ref.hooks = _Routed()
    ref.forward(sample_windows(tokenize(text, src), samples, seq_len, 0))
    raw, float_w, top_k = load_rank(tmp_path / "fp8", 0), load_rank(src, 0), 3
    fell_back = 0
    for mlp in _sparse(tmp_path / "fp8"):
        for linear in ("fc", "proj"):
            p = f"{mlp}.{linear}"
            counts, low = routed["linears"][p]["tokens"], routed["linears"][p]["fell_back"]
            assert counts == [seen.rows.get((p, e), 0) for e in range(8)] and sum(counts) == samples * seq_len * top_k
            assert low == [e for e, n in enumerate(counts) if n < MIN_EXPERT_TOKENS]
            fell_back += len(low)
            w = float_w[f"{p}.weight"].float()
            assert raw[f"{p}.weight"].dtype == torch.float8_e4m3fn
            torch.testing.assert_close(raw[f"{p}.weights_scaling_factor"], w.abs().amax((1, 2))[:, None] / 448)
            layer_max = max(seen.amax[(p, e)] for e in range(8) if (p, e) in seen.amax)
            want = [layer_max if e in low else seen.amax[(p, e)] for e in range(8)]
            act = raw[f"{p}.activation_scaling_factor"]
            assert act.shape == (8, 1)
            torch.testing.assert_close(act[:, 0].double(), torch.tensor(want, dtype=torch.float64) / FP8_E4M3_MAX)
    assert fell_back > 0  # this calibration leaves some experts short of MIN_EXPERT_TOKENS (the fallback is taken)
    fake, engine = load_quantized(tmp_path / "fp8"), build(tmp_path / "fp8", tmp_path / "fp8-engine")
    graph = onnx.load(str(engine.spec.engine_dir / "model.onnx"), load_external_data=False).graph
    moe = [n for n in graph.node if n.op_type == "MoE"]
    assert moe and all(any(a.name == "fp8_inputs" and a.i == 1 for a in n.attribute) for n in moe)
    ids = [torch.randint(0, 320, (40,), generator=torch.Generator().manual_seed(s)).tolist() for s in (6, 7)]
    g = torch.cat([torch.from_numpy(run_alone(engine, i)) for i in ids])
    e = torch.cat([fake.forward(torch.tensor([i]))[0] for i in ids])
    assert (g - e).abs().max() < 1e-4 and torch.equal(g.argmax(-1), e.argmax(-1))
    full = ReferenceModel.from_checkpoint(src)
    floats = torch.cat([full.forward(torch.tensor([i]))[0] for i in ids])
    quantize_checkpoint(src, tmp_path / "w4", QuantizeOptions("w4a16", group_size=64))
    w4 = load_quantized(tmp_path / "w4")
    w4_logits = torch.cat([w4.forward(torch.tensor([i]))[0] for i in ids])
    kld, kld_w4 = _kld(floats, g).mean().item(), _kld(floats, w4_logits).mean().item()
    top1, top1_w4 = ((floats.argmax(-1) == x.argmax(-1)).double().mean().item() for x in (g, w4_logits))
    assert 0 < kld < kld_w4 and top1 >= top1_w4, (kld, kld_w4, top1, top1_w4)


def test_an_expert_routed_no_calibration_token_takes_the_layer_scale(
    moe_with_tokenizer: tuple[Path, Path], tmp_path: Path
) -> None:
    """One window of 2 tokens: 6 routed (token, expert) pairs over 8 experts, so at least two experts of each
    sparse layer get none. Each of those has count 0, is listed as fallen back, and takes the layer's input scale
    (max over every routed row / 448), the same as every expert below MIN_EXPERT_TOKENS; nothing is NaN."""
    src, text = moe_with_tokenizer
    opts = QuantizeOptions("fp8", calib_data=text, calib_samples=1, calib_seq_len=2)
    r = quantize_checkpoint(src, tmp_path / "q", opts)
    assert r.routed_calibration is not None
    raw = load_rank(tmp_path / "q", 0)
    for p, info in r.routed_calibration["linears"].items():
        zero = [e for e, n in enumerate(info["tokens"]) if n == 0]
        assert len(zero) >= 2 and set(zero) <= set(info["fell_back"]) and info["fell_back"] == list(range(8))
        act = raw[f"{p}.activation_scaling_factor"][:, 0]
        assert torch.isfinite(act).all() and (act > 0).all() and torch.equal(act, act[zero[0]].expand(8))


def test_a_calibrated_kv_cache_runs_with_experts(moe_with_tokenizer: tuple[Path, Path], tmp_path: Path) -> None:
    """Calibration runs on a model with routed experts, so w8a16 experts take an INT8 KV cache: its scales are
    written for every layer and the engine equals the fake-quant reference (< 1e-4, same argmax)."""
    src, text = moe_with_tokenizer
    opts = QuantizeOptions("w8a16", "int8", calib_data=text, calib_samples=2, calib_seq_len=32)
    r = quantize_checkpoint(src, tmp_path / "q", opts)
    assert r.kv_cache_quant_algo == "INT8" and r.routed_calibration is not None
    assert sum(k.endswith("kv_cache_scaling_factor") for k in load_rank(tmp_path / "q", 0)) == 4
    fake, engine = load_quantized(tmp_path / "q"), build(tmp_path / "q", tmp_path / "engine")
    ids = torch.randint(0, 320, (40,), generator=torch.Generator().manual_seed(8)).tolist()
    g, e = torch.from_numpy(run_alone(engine, ids)), fake.forward(torch.tensor([ids]))[0]
    assert (g - e).abs().max() < 1e-4 and torch.equal(g.argmax(-1), e.argmax(-1))
