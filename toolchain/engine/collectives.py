"""The collective plugin ops of multi-rank engines (issue 27) and the communicators that run them.

Four ops (domain `trtbuild`), named and with fields as TensorRT-LLM's NCCL plugins
(cpp/tensorrt_llm/plugins/ncclPlugin/{allreducePlugin,allgatherPlugin,sendPlugin,recvPlugin}.cpp):

AllReduce   inputs x; outputs the sum of x over the ranks of `group` (every rank gets the same tensor, summed in
            group order). Fields group, type_id, strategy, config, fusion_op, counter, eps, affine, bias, scale;
            only strategy 0 (NCCL) and fusion_op 0 (NONE) are meant: torch.distributed has no other strategy, and
            fusing the residual + RMSNorm is a later optimisation. `counter` numbers a graph's all-reduces.
AllGather   inputs x; outputs the ranks' x concatenated on `axis` in group order. Fields group, type_id, and our
            own `axis` (TensorRT-LLM gathers on dim 0 and reshuffles; gathering on the last axis saves that).
Send        inputs x; outputs x unchanged (as TensorRT-LLM's: an output keeps the node in the graph), after sending
            it to tgt_rank. Fields tgt_rank, type_id.
Recv        inputs like (a tensor of the received tensor's shape; its values are not read); outputs the tensor of
            that shape and of dtype type_id sent by src_rank. Fields src_rank, type_id.

`type_id` is TensorRT's nvinfer1::DataType (TYPE_IDS). A `Communicator` runs them: `LocalComm` for one rank,
`ThreadComm` for ranks as threads of one process (fast tests), `GlooComm` (toolchain/parallel/comm.py) over
torch.distributed.
Every failure is a `CollectiveError` naming the rank, the op, what the op was for, the group and the timeout.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Protocol, TypeVar

import torch

from toolchain.errors import UserError

ALL_REDUCE_OP = "AllReduce"
ALL_GATHER_OP = "AllGather"
SEND_OP = "Send"
RECV_OP = "Recv"
COLLECTIVE_OPS = frozenset({ALL_REDUCE_OP, ALL_GATHER_OP, SEND_OP, RECV_OP})
# nvinfer1::DataType (TensorRT's NvInferRuntimeBase.h): kFLOAT 0, kHALF 1, kBF16 7, the dtypes engines compute in
TYPE_IDS: dict[str, int] = {"float32": 0, "float16": 1, "bfloat16": 7}
TORCH_DTYPES: dict[int, torch.dtype] = {0: torch.float32, 1: torch.float16, 7: torch.bfloat16}
DEFAULT_TIMEOUT_S = 30.0

_A = TypeVar("_A", bound="CollectiveAttrs")


def _check_rank(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} {value!r}: expected a rank (an int >= 0)")


@dataclass(frozen=True)
class CollectiveAttrs:
    """Every field is a node attribute (nothing was pinned before these ops existed: no OMITTED_AT)."""

    type_id: int

    def __post_init__(self) -> None:
        if self.type_id not in TORCH_DTYPES:
            raise ValueError(f"type_id {self.type_id!r}: expected one of {sorted(TORCH_DTYPES)} ({TYPE_IDS})")

    def to_attributes(self, op: str) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_attributes(cls: type[_A], op: str, attrs: dict[str, Any]) -> _A:
        unknown = set(attrs) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"{op}: unknown attributes {sorted(unknown)}")
        values: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in attrs.items()}
        return cls(**values)


@dataclass(frozen=True)
class _GroupAttrs(CollectiveAttrs):
    group: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        for r in self.group:
            _check_rank("group rank", r)
        if not self.group or len(set(self.group)) != len(self.group):
            raise ValueError(f"group {list(self.group)}: expected distinct ranks, at least one")


@dataclass(frozen=True)
class AllReduceAttrs(_GroupAttrs):
    strategy: int = 0
    config: int = 0
    fusion_op: int = 0
    counter: int = 0
    eps: float = 0.0
    affine: int = 0
    bias: int = 0
    scale: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.strategy != 0:
            raise ValueError(f"AllReduce strategy {self.strategy}: only 0 (NCCL) is supported")
        if (self.fusion_op, self.affine, self.bias, self.scale) != (0, 0, 0, 0):
            raise ValueError("AllReduce fusion_op / affine / bias / scale: only 0 (no fusion) is supported")


@dataclass(frozen=True)
class AllGatherAttrs(_GroupAttrs):
    axis: int = -1


@dataclass(frozen=True)
class SendAttrs(CollectiveAttrs):
    tgt_rank: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_rank("tgt_rank", self.tgt_rank)


@dataclass(frozen=True)
class RecvAttrs(CollectiveAttrs):
    src_rank: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_rank("src_rank", self.src_rank)


COLLECTIVE_ATTRS: dict[str, type[CollectiveAttrs]] = {
    ALL_REDUCE_OP: AllReduceAttrs,
    ALL_GATHER_OP: AllGatherAttrs,
    SEND_OP: SendAttrs,
    RECV_OP: RecvAttrs,
}
COLLECTIVE_FIELDS: dict[str, set[str]] = {op: {f.name for f in fields(c)} for op, c in COLLECTIVE_ATTRS.items()}


class CollectiveError(UserError):
    """A collective that failed or timed out, naming where: which rank saw it, which op, what for, which group."""

    def __init__(self, rank: int, op: str, what: str, group: tuple[int, ...], timeout_s: float, detail: str) -> None:
        self.rank, self.op, self.what, self.group, self.timeout_s = rank, op, what, group, timeout_s
        super().__init__(f"rank {rank}: {op} {what} on group {list(group)} failed (timeout {timeout_s:g} s): {detail}")


@dataclass
class OpStats:
    """What one op moved on one rank: calls, bytes of its input tensors, seconds spent in it (bench/parallel.py)."""

    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0


class Communicator(Protocol):
    """Runs the collective ops for one rank. `what` says what the op is for ("layer 3 mlp.proj"), for errors.
    Every call blocks until its peers take part or the timeout passes (then CollectiveError)."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def all_reduce(self, x: torch.Tensor, group: tuple[int, ...], what: str) -> torch.Tensor: ...

    def all_gather(self, x: torch.Tensor, group: tuple[int, ...], axis: int, what: str) -> torch.Tensor: ...

    def send(self, x: torch.Tensor, dst: int, what: str) -> None: ...

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int, what: str) -> torch.Tensor: ...

    def broadcast(self, x: torch.Tensor, src: int, what: str) -> torch.Tensor:
        """src's x on every rank of the world (x: the buffer of the right shape and dtype on the others); rank 0
        broadcasts each step's header then its payload this way (parallel/worker.py)."""
        ...

    def stats(self) -> dict[str, OpStats]: ...

    def close(self) -> None: ...


