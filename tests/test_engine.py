"""The CPU engine (engine graph in ONNX Runtime + reference plugin op) against transformers, against itself under
in-flight batching, and against the quantize stage's fake-quant reference; `trtbuild build` behaviour."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch
from conftest import one_line_error, save_random_llama
from test_convert_llama import CONFIGS
from test_families import FAMILIES, save_random
from test_quantize import WIKI
from transformers import AutoModelForCausalLM

from toolchain.checkpoint.convert import convert
from toolchain.engine.api import Engine as OrtEngine
from toolchain.engine.api import open_engine
from toolchain.engine.build import BuildOptions, build_engine
from toolchain.engine.contract import Batch
from toolchain.quantize.fake import load_quantized
from toolchain.quantize.stage import QuantizeOptions, quantize_checkpoint

TPB = 4  # small blocks so that short test sequences span several, with partial last blocks


def build(ckpt: Path, out: Path, **kw: Any) -> OrtEngine:
    build_engine(ckpt, out, BuildOptions(backend="onnxruntime", tokens_per_block=TPB, max_batch_size=4, **kw))
    return open_engine(out)


def run_alone(engine: OrtEngine, ids: list[int], blocks: int = 32) -> np.ndarray:
    """Every position's logits of one sequence in one prefill call, blocks in shuffled order."""
    pool = engine.new_kv_cache(blocks)
    order = torch.randperm(blocks, generator=torch.Generator().manual_seed(len(ids))).tolist()
    return engine.forward(Batch.from_sequences([ids], [0], [order[: -(-len(ids) // TPB)]], all_logits=True), pool)


def hf_logits(hf_dir: Path, ids: list[int]) -> np.ndarray:
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def assert_matches(got: np.ndarray, expected: np.ndarray) -> None:
    assert np.abs(got - expected).max() < 1e-4
    assert (got.argmax(-1) == expected.argmax(-1)).all()


CASES: dict[str, tuple[str, dict[str, Any]]] = {
    **{f"llama-{k}": ("llama", v) for k, v in CONFIGS.items() if k in ("gqa-4to1", "llama3-rope", "biases")},
    **FAMILIES,
}


@pytest.mark.parametrize("name", list(CASES))
def test_cpu_engine_matches_transformers(name: str, tmp_path: Path) -> None:
    arch, overrides = CASES[name]
    hf = tmp_path / "hf"
    save_random_llama(hf, **overrides) if arch == "llama" else save_random(hf, arch, **overrides)
    convert(hf, tmp_path / "ckpt")
    engine = build(tmp_path / "ckpt", tmp_path / "engine")
    ids = torch.randint(0, engine.vocab_size, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    assert_matches(run_alone(engine, ids), hf_logits(hf, ids))


def test_stories260k_engine_matches_transformers(stories: Path, tmp_path: Path) -> None:
    convert(stories, tmp_path / "ckpt")
    engine = build(tmp_path / "ckpt", tmp_path / "engine")
    ids = torch.randint(0, engine.vocab_size, (120,), generator=torch.Generator().manual_seed(3)).tolist()
    assert_matches(run_alone(engine, ids), hf_logits(stories, ids))


@pytest.fixture(scope="module")
def gqa_engine(tmp_path_factory: pytest.TempPathFactory) -> OrtEngine:
    tmp = tmp_path_factory.mktemp("gqa")
    convert(save_random_llama(tmp / "hf", num_attention_heads=8, num_key_value_heads=2), tmp / "ckpt")
    return build(tmp / "ckpt", tmp / "engine")


def test_prefill_then_decode_equals_full_sequence(gqa_engine: OrtEngine) -> None:
    ids = torch.randint(0, gqa_engine.vocab_size, (23,), generator=torch.Generator().manual_seed(4)).tolist()
    full = run_alone(gqa_engine, ids)
    pool, blocks = gqa_engine.new_kv_cache(16), [9, 3, 14, 0, 7, 11]
    got = [gqa_engine.forward(Batch.from_sequences([ids[:10]], [0], [blocks], all_logits=True), pool)]
    for p in range(10, len(ids)):  # one token per call, after the cached prefix
        got.append(gqa_engine.forward(Batch.from_sequences([[ids[p]]], [p], [blocks]), pool))
    np.testing.assert_allclose(np.concatenate(got), full, rtol=0, atol=1e-4)


def test_mixed_batch_equals_each_sequence_alone(gqa_engine: OrtEngine) -> None:
    """One call: two prefill chunks (one a later chunk after a cached first one) and three decode steps, in
    shuffled non-contiguous blocks with partial last blocks, equals running each sequence by itself."""
    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, gqa_engine.vocab_size, (n,), generator=gen).tolist() for n in (9, 14, 6, 11, 17)]
    cached = [0, 5, 5, 10, 16]  # tokens already in the cache before the mixed call
    perm = torch.randperm(40, generator=gen).tolist()
    tables, at = [], 0
    for s in seqs:
        tables.append(perm[at : at + -(-len(s) // TPB)])
        at += len(tables[-1])
    pool = gqa_engine.new_kv_cache(40)
    for s, c, t in zip(seqs, cached, tables, strict=True):  # fill each sequence's cached prefix
        if c:
            gqa_engine.forward(Batch.from_sequences([s[:c]], [0], [t]), pool)
    mixed = Batch.from_sequences([s[c:] for s, c in zip(seqs, cached, strict=True)], cached, tables, all_logits=True)
    assert mixed.new_lens.tolist() == [9, 9, 1, 1, 1]
    got = gqa_engine.forward(mixed, pool)
    starts = np.cumsum([0, *mixed.new_lens.tolist()])
    for k, (s, c) in enumerate(zip(seqs, cached, strict=True)):
        np.testing.assert_allclose(got[starts[k] : starts[k + 1]], run_alone(gqa_engine, s)[c:], rtol=0, atol=1e-4)


def test_kv_pool_is_written_in_place_and_only_at_the_new_slots(gqa_engine: OrtEngine) -> None:
    """The caller's pool tensor itself holds the new K/V afterwards (the engine wrote into it, it did not return a
    new pool), and nothing but the slots of the call's tokens changed."""
    pool = gqa_engine.new_kv_cache(64)
    pool.fill_(3.0)
    before = pool.clone()
    gqa_engine.forward(Batch.from_sequences([[1, 2, 3, 4, 5, 6]], [0], [[40, 7]]), pool)
    changed = (pool != before).any(dim=(0, 2, 3, 5))  # [blocks, slot]
    expected = torch.zeros_like(changed)
    expected[40, :4] = True
    expected[7, :2] = True
    assert torch.equal(changed, expected)


METHODS = [
    ("w8a16", "none", 128),
    ("w4a16", "none", 64),  # intermediate 172 padded to 192: the Slice after the blocked DequantizeLinear
    ("w4a16_awq", "none", 32),
    ("w8a8_sq", "int8", 128),
    ("fp8", "fp8", 128),
]


def _kld(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per row, in float64."""
    lp, lq = p_logits.double().log_softmax(-1), q_logits.double().log_softmax(-1)
    return (lp.exp() * (lp - lq)).sum(-1)


@pytest.mark.parametrize(("method", "kv", "group"), METHODS)
def test_quantized_engine_equals_fake_quant_reference(
    method: str, kv: str, group: int, stories: Path, tmp_path: Path
) -> None:
    """Weight-only methods: the engine computes what the fake-quant reference computes (< 1e-4). Where activations
    or the KV cache are quantized at run time, a last-bit difference in the summation order (ONNX Runtime's kernels
    differ by CPU and thread count) can put a value on the other side of a rounding boundary and flip a code, after
    which that sequence's later logits differ by a quantization step; so there the engine is held to what a flip can
    do: cost a small fraction of what quantization itself costs, and almost never change the top-1 token."""
    convert(stories, tmp_path / "ckpt")
    opts = QuantizeOptions(method, kv, group, calib_data=WIKI / "valid.txt", calib_samples=4, calib_seq_len=64)
    quantize_checkpoint(tmp_path / "ckpt", tmp_path / "q", opts)
    engine = build(tmp_path / "q", tmp_path / "engine")
    fake, full = load_quantized(tmp_path / "q"), load_quantized(tmp_path / "ckpt")
    got, expected, floats = [], [], []
    for seed in (6, 7, 8):
        ids = torch.randint(0, engine.vocab_size, (70,), generator=torch.Generator().manual_seed(seed)).tolist()
        got.append(torch.from_numpy(run_alone(engine, ids)))
        expected.append(fake.forward(torch.tensor([ids]))[0])
        floats.append(full.forward(torch.tensor([ids]))[0])
    g, e, f = torch.cat(got), torch.cat(expected), torch.cat(floats)
    if method in ("w8a8_sq", "fp8"):  # quantizers at run time
        assert _kld(e, g).mean() < 0.1 * _kld(f, e).mean()
        assert (g.argmax(-1) == e.argmax(-1)).double().mean() >= 0.95
    else:
        assert (g - e).abs().max() < 1e-4
        assert torch.equal(g.argmax(-1), e.argmax(-1))
    ops = {n.op_type for n in onnx.load(str(tmp_path / "engine" / "model.onnx")).graph.node}
    assert "DequantizeLinear" in ops and ("QuantizeLinear" in ops) == (method in ("w8a8_sq", "fp8"))


def test_build_is_deterministic_and_checked(gqa_engine: OrtEngine, make_llama: Any, tmp_path: Path) -> None:
    convert(make_llama(), tmp_path / "ckpt")
    for out in ("a", "b"):
        build_engine(tmp_path / "ckpt", tmp_path / out, BuildOptions(backend="onnxruntime"))
    assert (tmp_path / "a" / "model.onnx").read_bytes() == (tmp_path / "b" / "model.onnx").read_bytes()
    model = onnx.load(str(tmp_path / "a" / "model.onnx"))
    onnx.checker.check_model(model, full_check=True)
    onnx.shape_inference.infer_shapes(model, strict_mode=True)
    plugins = [n for n in model.graph.node if n.domain == "trtbuild"]
    assert [n.op_type for n in plugins] == ["KVCacheWrite", "PagedAttention"] * 2
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in plugins[3].attribute}
    assert attrs["layer"] == 1 and attrs["num_kv_heads"] == 2 and attrs["tokens_per_block"] == 16
    assert "rotary_base" in {a.name for a in plugins[2].attribute} and "rotary_base" not in attrs


def test_build_cli(cli: Any, make_llama: Any, tmp_path: Path) -> None:
    convert(make_llama(), tmp_path / "ckpt")
    result = cli("build", tmp_path / "ckpt", "-o", tmp_path / "trt", "--backend", "tensorrt")
    assert result.exit_code == 1 and "--backend tensorrt" in one_line_error(result)
    assert not (tmp_path / "trt").exists()
    result = cli("build", tmp_path / "ckpt", "-o", tmp_path / "engine", "--json", "--max-seq-len", "64")
    assert result.exit_code == 0, result.output
    assert "building the CPU engine" in result.stderr
    out = json.loads(result.stdout)
    assert out["backend"] == "onnxruntime" and out["limits"]["max_blocks_per_seq"] == 4
    manifest = json.loads((tmp_path / "engine" / "manifest.json").read_text())
    assert manifest["stage"] == "build" and any("CPU engine" in w for w in manifest["warnings"])
    assert {e["path"] for e in manifest["outputs"]} >= {"model.onnx", "build_config.json"}
    result = cli("build", tmp_path / "ckpt", "-o", tmp_path / "e2", "--max-seq-len", "100000")
    assert result.exit_code == 1 and "max_position_embeddings" in one_line_error(result)
    result = cli("build", tmp_path / "nope", "-o", tmp_path / "e3")
    assert result.exit_code == 1 and "nope" in one_line_error(result)


def test_engine_from_another_machine_is_refused_naming_both_sides(
    cli: Any, make_llama: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from toolchain.engine import tensorrt_backend
    from toolchain.errors import UserError

    here = {"tensorrt": "10.9.0", "sm": "80", "gpu": "NVIDIA A100", "driver": "550", "cuda": "12.4"}
    monkeypatch.setattr(tensorrt_backend, "versions", lambda: here)
    convert(make_llama(), tmp_path / "ckpt")
    build_engine(tmp_path / "ckpt", tmp_path / "e", BuildOptions(backend="onnxruntime"))
    inspected = cli("inspect", tmp_path / "e", "--json")
    assert json.loads(inspected.stdout)["engine"]["backend"] == "onnxruntime"
    path = tmp_path / "e" / "build_config.json"
    config = json.loads(path.read_text())
    config["backend"] = "tensorrt"  # as if built by TensorRT 10.13 on an H200
    config["compatibility"] = {"tensorrt": "10.13.0", "sm": "90", "gpu": "NVIDIA H200", "driver": "570", "cuda": "12.8"}
    path.write_text(json.dumps(config))
    with pytest.raises(
        UserError, match=r"tensorrt 10\.13\.0 \(NVIDIA H200\), this machine has 10\.9\.0 \(NVIDIA A100\)"
    ):
        open_engine(tmp_path / "e")
    assert "built with    TensorRT 10.13.0, GPU NVIDIA H200 (SM 90)" in cli("inspect", tmp_path / "e").stdout
    open_engine(tmp_path / "e", backend="onnxruntime")  # its ONNX graph still runs on the CPU


def test_bad_batches_are_refused(gqa_engine: OrtEngine) -> None:
    pool = gqa_engine.new_kv_cache(4)
    with pytest.raises(ValueError, match="outside the pool"):
        gqa_engine.forward(Batch.from_sequences([[1, 2]], [0], [[-1]]), pool)
    with pytest.raises(ValueError, match="outside the pool"):
        gqa_engine.forward(Batch.from_sequences([[1, 2]], [0], [[4]]), pool)
    bad = Batch.from_sequences([[1, 2]], [0], [[0]])
    bad.position_ids[:] = [5, 6]  # not where the sequence's cache ends
    with pytest.raises(ValueError, match="position_ids"):
        gqa_engine.forward(bad, pool)
    with pytest.raises(ValueError, match="KV pool"):
        gqa_engine.forward(Batch.from_sequences([[1]], [0], [[0]]), pool[:1])


def test_reference_ops_compute_in_float32_for_half_inputs() -> None:
    """bf16 inputs: rotary angles, scores and softmax in float32 (bf16 cannot even hold position 1001)."""
    from toolchain.engine.ops import AttentionAttrs, kv_cache_write, paged_attention

    a = AttentionAttrs(layer=0, num_heads=4, num_kv_heads=2, head_size=16, tokens_per_block=16)
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(8, 8 * 16, generator=gen).to(torch.bfloat16)
    args = (torch.arange(1000, 1008, dtype=torch.int32), torch.tensor([1000]), torch.tensor([8]))
    tables = torch.arange(64).reshape(1, 64).to(torch.int32)
    results = {}
    for dtype in (torch.bfloat16, torch.float32):
        pool = torch.zeros(1, 64, 2, 2, 16, 16, dtype=torch.float32)
        q = kv_cache_write(a, qkv.to(dtype), *args, tables, pool)
        results[dtype] = paged_attention(a, q.float(), *args, tables, pool)
    torch.testing.assert_close(results[torch.bfloat16], results[torch.float32], rtol=2e-2, atol=2e-2)


def test_half_precision_graph_is_valid_and_norms_in_float32(make_llama: Any, tmp_path: Path) -> None:
    from toolchain.checkpoint.trtllm import load_rank, read_config
    from toolchain.engine.export import export_model

    convert(make_llama(), tmp_path / "ckpt")
    model = export_model(read_config(tmp_path / "ckpt"), load_rank(tmp_path / "ckpt", 0), torch.float16, 16)
    onnx.checker.check_model(model, full_check=True)
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    types = {v.name: v.type.tensor_type.elem_type for v in inferred.graph.value_info}
    assert types["transformer.layers.0.input_layernorm.out.square"] == onnx.TensorProto.FLOAT
    assert types["transformer.layers.0.attention.qkv.out"] == onnx.TensorProto.FLOAT16
