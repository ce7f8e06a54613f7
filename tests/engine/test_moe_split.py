"""The MoE op split for TensorRT (toolchain/engine/moe_split.py): the split graph — the router in ONNX ops run by
ONNX Runtime, MoESort / MoEFc / MoEProj run by their torch definitions or by the Triton kernels under the
interpreter — against the unsplit op (ops.moe) on the same inputs; and whole MoE engines on the CPU engine with
their graph split, against the same engines unsplit."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from toolchain.engine import moe_split
from toolchain.engine.contract import PLUGIN_DOMAIN
from toolchain.engine.onnx_fields import complete_plugin_fields
from toolchain.engine.ops import MOE_OP, OP_FIELDS, MoEAttrs, moe
from toolchain.errors import UserError
from toolchain.plugins.kernels import moe as kernel
from toolchain.plugins.kernels import moe_sort

HIDDEN, INTER = 48, 40
# float32 both ways: the split sums the k weighted expert outputs in another order than the op's index_add, and
# the router runs in ONNX Runtime's kernels instead of torch's; each output is a sum of ~HIDDEN + INTER products
# of O(1) terms rounded at 2^-24 (~6e-8), so differences stay near sqrt(88) * 6e-8 ~ 6e-7 of the scale: 1e-5
# leaves a 15x margin (as tests/engine/test_moe_op.py's TOL)
TOL = 1e-5

GPT_OSS_SWIGLU: dict[str, Any] = {"swiglu_alpha": 1.702, "swiglu_beta": 1.0, "swiglu_limit": 0.5}
CASES = {
    "softmax_topk": MoEAttrs(6, 2, HIDDEN, INTER),
    "renormalise-bias": MoEAttrs(8, 3, HIDDEN, INTER, "softmax_topk_renormalise", "gelu", use_bias=1),
    "topk_softmax-swiglu": MoEAttrs(4, 2, HIDDEN, INTER, "topk_softmax", use_bias=1, router_bias=1, **GPT_OSS_SWIGLU),
    "ungated-relu-top_k=E": MoEAttrs(3, 3, HIDDEN, INTER, activation="relu", gated=0),
    "prequant": MoEAttrs(5, 2, HIDDEN, INTER, "softmax_topk_renormalise", prequant=1),
    "bias-prequant-router_bias": MoEAttrs(5, 1, HIDDEN, INTER, use_bias=1, router_bias=1, prequant=1),
}


def _inputs(a: MoEAttrs, tokens: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    e, h, i = a.number_of_experts, a.expert_hidden_size, a.expert_inter_size
    t: dict[str, torch.Tensor] = {
        "x": torch.randn(tokens, h, generator=g),
        "router": torch.randn(e, h, generator=g) * 4 / h**0.5,
        "fc": torch.randn(e, a.fc_rows, h, generator=g) / h**0.5,
        "proj": torch.randn(e, h, i, generator=g) / i**0.5,
    }
    if a.use_bias:
        t |= {"fc_bias": torch.randn(e, a.fc_rows, generator=g) * 0.5, "proj_bias": torch.randn(e, h, generator=g)}
    if a.router_bias:
        t["router_bias"] = torch.randn(e, generator=g)
    if a.prequant:  # 1/s in [0.5, 1.5), as AWQ's / SmoothQuant's
        t |= {"fc_pre": torch.rand(e, h, generator=g) + 0.5, "proj_pre": torch.rand(e, i, generator=g) + 0.5}
    return t


def _graph(a: MoEAttrs, t: dict[str, torch.Tensor]) -> onnx.ModelProto:
    """One trtbuild::MoE node as export.py writes it: x a graph input, the rest initializers, y typed."""
    names = [n for n in ("router", "fc", "proj", "fc_bias", "proj_bias", "router_bias", "fc_pre", "proj_pre") if n in t]
    node = helper.make_node(
        MOE_OP, ["x", *names], ["y"], name="transformer.layers.0.mlp/MoE", domain=PLUGIN_DOMAIN,
        **a.to_attributes(MOE_OP),
    )  # fmt: skip
    graph = helper.make_graph(
        [node], "moe",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["num_tokens", a.expert_hidden_size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["num_tokens", a.expert_hidden_size])],
        [numpy_helper.from_array(t[n].numpy(), n) for n in names],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(PLUGIN_DOMAIN, 1)])
    model.ir_version = 10
    return model


Impls = dict[str, Callable[..., Any]]


def _run(model: onnx.ModelProto, x: torch.Tensor, impls: Impls) -> torch.Tensor:
    """The graph, its standard nodes in ONNX Runtime sessions (one per run of them, as the CPU engine cuts it), its
    plugin nodes by `impls` — node by node in graph order, values passed by name."""
    inferred = onnx.shape_inference.infer_shapes(model)
    types = {v.name: v for v in [*inferred.graph.value_info, *model.graph.input, *model.graph.output]}
    inits = {i.name: i for i in model.graph.initializer}
    values: dict[str, np.ndarray] = {"x": x.numpy(), **{n: numpy_helper.to_array(i) for n, i in inits.items()}}
    nodes = list(model.graph.node)
    index = 0
    while index < len(nodes):
        node = nodes[index]
        if node.domain == PLUGIN_DOMAIN:
            a = moe_split.attrs_of(node)
            out = impls[node.op_type](a, *(torch.from_numpy(values[n].copy()) for n in node.input))
            outs = out if isinstance(out, tuple) else (out,)
            values.update((n, o.numpy()) for n, o in zip(node.output, outs, strict=True))
            index += 1
            continue
        run = []
        while index < len(nodes) and nodes[index].domain != PLUGIN_DOMAIN:
            run.append(nodes[index])
            index += 1
        produced = {o for n in run for o in n.output}
        ins = sorted({i for n in run for i in n.input if i and i not in produced and i not in inits})
        used = {i for n in run for i in n.input if i in inits}
        sub = helper.make_graph(
            run, "segment", [types[i] for i in ins], [types[o] for o in sorted(produced)], [inits[i] for i in used]
        )
        session = ort.InferenceSession(
            helper.make_model(sub, opset_imports=model.opset_import, ir_version=model.ir_version).SerializeToString(),
            providers=["CPUExecutionProvider"],
        )
        values.update(zip(sorted(produced), session.run(sorted(produced), {i: values[i] for i in ins}), strict=True))
    return torch.from_numpy(values["y"])


def _kernel_stage(stage: str) -> Callable[..., torch.Tensor]:
    """The Triton experts kernel (interpreted) as the MoEFc* / MoEProj* plugin: one launch, its output allocated as
    TensorRT would."""

    def run(a: MoEAttrs, src: torch.Tensor, asg: torch.Tensor, off: torch.Tensor, w8: torch.Tensor,
            w: torch.Tensor, *extra: torch.Tensor) -> torch.Tensor:  # fmt: skip
        bias = extra[0].contiguous() if a.use_bias else None
        pre = extra[-1].float().contiguous() if a.prequant else None
        rows = asg.numel()
        n = a.expert_inter_size if stage == "fc" else a.expert_hidden_size
        dst = torch.empty(rows, n, dtype=src.dtype if stage == "fc" else torch.float32)
        kernel.launch_stage(kernel.Stage(a, stage), rows // a.top_k, src, asg, off, w8, w, bias, pre, dst)
        return dst

    return run


KERNELS: Impls = {
    moe_split.SORT_OP: lambda a, experts: moe_sort.sort(experts, a.number_of_experts),
    **{op: _kernel_stage("fc") for op in moe_split.SPLIT_OPS if op.startswith(moe_split.FC_OP)},
    **{op: _kernel_stage("proj") for op in moe_split.SPLIT_OPS if op.startswith(moe_split.PROJ_OP)},
}


def _reference(a: MoEAttrs, t: dict[str, torch.Tensor]) -> torch.Tensor:
    rest = [t[n] for n in ("fc_bias", "proj_bias", "router_bias", "fc_pre", "proj_pre") if n in t]
    return moe(a, t["x"], t["router"], t["fc"], t["proj"], *rest)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("impls", ["torch", "kernels"])
def test_the_split_graph_computes_the_op(case: str, impls: str) -> None:
    a = CASES[case]
    tokens = 9 if impls == "torch" else 5  # the interpreter is slow: fewer tokens, still ties between experts
    t = _inputs(a, tokens, seed=list(CASES).index(case))
    model = _graph(a, t)
    split = moe_split.split_moe(_graph(a, t))
    ops = [n.op_type for n in split.graph.node if n.domain == PLUGIN_DOMAIN]
    assert ops == [moe_split.SORT_OP, moe_split.stage_op("fc", a), moe_split.stage_op("proj", a)]
    for node in split.graph.node:
        if node.domain == PLUGIN_DOMAIN:  # every field on every plugin node: tensorrt.plugin has no defaults
            assert {f.name for f in node.attribute} == OP_FIELDS[MOE_OP]
    got = _run(split, t["x"], moe_split.REFERENCES if impls == "torch" else KERNELS)
    want = _run(model, t["x"], {MOE_OP: moe})
    assert torch.equal(want, _reference(a, t))  # the unsplit graph runs the op itself
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() <= TOL * scale, ((got - want).abs().max().item(), scale)


def test_the_router_in_onnx_ops_chooses_the_experts_route_chooses() -> None:
    """The split's TopK indices (ONNX Runtime) equal ops.route's (torch.topk) on untied scores, every norm, and
    its weights within float32 rounding."""
    from toolchain.engine.ops import route

    seen: dict[str, torch.Tensor] = {}
    for case, a in CASES.items():
        t = _inputs(a, 33, seed=7)
        split = moe_split.split_moe(_graph(a, t))

        def grab(a_: MoEAttrs, experts: torch.Tensor, *_: Any) -> tuple[torch.Tensor, torch.Tensor]:
            seen["experts"] = experts
            return moe_split.sort(a_, experts)

        def grab_proj(a_: MoEAttrs, *inputs: torch.Tensor) -> torch.Tensor:
            seen["weights"] = inputs[3]
            return moe_split.proj(a_, *inputs)

        impls = {**moe_split.REFERENCES, moe_split.SORT_OP: grab, moe_split.stage_op("proj", a): grab_proj}
        _run(split, t["x"], impls)
        weights, experts = route(a, t["x"], t["router"], t.get("router_bias"))
        assert seen["experts"].dtype == torch.int32 and torch.equal(seen["experts"].long(), experts), case
        assert torch.allclose(seen["weights"], weights, rtol=0, atol=1e-6), case


def test_fp8_and_int8_expert_inputs_are_refused_by_name() -> None:
    for field, what in (("fp8_inputs", "fp8 experts"), ("int8_inputs", "w8a8_sq experts")):
        a = dataclasses.replace(CASES["softmax_topk"], **{field: 1})
        t = _inputs(CASES["softmax_topk"], 2, seed=0)
        t |= {"fc_scale": torch.ones(a.number_of_experts), "proj_scale": torch.ones(a.number_of_experts)}
        model = _graph(CASES["softmax_topk"], t)
        node = model.graph.node[0]
        node.attribute.append(helper.make_attribute(field, 1))
        message = rf"transformer.layers.0.mlp: the MoE op's {field} \({what}\) has no TensorRT kernel yet"
        with pytest.raises(UserError, match=message):
            complete_plugin_fields(model)


def test_complete_plugin_fields_splits_the_copy_and_leaves_the_graph() -> None:
    a = CASES["renormalise-bias"]
    model = _graph(a, _inputs(a, 2, seed=1))
    before = model.SerializeToString()
    parsed = complete_plugin_fields(model)
    assert model.SerializeToString() == before
    assert MOE_OP not in [n.op_type for n in parsed.graph.node]
    assert {n.op_type for n in parsed.graph.node if n.domain == PLUGIN_DOMAIN} == {
        "MoESort", "MoEFcBias", "MoEProjBias"
    }  # fmt: skip


ENGINE_CASES = [
    ("mixtral-top2-of-8", "torch"),
    ("qwen3-moe-unnormalised-step2", "torch"),
    ("gpt-oss-every-feature", "torch"),
    ("mixtral-top2-of-8", "kernels"),
    ("gpt-oss-every-feature", "kernels"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("case", "impls"), ENGINE_CASES)
def test_a_moe_engine_with_its_graph_split_gives_the_same_logits(
    case: str, impls: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CPU engine on the split graph (the graph TensorRT would parse, its MoE plugins run by their torch
    definitions, or by the Triton sort and experts kernels under the interpreter, one launch per plugin node)
    against the same engine on the MoE op: fp32 logits within 1e-4 of their scale, the same top-1."""
    from models import build, run_alone, save_case

    from toolchain.checkpoint.convert import convert
    from toolchain.engine import ops, ort_backend
    from toolchain.engine.api import MODEL_NAME

    convert(save_case(tmp_path / "hf", case), tmp_path / "ckpt")
    engine = build(tmp_path / "ckpt", tmp_path / "engine")
    ids = torch.randint(0, int(engine.spec.vocab_size), (19,), generator=torch.Generator().manual_seed(3)).tolist()
    want = run_alone(engine, ids)
    model = onnx.load(str(tmp_path / "engine" / MODEL_NAME))
    layers = sum(n.op_type == MOE_OP for n in model.graph.node)
    (tmp_path / "split").mkdir()
    onnx.save(moe_split.split_moe(model), str(tmp_path / "split" / MODEL_NAME))
    chosen = moe_split.REFERENCES if impls == "torch" else KERNELS
    called: list[str] = []

    def plugin(op: str) -> Callable[..., Any]:
        def run(a: MoEAttrs, *inputs: torch.Tensor, memo: Any = None) -> Any:
            called.append(op)
            return chosen[op](a, *inputs)

        return run

    for op in moe_split.SPLIT_OPS:
        monkeypatch.setitem(ort_backend.OPS, op, plugin(op))
        monkeypatch.setitem(ort_backend.OP_ATTRS, op, MoEAttrs)
        monkeypatch.setitem(ops.OP_FIELDS, op, OP_FIELDS[MOE_OP])
    split = ort_backend.OrtEngine(dataclasses.replace(engine.spec, engine_dir=tmp_path / "split"))
    assert sum(getattr(s, "op", None) == moe_split.SORT_OP for s in split.steps) == layers > 0
    got = run_alone(split, ids)
    assert len(called) == 3 * layers and called[0] == moe_split.SORT_OP  # every layer's three plugins ran
    scale = float(np.abs(want).max())
    assert np.abs(got - want).max() <= 1e-4 * scale, (np.abs(got - want).max(), scale)
    assert (got.argmax(-1) == want.argmax(-1)).all()
