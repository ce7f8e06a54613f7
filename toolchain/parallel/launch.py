"""Opening a multi-rank engine: starting (or, under torchrun, joining) one process per rank and handing the caller
rank 0's facade (engine.py's `DistributedEngine`), an `Engine` like any other. `open_trusted` sends every engine
of world_size > 1 here.

Two ways in, one command (`trtbuild serve ENGINE` is the same on every node):
- under torchrun (RANK, WORLD_SIZE, MASTER_ADDR in the environment): join its process group (env://); rank 0
  returns the facade, every other rank serves rank 0's steps and exits with the worker's status (it never returns
  from open_engine: only rank 0 answers HTTP).
- otherwise (one machine): this process is rank 0; it makes a TCPStore on port 0 (the OS picks a free port and
  the workers are handed it: no race for a free port) and spawns world_size - 1 workers (multiprocessing's spawn
  context: ONNX Runtime's and torch's thread pools make fork unsafe). Each rank takes cores / ranks ONNX Runtime
  threads ($TRTBUILD_ORT_THREADS overrides).
Then every rank opens its own graph (in parallel) and says so through the store; a rank that cannot is named
with its error. Collectives wait $TRTBUILD_COLLECTIVE_TIMEOUT seconds (comm.py).
"""

from __future__ import annotations

import multiprocessing
import os
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch.distributed import TCPStore  # type: ignore[attr-defined]  # exported at run time, not in the stubs

from toolchain.engine.api import MODEL_NAME, rank_dir
from toolchain.errors import UserError
from toolchain.parallel.comm import START_TIMEOUT_S, GlooComm, collective_timeout, mapping_groups
from toolchain.parallel.engine import DistributedEngine, stop_ranks
from toolchain.parallel.mapping import RankMapping
from toolchain.parallel.worker import JOINED_KEY, READY_KEY, local_threads, open_rank_engine, run_worker, worker_main

if TYPE_CHECKING:
    from toolchain.engine.api import Engine, EngineSpec

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR")
HOST = "127.0.0.1"  # spawned ranks share this machine


def under_torchrun() -> bool:
    return all(os.environ.get(k) for k in TORCHRUN_ENV)


def open_ranks(spec: EngineSpec, backend: str | None = None) -> Engine:
    """Rank 0's facade of a multi-rank engine (see the module docstring); under torchrun, ranks other than 0 run
    their steps here and exit."""
    m = spec.mapping
    chosen = backend or spec.backend
    if chosen != "onnxruntime":
        raise UserError(
            f"{spec.engine_dir}: a {m.world_size}-rank engine (tp={m.tp_size}, pp={m.pp_size}) runs on the CPU engine "
            f"only (backend onnxruntime), not {chosen}: TensorRT cannot run its collective ops yet; open it with "
            "--backend onnxruntime"
        )
    missing = [r for r in range(m.world_size) if not (rank_dir(spec.engine_dir, r) / MODEL_NAME).is_file()]
    if missing:
        raise UserError(
            f"{spec.engine_dir}: a {m.world_size}-rank engine (tp={m.tp_size}, pp={m.pp_size}) without "
            f"{', '.join(f'rank{r}/{MODEL_NAME}' for r in missing)}; the engine directory is incomplete, rebuild it"
        )
    timeout_s = collective_timeout()
    if under_torchrun():
        return _join_torchrun(spec, backend, timeout_s)
    return _spawn(spec, backend, timeout_s)


def _join_torchrun(spec: EngineSpec, backend: str | None, timeout_s: float) -> Engine:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != spec.world_size:
        raise UserError(
            f"torchrun started {world} processes (WORLD_SIZE) for a {spec.world_size}-rank engine "
            f"({spec.engine_dir}); start it with --nnodes x --nproc-per-node = {spec.world_size}"
        )
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=START_TIMEOUT_S))
    store = dist.distributed_c10d._get_default_store()
    threads = local_threads(int(os.environ.get("LOCAL_WORLD_SIZE") or world))
    if rank != 0:
        raise SystemExit(run_worker(spec, rank, store, threads, backend))
    return _rank0(spec, backend, timeout_s, store, threads, [])


def _spawn(spec: EngineSpec, backend: str | None, timeout_s: float) -> Engine:
    world = spec.world_size
    store = TCPStore(HOST, 0, world, is_master=True, timeout=timedelta(seconds=max(timeout_s, 60)),
                          wait_for_workers=False)  # fmt: skip
    threads = local_threads(world)
    ctx = multiprocessing.get_context("spawn")
    procs = []
    for r in range(1, world):
        args = (str(spec.engine_dir), r, world, HOST, store.port, timeout_s, threads, os.getpid(), backend)
        procs.append(ctx.Process(target=worker_main, args=args, daemon=True, name=f"trtbuild-rank{r}"))
    try:
        for p in procs:
            p.start()
        # the rendezvous waits for every rank: first make sure each is alive and at the store (a worker that died
        # importing would otherwise hold rank 0 in init_process_group for the whole start timeout)
        wait_for(store, JOINED_KEY, world, procs, START_TIMEOUT_S, "reach rank 0's store")
        start = timedelta(seconds=START_TIMEOUT_S)
        dist.init_process_group("gloo", store=store, rank=0, world_size=world, timeout=start)
    except BaseException:
        stop_ranks(procs, 0.0)
        raise
    return _rank0(spec, backend, timeout_s, store, threads, procs)


def _rank0(
    spec: EngineSpec, backend: str | None, timeout_s: float, store: Any, threads: int, procs: list[Any]
) -> Engine:
    comm: GlooComm | None = None
    try:
        comm = GlooComm(mapping_groups(RankMapping(spec.mapping, 0)), timeout_s)
        engine = open_rank_engine(spec, 0, comm, threads, backend)
        wait_for(store, READY_KEY, spec.world_size, procs, START_TIMEOUT_S, "open their engines")
    except BaseException:
        stop_ranks(procs, 0.0)
        if comm is not None:
            comm.close()
        elif dist.is_initialized():
            dist.destroy_process_group()
        raise
    return DistributedEngine(spec, engine, comm, timeout_s, procs, store)


def wait_for(store: Any, key: str, world: int, procs: list[Any], timeout_s: float, doing: str) -> None:
    """Until every rank 1.. set `key` ("ok" or its error) in the store; a rank that failed (or, spawned, died) is
    named with its error."""
    waiting = set(range(1, world))
    deadline = time.monotonic() + timeout_s
    while waiting:
        for r in sorted(waiting):
            name = key.format(rank=r)
            if store.check([name]):
                said = store.get(name).decode()
                if said != "ok":
                    raise UserError(f"rank {r} could not open its engine: {said.removeprefix('error: ')}")
                waiting.discard(r)
            elif procs and not procs[r - 1].is_alive():
                raise UserError(f"rank {r} exited ({procs[r - 1].exitcode}) before it could {doing} (see its stderr)")
        if time.monotonic() > deadline:
            raise UserError(f"ranks {sorted(waiting)} did not {doing} within {timeout_s:g} s")
        if waiting:
            time.sleep(0.05)
