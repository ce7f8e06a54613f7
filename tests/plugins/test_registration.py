"""TensorRT's registration of the Triton kernels (toolchain/plugins/tensorrt_registration.py) against the
`tensorrt.plugin` ahead-of-time contract, without TensorRT: a stand-in module (trt_contract.py) records the
decorated functions; the shape, type and launch answers are checked here, and aot_impl's on real PTX compiled in a
subprocess (TRITON_INTERPRET, which pytest sets, cannot compile)."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import os
import re
import struct
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import trt_contract

from toolchain.engine import moe_split
from toolchain.engine.collectives import (
    COLLECTIVE_FIELDS,
    COLLECTIVE_OPS,
    AllGatherAttrs,
    AllReduceAttrs,
    RecvAttrs,
    SendAttrs,
)
from toolchain.engine.export import KV_ONNX
from toolchain.engine.ops import OP_FIELDS, AttentionAttrs
from toolchain.plugins import launch
from toolchain.plugins.kernels import KERNEL_FUNCTIONS, KERNELS, common

ROOT = Path(__file__).resolve().parents[2]
REG = "toolchain.plugins.tensorrt_registration"
OPS = ("KVCacheWrite", "PagedAttention")
PLUGINS = (*OPS, "PagedAttentionSinks")  # attention with sinks (a seventh input) is a plugin of its own
SINKS = "trtbuild::PagedAttentionSinks"

# (activation, attrs): fp16 and bf16; every pool; GQA 4, MHA and MQA; head sizes 64, 24, 128, 40 (24, 40: not powers
# of two); 16, 32, 64 tokens per block; gpt-oss's attention sinks with its 128-token window
CASES: list[tuple[str, dict[str, Any]]] = [
    ("float16", dict(layer=1, num_heads=8, num_kv_heads=2, head_size=64, tokens_per_block=16,
                     kv_cache_dtype="float16")),
    ("bfloat16", dict(layer=0, num_heads=4, num_kv_heads=4, head_size=24, tokens_per_block=32, kv_cache_dtype="int8",
                      kv_scale=0.0125)),
    ("float16", dict(layer=3, num_heads=8, num_kv_heads=1, head_size=128, tokens_per_block=64, kv_cache_dtype="fp8",
                     kv_scale=0.375, sliding_window=32)),
    ("bfloat16", dict(layer=2, num_heads=6, num_kv_heads=2, head_size=40, tokens_per_block=16,
                      kv_cache_dtype="bfloat16", rotary_scaling_type="llama3", rotary_scaling_factor=8.0)),
    ("bfloat16", dict(layer=1, num_heads=16, num_kv_heads=2, head_size=64, tokens_per_block=32, kv_cache_dtype="fp8",
                      kv_scale=0.25, sliding_window=128, sinks=1)),
]  # fmt: skip


@pytest.fixture
def registered() -> Iterator[tuple[Any, dict[str, Any], Any]]:
    """(tensorrt stand-in, its registry, the registration module imported against it); sys.modules restored."""
    with trt_contract.registered(REG) as found:
        yield found


def _first_width(op: str, a: AttentionAttrs) -> int:
    return (a.num_heads + 2 * a.num_kv_heads) * a.head_size if op == "KVCacheWrite" else a.num_heads * a.head_size


def _inputs(op: str, activation: str, a: AttentionAttrs) -> list[Any]:
    sink_heads = a.num_heads if op == "PagedAttention" and a.sinks else 0
    return trt_contract.input_descs(op, activation, a.kv_cache_dtype, _first_width(op, a), sink_heads)


def _fields(op: str, a: AttentionAttrs) -> dict[str, Any]:
    return {k: v for k, v in asdict(a).items() if k in OP_FIELDS[op]}


@pytest.mark.parametrize(("activation", "attrs"), CASES)
def test_output_shapes_and_types(registered: Any, activation: str, attrs: dict[str, Any]) -> None:
    _, registry, _ = registered
    a = AttentionAttrs(**attrs)
    for op in OPS:
        inputs = _inputs(op, activation, a)
        out = registry["register"][trt_contract.plugin_id(op, a)](*inputs, **_fields(op, a))
        assert out.dtype == inputs[0].dtype, op
        assert len(out.shape_expr) == 2, op
        assert out.shape_expr[0].text == inputs[0].shape_expr[0].text  # num_tokens, symbolic
        assert out.shape_expr[1] == launch.output_width(a) == a.num_heads * a.head_size
        assert out.get_aliased() is None  # the pool's in-place write is not declared (docs/kernels.md)


def test_functions_follow_the_documented_schemas(registered: Any) -> None:
    """aot_impl: (inputs, attributes, outputs, tactic); autotune: (inputs, outputs); register: (inputs, attributes),
    the attributes exactly the op's fields (OP_FIELDS), inputs annotated TensorDesc: six, seven with sinks."""
    _, registry, _ = registered
    moe = {f"trtbuild::{p}" for p in moe_split.SPLIT_OPS}  # tests/plugins/test_registration_moe.py
    collective = {f"trtbuild::{op}" for op in COLLECTIVE_OPS}  # test_collectives_* below
    assert set(registry["register"]) == {f"trtbuild::{p}" for p in PLUGINS} | moe | collective
    for plugin in PLUGINS:
        pid, op = f"trtbuild::{plugin}", plugin.removesuffix("Sinks")
        reg = list(inspect.signature(registry["register"][pid]).parameters.values())
        inputs = [p.name for p in reg if "TensorDesc" in str(p.annotation)]
        attrs = [p.name for p in reg if "TensorDesc" not in str(p.annotation)]
        assert len(inputs) == 6 + (op != plugin) and set(attrs) == OP_FIELDS[op], op
        aot = list(inspect.signature(registry["aot_impl"][pid]).parameters)
        assert aot == [*inputs, *attrs, "outputs", "tactic"], op
        assert list(inspect.signature(registry["autotune"][pid]).parameters) == [*inputs, "outputs"], op


