"""Families the model description (toolchain/checkpoint/spec.py) made possible: Gemma 3 (5 local : 1 global
layers, per-kind rope bases, sandwich norms, qk-norm, scaled embeddings, query_pre_attn_scalar, soft-capped logits)
and Qwen2 / Qwen3 with per-layer sliding windows. Each on random tiny configs with its features on, against
transformers float32 (< 1e-4 max abs, identical argmax) through convert + reference, the CPU engine and TP=2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import one_line_error
from models import GEMMA3, PARITY, build, compare, hf_logits, run_alone, save_case, save_random
from safetensors.torch import load_file

from toolchain.checkpoint.convert import convert
from toolchain.checkpoint.spec import spec_of
from toolchain.checkpoint.tiny import make_tiny_llama
from toolchain.checkpoint.trtllm import load_rank, read_config
from toolchain.errors import UserError
from toolchain.quantize.fake import load_quantized
from toolchain.quantize.stage import QuantizeOptions, quantize_checkpoint
from toolchain.reference.model import ReferenceModel
from toolchain.reference.parallel import tp_logits
from toolchain.text import tokenize


@pytest.mark.parametrize("name", [name for name, case in PARITY.items() if case.engine])
def test_reference_and_cpu_engine_match_transformers(name: str, tmp_path: Path) -> None:
    hf = save_case(tmp_path / "hf", name)
    convert(hf, tmp_path / "ckpt")
    max_abs, same_top1 = compare(hf, tmp_path / "ckpt", seq=40)
    assert max_abs < 1e-4 and same_top1 == 1.0
    engine = build(tmp_path / "ckpt", tmp_path / "engine")
    ids = torch.randint(0, engine.vocab_size, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    got, expected = run_alone(engine, ids), hf_logits(hf, ids)
    assert np.abs(got - expected).max() < 1e-4 and (got.argmax(-1) == expected.argmax(-1)).all()


@pytest.mark.parametrize("name", ["gemma3", "qwen2-windows"])
def test_tensor_parallel_forward(name: str, tmp_path: Path) -> None:
    hf = save_case(tmp_path / "hf", name)
    convert(hf, tmp_path / "one")
    convert(hf, tmp_path / "tp", tp=2)
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(3))
    expected = ReferenceModel.from_checkpoint(tmp_path / "one", torch.float64).forward(ids)
    assert (tp_logits(tmp_path / "tp", ids, torch.float64) - expected).abs().max().item() < 1e-10


def test_gemma3_spec_and_config(tmp_path: Path) -> None:
    convert(save_case(tmp_path / "hf", "gemma3"), tmp_path / "ckpt")
    cfg = read_config(tmp_path / "ckpt")
    spec = spec_of(cfg)
    assert [ls.window for ls in spec.layers] == [6, 6, 6, 6, 6, None, 6]
    assert [ls.rope.base for ls in spec.layers if ls.rope] == [1000.0] * 5 + [50_000.0, 1000.0]
    assert spec.layers[5].rope is not None and spec.layers[5].rope.scaling == {"factor": 4.0, "rope_type": "linear"}
    assert spec.embedding_scale == 64**0.5 and spec.final_logit_softcap == 30.0
    assert spec.layers[0].attn_scale == 20**-0.5 and spec.layers[0].attn_out_norm is not None
    raw = json.loads((tmp_path / "ckpt" / "config.json").read_text())  # TensorRT-LLM's Gemma 3 fields
    assert raw["query_pre_attn_scalar"] == 20 and raw["_sliding_window_pattern"] == 6 and raw["inter_layernorms"]
    assert raw["rope_local_base_freq"] == 1000.0 and raw["rotary_base"] == 50_000.0
    # norms are stored as 1 + w, as TensorRT-LLM's converter writes them
    src = load_file(str(tmp_path / "hf" / "model.safetensors"))
    out = load_rank(tmp_path / "ckpt")
    for hf_name, ours in [
        ("model.layers.2.post_attention_layernorm.weight", "transformer.layers.2.post_layernorm.weight"),
        ("model.layers.2.self_attn.q_norm.weight", "transformer.layers.2.attention.q_layernorm.weight"),
        ("model.norm.weight", "transformer.ln_f.weight"),
    ]:
        torch.testing.assert_close(out[ours], src[hf_name] + 1, rtol=0, atol=0)


def test_gemma3_hub_style_config_reads_the_same(tmp_path: Path) -> None:
    """Hub config.json files carry rope_theta / rope_local_base_freq / sliding_window_pattern at the top level and
    no layer_types; transformers reads them, and so do we."""
    hf = save_random(tmp_path / "hf", "gemma3", **{**GEMMA3, "rope_parameters": None, "final_logit_softcapping": None})
    path = hf / "config.json"
    config = json.loads(path.read_text())
    for key in ("rope_parameters", "layer_types"):
        config.pop(key, None)
    config.update(rope_theta=20_000.0, rope_local_base_freq=500.0, sliding_window_pattern=3)
    path.write_text(json.dumps(config))
    convert(hf, tmp_path / "ckpt")
    spec = spec_of(read_config(tmp_path / "ckpt"))
    assert [ls.window for ls in spec.layers] == [6, 6, None, 6, 6, None, 6]
    assert spec.layers[2].rope is not None and spec.layers[2].rope.base == 20_000.0
    max_abs, same_top1 = compare(hf, tmp_path / "ckpt", seq=40)
    assert max_abs < 1e-4 and same_top1 == 1.0


@pytest.mark.parametrize(
    ("name", "edit"),
    [("gemma3", {"layer_types": ["full_attention"] * 7}), ("qwen2-windows", {"layer_types": None})],
)
def test_per_layer_windows_matter(name: str, edit: dict[str, Any], tmp_path: Path) -> None:
    """Windows shorter than the sequence change the logits: dropping them from config.json is visible."""
    hf = save_case(tmp_path / "hf", name)
    convert(hf, tmp_path / "ckpt")
    path = tmp_path / "ckpt" / "config.json"
    config = json.loads(path.read_text())
    config.update(edit)
    if edit.get("layer_types", "") is None:
        config.pop("layer_types")
        config["sliding_window"] = None
    path.write_text(json.dumps(config))
    max_abs, _ = compare(hf, tmp_path / "ckpt", seq=40)
    assert max_abs > 1e-3


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        ({"attn_logit_softcapping": 50.0}, ["attn_logit_softcapping 50.0", "null"]),
        ({"hidden_activation": "gelu"}, ["hidden_activation 'gelu'", "gelu_pytorch_tanh"]),
        ({"use_bidirectional_attention": True}, ["use_bidirectional_attention"]),
        ({"layer_types": ["full_attention"]}, ["layer_types", "7 entries"]),
        ({"attention_bias": True}, ["attention_bias=true"]),
        ({"rope_parameters": "x"}, ["'rope_parameters' must be an object per layer type"]),
        ({"rope_parameters": {"rope_theta": 5.0}}, ["'rope_parameters' must be an object per layer type"]),
    ],
)
def test_gemma3_refusals_are_one_line(edit: dict[str, Any], words: list[str], cli: Any, tmp_path: Path) -> None:
    hf = save_case(tmp_path / "hf", "gemma3")
    path = hf / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **edit}))
    line = one_line_error(cli("convert", hf, "-o", tmp_path / "out"))
    assert all(w in line for w in words), line
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def gemma3_with_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A converted random Gemma 3 with the demo's byte-level tokenizer (vocab 320), and calibration text."""
    tmp = tmp_path_factory.mktemp("gemma3q")
    hf = save_random(tmp / "hf", "gemma3", **{**GEMMA3, "vocab_size": 320})
    make_tiny_llama(tmp / "demo")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tmp / "demo" / name, hf / name)
    convert(hf, tmp / "ckpt")
    g = torch.Generator().manual_seed(5)
    words = ["gemma", "slides", "over", "six", "tokens", "then", "looks", "at", "all", "of", "them", "."]
    (tmp / "calib.txt").write_text(" ".join(words[i] for i in torch.randint(12, (2500,), generator=g).tolist()))
    return tmp / "ckpt", tmp / "calib.txt"


