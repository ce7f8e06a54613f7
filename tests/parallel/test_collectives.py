"""The collective ops' attributes (TensorRT-LLM's plugin fields, round trip through ONNX node attributes) and the
in-process communicators: sums, concatenation on an axis, the send / recv mailbox, and the timeout that names the
rank that never arrived."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from onnx import helper
from worlds import run_threads

from toolchain.engine import ops, ort_backend
from toolchain.engine.collectives import (
    ALL_GATHER_OP,
    ALL_REDUCE_OP,
    COLLECTIVE_OPS,
    RECV_OP,
    SEND_OP,
    AllGatherAttrs,
    AllReduceAttrs,
    CollectiveError,
    LocalComm,
    RecvAttrs,
    SendAttrs,
    ThreadComm,
    run_collective,
)
from toolchain.engine.contract import PLUGIN_DOMAIN


@pytest.mark.parametrize(
    ("op", "attrs"),
    [
        (ALL_REDUCE_OP, AllReduceAttrs(type_id=0, group=(0, 1), counter=5)),
        (ALL_GATHER_OP, AllGatherAttrs(type_id=7, group=(2, 3), axis=-1)),
        (SEND_OP, SendAttrs(type_id=1, tgt_rank=2)),
        (RECV_OP, RecvAttrs(type_id=0, src_rank=0)),
    ],
)
def test_attrs_round_trip_through_a_node(op: str, attrs: Any) -> None:
    node = helper.make_node(op, ["x"], ["y"], domain=PLUGIN_DOMAIN, **attrs.to_attributes(op))
    read = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert ops.OP_ATTRS[op].from_attributes(op, read) == attrs
    assert set(read) == ops.OP_FIELDS[op]


def test_all_reduce_carries_trtllm_fields() -> None:
    # allreducePlugin.cpp's creator fields, in order (the plugin's own `counter` included)
    fields = list(AllReduceAttrs(type_id=0, group=(0, 1)).to_attributes(ALL_REDUCE_OP))
    trtllm = ["group", "type_id", "strategy", "config", "fusion_op", "counter", "eps", "affine", "bias", "scale"]
    assert sorted(fields) == sorted(trtllm)


def test_collective_ops_are_registered_with_the_plugin_ops() -> None:
    assert set(ops.OP_ATTRS) >= COLLECTIVE_OPS and set(ops.OP_FIELDS) >= COLLECTIVE_OPS
    # no collective field is left out of graphs by OMITTED_AT (a global table keyed by field name)
    assert not set().union(*(ops.OP_FIELDS[op] for op in COLLECTIVE_OPS)) & set(ops.OMITTED_AT)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: AllReduceAttrs(type_id=0, group=(0, 0)), "distinct ranks"),
        (lambda: AllReduceAttrs(type_id=0, group=()), "distinct ranks"),
        (lambda: AllReduceAttrs(type_id=0, group=(0, 1), strategy=3), "only 0 \\(NCCL\\)"),
        (lambda: AllReduceAttrs(type_id=0, group=(0, 1), fusion_op=1), "no fusion"),
        (lambda: AllGatherAttrs(type_id=4, group=(0, 1)), "type_id 4"),
        (lambda: SendAttrs(type_id=0, tgt_rank=-1), "tgt_rank -1"),
    ],
)
def test_bad_attrs_are_refused(make: Callable[[], Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


def test_unknown_attribute_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown attributes \\['axis'\\]"):
        AllReduceAttrs.from_attributes(ALL_REDUCE_OP, {"type_id": 0, "group": [0, 1], "axis": 0})


def test_thread_comm_sums_and_gathers_in_group_order() -> None:
    def rank_fn(comm: ThreadComm) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = torch.full((2, 3), float(comm.rank + 1))
        tp_group = (0, 1) if comm.rank < 2 else (2, 3)  # two groups at once (TP=2 x PP=2)
        return (
            comm.all_reduce(x, tp_group, "layer 0 mlp.proj"),
            comm.all_gather(x[:, : 1 + comm.rank % 2], tp_group, -1, "lm_head"),
            comm.all_gather(x, (0, 1, 2, 3), 0, "rows"),
        )

    results = run_threads(rank_fn, 4)
    for rank, (summed, gathered, rows) in enumerate(results):
        pair = (1.0, 2.0) if rank < 2 else (3.0, 4.0)
        assert torch.equal(summed, torch.full((2, 3), pair[0] + pair[1]))
        widths = (1, 2)
        expected = torch.cat([torch.full((2, w), v) for w, v in zip(widths, pair, strict=True)], dim=-1)
        assert torch.equal(gathered, expected)
        assert torch.equal(rows[:, 0], torch.tensor([1.0, 1, 2, 2, 3, 3, 4, 4]))
    assert results[0][0] is not results[1][0]  # each rank owns its result (no shared buffer)


def test_thread_comm_repeated_calls_do_not_mix_rounds() -> None:
    def rank_fn(comm: ThreadComm) -> list[float]:
        return [float(comm.all_reduce(torch.tensor([i * 10.0 + comm.rank]), (0, 1), f"step {i}")) for i in range(20)]

    results = run_threads(rank_fn, 2)
    assert results[0] == results[1] == [i * 20.0 + 1 for i in range(20)]


def test_thread_comm_send_recv_and_broadcast() -> None:
    def rank_fn(comm: ThreadComm) -> tuple[torch.Tensor | None, torch.Tensor]:
        got = None
        if comm.rank == 0:
            comm.send(torch.arange(6.0).reshape(2, 3), 1, "stage 0 hidden_states")
        else:
            got = comm.recv((2, 3), torch.float32, 0, "stage 0 hidden_states")
        header = torch.tensor([7, 8]) if comm.rank == 0 else torch.zeros(2, dtype=torch.int64)
        return got, comm.broadcast(header, 0, "step header")

    (none, b0), (got, b1) = run_threads(rank_fn, 2)
    assert none is None and got is not None and torch.equal(got, torch.arange(6.0).reshape(2, 3))
    assert torch.equal(b0, torch.tensor([7, 8])) and torch.equal(b1, torch.tensor([7, 8]))


def test_recv_of_the_wrong_shape_names_both() -> None:
    def rank_fn(comm: ThreadComm) -> None:
        if comm.rank == 0:
            comm.send(torch.zeros(2, 4), 1, "hidden")
        else:
            comm.recv((2, 3), torch.float32, 0, "hidden")

    with pytest.raises(CollectiveError, match=r"rank 1: Recv hidden .*rank 0 sent \(2, 4\)"):
        run_threads(rank_fn, 2)


def test_a_rank_that_never_arrives_is_named() -> None:
    def rank_fn(comm: ThreadComm) -> torch.Tensor:
        return comm.all_reduce(torch.ones(2), (0, 1), "layer 3 mlp.proj")

    with pytest.raises(CollectiveError) as info:
        run_threads(rank_fn, 2, timeout_s=0.2, ranks=(0,))
    e = info.value
    assert (e.rank, e.op, e.what, e.group, e.timeout_s) == (0, ALL_REDUCE_OP, "layer 3 mlp.proj", (0, 1), 0.2)
    assert str(e) == "rank 0: AllReduce layer 3 mlp.proj on group [0, 1] failed (timeout 0.2 s): rank [1] never arrived"


def test_a_recv_that_never_comes_times_out() -> None:
    def rank_fn(comm: ThreadComm) -> torch.Tensor:
        return comm.recv((1,), torch.float32, 0, "stage 0 hidden_states")

    with pytest.raises(CollectiveError, match=r"rank 1: Recv stage 0 hidden_states .*rank 0 never sent"):
        run_threads(rank_fn, 2, timeout_s=0.2, ranks=(1,))


def test_stats_count_calls_and_bytes() -> None:
    def rank_fn(comm: ThreadComm) -> tuple[int, int]:
        for _ in range(3):
            comm.all_reduce(torch.ones(4), (0, 1), "x")
        s = comm.stats()[ALL_REDUCE_OP]
        return s.calls, s.bytes

    assert run_threads(rank_fn, 2) == [(3, 48), (3, 48)]


def test_local_comm_is_the_identity_and_refuses_peers() -> None:
    comm, x = LocalComm(), torch.ones(3)
    assert comm.all_reduce(x, (0,), "a") is x and comm.all_gather(x, (0,), -1, "b") is x
    with pytest.raises(CollectiveError, match="only group \\[0\\]"):
        comm.all_reduce(x, (0, 1), "a")
    with pytest.raises(CollectiveError, match="no peer"):
        comm.send(x, 1, "hidden")


def test_run_collective_dispatches_each_node() -> None:
    """What the CPU engine does at a collective node (OrtEngine._forward): the node's attributes pick the call."""

    def rank_fn(comm: ThreadComm) -> list[torch.Tensor]:
        x = torch.full((2, 2), float(comm.rank + 1))
        out = [
            run_collective(comm, ALL_REDUCE_OP, AllReduceAttrs(type_id=0, group=(0, 1)), x, "dense"),
            run_collective(comm, ALL_GATHER_OP, AllGatherAttrs(type_id=0, group=(0, 1), axis=0), x, "lm_head"),
        ]
        if comm.rank == 0:
            out.append(run_collective(comm, SEND_OP, SendAttrs(type_id=0, tgt_rank=1), x, "hidden"))
        else:
            like = torch.empty(2, 2)
            out.append(run_collective(comm, RECV_OP, RecvAttrs(type_id=0, src_rank=0), like, "hidden"))
        return out

    for summed, gathered, passed in run_threads(rank_fn, 2):
        assert torch.equal(summed, torch.full((2, 2), 3.0))
        assert torch.equal(gathered[:, 0], torch.tensor([1.0, 1.0, 2.0, 2.0]))
        assert torch.equal(passed, torch.ones(2, 2))  # Send passes its input on; Recv gives rank 0's


def test_the_cpu_engine_cuts_the_graph_at_collectives() -> None:
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["y"]),
        helper.make_node(ALL_REDUCE_OP, ["y"], ["z"], domain=PLUGIN_DOMAIN, group=[0, 1], type_id=0),
        helper.make_node("Relu", ["z"], ["out"]),
    ]
    graph = helper.make_graph(nodes, "g", [], [])
    parts = ort_backend._split(helper.make_model(graph))
    assert [([n.op_type for n in run], None if p is None else p.op_type) for run, p in parts] == [
        (["MatMul"], ALL_REDUCE_OP),
        (["Relu"], None),
    ]