def test_autotune_types_are_the_graph_types(registered: Any) -> None:
    """Every (activation, pool) the kernels serve, typed as the exported graph types them: an int8 pool INT8, an
    fp8 pool FLOAT8E4M3FN, which TensorRT's ONNX parser reads as DataType.FP8; the float pool the activations'."""
    trt, registry, reg = registered
    onnx_to_trt = {"INT8": trt.DataType.INT8, "FLOAT8E4M3FN": trt.DataType.FP8}
    from onnx import TensorProto

    for kv, onnx_type in KV_ONNX.items():
        trt_type = trt_contract.str_to_data_type(reg.TRT_TYPE_NAMES[kv])
        assert trt_type == onnx_to_trt[TensorProto.DataType.Name(onnx_type)], kv
    for plugin in PLUGINS:
        sinks = plugin.endswith("Sinks")
        combos = registry["autotune"][f"trtbuild::{plugin}"](*([None] * (6 + sinks)), outputs=(None,))
        got = {(c.types[0], c.types[5]) for c in combos}
        want = set()
        for act in common.ACTIVATIONS:
            for pool in (act, "int8", "fp8"):
                common.check_types(pool, 64, act)  # served by a kernel
                want.add((trt_contract.str_to_data_type(reg.TRT_TYPE_NAMES[act]),
                          trt_contract.str_to_data_type(reg.TRT_TYPE_NAMES[pool])))  # fmt: skip
        assert got == want and len(combos) == len(want)
        for c in combos:
            assert len(c.types) == 7 + sinks and c.types[1:5] == [trt.DataType.INT32] * 4 and c.types[-1] == c.types[0]
            assert c.types[6:-1] == [trt.DataType.FLOAT] * sinks  # the sink logits: FP32 (export.py writes float32)
            assert c.layouts == ["LINEAR"]


def test_aot_impl_refuses_a_pool_of_another_type(registered: Any) -> None:
    trt, registry, _ = registered
    a = AttentionAttrs(**CASES[1][1])  # int8 pool, bf16
    inputs = _inputs("PagedAttention", "bfloat16", a)
    inputs[5] = trt_contract.TensorDesc(list(inputs[5].shape_expr), trt.DataType.FP8)
    out = registry["register"]["trtbuild::PagedAttention"](*inputs, **_fields("PagedAttention", a))
    with pytest.raises(ValueError, match=r"kv_cache_dtype=.int8. needs INT8"):
        registry["aot_impl"]["trtbuild::PagedAttention"](*inputs, **_fields("PagedAttention", a), outputs=(out,),
                                                         tactic=0)  # fmt: skip