def _kld(logits: torch.Tensor, reference: torch.Tensor) -> float:
    kl = torch.nn.functional.kl_div(
        logits.log_softmax(-1), reference.log_softmax(-1), log_target=True, reduction="none"
    )
    return kl.sum(-1).mean().item()


@pytest.mark.parametrize(("method", "group"), [("w8a16", 128), ("w4a16_awq", 32), ("w8a8_sq", 128)])
def test_gemma3_quantizes_and_the_engine_computes_the_fake_quant_reference(
    method: str, group: int, gemma3_with_tokenizer: tuple[Path, Path], tmp_path: Path
) -> None:
    ckpt, text = gemma3_with_tokenizer
    opts = QuantizeOptions(method, group_size=group, calib_data=text, calib_samples=8, calib_seq_len=48)
    quantize_checkpoint(ckpt, tmp_path / "q", opts)
    ids = tokenize(text, ckpt)[-30:][None]  # in-distribution text (random bytes would exceed calibrated ranges)
    fake = load_quantized(tmp_path / "q").forward(ids)[0]
    base = ReferenceModel.from_checkpoint(ckpt).forward(ids)[0]
    kld = _kld(fake, base)  # measured: w8a16 0.030, w8a8_sq 0.087, int4 AWQ 1.15 (RTN 1.3) on this random model
    print(f"{method}: KLD {kld:.4f}")
    if method == "w4a16_awq":  # int4 costs this random model dearly; AWQ must still cost less than rounding
        quantize_checkpoint(ckpt, tmp_path / "rtn", QuantizeOptions("w4a16", group_size=group))
        assert 0 < kld < _kld(load_quantized(tmp_path / "rtn").forward(ids)[0], base)
    else:  # weights and activations in int8 cost more; a broken fold into the sandwich norms would cost far more
        assert 0 < kld < (0.05 if method == "w8a16" else 0.2)
    engine = build(tmp_path / "q", tmp_path / "engine")
    got = torch.from_numpy(run_alone(engine, ids[0].tolist()))
    if method == "w8a8_sq":  # int8 activations: a GEMM-order difference can flip a rounding (test_engine.py)
        assert (got.argmax(-1) == fake.argmax(-1)).float().mean().item() >= 0.9
    else:
        assert (got - fake).abs().max().item() < 1e-4 and torch.equal(got.argmax(-1), fake.argmax(-1))


