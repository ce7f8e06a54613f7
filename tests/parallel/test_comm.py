"""The process model's parts without processes (issue 27, slice B): the collective timeout setting, the groups a
mapping needs, the step protocol (rank 0's messages and a worker's loop, ranks as threads), rank 0's facade over
ThreadComm (pools, pipeline results, failures); then GlooComm on raw tensors in two real gloo processes (slow;
test_launch.py times a hung rank out through a real engine)."""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import spawned
import torch
from worlds import run_threads

from toolchain.checkpoint.trtllm import Mapping
from toolchain.engine.api import EngineSpec, KVCacheSpec, Limits, RankSpec, StepTokens, tokens_on_host
from toolchain.engine.collectives import CollectiveError, ThreadComm
from toolchain.engine.contract import Batch
from toolchain.errors import UserError
from toolchain.parallel.comm import TIMEOUT_ENV, collective_timeout, mapping_groups
from toolchain.parallel.engine import DistributedEngine, RankFailure
from toolchain.parallel.mapping import RankMapping
from toolchain.parallel.worker import (
    FORWARD,
    KEEPALIVE,
    NEW_POOL,
    STOP,
    WANT_TOKENS,
    Step,
    decode_forward,
    forward_message,
    header,
    payload_len,
    serve_steps,
)

VOCAB = 5


def test_collective_timeout_default_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TIMEOUT_ENV, raising=False)
    assert collective_timeout() == 30.0
    monkeypatch.setenv(TIMEOUT_ENV, " 2.5 ")
    assert collective_timeout() == 2.5