def test_aot_impl_takes_sinks_only_through_the_sinks_plugin(registered: Any) -> None:
    """sinks=1 reaching the six-input plugin (a graph TensorRT parsed without complete_plugin_fields), sinks=0 on
    the seven-input one, and sink logits of another type than FP32 are refused, naming the plugin and the fix."""
    trt, registry, _ = registered
    a = AttentionAttrs(**CASES[4][1])
    assert a.sinks == 1
    fields = _fields("PagedAttention", a)
    with_sinks = _inputs("PagedAttention", "bfloat16", a)
    plain, sinks_plugin = registry["aot_impl"]["trtbuild::PagedAttention"], registry["aot_impl"][SINKS]
    out = registry["register"][SINKS](*with_sinks, **fields)
    with pytest.raises(ValueError, match=r"trtbuild::PagedAttention with sinks=1: .*complete_plugin_fields"):
        plain(*with_sinks[:6], **fields, outputs=(out,), tactic=0)
    with pytest.raises(ValueError, match=r"trtbuild::PagedAttentionSinks with sinks=0: attention with sinks is"):
        sinks_plugin(*with_sinks, **{**fields, "sinks": 0}, outputs=(out,), tactic=0)
    half = [*with_sinks[:6], trt_contract.TensorDesc([a.num_heads], trt.DataType.HALF)]
    with pytest.raises(ValueError, match=r"sinks input of type DataType.HALF with 1 dims; expected FP32 \[num_heads\]"):
        sinks_plugin(*half, **fields, outputs=(out,), tactic=0)


def test_attrs_of_takes_the_op_fields_and_defaults_the_rest(registered: Any) -> None:
    _, _, reg = registered
    a = AttentionAttrs(**CASES[2][1])
    for op in OPS:
        got = reg.attrs_of(op, {**_fields(op, a), "outputs": (), "tactic": 0, "qkv": None})
        for name in OP_FIELDS[op]:
            assert getattr(got, name) == getattr(a, name), (op, name)


@pytest.mark.parametrize("op", OPS)
def test_launch_reads_the_kernel_modules(op: str) -> None:
    """launch.py describes what the entry points launch: kernel = the jit function, threads = 32 * NUM_WARPS, the
    module's grid and scalars over the same batch dims the entry points take from their tensors."""
    m = KERNELS[op]
    a = AttentionAttrs(**CASES[0][1])
    first = torch.empty(5, _first_width(op, a))
    dims = launch.batch_dims(first.shape, torch.empty(3).shape, torch.empty(3, 7).shape, torch.empty(2, 11).shape)
    assert dims == (5, 3, 7, 11)
    plan = launch.describe(op, a, dims, shared_mem=96)
    assert plan.kernel == KERNEL_FUNCTIONS[op].__name__
    assert plan.block_x == 32 * m.NUM_WARPS
    assert plan.grid == tuple(m.grid(a, 5)) and plan.shared_mem == 96
    assert plan.scalars == [5, 3, 7, 11, a.layer, common.float_bits(a.kv_scale)]
    params = launch.parameters(op, a, "float16")
    assert [t for _, t in params] == ["*fp16", "*i32", "*i32", "*i32", "*i32", "*fp16", *["i32"] * 6, "*fp16"]
    with pytest.raises(ValueError, match="choose one of KVCacheWrite, PagedAttention"):
        launch.kernel_name("Attention")


def test_launch_with_sinks_passes_a_seventh_pointer() -> None:
    """With sinks the kernel's parameters are the six inputs, the sink logits (*fp32), the scalars, the output;
    the grid, block and scalars stay those of the attention without sinks."""
    a = AttentionAttrs(**CASES[4][1])
    plain = dataclasses.replace(a, sinks=0)
    names = [n for n, _ in launch.parameters("PagedAttention", a, "bfloat16")]
    plain_names = [n for n, _ in launch.parameters("PagedAttention", plain, "bfloat16")]
    assert names == [*plain_names[:6], "sinks", *plain_names[6:]] and plain_names[6:] == [*common.SCALARS, "out"]
    types_ = [t for _, t in launch.parameters("PagedAttention", a, "bfloat16")]
    assert types_ == ["*bf16", "*i32", "*i32", "*i32", "*i32", "*u8", "*fp32", *["i32"] * 6, "*bf16"]
    dims = (5, 3, 7, 11)
    assert launch.describe("PagedAttention", a, dims, 0) == launch.describe("PagedAttention", plain, dims, 0)


