"""TensorRT's registration of the MoE op's plugins (MoESort, MoEFc*, MoEProj*: engine/moe_split.py) against the
`tensorrt.plugin` contract's stand-in (trt_contract.py), as test_registration.py checks the attention plugins:
schemas, output shapes and types on symbolic dims, autotune types against the split graph's, refusals; and, in a
subprocess (compiling needs TRITON_INTERPRET unset), aot_impl on real sm_90 PTX: entry name, parameters, grid from
the symbolic token count, block, shared memory, scalars."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import trt_contract
from trt_contract import DataType, Sym, TensorDesc

from toolchain.engine import moe_split
from toolchain.engine.ops import MOE_OP, OP_FIELDS, MoEAttrs
from toolchain.plugins.kernels import moe, moe_sort

ROOT = Path(__file__).resolve().parents[2]
REG = "toolchain.plugins.tensorrt_registration"
TYPES = {"float32": DataType.FLOAT, "float16": DataType.HALF, "bfloat16": DataType.BF16}

# gpt-oss-20b-like (biases, router bias, clamped SwiGLU); Qwen3-like with AWQ experts (prequant); a plain small one
GPT_OSS = MoEAttrs(32, 4, 2880, 2880, "topk_softmax", use_bias=1, router_bias=1, swiglu_alpha=1.702,
                   swiglu_beta=1.0, swiglu_limit=7.0)  # fmt: skip
AWQ = MoEAttrs(128, 8, 2048, 768, "softmax_topk_renormalise", prequant=1)
SMALL = MoEAttrs(8, 2, 96, 40, activation="gelu")
LAYERS = {"gpt-oss": GPT_OSS, "awq": AWQ, "small": SMALL}


@pytest.fixture
def registered() -> Iterator[tuple[dict[str, Any], Any]]:
    """(the stand-in's registry, the registration module imported against it); sys.modules restored."""
    with trt_contract.registered(REG) as (_, registry, module):
        yield registry, module


def _fields(a: MoEAttrs) -> dict[str, Any]:
    return {k: v for k, v in asdict(a).items() if k in OP_FIELDS[MOE_OP]}


def stage_descs(stage: str, a: MoEAttrs, activation: str) -> list[TensorDesc]:
    """The stage plugin's inputs as the split graph types them, T symbolic ("weights.0")."""
    act, t, rows = TYPES[activation], Sym("weights.0"), Sym("weights.0") * a.top_k
    src = [t, a.expert_hidden_size] if stage == "fc" else [rows, a.expert_inter_size]
    w_rows, k = (a.fc_rows, a.expert_hidden_size) if stage == "fc" else (a.expert_hidden_size, a.expert_inter_size)
    descs = [
        TensorDesc(src, act),
        TensorDesc([rows], DataType.INT32),
        TensorDesc([a.number_of_experts + 1], DataType.INT32),
        TensorDesc([t, a.top_k], DataType.FLOAT),
        TensorDesc([a.number_of_experts, w_rows, k], act),
    ]
    if a.use_bias:
        descs.append(TensorDesc([a.number_of_experts, w_rows], act))
    if a.prequant:
        descs.append(TensorDesc([a.number_of_experts, k], DataType.FLOAT))
    return descs


def sort_descs(a: MoEAttrs) -> list[TensorDesc]:
    return [TensorDesc([Sym("experts.0"), a.top_k], DataType.INT32)]


def test_every_split_op_is_registered_with_the_documented_schemas(registered: Any) -> None:
    """register: (inputs, every MoE field); autotune: (inputs, outputs); aot_impl: (inputs, fields, outputs,
    tactic) — the inputs exactly those the split gives each plugin node."""
    registry, reg = registered
    for op in moe_split.SPLIT_OPS:
        pid = f"trtbuild::{op}"
        assert pid in registry["register"] and pid in registry["autotune"] and pid in registry["aot_impl"], op
        params = list(inspect.signature(registry["register"][pid]).parameters)
        if op == moe_split.SORT_OP:
            inputs = ["experts"]
        else:
            stage = "fc" if op.startswith(moe_split.FC_OP) else "proj"
            inputs = reg.stage_inputs(stage, "Bias" in op, "Prequant" in op)
        assert params[: len(inputs)] == inputs and set(params[len(inputs) :]) == OP_FIELDS[MOE_OP], op
        assert list(inspect.signature(registry["autotune"][pid]).parameters) == [*inputs, "outputs"], op
        aot = list(inspect.signature(registry["aot_impl"][pid]).parameters)
        assert aot == [*params, "outputs", "tactic"], op


@pytest.mark.parametrize("layer", LAYERS)
def test_the_split_graphs_plugin_nodes_match_the_registered_inputs(registered: Any, layer: str) -> None:
    """A split node's input count is its plugin's: a node parsed as another plugin would shift every pointer."""
    import onnx
    from onnx import TensorProto, helper

    _, reg = registered
    a = LAYERS[layer]
    names = ["router", "fc", "proj", *(["fc_bias", "proj_bias"] if a.use_bias else [])]
    names += ["router_bias"] * a.router_bias + (["fc_pre", "proj_pre"] if a.prequant else [])
    node = helper.make_node(MOE_OP, ["x", *names], ["y"], name="l0.mlp/MoE", domain="trtbuild",
                            **a.to_attributes(MOE_OP))  # fmt: skip
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT16, ["T", a.expert_hidden_size])
    model = helper.make_model(helper.make_graph([node], "g", [], [y]))
    split = moe_split.split_moe(onnx.ModelProto.FromString(model.SerializeToString()))
    plugins = {n.op_type: n for n in split.graph.node if n.domain == "trtbuild"}
    for stage in moe.STAGES:
        op = moe_split.stage_op(stage, a)
        assert len(plugins[op].input) == len(reg.stage_inputs(stage, bool(a.use_bias), bool(a.prequant))), op
    assert list(plugins[moe_split.SORT_OP].output) == ["l0.mlp.moe.assignments", "l0.mlp.moe.offsets"]


