"""The step protocol between rank 0 and the other ranks, and `worker_main`, the life of a rank other than 0.

Rank 0 (the caller's process: scheduler, server) decides every step; the other ranks follow. Each message is a
broadcast from rank 0 over GlooComm's step group: a fixed int64 header, then, when the header says so, one flat
int32 payload. Nothing is pickled: a worker can only be told these four things.

  header [NEW_POOL, num_blocks, pool_id, num_freed, 0, 0, 0, 0]      payload: the ids of pools rank 0 dropped
  header [FORWARD, num_tokens, num_seqs, max_blocks, num_outputs, num_sampled, want, pool_id]
                                      payload: input_ids, position_ids, context_lens, new_lens, block_tables (row
                                      major), logits_index, sampled rows (for want = WANT_TOKENS)
  header [KEEPALIVE, 0, ...]          rank 0 is idle (sent every timeout / 3, so no worker's wait times out)
  header [STOP, 0, ...]               exit 0

Block ids are rank 0's (its BlockManager decides for every rank); each rank applies them to its own pool of the
same number of blocks. With pipeline parallelism the last stage's first rank sends the step's result to rank 0
after the step (`send_result` / `recv_result`): the logits for `forward`, the greedy tokens and the sampled rows
only for `forward_tokens` (D3: a few bytes per sequence, not [outputs, vocab]).

A worker never outlives rank 0: a thread watches its parent's pid (a spawned worker), and a dead rank 0 closes
its sockets, which fails the worker's next collective; either way the worker exits. It exits 0 on STOP, 3 after
printing a `CollectiveError` (naming its rank) on stderr, 1 on any other error.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed import Store, TCPStore  # type: ignore[attr-defined]  # exported at run time, not in the stubs

from toolchain.engine.api import MODEL_NAME, Engine, EngineSpec, rank_dir
from toolchain.engine.collectives import CollectiveError, Communicator
from toolchain.engine.contract import Batch
from toolchain.errors import UserError
from toolchain.parallel.mapping import RankMapping

NEW_POOL, FORWARD, KEEPALIVE, STOP = 1, 2, 3, 4
COMMANDS = {NEW_POOL: "NEW_POOL", FORWARD: "FORWARD", KEEPALIVE: "KEEPALIVE", STOP: "STOP"}
WANT_LOGITS, WANT_TOKENS = 0, 1
HEADER_LEN = 8
JOINED_KEY = "trtbuild/joined/{rank}"  # a spawned worker reached the store: rank 0 may start the rendezvous
READY_KEY = "trtbuild/ready/{rank}"  # a worker's "ok" (or its error) once its engine is open: launch.py waits
EXIT_COLLECTIVE = 3  # D9: a rank failed


@dataclass(frozen=True)
class Step:
    """One decoded message."""

    cmd: int
    header: tuple[int, ...]
    payload: np.ndarray  # int32


def header(cmd: int, *values: int) -> torch.Tensor:
    h = torch.zeros(HEADER_LEN, dtype=torch.int64)
    h[0] = cmd
    h[1 : 1 + len(values)] = torch.tensor(values, dtype=torch.int64)
    return h


def forward_message(batch: Batch, sampled: Sequence[int], want: int, pool_id: int) -> tuple[torch.Tensor, np.ndarray]:
    """The FORWARD header and payload of one batch."""
    n, s = batch.input_ids.shape[0], batch.context_lens.shape[0]
    tables = batch.block_tables.reshape(s, -1)
    parts = [batch.input_ids, batch.position_ids, batch.context_lens, batch.new_lens, tables.reshape(-1)]
    parts += [batch.logits_index, np.asarray(sampled, dtype=np.int32)]
    payload = np.concatenate([np.asarray(p, dtype=np.int32).reshape(-1) for p in parts])
    h = header(FORWARD, n, s, tables.shape[1], batch.logits_index.shape[0], len(sampled), want, pool_id)
    return h, payload


def payload_len(h: Sequence[int]) -> int:
    if h[0] == FORWARD:
        _, n, s, mb, o, k = h[:6]
        return 2 * n + 2 * s + s * mb + o + k
    if h[0] == NEW_POOL:
        return h[3]
    return 0


def decode_forward(step: Step) -> tuple[Batch, list[int], int, int]:
    """-> (batch, sampled rows, want, pool id) of a FORWARD message."""
    _, n, s, mb, o, k, want, pool_id = step.header
    p, cuts = step.payload, np.cumsum([n, n, s, s, s * mb, o, k])
    ids, pos, ctx, new, tables, index, sampled, _ = np.split(p, cuts)
    return Batch(ids, pos, ctx, new, tables.reshape(s, mb), index), sampled.tolist(), want, pool_id


def send_step(comm: Communicator, h: torch.Tensor, payload: np.ndarray | None = None) -> None:
    """Rank 0: broadcast one message."""
    what = f"step {COMMANDS[int(h[0])]}"
    comm.broadcast(h, 0, what)
    if payload is not None and payload.size:
        comm.broadcast(torch.from_numpy(np.ascontiguousarray(payload, dtype=np.int32)), 0, what + " payload")


def recv_step(comm: Communicator) -> Step:
    """A worker: the next message from rank 0 (waits up to the collective timeout: rank 0 sends keepalives)."""
    h = comm.broadcast(torch.zeros(HEADER_LEN, dtype=torch.int64), 0, "waiting for rank 0's next step")
    values = tuple(int(v) for v in h.tolist())
    if values[0] not in COMMANDS:
        raise ValueError(f"step header {list(values)}: unknown command {values[0]} (expected {COMMANDS})")
    size = payload_len(values)
    payload = np.empty(0, dtype=np.int32)
    if size:
        buf = comm.broadcast(torch.zeros(size, dtype=torch.int32), 0, f"step {COMMANDS[values[0]]} payload")
        payload = buf.numpy()
    return Step(values[0], values, payload)


def result_rank(rank: RankMapping) -> int:
    """The rank whose logits reach rank 0: the last stage's first (tp rank 0)."""
    return (rank.pp_size - 1) * rank.tp_size