def test_check_ptx_refuses_an_entry_with_the_hidden_scratch_parameters() -> None:
    """PTX as Triton emits it (two trailing .u64 scratch pointers) is refused; stripped, it passes."""
    a = AttentionAttrs(**CASES[0][1])
    name = launch.kernel_name("PagedAttention")
    params = [".u64"] * 6 + [".u32"] * len(common.SCALARS) + [".u64"]

    def ptx(types_: list[str]) -> str:
        lines = ",\n".join(f"\t.param {t} {name}_param_{i}" for i, t in enumerate(types_))
        return f".version 8.4\n.visible .entry {name}(\n{lines}\n)\n.reqntid 128\n{{\n\tret;\n}}\n"

    launch.check_ptx("PagedAttention", a, "float16", ptx(params))
    with pytest.raises(ValueError, match=r"strips Triton's hidden scratch parameters"):
        launch.check_ptx("PagedAttention", a, "float16", ptx([*params, ".u64", ".u64"]))
    # with sinks TensorRT passes a seventh pointer: a six-input entry is refused, a seven-input one passes
    sinks = dataclasses.replace(a, sinks=1)
    with pytest.raises(ValueError, match=r"TensorRT will pass \((\.u64, ){7}\.u32"):
        launch.check_ptx("PagedAttention", sinks, "float16", ptx(params))
    launch.check_ptx("PagedAttention", sinks, "float16", ptx([".u64", *params]))
    with pytest.raises(ValueError, match=r"has no \.entry attention_kernel"):
        launch.check_ptx("PagedAttention", a, "float16", ptx(params).replace(name, "other"))


def _entry(ptx: str) -> tuple[str, list[str], int]:
    """(entry name, its parameter types, .reqntid x) of the PTX's one kernel."""
    entries = re.findall(r"\.visible \.entry (\w+)\((.*?)\)", ptx, re.S)
    assert len(entries) == 1, [e[0] for e in entries]
    name, params = entries[0]
    types_ = [line.split()[1] for line in params.strip().splitlines()]
    reqntid = re.search(r"\.reqntid (\d+)", ptx)
    assert reqntid, "no .reqntid in the PTX"
    return name, types_, int(reqntid.group(1))


@pytest.mark.slow
def test_aot_impl_on_compiled_ptx() -> None:
    """aot_impl's answer on real sm_90 PTX: the kernel name is the `.entry`; the entry's parameters are exactly the
    6 input pointers (.u64; 7 with sinks, through PagedAttentionSinks), the extra args (.u32 / .s32), 1 output
    pointer, in that order; grid, block and shared
    memory are launch.py's and the compile's (block = .reqntid); the args are SymInt32 — the batch dims symbolic,
    from the right input dims, layer and kv_scale's float bits constant. ~1.5 s per compile: 10 of them."""
    cases = [
        {"op": op, "activation": act, "arch": "sm_90", "num_tokens": 7, "attrs": attrs}
        for act, attrs in CASES
        for op in OPS
    ]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    script = Path(trt_contract.__file__)
    res = subprocess.run(
        [sys.executable, str(script), json.dumps(cases)], capture_output=True, text=True, env=env, timeout=300
    )
    assert res.returncode == 0, res.stderr[-3000:]
    results = json.loads(res.stdout.strip().splitlines()[-1])
    for case, r in zip(cases, results, strict=True):
        op, a = case["op"], AttentionAttrs(**case["attrs"])
        first = "qkv" if op == "KVCacheWrite" else "q"
        where = f"{op} {case['activation']} {a.kv_cache_dtype} hd{a.head_size}"
        name, types_, reqntid = _entry(r["ptx"])
        assert r["name"] == name == launch.kernel_name(op) == r["compiled"]["name"], where
        n_args, n_in = len(r["args"]), 6 + (op == "PagedAttention" and a.sinks)
        assert len(types_) == n_in + n_args + 1, (where, types_)
        assert types_[:n_in] == [".u64"] * n_in and types_[-1] == ".u64", (where, types_)
        assert all(t in (".u32", ".s32") for t in types_[n_in:-1]), (where, types_)
        assert r["block"] == [reqntid, 1, 1] == [launch.block_threads(op), 1, 1], where
        assert reqntid == 32 * r["compiled"]["num_warps"], where
        assert r["shared_mem"] == r["compiled"]["shared"], where
        grid = launch.grid(op, a, case["num_tokens"])
        assert r["grid"][0]["sym"] == f"{first}.0", where
        assert [g["value"] if isinstance(g, dict) else g for g in r["grid"]] == list(grid), where
        assert r["args_not_symint32"] == [], where
        bits = struct.unpack("<i", struct.pack("<f", a.kv_scale))[0]
        assert dict(zip(common.SCALARS, r["args"], strict=True)) == {
            "num_tokens": {"sym": f"{first}.0", "value": case["num_tokens"]},
            "num_seqs": {"sym": "new_lens.0", "value": None},
            "max_blocks": {"sym": "block_tables.1", "value": None},
            "num_blocks": {"sym": "kv_cache.1", "value": None},
            "layer": a.layer,
            "kv_scale_bits": bits,
        }, where


