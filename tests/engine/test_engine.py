"""The CPU engine (engine graph in ONNX Runtime + reference plugin op) against transformers, against itself under
in-flight batching, and against the quantize stage's fake-quant reference; `trtbuild build` behaviour."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch
from conftest import WIKI, one_line_error, reseal, save_random_llama
from models import TPB, assert_matches, build, hf_logits, run_alone, run_with_pool, save_case

from toolchain.checkpoint.convert import convert
from toolchain.engine.api import Engine as OrtEngine
from toolchain.engine.api import open_engine
from toolchain.engine.build import BuildOptions, build_engine
from toolchain.engine.contract import Batch
from toolchain.quantize.core import FP8_E4M3_MAX, fake_quant
from toolchain.quantize.fake import load_quantized
from toolchain.quantize.stage import QuantizeOptions, quantize_checkpoint

# Parity cases (models.PARITY) that also run on the CPU engine: every family of the plain decoder layer.
CASES = [
    "llama-gqa-4to1",
    "llama-llama3-rope",
    "llama-biases",
    "mistral-sliding-window",
    "qwen2-biases",
    "qwen2-tied",
    "qwen3-qk-norm",
    "gpt2-tied",
    "gpt2-untied",
    "phi3-window",
    "phi3-tied-mha",
]


@pytest.mark.parametrize("name", CASES)
def test_cpu_engine_matches_transformers(name: str, tmp_path: Path) -> None:
    hf = save_case(tmp_path / "hf", name)
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
    (
        "w4a16",
        "none",
        64,
    ),  # intermediate 172 padded to 192: the codes go in cut to 172, blocked DQ's last block partial
    ("w4a16_awq", "none", 32),
    ("w8a8_sq", "int8", 128),
    ("fp8", "fp8", 128),
]
RUN_TIME = ("w8a8_sq", "fp8")  # methods that quantize activations (and here the KV cache) while the engine runs


def _kld(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per row, in float64."""
    lp, lq = p_logits.double().log_softmax(-1), q_logits.double().log_softmax(-1)
    return (lp.exp() * (lp - lq)).sum(-1)


@pytest.fixture(scope="module")
def quantized(stories: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., tuple[Path, OrtEngine]]:
    """(checkpoint, CPU engine) of stories260K quantized by (method, kv, group), made once per module."""
    tmp = tmp_path_factory.mktemp("quantized")
    convert(stories, tmp / "ckpt")
    made: dict[str, tuple[Path, OrtEngine]] = {"float": (tmp / "ckpt", build(tmp / "ckpt", tmp / "float-engine"))}

    def make(method: str = "float", kv: str = "none", group: int = 128) -> tuple[Path, OrtEngine]:
        name = method if method == "float" else f"{method}-{kv}-{group}"
        if name not in made:
            opts = QuantizeOptions(method, kv, group, calib_data=WIKI / "valid.txt", calib_samples=4, calib_seq_len=64)
            quantize_checkpoint(tmp / "ckpt", tmp / name, opts)
            made[name] = (tmp / name, build(tmp / name, tmp / f"{name}-engine"))
        return made[name]

    return make


def _probe(scale: float, kind: str, width: int = 67) -> torch.Tensor:
    """Fixed quantizer inputs [rows, width] (an odd width: vectorised kernels' tails run too): every code's value,
    every midpoint between two adjacent codes (where round-half-to-even decides), a hair either side of each,
    values past saturation, signed zeros, and a spread of ordinary values."""
    codes = torch.arange(-128, 128, dtype=torch.float32)
    if kind == "FP8":
        codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
        codes = codes[torch.isfinite(codes)].unique()  # sorted, -448 .. 448
    mids = (codes[1:] + codes[:-1]) / 2
    grid = torch.cat([codes, mids, mids.nextafter(mids + 1), mids.nextafter(mids - 1)]) * scale
    edges = torch.tensor([0.0, -0.0, 1e4, -1e4, 3e38, -3e38]) * scale
    spread = torch.randn(40 * width, generator=torch.Generator().manual_seed(0)) * 30 * scale
    x = torch.cat([grid, edges, spread])
    return torch.cat([x, torch.zeros(-x.numel() % width)]).reshape(-1, width)


def _run_nodes(nodes: list[onnx.NodeProto], inits: list[onnx.TensorProto], x: torch.Tensor) -> torch.Tensor:
    import onnxruntime as ort

    from toolchain.engine.ort_backend import ort_threads

    io = onnx.helper.make_tensor_value_info
    graph = onnx.helper.make_graph(
        nodes,
        "quantizer",
        [io(nodes[0].input[0], onnx.TensorProto.FLOAT, ["rows", "width"])],
        [io(nodes[-1].output[0], onnx.TensorProto.FLOAT, ["rows", "width"])],
        inits,
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 21)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = ort_threads()  # the engine's own thread count (TRTBUILD_ORT_THREADS)
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return torch.from_numpy(session.run(None, {nodes[0].input[0]: x.numpy()})[0])