def test_smoothquant_folds_into_gemma3_pre_norms_only(gemma3_with_tokenizer: tuple[Path, Path], tmp_path: Path) -> None:
    """SmoothQuant's 1/s goes into the norms that feed linears (input_layernorm, pre_feedforward_layernorm), never
    into the sandwich norms on the blocks' outputs."""
    ckpt, text = gemma3_with_tokenizer
    opts = QuantizeOptions("w8a8_sq", calib_data=text, calib_samples=8, calib_seq_len=48)
    quantize_checkpoint(ckpt, tmp_path / "q", opts)
    before, after = load_rank(ckpt), load_rank(tmp_path / "q")
    changed = {
        n.split(".", 3)[3] for n in before if "norm" in n and "layers" in n and not torch.equal(before[n], after[n])
    }
    assert changed == {"input_layernorm.weight", "pre_feedforward_layernorm.weight"}


def test_a_tensor_the_spec_needs_and_the_checkpoint_lacks_is_one_line(cli: Any, tmp_path: Path) -> None:
    """Biases come from the description, not from which tensors exist: a Qwen2 checkpoint missing a q/k/v bias is
    refused by build (and the reference) instead of running without it."""
    from safetensors.torch import save_file

    convert(save_case(tmp_path / "hf", "qwen2-windows"), tmp_path / "ckpt")
    weights = load_rank(tmp_path / "ckpt")
    del weights["transformer.layers.1.attention.qkv.bias"]
    save_file(weights, str(tmp_path / "ckpt" / "rank0.safetensors"), {"format": "pt"})
    line = one_line_error(cli("build", tmp_path / "ckpt", "-o", tmp_path / "engine", "--backend", "onnxruntime"))
    assert "transformer.layers.1.attention.qkv.bias missing" in line and "Qwen2ForCausalLM" in line
    assert not (tmp_path / "engine").exists()
    with pytest.raises(UserError, match=r"attention\.qkv\.bias missing"):
        ReferenceModel.from_checkpoint(tmp_path / "ckpt")


