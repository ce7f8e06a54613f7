"""The Triton kernels driving whole models: the CPU engine with its two plugin ops swapped for the kernels (run by
Triton's interpreter) against the same engine on the reference ops, over prefill, a mixed prefill + decode batch
and decodes, on shuffled blocks. This is what TensorRT's plugins will do inside an engine, layer after layer; the
unit tests beside this file check each kernel variant alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from toolchain.engine import ort_backend
from toolchain.engine.api import open_engine
from toolchain.engine.build import BuildOptions, build_engine
from toolchain.engine.contract import Batch
from toolchain.plugins.kernels import attention, kv_write

TPB = 16


def _triton_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine calls OPS[op](attrs, *inputs, memo=...): the kernels' entry points take the same inputs."""

    def wrap(fn: Any) -> Any:
        return lambda a, *inputs, memo=None: fn(a, *inputs)

    monkeypatch.setitem(ort_backend.OPS, "KVCacheWrite", wrap(kv_write.kv_cache_write))
    monkeypatch.setitem(ort_backend.OPS, "PagedAttention", wrap(attention.paged_attention))


def _session(engine: Any, vocab: int) -> tuple[list[np.ndarray], torch.Tensor]:
    """Three calls on one pool of 12 shuffled blocks (2 nobody owns, filled with NaN): A's 21-token prefill; A's
    decode beside B's 9-token prefill; both decoding. Returns every call's logits and the pool."""
    g = torch.Generator().manual_seed(0)
    pool = engine.new_kv_cache(12).fill_(float("nan"))
    order = torch.randperm(12, generator=g).tolist()
    table_a, table_b = order[:2], order[2:4]
    a = torch.randint(0, vocab, (23,), generator=g).tolist()
    b = torch.randint(0, vocab, (10,), generator=g).tolist()
    calls = [
        Batch.from_sequences([a[:21]], [0], [table_a], all_logits=True),
        Batch.from_sequences([a[21:22], b[:9]], [21, 0], [table_a, table_b], all_logits=True),
        Batch.from_sequences([a[22:23], b[9:10]], [22, 9], [table_a, table_b], all_logits=True),
    ]
    return [engine.forward(c, pool) for c in calls], pool


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny", "stories"])
def test_kernels_run_a_model_as_the_reference_ops_do(
    model: str, request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fp32 end to end: the logits of every call agree to 1e-4 of their scale with the same top-1 token, and the
    pools hold the same K/V (NaN where nobody wrote, in both)."""
    from toolchain.checkpoint.convert import convert

    hf = request.getfixturevalue(model)
    convert(hf, tmp_path / "ckpt")
    build_engine(tmp_path / "ckpt", tmp_path / "engine", BuildOptions(backend="onnxruntime", tokens_per_block=TPB))
    engine = open_engine(tmp_path / "engine")
    vocab = int(engine.spec.vocab_size)
    want, want_pool = _session(engine, vocab)
    _triton_ops(monkeypatch)
    got, got_pool = _session(engine, vocab)
    for i, (w, x) in enumerate(zip(want, got, strict=True)):
        scale = float(np.abs(w).max())
        assert np.abs(x - w).max() <= 1e-4 * scale, f"call {i}: max |diff| {np.abs(x - w).max():.3g}, scale {scale:.3g}"
        assert (x.argmax(-1) == w.argmax(-1)).all(), f"call {i}: top-1 differs"
    assert torch.equal(got_pool.isnan(), want_pool.isnan())
    written = ~want_pool.isnan()
    assert torch.allclose(got_pool[written], want_pool[written], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_kernels_run_gpt_oss_sinks_as_the_reference_ops_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """gpt-oss's parity model (attention sinks on every layer, a 6-token window alternating with full layers, YaRN;
    its MoE on the reference op) with both attention ops on the kernels, over the same three calls: fp32 logits
    within 1e-4 of their scale (the MoE kernel's swap test's bound), the same top-1 and the same pool."""
    from models import save_case

    from toolchain.checkpoint.convert import convert

    convert(save_case(tmp_path / "hf", "gpt-oss-every-feature"), tmp_path / "ckpt")
    build_engine(tmp_path / "ckpt", tmp_path / "engine", BuildOptions(backend="onnxruntime", tokens_per_block=TPB))
    engine = open_engine(tmp_path / "engine")
    vocab = int(engine.spec.vocab_size)
    want, want_pool = _session(engine, vocab)
    _triton_ops(monkeypatch)
    seen: list[tuple[int, int]] = []
    kernel = ort_backend.OPS["PagedAttention"]

    def attention_op(a: Any, *inputs: Any, memo: Any = None) -> Any:
        seen.append((a.sinks, a.sliding_window))
        return kernel(a, *inputs, memo=memo)

    monkeypatch.setitem(ort_backend.OPS, "PagedAttention", attention_op)
    got, got_pool = _session(engine, vocab)
    assert {s for s, _ in seen} == {1} and {w > 0 for _, w in seen} == {True, False}  # sinks on both layer kinds
    for i, (w, x) in enumerate(zip(want, got, strict=True)):
        scale = float(np.abs(w).max())
        assert np.abs(x - w).max() <= 1e-4 * scale, f"call {i}: max |diff| {np.abs(x - w).max():.3g}, scale {scale:.3g}"
        assert (x.argmax(-1) == w.argmax(-1)).all(), f"call {i}: top-1 differs"
        print(f"call {i}: max |diff| {np.abs(x - w).max():.3g}, scale {scale:.3g}")
    assert torch.equal(got_pool.isnan(), want_pool.isnan())
    written = ~want_pool.isnan()
    assert torch.allclose(got_pool[written], want_pool[written], rtol=1e-5, atol=1e-6)
