"""TensorRT's own ONNX ops (domain `trt`) and FP4 tensors, made runnable by ONNX Runtime: the CPU engine lowers an
engine graph that holds them when it loads it (`lower_for_ort`), and runs what it lowered to by the reference
functions here (`LOWERED_OPS`).

ONNX Runtime 1.32 on CPU cannot dequantize FLOAT4E2M1 (NOT_IMPLEMENTED at opset 23) and has no op for TensorRT's
dynamic block quantization (its DynamicQuantizeLinear is uint8 only). The exported graph stays TensorRT's form
(quantize/methods/nvfp4.py, mxfp8.py say which); the lowering rewrites, on a copy:
- a weight's FP4 chain DequantizeLinear(FP8 block scales, global) -> DequantizeLinear(FLOAT4E2M1 weight, scales):
  folded into a float32 initializer by our exact decoder (E2M1 table, E4M3 scales times the float32 global: one
  rounding, as DequantizeLinear's x · scale);
- a weight's `trt::TRT_MXFP8DequantizeLinear(E4M3 weight, E8M0 uint8 scales)`: folded likewise (2^(s − 127) times
  the E4M3 value: exact in float32);
- an input's `trt::TRT_FP4DynamicQuantize(x, global) -> (x_fp4, scales_fp8)` with its two DequantizeLinear
  consumers: one `trtbuild.ort::FP4QDQ(x, global)` node, computed by quantize/methods/nvfp4.py `nvfp4_qdq`;
- an input's `trt::TRT_MXFP8DynamicQuantize(x) -> (x_fp8, scales)` with its `TRT_MXFP8DequantizeLinear`: one
  `trtbuild.ort::MXFP8QDQ(x)` node, computed by quantize/methods/mxfp8.py `mxfp8_qdq`.
Anything else in the `trt` domain is refused by name: this engine does not know what it computes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from toolchain.checkpoint.prequant.codecs import e2m1_decode, e8m0_decode
from toolchain.errors import UserError
from toolchain.quantize.methods.mxfp8 import MXFP8_DEQUANTIZE_OP, MXFP8_QUANTIZE_OP, mxfp8_qdq
from toolchain.quantize.methods.nvfp4 import FP4_QUANTIZE_OP, TRT_DOMAIN, nvfp4_qdq

LOWERED_DOMAIN = "trtbuild.ort"  # the ops the lowering makes; only the CPU engine ever sees them
FP4_QDQ, MXFP8_QDQ = "FP4QDQ", "MXFP8QDQ"
TORCH_TYPES: dict[int, torch.dtype] = {
    TensorProto.FLOAT: torch.float32,
    TensorProto.FLOAT16: torch.float16,
    TensorProto.BFLOAT16: torch.bfloat16,
}


def _fp4_qdq(attrs: dict[str, Any], x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    return nvfp4_qdq(x, g)


def _mxfp8_qdq(attrs: dict[str, Any], x: torch.Tensor) -> torch.Tensor:
    return mxfp8_qdq(x).to(TORCH_TYPES[int(attrs["output_dtype"])])


LOWERED_OPS: dict[str, Callable[..., torch.Tensor]] = {FP4_QDQ: _fp4_qdq, MXFP8_QDQ: _mxfp8_qdq}


def holds_trt(model: onnx.ModelProto) -> bool:
    """Whether the graph needs lowering before ONNX Runtime can run it."""
    g = model.graph
    return any(n.domain == TRT_DOMAIN for n in g.node) or any(
        t.data_type == TensorProto.FLOAT4E2M1 for t in g.initializer
    )


def _array(t: TensorProto) -> np.ndarray:
    """An initializer's values as float32 (FLOAT4E2M1, FLOAT8E4M3FN, float types) or as stored (uint8)."""
    raw = np.frombuffer(t.raw_data, dtype=np.uint8)
    dims = tuple(t.dims)
    if t.data_type == TensorProto.FLOAT4E2M1:
        return e2m1_decode(raw)[: int(np.prod(dims))].reshape(dims)
    if t.data_type == TensorProto.FLOAT8E4M3FN:
        return torch.from_numpy(raw.copy()).view(torch.float8_e4m3fn).float().numpy().reshape(dims)
    if t.data_type in (TensorProto.FLOAT16, TensorProto.BFLOAT16):
        kind = torch.float16 if t.data_type == TensorProto.FLOAT16 else torch.bfloat16
        return torch.from_numpy(raw.copy()).view(kind).float().numpy().reshape(dims)
    stored: np.ndarray = numpy_helper.to_array(t)
    return stored


