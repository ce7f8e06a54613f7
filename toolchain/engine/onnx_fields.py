"""Every plugin field on every plugin node, for TensorRT's ONNX parser: a graph leaves a newer field out at its old
value (AttentionAttrs.to_attributes and OMITTED_AT, so that graphs not using it stay byte-identical), but
`tensorrt.plugin` takes no default attribute values ("Default values are not supported yet", tensorrt/plugin/
_validate.py) and TensorRT's parser only warns about a field a node lacks ("Attribute ... not found in plugin
node"), then calls the registered functions without it. The TensorRT backend therefore parses a copy completed
here, in memory; the graph on disk stays as built. The CPU backend needs none of this (from_attributes defaults).

A `tensorrt.plugin` plugin has a fixed input list, so attention with sinks (a seventh input, gpt-oss) is a plugin of
its own: in that copy its PagedAttention nodes are renamed SINKS_PLUGIN (tensorrt_registration.py registers both).
A MoE node is split there into the router's ONNX ops and three one-launch plugins (engine/moe_split.py)."""

from __future__ import annotations

import onnx
from onnx import helper

from toolchain.engine.contract import ATTENTION_OP, PLUGIN_DOMAIN
from toolchain.engine.moe_split import split_moe
from toolchain.engine.ops import OMITTED_AT, OP_FIELDS

SINKS_PLUGIN = "PagedAttentionSinks"  # TensorRT's name of a PagedAttention node with sinks=1 (seven inputs)


def complete_plugin_fields(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `model` whose plugin nodes carry every field of their op, omitted ones at their OMITTED_AT value,
    whose attention nodes with sinks are SINKS_PLUGIN nodes, and whose MoE nodes are split (moe_split.split_moe:
    its plugin nodes carry every field already)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    split_moe(out)
    for node in out.graph.node:
        if node.domain != PLUGIN_DOMAIN or node.op_type not in OP_FIELDS:
            continue
        present = {a.name for a in node.attribute}
        for name, value in OMITTED_AT.items():
            if name in OP_FIELDS[node.op_type] and name not in present:
                node.attribute.append(helper.make_attribute(name, value))
        if node.op_type == ATTENTION_OP and any(a.name == "sinks" and a.i for a in node.attribute):
            node.op_type = SINKS_PLUGIN
    return out
