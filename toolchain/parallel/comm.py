"""`GlooComm`: the `Communicator` of one rank process, over torch.distributed (gloo on CPU).

The process group must exist already (launch.py starts it, from a TCPStore rank 0 made or from torchrun's env).
`GlooComm` then makes every group the mapping can ask for, once, on every rank in the same order (torch.distributed's
`new_group` is itself a collective: every rank must call it for every group, members or not), plus a dedicated
group for rank 0's step broadcasts so they never interleave with the graph's collectives.

Every op is timed and counted (`stats()`: calls, bytes of its input, seconds; bench/parallel.py reads them) and
wrapped: gloo's own errors ("Timed out waiting 30000ms for recv operation", "Connection closed by peer") name
neither the op nor the rank, so a failure is re-raised as the frame's `CollectiveError` naming this rank, the op,
what it was for (the graph node's name), the group, how long it waited, the peers it waited for, and gloo's text.

The timeout of every op is $TRTBUILD_COLLECTIVE_TIMEOUT seconds (default 30), read once by `collective_timeout`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from toolchain.engine.collectives import (
    ALL_GATHER_OP,
    ALL_REDUCE_OP,
    DEFAULT_TIMEOUT_S,
    RECV_OP,
    SEND_OP,
    CollectiveError,
    OpStats,
)
from toolchain.errors import UserError
from toolchain.parallel.mapping import RankMapping

TIMEOUT_ENV = "TRTBUILD_COLLECTIVE_TIMEOUT"
BROADCAST_OP = "Broadcast"
# joining the world and opening every rank's graph: minutes for a large model on a busy machine (the process
# group's own timeout covers its rendezvous; each group made afterwards gets the collective timeout)
START_TIMEOUT_S = 600.0
# test-only: "RANK:OP:SECONDS" makes rank RANK sleep SECONDS before each OP (a rank hung inside a collective)
STALL_ENV = "TRTBUILD_TEST_STALL_COLLECTIVE"

_T = TypeVar("_T")


def collective_timeout() -> float:
    """$TRTBUILD_COLLECTIVE_TIMEOUT in seconds (default 30): how long any collective waits for its peers."""
    value = os.environ.get(TIMEOUT_ENV, "").strip()
    if not value:
        return DEFAULT_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0.1 <= seconds <= 86400:  # also refuses nan and inf
        raise UserError(
            f"{TIMEOUT_ENV}={value!r}: expected seconds from 0.1 to 86400 (how long a collective waits for the "
            f"other ranks; default {DEFAULT_TIMEOUT_S:g}), or unset it"
        )
    return seconds


def mapping_groups(rank: RankMapping) -> list[tuple[int, ...]]:
    """Every group of two or more ranks any rank of this mapping runs a collective on, in one fixed order: the
    world, then tp, pp, moe-tp and moe-ep groups (sorted, no repeats)."""
    groups: set[tuple[int, ...]] = {tuple(range(rank.world_size))}
    for r in rank.ranks():
        groups.update((r.tp_group, r.pp_group, r.moe_tp_group, r.moe_ep_group))
    return sorted((g for g in groups if len(g) > 1), key=lambda g: (len(g), g))


def _stall(rank: int, op: str) -> float:
    value = os.environ.get(STALL_ENV, "")
    if not value:
        return 0.0
    who, what, seconds = value.split(":")
    return float(seconds) if int(who) == rank and what == op else 0.0


class GlooComm:
    """One rank's communicator over the default torch.distributed process group (already initialised)."""

    def __init__(self, groups: Iterable[tuple[int, ...]], timeout_s: float | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("GlooComm needs torch.distributed's process group (launch.py starts it)")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.timeout_s = collective_timeout() if timeout_s is None else timeout_s
        self.backend = str(dist.get_backend())
        timeout = timedelta(seconds=self.timeout_s)
        self._groups: dict[tuple[int, ...], Any] = {}
        for g in groups:  # the same order on every rank: new_group is collective over the whole world
            g = tuple(g)
            if g not in self._groups and len(g) > 1:
                self._groups[g] = dist.new_group(list(g), timeout=timeout)
        world = list(range(self.world_size))
        self._control = dist.new_group(world, timeout=timeout)
        self._p2p = dist.new_group(world, timeout=timeout)  # send / recv: the default group has the start timeout
        self._stats: dict[str, OpStats] = {}
        self._closed = False

    def _group(self, op: str, group: tuple[int, ...], what: str) -> None:
        """Refuse a group this rank cannot run `op` on (the process group objects stay in self._groups: a local
        reference in a traceback would keep the store alive past close)."""
        group = tuple(group)
        if self.rank not in group:
            raise CollectiveError(self.rank, op, what, group, self.timeout_s, "this rank is not in the group")
        if group not in self._groups:
            raise CollectiveError(
                self.rank, op, what, group, self.timeout_s,
                f"no such group in this engine's mapping (groups: {[list(g) for g in self._groups]})",
            )  # fmt: skip

    def _run(self, op: str, what: str, group: tuple[int, ...], nbytes: int, fn: Callable[[], _T]) -> _T:
        start = time.perf_counter()
        if self._closed:
            raise CollectiveError(self.rank, op, what, group, self.timeout_s, "the communicator is closed")
        stall = _stall(self.rank, op)
        if stall:
            time.sleep(stall)
        failure: str | None = None
        try:
            out = fn()
        except (RuntimeError, ValueError) as e:  # gloo's errors are RuntimeError (DistBackendError included)
            failure = " ".join(str(e).split())[:300]
        if failure is not None:  # raised here, not in the except: gloo's exception (and the group objects its
            # frames hold, which keep rank 0's TCPStore and its port alive) is not chained to ours
            elapsed = time.perf_counter() - start
            peers = [r for r in group if r != self.rank]
            raise CollectiveError(
                self.rank, op, what, group, self.timeout_s,
                f"after {elapsed:.1f} s waiting for rank {', '.join(map(str, peers))} ({self.backend}: {failure})",
            )  # fmt: skip
        s = self._stats.setdefault(op, OpStats())
        s.calls += 1
        s.bytes += nbytes
        s.seconds += time.perf_counter() - start
        return out

    def all_reduce(self, x: torch.Tensor, group: tuple[int, ...], what: str) -> torch.Tensor:
        group = tuple(group)
        self._group(ALL_REDUCE_OP, group, what)
        out = x.clone(memory_format=torch.contiguous_format)  # x may be a read-only view of ONNX Runtime's output

        def reduce() -> torch.Tensor:
            dist.all_reduce(out, group=self._groups[group])
            return out

        return self._run(ALL_REDUCE_OP, what, group, _nbytes(x), reduce)

    def all_gather(self, x: torch.Tensor, group: tuple[int, ...], axis: int, what: str) -> torch.Tensor:
        group = tuple(group)
        self._group(ALL_GATHER_OP, group, what)
        mine = x.contiguous()
        parts = [torch.empty_like(mine) for _ in group]

        def gather() -> torch.Tensor:
            dist.all_gather(parts, mine, group=self._groups[group])
            return torch.cat(parts, dim=axis)

        return self._run(ALL_GATHER_OP, what, group, _nbytes(x), gather)

    def send(self, x: torch.Tensor, dst: int, what: str) -> None:
        self._peer(SEND_OP, dst, what)
        mine = x.contiguous()
        self._run(SEND_OP, what, (self.rank, dst), _nbytes(x), lambda: dist.send(mine, dst, group=self._p2p))

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int, what: str) -> torch.Tensor:
        self._peer(RECV_OP, src, what)
        out = torch.empty(shape, dtype=dtype)

        def receive() -> torch.Tensor:
            dist.recv(out, src, group=self._p2p)
            return out

        return self._run(RECV_OP, what, (src, self.rank), _nbytes(out), receive)

    def _peer(self, op: str, peer: int, what: str) -> None:
        if not 0 <= peer < self.world_size or peer == self.rank:
            raise CollectiveError(
                self.rank, op, what, (self.rank, peer), self.timeout_s,
                f"rank {peer} is no peer of rank {self.rank} in a world of {self.world_size}",
            )  # fmt: skip

    def broadcast(self, x: torch.Tensor, src: int, what: str) -> torch.Tensor:
        """src's x on every rank, over the step group (rank 0's step messages, nothing else)."""
        world = tuple(range(self.world_size))
        buf = x if x.is_contiguous() else x.contiguous()

        def bcast() -> torch.Tensor:
            dist.broadcast(buf, src, group=self._control)
            return buf

        return self._run(BROADCAST_OP, what, world, _nbytes(x), bcast)

    def stats(self) -> dict[str, OpStats]:
        return self._stats

    def close(self) -> None:
        """Tear the process group down (every group with it); later ops raise CollectiveError."""
        if self._closed:
            return
        self._closed = True
        if dist.is_initialized():
            dist.destroy_process_group()
        # the groups hold the store (rank 0's TCPStore server, its port) until the last reference goes
        self._groups.clear()
        self._control = self._p2p = None


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()
