"""`DistributedEngine`: rank 0's face of a multi-rank engine, an `Engine` (api.py) like any other.

Rank 0 runs its own rank's engine in this process and tells the other ranks what to do (worker.py's step
protocol): `new_kv_cache` makes a pool on every rank, `forward` / `forward_tokens` broadcast the batch, run rank 0's
part, and (pipeline parallel) receive the last stage's result. The runtime drives it from one thread (LLMEngine's
loop); a keepalive thread broadcasts KEEPALIVE while it is idle, so that no worker waiting for the next step times
out, and a monitor thread (as vLLM's MultiprocExecutor's) waits on the spawned workers' sentinels: a rank that
dies marks the engine failed at once ("rank 1 died (exit -9)").

A failed engine stays failed: `health()` says why, every later step raises `RankFailure` (the ranks' collectives
are out of step for good; the fix is a restart). `close()` stops the ranks: STOP, a grace period, then terminate
and kill; the process group is destroyed and the TCPStore's port freed.
"""

from __future__ import annotations

import multiprocessing.connection
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from toolchain.engine.api import Engine, EngineSpec, StepTokens, tokens_on_host
from toolchain.engine.collectives import CollectiveError, Communicator
from toolchain.engine.contract import Batch
from toolchain.errors import UserError
from toolchain.parallel.mapping import RankMapping
from toolchain.parallel.worker import (
    EXIT_COLLECTIVE,
    KEEPALIVE,
    NEW_POOL,
    STOP,
    WANT_LOGITS,
    WANT_TOKENS,
    forward_message,
    header,
    recv_result,
    result_rank,
    send_step,
)

STOP_GRACE_S = 5.0  # how long close() lets the workers finish on their own before it terminates them
FAILED_GRACE_S = 1.0  # the same after a failure (no STOP sent: they exit when their collective fails)


class RankFailure(UserError):
    """A rank died or a collective failed: the engine cannot run another step (restart it)."""

    exit_code = EXIT_COLLECTIVE