class LocalComm:
    """The communicator of a one-rank world: every group is (0,), collectives are the identity."""

    rank = 0
    world_size = 1

    def __init__(self) -> None:
        self._stats: dict[str, OpStats] = {}

    def _only(self, op: str, group: tuple[int, ...], what: str) -> None:
        if tuple(group) != (0,):
            raise CollectiveError(0, op, what, tuple(group), 0.0, "a one-rank world has only group [0]")

    def all_reduce(self, x: torch.Tensor, group: tuple[int, ...], what: str) -> torch.Tensor:
        self._only(ALL_REDUCE_OP, group, what)
        return x

    def all_gather(self, x: torch.Tensor, group: tuple[int, ...], axis: int, what: str) -> torch.Tensor:
        self._only(ALL_GATHER_OP, group, what)
        return x

    def send(self, x: torch.Tensor, dst: int, what: str) -> None:
        raise CollectiveError(0, SEND_OP, what, (0, dst), 0.0, "a one-rank world has no peer to send to")

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int, what: str) -> torch.Tensor:
        raise CollectiveError(0, RECV_OP, what, (src, 0), 0.0, "a one-rank world has no peer to receive from")

    def broadcast(self, x: torch.Tensor, src: int, what: str) -> torch.Tensor:
        self._only("Broadcast", (src,), what)
        return x

    def stats(self) -> dict[str, OpStats]:
        return self._stats

    def close(self) -> None:
        pass


@dataclass
class _Group:
    barrier: threading.Barrier
    slots: dict[int, tuple[int, torch.Tensor]] = field(default_factory=dict)  # rank -> (its call number, tensor)
    calls: dict[int, int] = field(default_factory=dict)