# --- the collective plugins (issue 27): shape/type functions and a Python (trtp.impl) enqueue through the process's
# Communicator. Checked against the contract only: nothing here has TensorRT or two GPUs for NCCL (docs/kernels.md).

_COLLECTIVE_CASES: dict[str, tuple[Any, list[Any]]] = {  # op -> (attrs, input dims)
    "AllReduce": (AllReduceAttrs(type_id=1, group=(2, 3), counter=5), ["x.0", 64]),
    "AllGather": (AllGatherAttrs(type_id=7, group=(0, 1, 2, 3), axis=-1), ["x.0", 250]),
    "Send": (SendAttrs(type_id=0, tgt_rank=3), ["x.0", 64]),
    "Recv": (RecvAttrs(type_id=1, src_rank=1), ["like.0", 64]),
}
_TRT_TYPES = {0: "FLOAT", 1: "HALF", 7: "BF16"}


def _collective_fields(op: str, a: Any) -> dict[str, Any]:
    """The node's fields as TensorRT passes them: `group` an int32 array."""
    return {k: np.array(v, dtype=np.int32) if k == "group" else v for k, v in asdict(a).items()}


def _collective_input(registered: Any, op: str) -> Any:
    trt, _, _ = registered
    a, dims = _COLLECTIVE_CASES[op]
    shape = [trt_contract.Sym(d) if isinstance(d, str) else d for d in dims]
    return trt_contract.TensorDesc(shape, trt.DataType[_TRT_TYPES[a.type_id]])


def test_collectives_follow_the_documented_schemas_with_every_field(registered: Any) -> None:
    """register: (the input, every field of the op, TensorRT-LLM's and ours: collectives.COLLECTIVE_FIELDS), autotune:
    (input, outputs), impl: (input as a Tensor, every field, outputs, stream); `group` a 1-D int32 array field."""
    _, registry, reg = registered
    for op in COLLECTIVE_OPS:
        pid = f"trtbuild::{op}"
        params = inspect.signature(registry["register"][pid]).parameters
        first, *attrs = params
        assert first == ("like" if op == "Recv" else "x") and set(attrs) == COLLECTIVE_FIELDS[op], op
        assert "group" not in params or params["group"].annotation == reg.np_typing.NDArray[np.int32]
        assert list(inspect.signature(registry["impl"][pid]).parameters) == [first, *attrs, "outputs", "stream"]
        assert list(inspect.signature(registry["autotune"][pid]).parameters) == [first, "outputs"]
        assert pid not in registry["aot_impl"]  # a Python enqueue, not a kernel


def test_collective_output_shapes_and_types(registered: Any) -> None:
    trt, registry, _ = registered
    for op, (a, _) in _COLLECTIVE_CASES.items():
        x = _collective_input(registered, op)
        out = registry["register"][f"trtbuild::{op}"](x, **_collective_fields(op, a))
        assert out.dtype == trt.DataType[_TRT_TYPES[a.type_id]], op
        assert out.shape_expr[0].text == x.shape_expr[0].text, op  # num_tokens, symbolic
        assert out.shape_expr[1] == (250 * 4 if op == "AllGather" else 64), op  # gathered on the last axis
    first = AllGatherAttrs(type_id=7, group=(0, 1, 2, 3), axis=0)
    out = registry["register"]["trtbuild::AllGather"](
        _collective_input(registered, "AllGather"), **_collective_fields("AllGather", first)
    )
    assert out.shape_expr[0].text == "(x.0*4)" and out.shape_expr[1] == 250
    half = _collective_input(registered, "AllReduce")
    wrong = dataclasses.replace(_COLLECTIVE_CASES["AllReduce"][0], type_id=0)
    with pytest.raises(ValueError, match=r"trtbuild::AllReduce: input of type DataType.HALF but type_id 0 \(float32\)"):
        registry["register"]["trtbuild::AllReduce"](half, **_collective_fields("AllReduce", wrong))
    tunes = registry["autotune"]["trtbuild::AllReduce"](half, outputs=(half,))
    assert [t.io_types for t in tunes] == [["FP32", "FP32"], ["FP16", "FP16"], ["BF16", "BF16"]]