@pytest.mark.parametrize("activation", ["float16", "bfloat16"])
@pytest.mark.parametrize("layer", LAYERS)
def test_output_shapes_and_types(registered: Any, layer: str, activation: str) -> None:
    registry, _ = registered
    a = LAYERS[layer]
    assignments, offsets = registry["register"]["trtbuild::MoESort"](*sort_descs(a), **_fields(a))
    env = {"experts.0": 5, "weights.0": 5}
    assert assignments.dtype == offsets.dtype == DataType.INT32
    assert [d.fn(env) if isinstance(d, Sym) else d for d in assignments.shape_expr] == [5 * a.top_k]
    assert offsets.shape_expr[0] == a.number_of_experts + 1
    for stage, width, dtype in (("fc", a.expert_inter_size, TYPES[activation]), ("proj", a.expert_hidden_size,
                                                                                    DataType.FLOAT)):  # fmt: skip
        out = registry["register"][f"trtbuild::{moe_split.stage_op(stage, a)}"](
            *stage_descs(stage, a, activation), **_fields(a)
        )
        assert out.dtype == dtype and out.shape_expr[1] == width, stage
        assert out.shape_expr[0].fn(env) == 5 * a.top_k and out.shape_expr[0].text == f"(weights.0*{a.top_k})"


def test_autotune_types_are_the_split_graphs(registered: Any) -> None:
    """One LINEAR combination per activation type: src, weight and bias in it, the sorted ids INT32, the router
    weights and prequant vectors FP32, h in the activations' type, proj's out FP32 — the types split_moe and
    export.py give those tensors. MoESort: INT32 in and out."""
    registry, _ = registered
    (sort,) = registry["autotune"]["trtbuild::MoESort"](None, outputs=(None, None))
    assert sort.types == [DataType.INT32] * 3 and sort.layouts == ["LINEAR"]
    for layer, a in LAYERS.items():
        for stage in moe.STAGES:
            pid = f"trtbuild::{moe_split.stage_op(stage, a)}"
            n = len(stage_descs(stage, a, "float16"))
            combos = registry["autotune"][pid](*[None] * n, outputs=(None,))
            assert len(combos) == 3, (layer, stage)
            for c in combos:
                act = c.types[0]
                assert act in TYPES.values() and c.types[1:4] == [DataType.INT32, DataType.INT32, DataType.FLOAT]
                assert c.types[4] == act and c.types[5 : 5 + a.use_bias] == [act] * a.use_bias
                assert c.types[5 + a.use_bias : n] == [DataType.FLOAT] * a.prequant
                assert c.types[n] == (act if stage == "fc" else DataType.FLOAT) and len(c.types) == n + 1


def test_refusals_name_the_plugin_and_the_fix(registered: Any) -> None:
    registry, _ = registered
    a = SMALL
    impl = registry["aot_impl"]["trtbuild::MoEFc"]
    descs = stage_descs("fc", a, "float16")
    with pytest.raises(ValueError, match=r"trtbuild::MoEFc: fp8_inputs 1 / int8_inputs 0: the experts kernel has no"):
        impl(*descs, **{**_fields(a), "fp8_inputs": 1}, outputs=(None,), tactic=0)
    with pytest.raises(ValueError, match=r"int8_inputs 1: the experts kernel has no input quantization"):
        impl(*descs, **{**_fields(a), "int8_inputs": 1}, outputs=(None,), tactic=0)
    with pytest.raises(ValueError, match=r"trtbuild::MoEFc with use_bias=1 .* is the trtbuild::MoEFcBias plugin"):
        impl(*descs, **{**_fields(a), "use_bias": 1}, outputs=(None,), tactic=0)
    wrong = [*descs[:4], TensorDesc(list(descs[4].shape_expr), DataType.BF16)]
    with pytest.raises(ValueError, match=r"fc_weight of type DataType.BF16: expected the activations' FP16"):
        impl(*wrong, **_fields(a), outputs=(None,), tactic=0)
    int64 = [descs[0], TensorDesc(list(descs[1].shape_expr), DataType.INT64), *descs[2:]]
    with pytest.raises(ValueError, match=r"assignments of type DataType.INT64: expected INT32"):
        impl(*int64, **_fields(a), outputs=(None,), tactic=0)
    sort = registry["aot_impl"]["trtbuild::MoESort"]
    with pytest.raises(ValueError, match=r"MoESort experts of type DataType.INT64: expected INT32"):
        sort(TensorDesc([Sym("experts.0"), 2], DataType.INT64), **_fields(a), outputs=(None, None), tactic=0)


_SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[1] + "/tests/plugins")
import trt_contract
from trt_contract import Sym, SymInt32
_, _, registry = trt_contract.install()
import importlib
import test_registration_moe as t
reg = importlib.import_module("toolchain.plugins.tensorrt_registration")
from toolchain.plugins.compile import compile_kernel
seen = {}
def compiled(op, attrs, act):
    seen["k"] = compile_kernel(op, attrs, act, "sm_90")
    return seen["k"]
reg.compiled = compiled
env = {"experts.0": 37, "weights.0": 37}
def show(v):
    v = v.value if isinstance(v, SymInt32) else v
    return {"sym": v.text, "value": v.fn(env)} if isinstance(v, Sym) else v
out = []
for layer, a in t.LAYERS.items():
    cases = [("MoESort", t.sort_descs(a), (None, None))]
    cases += [(t.moe_split.stage_op(s, a), t.stage_descs(s, a, "bfloat16"), (None,)) for s in ("fc", "proj")]
    for op, descs, outs in cases:
        name, ptx, p, args = registry["aot_impl"]["trtbuild::" + op](*descs, **t._fields(a), outputs=outs, tactic=0)
        k = seen["k"]
        out.append({"layer": layer, "op": op, "name": name, "ptx": ptx, "args": [show(x) for x in args],
                    "grid": [show(getattr(p, f)) for f in ("grid_x", "grid_y", "grid_z")],
                    "block": [show(getattr(p, f)) for f in ("block_x", "block_y", "block_z")],
                    "shared": show(p.shared_mem), "compiled": [k.name, k.shared, k.num_warps, k.params]})
print(json.dumps(out))
"""


@pytest.mark.slow
def test_aot_impl_on_compiled_ptx() -> None:
    """On real sm_90 PTX (bf16; the three layers' sort, fc and proj plugins, 9 compiles): the kernel name is the
    `.entry`; the entry's parameters are the plugin's inputs (.u64 each), its extra args (.u32), its outputs (.u64),
    in that order; block = .reqntid, shared memory = the compile's; the grid evaluates, at 37 tokens, to the
    kernel module's grid; MoESort's one extra arg is the token count, symbolic (dim 0 of experts)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    res = subprocess.run([sys.executable, "-c", _SCRIPT, str(ROOT)], capture_output=True, text=True, env=env,
                         timeout=600)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    results = json.loads(res.stdout.strip().splitlines()[-1])
    assert len(results) == 9
    for r in results:
        a, op, where = LAYERS[r["layer"]], r["op"], (r["layer"], r["op"])
        name, params, shared, warps = r["compiled"][0], r["compiled"][3], r["compiled"][1], r["compiled"][2]
        entry = re_entry(r["ptx"])
        assert r["name"] == name == entry[0], where
        assert entry[2] == 32 * warps and r["block"] == [entry[2], 1, 1] and r["shared"] == shared, where
        if op == moe_split.SORT_OP:
            assert entry[1] == [".u64", ".u32", ".u64", ".u64"] and name == "sort_kernel", where
            assert r["args"] == [{"sym": "experts.0", "value": 37}] and r["grid"] == [1, 1, 1], where
            continue
        stage = "fc" if op.startswith(moe_split.FC_OP) else "proj"
        inputs = len(stage_descs(stage, a, "bfloat16"))
        assert entry[1] == [".u64"] * (inputs + 1) and r["args"] == [] and name == "moe_kernel", where
        assert params == ["u64 ptr"] * (inputs + 1), where
        grid = [g["value"] if isinstance(g, dict) else g for g in r["grid"]]
        assert grid == list(moe.grid(moe.Stage(a, stage), 37)), where
        assert r["grid"][1]["sym"] == f"(((weights.0+{moe.BLOCK_M})-1)//{moe.BLOCK_M})", where  # symbolic in T
    assert moe_sort.OP == moe_split.SORT_OP


def re_entry(ptx: str) -> tuple[str, list[str], int]:
    import re

    entries = re.findall(r"\.visible \.entry (\w+)\((.*?)\)", ptx, re.S)
    assert len(entries) == 1
    name, params = entries[0]
    reqntid = re.search(r"\.reqntid (\d+)", ptx)
    assert reqntid
    return name, [line.split()[1] for line in params.strip().splitlines()], int(reqntid.group(1))