@pytest.mark.parametrize("method", RUN_TIME)
def test_activation_quantizers_of_the_graph_equal_fake_quant_bit_for_bit(
    method: str, quantized: Callable[..., tuple[Path, OrtEngine]]
) -> None:
    """Every QuantizeLinear -> DequantizeLinear pair of the engine graph, run by ONNX Runtime on fixed inputs,
    returns exactly what the fake-quant reference computes with its own scale for that linear: same codes, same
    values, ties and saturation included. The graph's scales are therefore the reference's, bit for bit."""
    ckpt, engine = quantized(method, "int8" if method == "w8a8_sq" else "fp8")
    hooks = load_quantized(ckpt).hooks
    model = onnx.load(str(engine.spec.engine_dir / "model.onnx"))
    inits = {t.name: t for t in model.graph.initializer}
    dq_of = {n.input[0]: n for n in model.graph.node if n.op_type == "DequantizeLinear"}
    pairs = [(n, dq_of[n.output[0]]) for n in model.graph.node if n.op_type == "QuantizeLinear"]
    assert {q.output[0].removesuffix(".input_q") for q, _ in pairs} == set(hooks.activation_scales)
    assert len(pairs) == 5 * engine.spec.kv_cache.num_layers and hooks.activation_kind
    for q, dq in pairs:
        scale = hooks.activation_scales[q.output[0].removesuffix(".input_q")]
        x = _probe(scale, hooks.activation_kind)
        got = _run_nodes([q, dq], [inits[i] for i in {*q.input[1:], *dq.input[1:]}], x)
        expected = fake_quant(x, scale, hooks.activation_kind)
        assert torch.equal(got, expected), (q.name, (got != expected).sum().item(), x[got != expected][:4])