def _attr(node: onnx.NodeProto, name: str, default: int) -> int:
    for a in node.attribute:
        if a.name == name:
            return int(helper.get_attribute_value(a))
    return default


def _blocked(values: np.ndarray, scale: np.ndarray, axis: int, block: int) -> np.ndarray:
    """DequantizeLinear's blocked product x · scale (scale repeated `block` times along `axis`), float32."""
    axis = axis % values.ndim
    expanded = np.repeat(scale.astype(np.float32), block, axis=axis)
    expanded = np.take(expanded, np.arange(values.shape[axis]), axis=axis)  # a partial last block
    product: np.ndarray = (values.astype(np.float32) * expanded).astype(np.float32)
    return product


def _scalar_product(values: np.ndarray, scale: np.ndarray, node: onnx.NodeProto) -> np.ndarray:
    """A per-tensor (scalar) or per-axis DequantizeLinear's x · scale in float32."""
    shape = [1] * values.ndim
    if scale.size > 1:
        shape[_attr(node, "axis", 1) % values.ndim] = -1
    product: np.ndarray = (values.astype(np.float32) * scale.astype(np.float32).reshape(shape)).astype(np.float32)
    return product


def _feeds_fp4(n: onnx.NodeProto, consumers: dict[str, list[onnx.NodeProto]], inits: dict[str, TensorProto]) -> bool:
    """Whether DequantizeLinear `n` makes the scales of FP4 weights only (the first of a weight's two)."""
    users = consumers.get(n.output[0], [])
    return bool(users) and all(
        u.op_type == "DequantizeLinear"
        and u.input[0] in inits
        and inits[u.input[0]].data_type == TensorProto.FLOAT4E2M1
        for u in users
    )


