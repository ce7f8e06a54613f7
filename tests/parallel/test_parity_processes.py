"""Real multi-rank engines run as real processes: `open_engine` on a TP=2 Llama, a PP=2 Qwen3 and an expert-parallel
(EP=2) Mixtral spawns rank 1, and rank 0's facade gives the TP=1 engine's logits and, driven by the runtime
(`LLMEngine.generate`), the same greedy tokens. test_build.py proves the same graphs with ranks as threads; here
the collectives are gloo's, the step reaches rank 1 through the step protocol, and (PP) the last stage's tokens
come back to rank 0. One world per model (spawn + imports: ~3 s on 2 cores), hence `slow`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from models import MIXTRAL, TPB
from worlds import sharded_checkpoint

from toolchain.engine.api import open_engine
from toolchain.engine.build import BuildOptions, build_engine
from toolchain.engine.contract import Batch
from toolchain.parallel.engine import DistributedEngine
from toolchain.runtime.llm_engine import LLMEngine
from toolchain.runtime.request import SamplingParams

OPTS = BuildOptions(backend="onnxruntime", tokens_per_block=TPB, max_batch_size=4)
# as test_build.py: a TP rank's all-reduce adds per-rank partial sums of the same float32 products in another
# order, which moves these tiny models' logits (a few units) by float32 rounding: ~2e-6 seen, 1e-5 the bound
TOLERANCE = 1e-5
PROMPTS = ([3, 17, 45, 2, 88, 60, 9, 31, 5], [70, 12, 44, 1, 96])
TABLES = ([5, 2, 7, 11], [0, 9, 3])
DECODE = ([8, 50, 61], [24, 90, 13])
CASES = {  # arch, tp, pp, moe_ep, config
    "llama-tp2": ("llama", 2, 1, 1, {"num_hidden_layers": 3}),
    "qwen3-pp2": ("qwen3", 1, 2, 1, {"num_hidden_layers": 3}),
    "mixtral-ep2": ("mixtral", 2, 1, 2, MIXTRAL),  # 4 of 8 experts per rank, one AllReduce after each MoE node
}


@pytest.fixture(autouse=True)
def one_thread_per_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRTBUILD_ORT_THREADS", "1")


def steps(engine: Any) -> list[np.ndarray]:
    """A prefill of both prompts (every row's logits), then three decode steps of both, in one pool."""
    pool = engine.new_kv_cache(12)
    out = [engine.forward(Batch.from_sequences(list(PROMPTS), [0, 0], list(TABLES), all_logits=True), pool)]
    for step in range(len(DECODE[0])):
        ctx = [len(p) + step for p in PROMPTS]
        out.append(engine.forward(Batch.from_sequences([[d[step]] for d in DECODE], ctx, list(TABLES)), pool))
    return out


def generate(engine: Any) -> list[list[int]]:
    llm = LLMEngine(engine)
    try:
        return [c.token_ids for c in llm.generate(list(PROMPTS), SamplingParams(max_new_tokens=8))]
    finally:
        llm.close()


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_process_world_matches_the_tp1_engine(name: str, tmp_path: Path) -> None:
    arch, tp, pp, moe_ep, overrides = CASES[name]
    one, split = sharded_checkpoint(tmp_path, arch, tp, pp, moe_ep, **overrides)
    build_engine(one, tmp_path / "engine1", OPTS)
    build_engine(split, tmp_path / "engine", OPTS)
    single = open_engine(tmp_path / "engine1")
    expected, greedy = steps(single), generate(single)
    engine = open_engine(tmp_path / "engine")
    assert isinstance(engine, DistributedEngine) and len(engine.worker_pids) == tp * pp - 1
    try:
        got = steps(engine)
        for step, (g, e) in enumerate(zip(got, expected, strict=True)):
            np.testing.assert_allclose(g, e, rtol=0, atol=TOLERANCE, err_msg=f"{name} step {step}")
            np.testing.assert_array_equal(g.argmax(axis=1), e.argmax(axis=1))
        assert generate(engine) == greedy
        assert engine.health() is None
        stats = engine.comm.stats()  # rank 0's own collectives were gloo's
        assert stats["Broadcast"].calls > 0
        assert ("AllReduce" if tp > 1 else "Send") in stats
    finally:
        engine.close()