@pytest.mark.parametrize("kind", ["INT8", "FP8"])
def test_kv_cache_quantizer_equals_fake_quant_bit_for_bit(kind: str) -> None:
    """What KVCacheWrite stores and PagedAttention reads back (the plugin ops the CPU engine runs) is exactly the
    fake-quant reference of the same K and V, ties and saturation included."""
    from toolchain.engine.ops import AttentionAttrs, _load, kv_cache_write

    scale = float(torch.tensor(0.0371))  # a float32 value, as the graph attribute holds it
    kv = _probe(scale, kind, width=2 * 8).reshape(-1, 2, 8)  # [tokens, kv heads, head size]
    t = kv.shape[0]
    a = AttentionAttrs(
        0, 2, 2, 8, tokens_per_block=TPB, rotary_style="none", kv_cache_dtype=kind.lower(), kv_scale=scale
    )
    qkv = torch.cat([torch.zeros(t, 16), kv.reshape(t, 16), -kv.reshape(t, 16)], dim=1)
    blocks = -(-t // TPB)
    pool = torch.zeros(1, blocks + 3, 2, 2, TPB, 8, dtype=torch.int8 if kind == "INT8" else torch.uint8)
    table = torch.randperm(blocks + 3, generator=torch.Generator().manual_seed(1))[:blocks].int()
    positions = torch.arange(t, dtype=torch.int32)
    kv_cache_write(a, qkv, positions, torch.tensor([0]), torch.tensor([t]), table[None], pool)
    stored = pool[0][table.long()[positions // TPB], :, :, positions % TPB]  # [tokens, K/V, kv heads, head size]
    assert torch.equal(_load(stored[:, 0], a, torch.float32), fake_quant(kv, scale, kind))
    assert torch.equal(_load(stored[:, 1], a, torch.float32), fake_quant(-kv, scale, kind))


def _kv_codes(x: torch.Tensor, scale: float, kind: str) -> torch.Tensor:
    """The bytes the pool holds for x (what fake_quant rounds to, as stored)."""
    if kind == "INT8":
        return torch.round(x / scale).clamp(-128, 127).to(torch.int8).view(torch.uint8)
    return (x / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


@pytest.mark.parametrize(("method", "kv", "group"), METHODS)
def test_quantized_engine_equals_fake_quant_reference(
    method: str, kv: str, group: int, quantized: Callable[..., tuple[Path, OrtEngine]]
) -> None:
    """Weight-only methods: the engine computes what the fake-quant reference computes (< 1e-4, same argmax).

    Where activations or the KV cache are quantized at run time, each quantizer is exact (the two tests above), but
    its input is the output of a GEMM or an attention whose summation order differs between ONNX Runtime and torch
    (and between CPUs and thread counts). A last-bit difference can put a value on the other side of a rounding
    boundary and flip a code; that sequence's later tokens then differ by a quantization step. So there the engine
    is held to what a flip can do, and to what it cannot: flipped KV codes stay a small share (a wrong scale,
    rounding mode or zero point changes most of them); the engine costs a small fraction of what quantization
    itself costs (KLD), and almost never changes the top-1 token."""
    ckpt, engine = quantized(method, kv, group)
    fake, full = load_quantized(ckpt), load_quantized(quantized()[0])
    recorded: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    fake_kv = fake.hooks.kv_cache

    def record_kv(layer: str, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        recorded[layer] = (k, v)
        return fake_kv(layer, k, v)

    fake.hooks.kv_cache = record_kv
    got, expected, floats, flipped, codes = [], [], [], 0, 0
    for seed in (6, 7, 8):
        ids = torch.randint(0, engine.vocab_size, (70,), generator=torch.Generator().manual_seed(seed)).tolist()
        logits, pool, table = run_with_pool(engine, ids)
        got.append(torch.from_numpy(logits))
        expected.append(fake.forward(torch.tensor([ids]))[0])
        floats.append(full.forward(torch.tensor([ids]))[0])
        positions = torch.arange(len(ids))
        blocks, slots = torch.tensor(table)[positions // TPB], positions % TPB
        for layer, (k, v) in recorded.items() if fake.hooks.kv_kind else ():
            i = int(layer.rsplit(".", 1)[1])
            for j, x in enumerate((k, v)):  # x [1, kv heads, tokens, head size]
                reference = _kv_codes(x[0].transpose(0, 1), fake.hooks.kv_scales[layer], fake.hooks.kv_kind)
                flipped += int((pool[i][blocks, j, :, slots].view(torch.uint8) != reference).sum())
                codes += reference.numel()
    g, e, f = torch.cat(got), torch.cat(expected), torch.cat(floats)
    ops = {n.op_type for n in onnx.load(str(engine.spec.engine_dir / "model.onnx")).graph.node}
    assert "DequantizeLinear" in ops and ("QuantizeLinear" in ops) == (method in RUN_TIME)
    if method not in RUN_TIME:
        assert (g - e).abs().max() < 1e-4
        assert torch.equal(g.argmax(-1), e.argmax(-1))
        return
    geometry = engine.spec.kv_cache
    assert codes == 3 * 70 * 2 * geometry.num_layers * geometry.num_kv_heads * geometry.head_size
    assert flipped <= 0.1 * codes, f"{flipped} of {codes} KV codes differ from the reference's"
    assert _kld(e, g).mean() < 0.1 * _kld(f, e).mean()
    assert (g.argmax(-1) == e.argmax(-1)).double().mean() >= 0.95


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
    engine = json.loads(inspected.stdout)["engine"]
    assert engine["backend"] == "onnxruntime"
    assert "the Triton kernels are executed in CI by Triton's interpreter; not yet timed on a GPU" in engine["plugins"]
    path = tmp_path / "e" / "build_config.json"
    config = json.loads(path.read_text())
    config["backend"] = "tensorrt"  # as if built by TensorRT 10.13 on an H200
    config["compatibility"] = {"tensorrt": "10.13.0", "sm": "90", "gpu": "NVIDIA H200", "driver": "570", "cuda": "12.8"}
    path.write_text(json.dumps(config))
    reseal(tmp_path / "e")  # as that machine's build would have recorded it
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


def test_ort_threads_follow_the_environment(gqa_engine: OrtEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """TRTBUILD_ORT_THREADS pins ONNX Runtime's intra-op threads (the numerics tests run under 1 and 2 as a check
    that no result depends on the kernels' split); anything but a positive count is refused naming the variable."""
    from toolchain.engine.ort_backend import THREADS_ENV, OrtEngine, available_cores, ort_threads
    from toolchain.errors import UserError

    monkeypatch.delenv(THREADS_ENV, raising=False)
    assert ort_threads() == available_cores() and ort_threads(3) == 3
    monkeypatch.setenv(THREADS_ENV, "1")
    assert ort_threads() == 1 and ort_threads(3) == 3
    engine = OrtEngine(gqa_engine.spec)
    sessions = [s.session for s in engine.steps if hasattr(s, "session")]
    assert sessions and all(s.get_session_options().intra_op_num_threads == 1 for s in sessions)
    for bad in ("0", "-2", "two", "1.5"):
        monkeypatch.setenv(THREADS_ENV, bad)
        with pytest.raises(UserError, match=f"{THREADS_ENV}={bad!r}"):
            ort_threads()