@pytest.mark.parametrize("value", ["abc", "0", "-3", "nan", "inf", "1e9"])
def test_bad_collective_timeout_is_refused(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(TIMEOUT_ENV, value)
    with pytest.raises(UserError, match=rf"{TIMEOUT_ENV}='{value}': expected seconds from 0.1 to 86400"):
        collective_timeout()


def test_mapping_groups_tp2_pp2() -> None:
    groups = mapping_groups(RankMapping(Mapping.for_parallel(2, 2), 3))
    # the same list on every rank (new_group is collective): tp groups, pp groups, the world; no 1-rank group
    assert groups == [(0, 1), (0, 2), (1, 3), (2, 3), (0, 1, 2, 3)]
    assert groups == mapping_groups(RankMapping(Mapping.for_parallel(2, 2), 0))


def _batch() -> Batch:
    return Batch.from_sequences([[3, 1, 4], [1], [5, 9]], [0, 6, 2], [[0], [1, 2], [3]])


def test_forward_message_round_trips() -> None:
    batch = _batch()
    h, payload = forward_message(batch, [2, 0], WANT_TOKENS, pool_id=7)
    values = tuple(int(v) for v in h.tolist())
    assert values == (FORWARD, 6, 3, 2, 3, 2, WANT_TOKENS, 7)
    assert payload.dtype == np.int32 and payload.size == payload_len(values)
    got, sampled, want, pool_id = decode_forward(Step(FORWARD, values, payload))
    assert (sampled, want, pool_id) == ([2, 0], WANT_TOKENS, 7)
    for name, value in batch.feeds().items():
        np.testing.assert_array_equal(got.feeds()[name], value, err_msg=name)


class FakeEngine:
    """Logits that depend on the batch, the pool and the rank: output i is 1 + rank at column (its token + the
    pool's marker, the count of calls when it was made) % VOCAB, 0 elsewhere."""

    def __init__(self, rank: int) -> None:
        self.rank, self.spec = rank, _spec(2, 1)
        self.vocab_size, self.tokens_per_block = VOCAB, 16
        self.calls: list[tuple[str, Any]] = []

    def forward_tokens(self, batch: Batch, kv_cache: torch.Tensor, sampled: Sequence[int]) -> StepTokens:
        return tokens_on_host(self.forward(batch, kv_cache), sampled)

    def new_kv_cache(self, num_blocks: int) -> torch.Tensor:
        self.calls.append(("pool", num_blocks))
        return torch.full((1, num_blocks), float(len(self.calls)))

    def forward(self, batch: Batch, kv_cache: torch.Tensor) -> np.ndarray:
        self.calls.append(("forward", batch.input_ids.tolist()))
        rows = batch.input_ids[batch.logits_index].astype(np.float32)
        logits = np.zeros((rows.shape[0], VOCAB), dtype=np.float32)
        logits[np.arange(rows.shape[0]), (rows.astype(np.int64) + int(kv_cache[0, 0])) % VOCAB] = 1.0 + self.rank
        return logits


def _spec(tp: int, pp: int) -> EngineSpec:
    kv = KVCacheSpec("float32", 2, 2, 16, 8)
    ranks = tuple(RankSpec(r, r % tp, r // tp, (0, 2), kv) for r in range(tp * pp))
    return EngineSpec(Path("e"), "onnxruntime", "float32", "float32", "LlamaForCausalLM", VOCAB,
                      Limits(4, 64, 64, 16, 8), kv, mapping=Mapping.for_parallel(tp, pp), ranks=ranks)  # fmt: skip


def test_worker_loop_follows_rank0() -> None:
    engines = [FakeEngine(0), FakeEngine(1)]
    where = RankMapping(Mapping.for_parallel(2, 1), 1)

    def rank(comm: ThreadComm) -> Any:
        if comm.rank == 1:
            serve_steps(engines[1], comm, where)
            return "stopped"
        from toolchain.parallel.worker import send_step

        send_step(comm, header(NEW_POOL, 4, 0, 0))
        send_step(comm, *forward_message(_batch(), [], 0, 0))
        send_step(comm, header(KEEPALIVE))
        send_step(comm, header(NEW_POOL, 6, 1, 1), np.array([0], dtype=np.int32))
        send_step(comm, *forward_message(Batch.from_sequences([[7]], [0], [[5]]), [], 0, 1))
        send_step(comm, header(STOP))
        return "sent"

    assert run_threads(rank, 2) == ["sent", "stopped"]
    assert engines[1].calls == [("pool", 4), ("forward", [3, 1, 4, 1, 5, 9]), ("pool", 6), ("forward", [7])]


def test_worker_refuses_a_pool_rank0_never_made() -> None:
    def rank(comm: ThreadComm) -> Any:
        if comm.rank == 1:
            serve_steps(FakeEngine(1), comm, RankMapping(Mapping.for_parallel(2, 1), 1))
        else:
            from toolchain.parallel.worker import send_step

            send_step(comm, *forward_message(_batch(), [], 0, 3))

    with pytest.raises(ValueError, match="rank 1: FORWARD on pool 3, which rank 0 never made"):
        run_threads(rank, 2)


def _facade_world(tp: int, pp: int, rank0: Any, timeout_s: float = 5.0) -> list[Any]:
    """rank0(facade, engine) on rank 0, serve_steps on the others (FakeEngine each); -> per-rank results."""
    spec = _spec(tp, pp)

    def rank(comm: ThreadComm) -> Any:
        engine = FakeEngine(comm.rank)
        if comm.rank:
            serve_steps(engine, comm, RankMapping(spec.mapping, comm.rank))
            return engine.calls
        facade = DistributedEngine(spec, engine, comm, timeout_s)
        try:
            return rank0(facade, engine)
        finally:
            facade.close()

    return run_threads(rank, tp * pp, timeout_s)


def test_facade_pipeline_result_comes_from_the_last_stage() -> None:
    def rank0(facade: DistributedEngine, engine: FakeEngine) -> Any:
        pool = facade.new_kv_cache(4)
        logits = facade.forward(_batch(), pool)
        tokens = facade.forward_tokens(_batch(), pool, [1])
        return logits, tokens

    (logits, tokens), calls1 = _facade_world(1, 2, rank0)
    # rank 1 (the last stage) marks its rows 2.0: the logits rank 0 returns are rank 1's, not its own (1.0)
    expected = FakeEngine(1).forward(_batch(), torch.ones(1, 4))
    np.testing.assert_array_equal(logits, expected)
    np.testing.assert_array_equal(tokens.greedy, expected.argmax(axis=1))
    assert list(tokens.rows) == [1]
    np.testing.assert_array_equal(tokens.rows[1], expected[1])
    assert [c[0] for c in calls1] == ["pool", "forward", "forward"]


def test_facade_tracks_pools_and_frees_dropped_ones() -> None:
    def rank0(facade: DistributedEngine, engine: FakeEngine) -> Any:
        first = facade.new_kv_cache(4)
        del first  # dropped: the next NEW_POOL tells the workers to free it
        second = facade.new_kv_cache(2)
        with pytest.raises(ValueError, match="not made by this engine's new_kv_cache"):
            facade.forward(_batch(), torch.ones(1, 8))
        return facade.forward(Batch.from_sequences([[2]], [0], [[1]]), second)

    logits, calls1 = _facade_world(2, 1, rank0)
    assert calls1 == [("pool", 4), ("pool", 2), ("forward", [2])]
    assert logits.shape == (1, VOCAB)


def test_facade_failure_is_terminal() -> None:
    def rank0(facade: DistributedEngine, engine: FakeEngine) -> Any:
        pool = facade.new_kv_cache(4)
        with pytest.raises(CollectiveError, match=r"rank 0: Broadcast step FORWARD on group \[0, 1\]"):
            facade.forward(_batch(), pool)  # rank 1 never arrives
        assert facade.health() is not None and "rank [1] never arrived" in str(facade.health())
        with pytest.raises(RankFailure, match="restart to run it again"):
            facade.forward(_batch(), pool)
        return facade.health()

    spec = _spec(2, 1)

    def rank(comm: ThreadComm) -> Any:
        if comm.rank == 1:  # takes the pool, then stops following
            from toolchain.parallel.worker import recv_step

            return recv_step(comm).cmd
        facade = DistributedEngine(spec, FakeEngine(0), comm, 0.5)
        try:
            return rank0(facade, FakeEngine(0))
        finally:
            facade.close()

    health, cmd = run_threads(rank, 2, timeout_s=0.5)
    assert cmd == NEW_POOL and "Broadcast" in health


def test_facade_keeps_idle_workers_alive() -> None:
    def rank0(facade: DistributedEngine, engine: FakeEngine) -> Any:
        pool = facade.new_kv_cache(4)
        time.sleep(1.2)  # 4 x the 0.3 s timeout: the workers wait in broadcasts the keepalives answer
        return facade.forward(_batch(), pool), facade.health()

    (logits, health), calls1 = _facade_world(2, 1, rank0, timeout_s=0.3)
    assert health is None and logits.shape == (3, VOCAB)
    assert [c[0] for c in calls1] == ["pool", "forward"]


# -- GlooComm in two real processes ----------------------------------------------------------------------------


@pytest.mark.slow
def test_gloo_comm_ops_and_stats() -> None:
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    timeout_s = 1.0
    store = TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=spawned.gloo_rank, args=(r, store.port, timeout_s, out), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(10)
        assert p.exitcode == 0
    x0 = np.arange(6, dtype=np.float32).reshape(2, 3)
    for r in range(2):
        assert isinstance(got[r], dict), got[r]
        np.testing.assert_array_equal(got[r]["reduce"], 3 * x0)
        np.testing.assert_array_equal(got[r]["gather"], np.concatenate([x0, 2 * x0], axis=-1))
        np.testing.assert_array_equal(got[r]["bcast"], 2 * x0)
    assert "no such group in this engine's mapping (groups: [[0, 1]])" in got[0]["bad group"]
    assert "rank 1: AllReduce no such group on group [0, 2] failed" in got[1]["bad group"]
    assert "this rank is not in the group" in got[1]["bad group"]
    np.testing.assert_array_equal(got[1]["recv"], x0)
    # stats: every op that completed, bytes of this rank's input (24 B a tensor)
    assert got[0]["stats"] == {"AllReduce": (1, 24), "AllGather": (1, 24), "Send": (1, 24), "Broadcast": (1, 24)}