class _RecordingComm:
    """A communicator that records each call and answers as if every other rank held the same tensor."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def all_reduce(self, x: torch.Tensor, group: tuple[int, ...], what: str) -> torch.Tensor:
        self.calls.append(("all_reduce", group, what))
        return x * len(group)

    def all_gather(self, x: torch.Tensor, group: tuple[int, ...], axis: int, what: str) -> torch.Tensor:
        self.calls.append(("all_gather", group, axis, what))
        return torch.cat([x] * len(group), dim=axis)

    def send(self, x: torch.Tensor, dst: int, what: str) -> None:
        self.calls.append(("send", dst, what))

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int, what: str) -> torch.Tensor:
        self.calls.append(("recv", shape, dtype, src, what))
        return torch.full(shape, 7.0, dtype=dtype)


def test_collective_impl_runs_the_process_communicator_on_tensorrt_s_stream(
    registered: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The enqueue hands the input to the communicator set for this process, on TensorRT's stream, and writes its
    answer into TensorRT's output buffer; with no communicator set it refuses (a rank must set one first). The CUDA
    wrapping (as_torch, on_stream) is replaced by CPU tensors here: no GPU in this test."""
    _, registry, reg = registered
    streams: list[int] = []
    monkeypatch.setattr(reg, "as_torch", lambda t: t)

    def on_stream(stream: int) -> contextlib.nullcontext[None]:
        streams.append(stream)
        return contextlib.nullcontext()

    monkeypatch.setattr(reg, "on_stream", on_stream)
    a, _ = _COLLECTIVE_CASES["AllReduce"]
    x, out = torch.arange(6.0).reshape(3, 2), torch.zeros(3, 2)
    monkeypatch.setattr(reg, "_COMMUNICATOR", [])
    with pytest.raises(RuntimeError, match=r"trtbuild::AllReduce: no communicator set in this process; .*"
                       r"set_communicator\(comm\) before its first step"):  # fmt: skip
        registry["impl"]["trtbuild::AllReduce"](x, **_collective_fields("AllReduce", a), outputs=(out,), stream=11)
    comm = _RecordingComm()
    reg.set_communicator(comm)
    registry["impl"]["trtbuild::AllReduce"](x, **_collective_fields("AllReduce", a), outputs=(out,), stream=11)
    assert torch.equal(out, 2 * x) and streams == [11]
    g, _ = _COLLECTIVE_CASES["AllGather"]
    gathered = torch.zeros(3, 8)
    registry["impl"]["trtbuild::AllGather"](x, **_collective_fields("AllGather", g), outputs=(gathered,), stream=12)
    assert torch.equal(gathered, torch.cat([x] * 4, dim=1))
    sent = torch.zeros(3, 2)
    registry["impl"]["trtbuild::Send"](x, **_collective_fields("Send", _COLLECTIVE_CASES["Send"][0]), outputs=(sent,),
                                       stream=13)  # fmt: skip
    assert torch.equal(sent, x)
    got = torch.zeros(3, 2, dtype=torch.float16)
    r, _ = _COLLECTIVE_CASES["Recv"]
    registry["impl"]["trtbuild::Recv"](got, **_collective_fields("Recv", r), outputs=(got,), stream=14)
    assert torch.equal(got, torch.full((3, 2), 7.0, dtype=torch.float16))
    assert streams == [11, 12, 13, 14]
    assert comm.calls == [
        ("all_reduce", (2, 3), "AllReduce #5 (TensorRT)"),
        ("all_gather", (0, 1, 2, 3), -1, "AllGather #0 (TensorRT)"),
        ("send", 3, "Send #0 (TensorRT)"),
        ("recv", (3, 2), torch.float16, 1, "Recv #0 (TensorRT)"),
    ]


def test_complete_plugin_fields_leaves_collective_nodes_whole() -> None:
    """Collective nodes carry every field already (to_attributes writes them all): TensorRT's copy is unchanged."""
    from onnx import helper

    from toolchain.engine.onnx_fields import complete_plugin_fields

    nodes = [
        helper.make_node(op, ["x"], [f"y{i}"], domain="trtbuild", **a.to_attributes(op))
        for i, (op, (a, _)) in enumerate(_COLLECTIVE_CASES.items())
    ]
    model = helper.make_model(helper.make_graph(nodes, "g", [], []))
    completed = complete_plugin_fields(model)
    for before, after in zip(model.graph.node, completed.graph.node, strict=True):
        assert before == after
        assert {att.name for att in after.attribute} == COLLECTIVE_FIELDS[after.op_type]