def send_result(comm: Communicator, logits: np.ndarray, want: int, sampled: Sequence[int]) -> None:
    """The last stage -> rank 0: the logits (WANT_LOGITS) or the greedy tokens and the sampled rows."""
    if want == WANT_LOGITS:
        comm.send(torch.from_numpy(np.ascontiguousarray(logits)), 0, "step logits to rank 0")
        return
    comm.send(torch.from_numpy(logits.argmax(axis=1).astype(np.int64)), 0, "step tokens to rank 0")
    if sampled:
        rows = np.ascontiguousarray(logits[np.asarray(sampled, dtype=np.int64)])
        comm.send(torch.from_numpy(rows), 0, "step sampled rows to rank 0")


def recv_result(
    comm: Communicator, src: int, outputs: int, vocab: int, want: int, sampled: Sequence[int]
) -> tuple[np.ndarray, dict[int, np.ndarray]]:
    """Rank 0's side of send_result: (logits, {}) for WANT_LOGITS, else (greedy tokens, {row: logits})."""
    if want == WANT_LOGITS:
        return comm.recv((outputs, vocab), torch.float32, src, "step logits to rank 0").numpy(), {}
    greedy = comm.recv((outputs,), torch.int64, src, "step tokens to rank 0").numpy()
    rows: dict[int, np.ndarray] = {}
    if sampled:
        got = comm.recv((len(sampled), vocab), torch.float32, src, "step sampled rows to rank 0").numpy()
        rows = {int(i): got[j] for j, i in enumerate(sampled)}
    return greedy, rows


def stage_forward(engine: Engine, batch: Batch, pool: torch.Tensor) -> np.ndarray:
    """This rank's part of one step (a non-last pipeline stage ends by sending its hidden states: its result is not
    used)."""
    return engine.forward(batch, pool)


def serve_steps(engine: Engine, comm: Communicator, rank: RankMapping) -> None:
    """A worker's loop: follow rank 0's messages until STOP."""
    pools: dict[int, torch.Tensor] = {}
    sends = rank.rank == result_rank(rank) != 0
    while True:
        step = recv_step(comm)
        if step.cmd == STOP:
            return
        if step.cmd == NEW_POOL:
            for freed in step.payload.tolist():
                pools.pop(int(freed), None)
            pools[step.header[2]] = engine.new_kv_cache(step.header[1])
        elif step.cmd == FORWARD:
            batch, sampled, want, pool_id = decode_forward(step)
            if pool_id not in pools:
                raise ValueError(f"rank {rank.rank}: FORWARD on pool {pool_id}, which rank 0 never made")
            logits = stage_forward(engine, batch, pools[pool_id])
            if sends:
                send_result(comm, logits, want, sampled)


