"""Multi-rank engines run as processes (issue 27, slice B): `open_engine` on a 2-rank engine spawns rank 1, hands
back rank 0's facade, and the runtime generates with it exactly as with the single-rank engine; a killed rank is
named by health() at once, a hung one by a CollectiveError within the collective timeout; close() leaves no
process and frees the store's port; the torchrun path joins an existing world.

The engines are handmade.py's: the tiny Llama on each rank plus a final collective that leaves the logits
bit-identical to the single-rank engine's (so equality here is exact, not a tolerance). Each test spawns one world
(rank 1 imports torch and ONNX Runtime: ~3 s on 2 busy cores), hence `slow`.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import spawned
from handmade import two_rank_engine

from toolchain.checkpoint.trtllm import Mapping
from toolchain.engine.api import MODEL_NAME, EngineSpec, KVCacheSpec, Limits, RankSpec, open_engine, open_trusted
from toolchain.engine.collectives import CollectiveError
from toolchain.engine.contract import Batch
from toolchain.errors import UserError
from toolchain.parallel.comm import STALL_ENV, TIMEOUT_ENV
from toolchain.parallel.engine import DistributedEngine, RankFailure
from toolchain.runtime.llm_engine import LLMEngine
from toolchain.runtime.request import SamplingParams

PROMPTS: list[str | list[int]] = [[5, 17, 42, 9], [100, 3], [7, 7, 7, 7, 7, 7, 7, 7, 7]]


@pytest.fixture(scope="module")
def engines(tiny_engine: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ranks")
    return {"one": tiny_engine, **{kind: two_rank_engine(tiny_engine, root / kind, kind) for kind in ("tp", "pp")}}


@pytest.fixture(autouse=True)
def one_thread_per_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRTBUILD_ORT_THREADS", "1")  # 2 ranks on 2 cores: no oversubscription


def _generate(engine: Any, params: SamplingParams) -> list[list[int]]:
    llm = LLMEngine(engine)
    try:
        return [c.token_ids for c in llm.generate(PROMPTS, params)]
    finally:
        llm.close()


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _closed_cleanly(engine: DistributedEngine) -> None:
    pids, port = engine.worker_pids, engine.store_port
    start = time.monotonic()
    engine.close()
    assert time.monotonic() - start < 10
    assert all(_gone(p) for p in pids) and multiprocessing.active_children() == []
    assert port is not None
    with socket.socket() as s:  # nothing listens on the store's port any more (as a server rebinding it: its
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # closed connections may linger in TIME_WAIT)
        s.bind(("127.0.0.1", port))
        s.listen()


def _reference(one: Path) -> tuple[np.ndarray, list[list[int]], list[list[int]]]:
    engine = open_engine(one)
    batch = Batch.from_sequences([[1, 2, 3, 4, 5], [9, 8]], [0, 0], [[0, 1], [2]], all_logits=True)
    logits = engine.forward(batch, engine.new_kv_cache(4))
    greedy = _generate(engine, SamplingParams(max_new_tokens=6))
    sampled = _generate(engine, SamplingParams(max_new_tokens=6, temperature=0.8, seed=3))
    return logits, greedy, sampled


@pytest.fixture(scope="module")
def reference(engines: dict[str, Path]) -> tuple[np.ndarray, list[list[int]], list[list[int]]]:
    return _reference(engines["one"])


def _same_as_one_rank(engine: Any, reference: tuple[np.ndarray, list[list[int]], list[list[int]]]) -> None:
    logits, greedy, sampled = reference
    batch = Batch.from_sequences([[1, 2, 3, 4, 5], [9, 8]], [0, 0], [[0, 1], [2]], all_logits=True)
    np.testing.assert_array_equal(engine.forward(batch, engine.new_kv_cache(4)), logits)  # exact: see handmade.py
    assert _generate(engine, SamplingParams(max_new_tokens=6)) == greedy
    assert _generate(engine, SamplingParams(max_new_tokens=6, temperature=0.8, seed=3)) == sampled


@pytest.mark.slow
def test_tp_world_runs_as_one_rank_then_a_killed_rank_is_named(engines: dict[str, Path], reference: Any) -> None:
    engine = open_engine(engines["tp"])
    assert isinstance(engine, DistributedEngine)
    try:
        assert len(engine.worker_pids) == 1 and engine.health() is None
        _same_as_one_rank(engine, reference)
        pool = engine.new_kv_cache(4)
        os.kill(engine.worker_pids[0], signal.SIGKILL)
        deadline = time.monotonic() + 2
        while engine.health() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.health() == "rank 1 died (exit -9)"
        with pytest.raises(RankFailure, match=r"rank 1 died \(exit -9\); restart to run it again"):
            engine.forward(Batch.from_sequences([[1]], [0], [[0]]), pool)
    finally:
        _closed_cleanly(engine)


@pytest.mark.slow
def test_pp_world_runs_as_one_rank(engines: dict[str, Path], reference: Any) -> None:
    engine = open_engine(engines["pp"])
    assert isinstance(engine, DistributedEngine)
    try:  # rank 1, the last stage, sends rank 0 the logits (forward) or the tokens and sampled rows (generate)
        _same_as_one_rank(engine, reference)
        assert engine.health() is None
        # a terminal's Ctrl-C reaches every process of the group: the worker lives on for rank 0 to drain and stop
        os.kill(engine.worker_pids[0], signal.SIGINT)
        time.sleep(0.5)
        assert engine.health() is None
        _same_as_one_rank(engine, reference)
    finally:
        _closed_cleanly(engine)


@pytest.mark.slow
def test_idle_ranks_live_and_a_hung_rank_times_out_naming_it(
    engines: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    timeout_s = 2.0
    monkeypatch.setenv(TIMEOUT_ENV, str(timeout_s))
    monkeypatch.setenv(STALL_ENV, "1:AllReduce:60")  # rank 1 sleeps in every all-reduce
    engine = open_engine(engines["tp"])
    assert isinstance(engine, DistributedEngine)
    try:
        pool = engine.new_kv_cache(4)
        time.sleep(1.5 * timeout_s)  # idle past the timeout: rank 0's keepalives keep rank 1's wait for a step short
        assert engine.health() is None  # (rank 1 timing out would have exited 3, which the monitor reports)
        start = time.monotonic()
        with pytest.raises(CollectiveError) as caught:
            engine.forward(Batch.from_sequences([[1, 2]], [0], [[0]]), pool)
        assert time.monotonic() - start < timeout_s + 2
        message = str(caught.value)
        assert message.startswith("rank 0: AllReduce logits all-reduce on group [0, 1] failed (timeout 2 s)")
        assert "waiting for rank 1" in message
        assert engine.health() == message
    finally:
        _closed_cleanly(engine)  # rank 1 still sleeps: terminated after the grace


@pytest.mark.slow
def test_a_rank_that_cannot_open_its_graph_is_named(engines: dict[str, Path], tmp_path: Path) -> None:
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(engines["tp"], broken)
    (broken / "rank1" / MODEL_NAME).write_bytes(b"not a graph")
    # past the manifest check (open_engine refuses the changed file first): rank 1 finds it itself
    with pytest.raises(
        UserError, match=r"rank 1 could not open its engine: .*rank1/model\.onnx: DecodeError: Error parsing"
    ):
        open_trusted(EngineSpec.from_dir(broken))
    assert multiprocessing.active_children() == []


ORPHAN = """
import os, signal, sys
from pathlib import Path
from toolchain.engine.api import open_engine
engine = open_engine(Path(sys.argv[1]))
print(engine.worker_pids[0], flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.slow
def test_workers_never_outlive_rank0(engines: dict[str, Path]) -> None:
    import subprocess
    import sys

    import toolchain

    env = {**os.environ, "PYTHONPATH": str(Path(toolchain.__file__).parents[1])}
    rank0 = subprocess.Popen([sys.executable, "-c", ORPHAN, str(engines["tp"])], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    try:
        assert rank0.stdout is not None
        worker = int(rank0.stdout.readline())
        assert rank0.wait(60) == -signal.SIGKILL
        deadline = time.monotonic() + 2
        while not _gone(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(worker), "rank 1 outlived rank 0 by 2 s"
        _, stderr = rank0.communicate(timeout=10)
    finally:
        rank0.kill()
    # its last words (on the stderr it inherited from rank 0): its broadcast failed, or it saw rank 0 gone
    assert "trtbuild: rank 1: " in stderr, stderr


@pytest.mark.slow
def test_torchrun_ranks_join_one_world(engines: dict[str, Path], reference: Any) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=spawned.torchrun_rank, args=(r, port, str(engines["tp"]), out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        rank, logits, pids = out.get(timeout=60)
        for p in procs:
            p.join(30)
        assert rank == 0, logits
        np.testing.assert_array_equal(logits, reference[0])
        assert pids == []  # torchrun's agent owns the processes, not rank 0
        assert [p.exitcode for p in procs] == [0, 0]  # rank 1 left open_engine with the worker's status: STOP -> 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()


@pytest.fixture
def engines_spec(tmp_path: Path) -> EngineSpec:
    """A 2-rank spec whose rank graphs exist (empty: nothing here opens them)."""
    kv = KVCacheSpec("float32", 2, 2, 16, 8)
    spec = EngineSpec(tmp_path, "onnxruntime", "float32", "float32", "LlamaForCausalLM", 64,
                      Limits(2, 64, 64, 16, 8), kv)  # fmt: skip
    for r in (0, 1):
        (tmp_path / f"rank{r}").mkdir()
        (tmp_path / f"rank{r}" / MODEL_NAME).write_bytes(b"")
    return replace(spec, mapping=Mapping.for_parallel(2, 1), ranks=tuple(RankSpec(r, r, 0, (0, 2), kv) for r in (0, 1)))


def test_a_multi_rank_engine_refuses_tensorrt(engines_spec: EngineSpec) -> None:
    with pytest.raises(UserError, match=r"runs on the CPU engine only .* not tensorrt: TensorRT cannot run its"):
        open_trusted(engines_spec, "tensorrt")


def test_one_multi_rank_engine_per_process(engines_spec: EngineSpec, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)  # as while another world is open here
    with pytest.raises(UserError, match="another multi-rank engine is open in this process"):
        open_trusted(engines_spec)