def test_gemma3_windows_from_trtllm_pattern_alone(cli: Any, tmp_path: Path) -> None:
    """A Gemma 3 checkpoint written by TensorRT-LLM or ModelOpt says which layers slide with
    `_sliding_window_pattern` only; without it and without layer_types, build refuses instead of sliding every
    layer; a sliding layer with a null window is refused too."""
    convert(save_case(tmp_path / "hf", "gemma3"), tmp_path / "ckpt")
    path = tmp_path / "ckpt" / "config.json"
    config = json.loads(path.read_text())
    del config["layer_types"]
    path.write_text(json.dumps(config))
    assert spec_of(read_config(tmp_path / "ckpt")).windows == [6, 6, 6, 6, 6, None, 6]
    del config["_sliding_window_pattern"]
    path.write_text(json.dumps(config))
    line = one_line_error(cli("build", tmp_path / "ckpt", "-o", tmp_path / "e1", "--backend", "onnxruntime"))
    assert str(path) in line and "_sliding_window_pattern" in line
    config.update(layer_types=["sliding_attention"] * 7, sliding_window=None)
    path.write_text(json.dumps(config))
    line = one_line_error(cli("build", tmp_path / "ckpt", "-o", tmp_path / "e2", "--backend", "onnxruntime"))
    assert str(path) in line and "'sliding_window' is null" in line


def test_gemma3_decode_past_the_window_matches_the_full_sequence(tmp_path: Path) -> None:
    """Token by token after a prefill, well past the window of 6: the paged cache serves the sliding and the global
    layers what a single full forward computes."""
    from toolchain.engine.contract import Batch

    convert(save_case(tmp_path / "hf", "gemma3"), tmp_path / "ckpt")
    engine = build(tmp_path / "ckpt", tmp_path / "engine")
    ids = torch.randint(0, engine.vocab_size, (26,), generator=torch.Generator().manual_seed(8)).tolist()
    full = run_alone(engine, ids)
    pool, blocks = engine.new_kv_cache(16), [9, 3, 14, 0, 7, 11, 2]
    got = [engine.forward(Batch.from_sequences([ids[:5]], [0], [blocks], all_logits=True), pool)]
    for p in range(5, len(ids)):
        got.append(engine.forward(Batch.from_sequences([[ids[p]]], [p], [blocks]), pool))
    np.testing.assert_allclose(np.concatenate(got), full, rtol=0, atol=1e-4)


def test_a_scale_on_something_that_is_not_a_linear_names_the_file(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    convert(save_case(tmp_path / "hf", "qwen2-windows"), tmp_path / "ckpt")
    quantize_checkpoint(tmp_path / "ckpt", tmp_path / "q", QuantizeOptions("w8a16"))
    weights = load_rank(tmp_path / "q")
    weights["transformer.ln_f.weights_scaling_factor"] = torch.ones(64)
    save_file(weights, str(tmp_path / "q" / "rank0.safetensors"), {"format": "pt"})
    with pytest.raises(UserError, match=r"rank0\.safetensors: transformer\.ln_f\.weights_scaling_factor"):
        load_quantized(tmp_path / "q")
