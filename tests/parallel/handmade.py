"""Two-rank engines made by hand from a single-rank one (issue 27, slice B's tests of the process model that do not
need slice A's per-rank export): every rank holds the whole model, and a collective at the end makes the ranks
depend on each other while leaving the logits exactly the single-rank engine's.

- "tp": each rank halves its logits and all-reduces them over [0, 1]: 0.5 * x + 0.5 * x == x exactly in float32
  (a product by a power of two and a sum of two equal numbers round nothing).
- "pp": rank 0 sends its logits to rank 1 (the last stage, whose result reaches rank 0 through the facade), rank 1
  receives them into `logits_peer` and outputs (own + peer) * 0.5 == own, exactly as above.
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import onnx
from onnx import TensorProto, helper

from toolchain.checkpoint.trtllm import Mapping
from toolchain.engine.api import MODEL_NAME, EngineSpec, RankSpec, rank_dir
from toolchain.engine.collectives import (
    ALL_REDUCE_OP,
    RECV_OP,
    SEND_OP,
    TYPE_IDS,
    AllReduceAttrs,
    RecvAttrs,
    SendAttrs,
)
from toolchain.engine.contract import PLUGIN_DOMAIN
from toolchain.manifest import file_entry, read_manifest, write_manifest


def _rename_output(model: onnx.ModelProto, new: str) -> None:
    for node in model.graph.node:
        node.output[:] = [new if o == "logits" else o for o in node.output]


def _half(model: onnx.ModelProto, x: str, out: str) -> None:
    model.graph.initializer.append(helper.make_tensor("half", TensorProto.FLOAT, [], [0.5]))
    model.graph.node.append(helper.make_node("Mul", [x, "half"], [out], name=f"{out} = {x} * 0.5"))


def _graph(model: onnx.ModelProto, kind: str, rank: int) -> onnx.ModelProto:
    f32 = TYPE_IDS["float32"]
    _rename_output(model, "logits_own")
    nodes = model.graph.node
    if kind == "tp":
        _half(model, "logits_own", "logits_half")
        attrs = AllReduceAttrs(type_id=f32, group=(0, 1)).to_attributes(ALL_REDUCE_OP)
        nodes.append(helper.make_node(ALL_REDUCE_OP, ["logits_half"], ["logits"], name="logits all-reduce",
                                      domain=PLUGIN_DOMAIN, **attrs))  # fmt: skip
    elif rank == 0:
        attrs = SendAttrs(type_id=f32, tgt_rank=1).to_attributes(SEND_OP)
        nodes.append(helper.make_node(SEND_OP, ["logits_own"], ["logits"], name="logits to rank 1",
                                      domain=PLUGIN_DOMAIN, **attrs))  # fmt: skip
    else:
        attrs = RecvAttrs(type_id=f32, src_rank=0).to_attributes(RECV_OP)
        nodes.append(helper.make_node(RECV_OP, ["logits_own"], ["logits_peer"], name="logits from rank 0",
                                      domain=PLUGIN_DOMAIN, **attrs))  # fmt: skip
        nodes.append(helper.make_node("Add", ["logits_own", "logits_peer"], ["logits_sum"], name="own + peer"))
        _half(model, "logits_sum", "logits")
        model.graph.value_info.append(
            helper.make_tensor_value_info("logits_peer", TensorProto.FLOAT, ["num_outputs", "vocab_size"])
        )
    return model


def two_rank_engine(single: Path, out: Path, kind: str) -> Path:
    """`single` (a single-rank CPU engine) as a 2-rank engine of `kind` "tp" or "pp" in `out`, its manifest
    listing every file as a build would."""
    shutil.copytree(single, out)
    spec = EngineSpec.from_dir(out)
    (out / MODEL_NAME).unlink()
    mapping = Mapping.for_parallel(2, 1) if kind == "tp" else Mapping.for_parallel(1, 2)
    ranks = []
    for r in range(2):
        rank_dir(out, r).mkdir()
        model = _graph(onnx.load(str(single / MODEL_NAME)), kind, r)
        onnx.save(model, str(rank_dir(out, r) / MODEL_NAME))
        tp_rank, pp_rank = (r, 0) if kind == "tp" else (0, r)
        ranks.append(RankSpec(r, tp_rank, pp_rank, (0, spec.num_layers), spec.kv_cache))
    replace(spec, mapping=mapping, ranks=tuple(ranks)).write(out)
    manifest = read_manifest(out)
    manifest["outputs"] = [
        file_entry(p, out) for p in sorted(out.rglob("*")) if p.is_file() and p.name != "manifest.json"
    ]
    write_manifest(out, manifest)
    return out