def _watch_parent(parent: int, rank: int) -> None:
    """Exit the moment the parent (rank 0) is gone: its pid is no longer our parent's."""
    while os.getppid() == parent:
        time.sleep(0.2)
    print(f"trtbuild: rank {rank}: rank 0 (pid {parent}) is gone; exiting", file=sys.stderr, flush=True)
    os._exit(EXIT_COLLECTIVE)


def local_threads(local_world: int) -> int:
    """ONNX Runtime threads of one rank: $TRTBUILD_ORT_THREADS when set, else this machine's cores shared by its
    ranks (two ranks each taking every core oversubscribe them: spinning pools cost 6-13x, docs/benchmarks.md)."""
    from toolchain.engine.ort_backend import THREADS_ENV, available_cores, ort_threads

    if os.environ.get(THREADS_ENV, "").strip():
        return ort_threads()
    return max(1, available_cores() // max(1, local_world))


def open_rank_engine(spec: EngineSpec, rank: int, comm: Communicator, threads: int) -> Engine:
    """Rank `rank`'s own engine (its graph only), its collectives run by `comm`: the CPU engine (launch.open_ranks
    refused any other backend before a rank started)."""
    from toolchain.engine.ort_backend import OrtEngine

    return OrtEngine(spec.for_rank(rank), threads=threads, comm=comm)


def run_worker(spec: EngineSpec, rank: int, store: Store, threads: int) -> int:
    """A worker inside a started process group: make the groups, open its engine, say so, follow rank 0.
    -> the process's exit status."""
    from toolchain.parallel.comm import GlooComm, mapping_groups

    where = RankMapping(spec.mapping, rank)
    comm: GlooComm | None = None
    try:
        comm = GlooComm(mapping_groups(where))
        try:
            engine = open_rank_engine(spec, rank, comm, threads)
        except Exception as e:  # said once, through the store: rank 0 raises it naming this rank
            text = " ".join(str(e).split())
            if not isinstance(e, UserError):
                text = f"{rank_dir(spec.engine_dir, rank) / MODEL_NAME}: {type(e).__name__}: {text}"
            store.set(READY_KEY.format(rank=rank), f"error: {text}")
            print(f"trtbuild: rank {rank}: {text}", file=sys.stderr, flush=True)
            return 1
        store.set(READY_KEY.format(rank=rank), "ok")
        serve_steps(engine, comm, where)
        return 0
    except CollectiveError as e:
        print(f"trtbuild: {e}", file=sys.stderr, flush=True)
        return EXIT_COLLECTIVE
    except Exception:
        print(f"trtbuild: rank {rank} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        return 1
    finally:
        if comm is not None:
            comm.close()


def worker_main(
    engine_dir: str,
    rank: int,
    world_size: int,
    host: str,
    port: int,
    timeout_s: float,
    threads: int,
    parent: int,
) -> None:
    """The entry point of a spawned rank (launch.py): join rank 0's store and process group, then run_worker."""
    # A terminal's Ctrl-C reaches the whole foreground process group: rank 0 drains its requests and then stops
    # this rank, which must live until then (the parent watch ends it if rank 0 goes first)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(parent, rank), daemon=True, name="parent-watch").start()
    os.environ["TRTBUILD_COLLECTIVE_TIMEOUT"] = repr(timeout_s)  # rank 0 read it: every rank uses the same
    from toolchain.parallel.comm import START_TIMEOUT_S

    start = timedelta(seconds=START_TIMEOUT_S)
    store = TCPStore(host, port, world_size, is_master=False, timeout=start)
    store.set(JOINED_KEY.format(rank=rank), "ok")
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=start)
    spec = EngineSpec.from_dir(Path(engine_dir))
    code = run_worker(spec, rank, store, threads)
    sys.stdout.flush()
    os._exit(code)  # no atexit hooks: torch / ONNX Runtime teardown in a spawned child adds nothing but time