class DistributedEngine:
    """Rank 0 of a multi-rank engine: `engine` runs rank 0's graph, its collectives through `comm` (GlooComm; the
    tests' ThreadComm), whose ops time out after `timeout_s`. `procs`: the spawned workers (empty under torchrun,
    whose agent owns them); `store`: the TCPStore rank 0 made (kept so its port stays ours until close)."""

    def __init__(
        self,
        spec: EngineSpec,
        engine: Engine,
        comm: Communicator,
        timeout_s: float,
        procs: Sequence[Any] = (),
        store: object | None = None,
    ) -> None:
        self.spec = spec
        self.vocab_size, self.tokens_per_block = spec.vocab_size, spec.limits.tokens_per_block
        self.engine, self.comm = engine, comm
        self.rank = RankMapping(spec.mapping, 0)
        self._result_rank = result_rank(self.rank)
        self._procs = list(procs)
        self._pids = [int(p.pid) for p in self._procs]
        self._store = store
        self._lock = threading.Lock()  # one message at a time: a step, a keepalive, STOP
        self._failure: str | None = None
        self._closed = False
        self._pool_ids: dict[int, int] = {}  # id(rank 0's pool tensor) -> pool id the workers know it by
        self._next_pool = 0
        self._freed: list[int] = []
        self._last = time.monotonic()
        self.timeout_s, self.keepalive_s = timeout_s, timeout_s / 3
        self._stop = threading.Event()
        self._wake_r, self._wake_w = multiprocessing.connection.Pipe(duplex=False)
        self._threads = [threading.Thread(target=self._keepalive, daemon=True, name="rank0-keepalive")]
        if self._procs:
            self._threads.append(threading.Thread(target=self._monitor, daemon=True, name="rank-monitor"))
        for t in self._threads:
            t.start()

    @property
    def worker_pids(self) -> list[int]:
        """The spawned workers' pids, rank 1 first (empty under torchrun)."""
        return list(self._pids)

    @property
    def store_port(self) -> int | None:
        """The TCPStore's port while the engine is open (close frees it)."""
        port = getattr(self._store, "port", None)
        return int(port) if port is not None else None

    def health(self) -> str | None:
        """Why the engine cannot run (a rank died, a collective failed), or None."""
        return self._failure

    # -- the Engine protocol -----------------------------------------------------------------------------------
    def new_kv_cache(self, num_blocks: int) -> torch.Tensor:
        with self._lock:
            self._check()
            pool_id, self._next_pool = self._next_pool, self._next_pool + 1
            freed, self._freed = self._freed, []
            self._send(header(NEW_POOL, num_blocks, pool_id, len(freed)), np.asarray(freed, dtype=np.int32))
            pool = self.engine.new_kv_cache(num_blocks)
            self._pool_ids[id(pool)] = pool_id
            weakref.finalize(pool, self._drop_pool, id(pool))
            return pool

    def forward(self, batch: Batch, kv_cache: torch.Tensor) -> np.ndarray:
        logits, _ = self._step(batch, kv_cache, WANT_LOGITS, ())
        return logits

    def forward_tokens(self, batch: Batch, kv_cache: torch.Tensor, sampled: Sequence[int]) -> StepTokens:
        if self._result_rank == 0:  # rank 0 holds the logits itself
            return tokens_on_host(self.forward(batch, kv_cache), sampled)
        greedy, rows = self._step(batch, kv_cache, WANT_TOKENS, sampled)
        return StepTokens(greedy, rows)

    def _step(
        self, batch: Batch, pool: torch.Tensor, want: int, sampled: Sequence[int]
    ) -> tuple[np.ndarray, dict[int, np.ndarray]]:
        # refused here, before any rank hears of it: a bad batch must not reach the workers
        batch.check(self.tokens_per_block)
        batch.check_blocks(pool.shape[1], self.tokens_per_block)
        pool_id = self._pool_ids.get(id(pool))
        if pool_id is None:
            raise ValueError("this KV pool was not made by this engine's new_kv_cache")
        with self._lock:
            self._check()
            self._send(*forward_message(batch, sampled, want, pool_id))
            try:  # from here on the other ranks run this step: whatever stops rank 0 leaves them out of step
                logits = self.engine.forward(batch, pool)
                if self._result_rank == 0:
                    return logits, {}
                outputs = batch.logits_index.shape[0]
                return recv_result(self.comm, self._result_rank, outputs, self.vocab_size, want, sampled)
            except CollectiveError as e:
                self._fail(str(e))
                raise
            except Exception as e:
                self._fail(f"rank 0 failed in a step the other ranks ran ({type(e).__name__}: {e})")
                raise
            finally:
                self._last = time.monotonic()

    # -- internals ---------------------------------------------------------------------------------------------
    def _check(self) -> None:
        if self._closed:
            raise RankFailure(f"{self.spec.engine_dir}: the engine is closed")
        if self._failure is not None:
            raise RankFailure(f"{self.spec.engine_dir}: {self._failure}; restart to run it again")

    def _send(self, h: torch.Tensor, payload: np.ndarray | None = None) -> None:
        try:
            send_step(self.comm, h, payload)
        except CollectiveError as e:
            self._fail(str(e))
            raise
        self._last = time.monotonic()

    def _fail(self, why: str) -> None:
        if self._failure is None and not self._closed:
            self._failure = why

    def _drop_pool(self, key: int) -> None:
        pool_id = self._pool_ids.pop(key, None)
        if pool_id is not None:
            self._freed.append(pool_id)

    def _keepalive(self) -> None:
        while not self._stop.wait(self.keepalive_s / 2):
            if time.monotonic() - self._last < self.keepalive_s or self._failure is not None:
                continue
            if not self._lock.acquire(blocking=False):
                continue  # a step is running: the workers are in it, not waiting
            try:
                if not self._closed and self._failure is None:
                    self._send(header(KEEPALIVE))
            except CollectiveError:
                pass  # _send recorded it
            finally:
                self._lock.release()

    def _monitor(self) -> None:
        sentinels = {p.sentinel: r for r, p in enumerate(self._procs, start=1)}
        ready = multiprocessing.connection.wait([*sentinels, self._wake_r])
        for s in ready:
            if s in sentinels and not self._closed:
                p = self._procs[sentinels[s] - 1]
                p.join(0.1)
                self._fail(f"rank {sentinels[s]} died (exit {p.exitcode})")
                return

    def close(self) -> None:
        """Stop every rank: STOP, STOP_GRACE_S to exit, then terminate / kill; destroy the process group, free the
        store's port. Safe to call twice, and on a failed engine."""
        if self._closed:
            return
        got = self._lock.acquire(timeout=self.timeout_s + 1)
        stopped = False
        try:
            if self._failure is None:
                try:
                    send_step(self.comm, header(STOP))
                    stopped = True
                except CollectiveError:
                    pass
            self._closed = True
        finally:
            if got:
                self._lock.release()
        self._stop.set()
        self._wake_w.send_bytes(b"x")
        if stopped:  # the workers exit on their own
            stop_ranks(self._procs, STOP_GRACE_S)
            self.comm.close()
        else:  # no STOP reached them: closing our sockets fails whatever collective they wait in, and they exit
            self.comm.close()
            stop_ranks(self._procs, FAILED_GRACE_S, terminate=False)
        self._store = None  # the TCPStore's server (and port) goes with its last reference
        for t in self._threads:
            t.join(2)

    def __enter__(self) -> DistributedEngine:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def stop_ranks(procs: Sequence[Any], grace_s: float, terminate: bool = True) -> None:
    """Wait grace_s for the processes to exit, then terminate (unless told not to), then kill: none is left.

    After a failure a rank has nothing left to finish, and a hung one (SIGSTOPped, or stuck in a native call) would
    not act on SIGTERM anyway: there the wait for SIGTERM is skipped, which keeps the server's exit within D9's
    bound (collective timeout + 5 s)."""
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    if terminate:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(2)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(2)