class ThreadWorld:
    """The shared state of `world_size` ranks run as threads of one process: per group a barrier and one slot per
    rank, per (src, dst) a mailbox. Make one, then `comm(r)` for each rank's thread."""

    def __init__(self, world_size: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.world_size, self.timeout_s = world_size, timeout_s
        self._lock = threading.Lock()
        self._groups: dict[tuple[int, ...], _Group] = {}
        self._mail: dict[tuple[int, int], queue.Queue[torch.Tensor]] = {}

    def comm(self, rank: int) -> ThreadComm:
        return ThreadComm(self, rank)

    def group(self, ranks: tuple[int, ...]) -> _Group:
        with self._lock:
            if ranks not in self._groups:
                self._groups[ranks] = _Group(threading.Barrier(len(ranks)))
            return self._groups[ranks]

    def mailbox(self, src: int, dst: int) -> queue.Queue[torch.Tensor]:
        with self._lock:
            return self._mail.setdefault((src, dst), queue.Queue())


class ThreadComm:
    """One rank of a ThreadWorld. Collectives deposit the rank's tensor, wait for the group at the barrier, combine
    every slot in group order, and wait again so no slot is overwritten while read."""

    def __init__(self, world: ThreadWorld, rank: int) -> None:
        if not 0 <= rank < world.world_size:
            raise ValueError(f"rank {rank}: expected 0 .. {world.world_size - 1}")
        self.world, self.rank, self.world_size = world, rank, world.world_size
        self._stats: dict[str, OpStats] = {}

    def _collective(self, op: str, x: torch.Tensor, group: tuple[int, ...], what: str) -> list[torch.Tensor]:
        group = tuple(group)
        if self.rank not in group or any(not 0 <= r < self.world_size for r in group):
            raise CollectiveError(
                self.rank, op, what, group, self.world.timeout_s, f"not a group of this rank in world {self.world_size}"
            )
        start = time.perf_counter()
        g = self.world.group(group)
        call = g.calls.get(self.rank, 0) + 1
        g.calls[self.rank] = call
        g.slots[self.rank] = (call, x)
        try:
            g.barrier.wait(self.world.timeout_s)
            out = [g.slots[r][1] for r in group]
            g.barrier.wait(self.world.timeout_s)
        except threading.BrokenBarrierError:
            missing = [r for r in group if g.calls.get(r, 0) < call]
            detail = f"rank {missing} never arrived" if missing else "a peer failed"
            raise CollectiveError(self.rank, op, what, group, self.world.timeout_s, detail) from None
        self._count(op, x, start)
        return out

    def _count(self, op: str, x: torch.Tensor, start: float) -> None:
        s = self._stats.setdefault(op, OpStats())
        s.calls += 1
        s.bytes += x.numel() * x.element_size()
        s.seconds += time.perf_counter() - start

    def all_reduce(self, x: torch.Tensor, group: tuple[int, ...], what: str) -> torch.Tensor:
        parts = self._collective(ALL_REDUCE_OP, x, group, what)
        total = parts[0].clone()
        for p in parts[1:]:
            total += p
        return total

    def all_gather(self, x: torch.Tensor, group: tuple[int, ...], axis: int, what: str) -> torch.Tensor:
        return torch.cat(self._collective(ALL_GATHER_OP, x, group, what), dim=axis)

    def broadcast(self, x: torch.Tensor, src: int, what: str) -> torch.Tensor:
        world = tuple(range(self.world_size))
        return self._collective("Broadcast", x, world, what)[src].clone()

    def send(self, x: torch.Tensor, dst: int, what: str) -> None:
        if not 0 <= dst < self.world_size or dst == self.rank:
            raise CollectiveError(self.rank, SEND_OP, what, (self.rank, dst), self.world.timeout_s, "no such peer")
        start = time.perf_counter()
        self.world.mailbox(self.rank, dst).put(x.clone())
        self._count(SEND_OP, x, start)

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int, what: str) -> torch.Tensor:
        try:
            x = self.world.mailbox(src, self.rank).get(timeout=self.world.timeout_s)
        except queue.Empty:
            raise CollectiveError(
                self.rank, RECV_OP, what, (src, self.rank), self.world.timeout_s, f"rank {src} never sent"
            ) from None
        if tuple(x.shape) != tuple(shape) or x.dtype != dtype:
            raise CollectiveError(
                self.rank, RECV_OP, what, (src, self.rank), self.world.timeout_s,
                f"rank {src} sent {tuple(x.shape)} {x.dtype}, expected {tuple(shape)} {dtype}",
            )  # fmt: skip
        return x

    def stats(self) -> dict[str, OpStats]:
        return self._stats

    def close(self) -> None:
        pass


def run_collective(comm: Communicator, op: str, attrs: CollectiveAttrs, x: torch.Tensor, what: str) -> torch.Tensor:
    """One collective node on this rank: its attributes, its one input, `what` for errors (the CPU engine's step)."""
    if isinstance(attrs, AllReduceAttrs):
        return comm.all_reduce(x, attrs.group, what)
    if isinstance(attrs, AllGatherAttrs):
        return comm.all_gather(x, attrs.group, attrs.axis, what)
    if isinstance(attrs, SendAttrs):
        comm.send(x, attrs.tgt_rank, what)
        return x
    if isinstance(attrs, RecvAttrs):
        return comm.recv(tuple(x.shape), TORCH_DTYPES[attrs.type_id], attrs.src_rank, what)
    raise ValueError(f"{op}: not a collective op ({sorted(COLLECTIVE_OPS)})")
