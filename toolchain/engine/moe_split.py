"""The MoE op as TensorRT runs it: each `trtbuild::MoE` node split into native ONNX ops and three plugin nodes,
each one kernel launch (a `tensorrt.plugin` ahead-of-time plugin launches exactly one kernel).

`split_moe(model)` rewrites, in place, the copy of the graph TensorRT parses (engine/onnx_fields.
complete_plugin_fields); the graph on disk keeps its one MoE node, which the CPU engine runs. Per MoE node:

  router (native ops, as ops.route computes it): Cast(x, float32) -> Gemm(x, router_weight^T (+ router_bias))
      -> softmax_topk: Softmax -> TopK; softmax_topk_renormalise: the same, then / ReduceSum over the k;
         topk_softmax: TopK of the logits -> Softmax over the k
      -> weights [T, k] float32, experts = Cast(TopK's indices, int32) [T, k]
  trtbuild::MoESort (kernels/moe_sort.py)   experts -> assignments [T*k] int32, offsets [E+1] int32
  trtbuild::MoEFc (kernels/moe.py, STAGE 0) x, assignments, offsets, weights, fc_weight (, fc_bias)
      (, fc_prequant) -> h [T*k, I] in the activations' type, in the sorted order
  trtbuild::MoEProj (STAGE 1)               h, assignments, offsets, weights, proj_weight (, proj_bias)
      (, proj_prequant) -> out [T*k, H] float32, weighted, in token-major order
  combine (native ops): Reshape(out, [-1, k, H]) -> ReduceSum over k -> Cast to the activations' type -> y

A plugin's inputs are fixed by its registered signature, so the fc and proj plugins with biases and / or prequant
vectors (AWQ / SmoothQuant experts) are plugins of their own: `stage_op` names them (MoEFcBias, MoEFcPrequant,
MoEFcBiasPrequant, and the same for MoEProj). Every plugin node carries every MoE field (tensorrt.plugin has no
default field values). The experts' input quantization (fp8_inputs, int8_inputs: fp8 and w8a8_sq experts) has no
kernel: refused here by name. Quantized weights arrive dequantized (DequantizeLinear before the node), so the
plugins see float weights whatever the method.

Ties: TopK breaks exact ties between router scores as TensorRT's ITopKLayer does, not necessarily as torch.topk (the
reference); only bit-identical scores can route differently.

`REFERENCES` are the three plugins' definitions in torch, so that the CPU engine can run the split graph
(tests/engine/test_moe_split.py: the split graph's logits against the unsplit op's).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import onnx
import torch
from onnx import TensorProto, helper

from toolchain.engine.contract import PLUGIN_DOMAIN
from toolchain.engine.ops import MOE_OP, OP_FIELDS, MoEAttrs
from toolchain.errors import UserError
from toolchain.reference.model import ACTIVATIONS as ACTIVATION_FNS

SORT_OP = "MoESort"
FC_OP = "MoEFc"
PROJ_OP = "MoEProj"
STAGE_OPS = {"fc": FC_OP, "proj": PROJ_OP}


def stage_op(stage: str, a: MoEAttrs) -> str:
    """The plugin of a stage: MoEFc / MoEProj, + "Bias" with use_bias, + "Prequant" with prequant (fixed inputs)."""
    return STAGE_OPS[stage] + ("Bias" if a.use_bias else "") + ("Prequant" if a.prequant else "")


SPLIT_OPS = (SORT_OP, *(STAGE_OPS[s] + b + p for s in STAGE_OPS for b in ("", "Bias") for p in ("", "Prequant")))


def attrs_of(node: onnx.NodeProto) -> MoEAttrs:
    values = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    return MoEAttrs.from_attributes(MOE_OP, {k: v.decode() if isinstance(v, bytes) else v for k, v in values.items()})


def refuse(a: MoEAttrs, layer: str) -> None:
    """What the split plugins cannot run, in one line naming it and the way out."""
    if a.fp8_inputs or a.int8_inputs:
        what = "fp8_inputs (fp8 experts)" if a.fp8_inputs else "int8_inputs (w8a8_sq experts)"
        raise UserError(
            f"{layer}: the MoE op's {what} has no TensorRT kernel yet (the experts' per-expert input quantization); "
            "quantize the experts weight-only (w8a16, w4a16, w4a16_awq) or build the CPU engine with --backend "
            "onnxruntime"
        )


def _fields(a: MoEAttrs) -> dict[str, Any]:
    return {k: v for k, v in asdict(a).items() if k in OP_FIELDS[MOE_OP]}


def _dtype_of(model: onnx.ModelProto, name: str) -> int:
    for v in [*model.graph.value_info, *model.graph.input, *model.graph.output]:
        if v.name == name:
            return int(v.type.tensor_type.elem_type)
    raise UserError(f"the graph has no type for MoE output {name!r}; rebuild it with this trtbuild (trtbuild build)")


def _split_node(node: onnx.NodeProto, elem_type: int) -> tuple[list[onnx.NodeProto], list[onnx.ValueInfoProto]]:
    a = attrs_of(node)
    layer = node.name.split("/")[0]
    refuse(a, layer)
    inputs = list(node.input)
    x, router_weight, fc_weight, proj_weight = inputs[:4]
    rest = inputs[4:]
    fc_bias, proj_bias = (rest[0], rest[1]) if a.use_bias else (None, None)
    router_bias = rest[2 * a.use_bias] if a.router_bias else None
    prequant = rest[-2:] if a.prequant else [None, None]
    p = f"{layer}.moe"
    k, h, inter, e = a.top_k, a.expert_hidden_size, a.expert_inter_size, a.number_of_experts
    nodes: list[onnx.NodeProto] = []

    def op(op_type: str, ins: list[str], out: str, **kw: Any) -> str:
        nodes.append(helper.make_node(op_type, ins, [out], name=f"{p}/{out.rsplit('.', 1)[-1]}", **kw))
        return out

    def const(name: str, values: list[int]) -> str:
        tensor = helper.make_tensor(f"{p}.{name}", TensorProto.INT64, [len(values)], values)
        return op("Constant", [], f"{p}.{name}", value=tensor)

    xf = op("Cast", [x], f"{p}.x_float", to=TensorProto.FLOAT)
    logits = op("Gemm", [xf, router_weight, *([router_bias] if router_bias else [])], f"{p}.logits", transB=1)
    kk = const("k", [k])
    top_k: dict[str, Any] = {"axis": -1, "largest": 1, "sorted": 1}
    if a.router_norm == "topk_softmax":
        nodes.append(helper.make_node("TopK", [logits, kk], [f"{p}.top", f"{p}.index"], name=f"{p}/topk", **top_k))
        weights = op("Softmax", [f"{p}.top"], f"{p}.weights", axis=-1)
    else:
        probs = op("Softmax", [logits], f"{p}.probs", axis=-1)
        nodes.append(helper.make_node("TopK", [probs, kk], [f"{p}.top", f"{p}.index"], name=f"{p}/topk", **top_k))
        weights = f"{p}.top"
        if a.router_norm == "softmax_topk_renormalise":
            total = op("ReduceSum", [weights, const("last", [-1])], f"{p}.top_sum", keepdims=1)
            weights = op("Div", [weights, total], f"{p}.weights")
    experts = op("Cast", [f"{p}.index"], f"{p}.experts", to=TensorProto.INT32)
    fields = _fields(a)
    assignments, offsets, hidden, out = f"{p}.assignments", f"{p}.offsets", f"{p}.h", f"{p}.out"
    nodes.append(
        helper.make_node(SORT_OP, [experts], [assignments, offsets], name=f"{p}/{SORT_OP}", domain=PLUGIN_DOMAIN,
                         **fields)
    )  # fmt: skip
    for stage, src, w, bias, pre, dst in (
        ("fc", x, fc_weight, fc_bias, prequant[0], hidden),
        ("proj", hidden, proj_weight, proj_bias, prequant[1], out),
    ):
        ins = [src, assignments, offsets, weights, w, *([bias] if bias else []), *([pre] if pre else [])]
        name = stage_op(stage, a)
        nodes.append(helper.make_node(name, ins, [dst], name=f"{p}/{name}", domain=PLUGIN_DOMAIN, **fields))
    per_token = op("Reshape", [out, const("shape", [-1, k, h])], f"{p}.per_token")
    total_out = op("ReduceSum", [per_token, const("k_axis", [1])], f"{p}.sum", keepdims=0)
    nodes.append(helper.make_node("Cast", [total_out], [node.output[0]], name=f"{p}/y", to=elem_type))
    rows = "moe_assignments"  # T * top_k
    info = [
        helper.make_tensor_value_info(assignments, TensorProto.INT32, [rows]),
        helper.make_tensor_value_info(offsets, TensorProto.INT32, [e + 1]),
        helper.make_tensor_value_info(hidden, elem_type, [rows, inter]),
        helper.make_tensor_value_info(out, TensorProto.FLOAT, [rows, h]),
    ]
    return nodes, info


def split_moe(model: onnx.ModelProto) -> onnx.ModelProto:
    """Every trtbuild::MoE node of `model` replaced, in place, by the router's ONNX ops, MoESort, the fc and proj
    plugins and the combine (module docstring); returns `model`. A graph without MoE nodes is left as it was."""
    if not any(n.domain == PLUGIN_DOMAIN and n.op_type == MOE_OP for n in model.graph.node):
        return model
    new: list[onnx.NodeProto] = []
    for node in model.graph.node:
        if node.domain == PLUGIN_DOMAIN and node.op_type == MOE_OP:
            nodes, info = _split_node(node, _dtype_of(model, node.output[0]))
            new += nodes
            model.graph.value_info.extend(info)
        else:
            new.append(node)
    del model.graph.node[:]
    model.graph.node.extend(new)
    return model


# --- the plugins' definitions in torch (what the kernels compute; the CPU engine runs the split graph with them) ---


def sort(a: MoEAttrs, experts: torch.Tensor, memo: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """MoESort: (assignments [T*k] int32, offsets [E+1] int32); a stable sort by expert (kernels/moe_sort.py)."""
    del memo
    flat = experts.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    offsets = torch.zeros(a.number_of_experts + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.bincount(flat, minlength=a.number_of_experts), 0)
    return order.to(torch.int32), offsets.to(torch.int32)


def _stage(
    stage: str, a: MoEAttrs, src: torch.Tensor, assignments: torch.Tensor, offsets: torch.Tensor,
    weights: torch.Tensor, w: torch.Tensor, *extra: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    bias = extra[0] if a.use_bias else None
    pre = extra[-1] if a.prequant else None
    fc = stage == "fc"
    n = a.expert_inter_size if fc else a.expert_hidden_size
    rows = assignments.numel()
    dst = torch.zeros(rows, n, dtype=src.dtype if fc else torch.float32)
    compute = torch.float64 if src.dtype == torch.float64 else torch.float32
    asg = assignments.long()
    act = ACTIVATION_FNS[a.activation]
    bounds = offsets.tolist()
    for expert in range(a.number_of_experts):
        lo, hi = bounds[expert], bounds[expert + 1]
        if lo == hi:
            continue
        r = asg[lo:hi]
        xe = (src[r // a.top_k] if fc else src[lo:hi]).to(compute)
        if pre is not None:
            xe = xe * pre[expert].to(compute)
        y = torch.nn.functional.linear(xe, w[expert].to(compute), None if bias is None else bias[expert].to(compute))
        if not fc:
            dst[r] = (y * weights.reshape(-1)[r, None].to(compute)).float()
            continue
        if a.clamped_swiglu:
            up, gate = y.chunk(2, dim=-1)
            if a.swiglu_limit:
                gate = gate.clamp(max=a.swiglu_limit)
                up = up.clamp(min=-a.swiglu_limit, max=a.swiglu_limit)
            y = gate * torch.sigmoid(gate * a.swiglu_alpha) * (up + a.swiglu_beta)
        elif a.gated:
            up, gate = y.chunk(2, dim=-1)
            y = up * act(gate)
        else:
            y = act(y)
        dst[lo:hi] = y.to(dst.dtype)
    return dst


def fc(a: MoEAttrs, *inputs: torch.Tensor, memo: Any = None) -> torch.Tensor:
    """MoEFc*: h [T*k, I] in x's type, row r = expert e's activation of token assignments[r] // k."""
    del memo
    return _stage("fc", a, *inputs)


def proj(a: MoEAttrs, *inputs: torch.Tensor, memo: Any = None) -> torch.Tensor:
    """MoEProj*: out [T*k, H] float32, row assignments[r] = weight x (h[r] @ proj_e^T + proj_bias_e)."""
    del memo
    return _stage("proj", a, *inputs)


REFERENCES: dict[str, Callable[..., Any]] = {
    SORT_OP: sort,
    **{op: fc for op in SPLIT_OPS if op.startswith(FC_OP)},
    **{op: proj for op in SPLIT_OPS if op.startswith(PROJ_OP)},
}