def lower_for_ort(model: onnx.ModelProto, source: str = "model.onnx") -> onnx.ModelProto:
    """The graph with TensorRT's FP4 / MXFP8 forms rewritten into what ONNX Runtime runs (the module says how); the
    model itself when it holds none."""
    if not holds_trt(model):
        return model
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in g.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    folded: dict[str, np.ndarray] = {}  # DequantizeLinear outputs computed here, by name
    dropped: set[int] = set()  # ids of the nodes replaced
    added: dict[int, onnx.NodeProto] = {}  # id of the node replaced -> the node taking its place
    value_info: list[onnx.ValueInfoProto] = []

    def only(name: str, op: str, node: onnx.NodeProto) -> onnx.NodeProto:
        users = consumers.get(name, [])
        if len(users) != 1 or users[0].op_type != op:
            raise UserError(
                f"{source}: {node.domain}::{node.op_type} node {node.name}: its output {name} feeds "
                f"{[u.op_type for u in users]}, not one {op} as trtbuild's export makes it; rebuild the engine"
            )
        return users[0]

    for n in g.node:
        if n.op_type == "DequantizeLinear" and n.domain == "" and n.input[0] in inits:
            data = inits[n.input[0]]
            if data.data_type == TensorProto.FLOAT4E2M1:  # the FP4 weight: its scales folded just before
                if n.input[1] not in folded:
                    raise UserError(f"{source}: {n.name}: FP4 weight {n.input[0]}'s scales are not constants")
                block = _attr(n, "block_size", 0)
                folded[n.output[0]] = _blocked(_array(data), folded.pop(n.input[1]), _attr(n, "axis", 1), block)
                dropped.add(id(n))
            elif data.data_type == TensorProto.FLOAT8E4M3FN and n.input[1] in inits and _feeds_fp4(n, consumers, inits):
                folded[n.output[0]] = _scalar_product(_array(data), _array(inits[n.input[1]]), n)
                dropped.add(id(n))
        elif n.domain == TRT_DOMAIN and n.op_type == MXFP8_DEQUANTIZE_OP and n.input[0] in inits:
            if _attr(n, "output_dtype", TensorProto.FLOAT) != TensorProto.FLOAT:
                raise UserError(f"{source}: {n.name}: an MXFP8 weight dequantizes to float32 in trtbuild's export")
            values, scales = _array(inits[n.input[0]]), e8m0_decode(_array(inits[n.input[1]]))
            folded[n.output[0]] = _blocked(values, scales, _attr(n, "axis", -1), _attr(n, "block_size", 32))
            dropped.add(id(n))
        elif n.domain == TRT_DOMAIN and n.op_type == FP4_QUANTIZE_OP:
            scale_dq = only(n.output[1], "DequantizeLinear", n)
            data_dq = only(n.output[0], "DequantizeLinear", n)
            if data_dq.input[1] != scale_dq.output[0] or scale_dq.input[1] != n.input[1]:
                raise UserError(f"{source}: {n.name}: not the TRT_FP4DynamicQuantize -> DequantizeLinear x2 chain")
            node = helper.make_node(
                FP4_QDQ, [n.input[0], n.input[1]], [data_dq.output[0]], name=n.name, domain=LOWERED_DOMAIN
            )
            added[id(n)] = node
            dropped.update((id(scale_dq), id(data_dq)))
            elem = inits[n.input[1]].data_type if n.input[1] in inits else TensorProto.FLOAT
            value_info.append(helper.make_tensor_value_info(data_dq.output[0], elem, None))
        elif n.domain == TRT_DOMAIN and n.op_type == MXFP8_QUANTIZE_OP:
            dq = only(n.output[0], MXFP8_DEQUANTIZE_OP, n)
            if only(n.output[1], MXFP8_DEQUANTIZE_OP, n) is not dq:
                raise UserError(f"{source}: {n.name}: not the TRT_MXFP8DynamicQuantize -> dequantize pair")
            elem = _attr(dq, "output_dtype", TensorProto.FLOAT)
            node = helper.make_node(
                MXFP8_QDQ, [n.input[0]], [dq.output[0]], name=n.name, domain=LOWERED_DOMAIN, output_dtype=elem
            )
            added[id(n)] = node
            dropped.add(id(dq))
            value_info.append(helper.make_tensor_value_info(dq.output[0], elem, None))
        elif n.domain == TRT_DOMAIN and id(n) not in dropped:
            raise UserError(
                f"{source}: {TRT_DOMAIN}::{n.op_type} ({n.name}) has no reference implementation in the CPU engine "
                f"(it runs {FP4_QUANTIZE_OP}, {MXFP8_QUANTIZE_OP}, {MXFP8_DEQUANTIZE_OP}); build for TensorRT"
            )
    nodes = [added.get(id(n), n) for n in g.node if id(n) not in dropped]
    used = {i for n in nodes for i in n.input}
    kept = [t for t in g.initializer if t.name in used]
    new_inits = [numpy_helper.from_array(v.astype(np.float32), name) for name, v in folded.items()]
    lowered = onnx.ModelProto()
    lowered.CopyFrom(model)
    del lowered.graph.node[:]
    lowered.graph.node.extend(nodes)
    del lowered.graph.initializer[:]
    lowered.graph.initializer.extend([*kept, *new_inits])
    lowered.graph.value_info.extend(value_info)
    if added:
        lowered.opset_import.append(helper.make_opsetid(LOWERED_DOMAIN, 1))
    return lowered
