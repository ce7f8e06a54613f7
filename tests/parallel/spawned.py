"""What the spawned processes of the multi-rank tests run (issue 27, slice B). A module of its own, importing
little: a spawned child imports the module of its target, and a test module's imports (the CLI, test fixtures)
cost seconds per process on 2 busy cores."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from toolchain.engine.collectives import CollectiveError


def _leave(out: Any) -> None:
    """Flush the queue, then exit without torch's and ONNX Runtime's teardown (seconds on a busy machine)."""
    out.close()
    out.join_thread()
    os._exit(0)


def gloo_rank(rank: int, port: int, timeout_s: float, out: Any) -> None:
    import torch.distributed as dist
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    from toolchain.parallel.comm import GlooComm

    try:
        store = TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=30))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=30))
        comm = GlooComm([(0, 1)], timeout_s)
        x = torch.arange(6, dtype=torch.float32).reshape(2, 3) * (rank + 1)
        results: dict[str, Any] = {"reduce": comm.all_reduce(x, (0, 1), "test sum")}
        results["gather"] = comm.all_gather(x, (0, 1), -1, "test gather")
        if rank == 0:
            comm.send(x, 1, "test send")
        else:
            results["recv"] = comm.recv((2, 3), torch.float32, 0, "test recv")
        results["bcast"] = comm.broadcast(x.clone(), 1, "test broadcast")
        try:
            comm.all_reduce(x, (0, 2), "no such group")
        except CollectiveError as e:
            results["bad group"] = str(e)
        results["stats"] = {op: (s.calls, s.bytes) for op, s in comm.stats().items()}
        # numpy, not tensors: torch's queue reducer shares a tensor's memory through this process, which exits
        out.put((rank, {k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in results.items()}))
        comm.close()
    except BaseException as e:
        out.put((rank, repr(e)))
    _leave(out)


def torchrun_rank(rank: int, port: int, engine_dir: str, out: Any) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), TRTBUILD_ORT_THREADS="1")  # fmt: skip
    from toolchain.engine.api import open_engine
    from toolchain.engine.contract import Batch

    try:
        engine = open_engine(Path(engine_dir))  # rank 1 never returns: it serves rank 0, then exits 0
        batch = Batch.from_sequences([[1, 2, 3, 4, 5], [9, 8]], [0, 0], [[0, 1], [2]], all_logits=True)
        logits = engine.forward(batch, engine.new_kv_cache(4))
        out.put((rank, logits, getattr(engine, "worker_pids", None)))
        engine.close()  # type: ignore[attr-defined]
    except SystemExit:
        raise
    except BaseException as e:
        out.put((rank, repr(e), None))
    _leave(out)
