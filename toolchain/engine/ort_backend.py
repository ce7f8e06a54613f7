"""The CPU engine: the engine graph run by ONNX Runtime, with our plugin ops run by their reference
implementations (ops.py).

The graph is cut at its plugin nodes into segments of standard ops, one ONNX Runtime session each; a call runs
segment, plugin node, segment, ... passing values by name. The KV pool never enters ONNX Runtime: it is one torch
tensor the caller owns, handed to every plugin node, which writes the new tokens into it in place — the pool's
pool is an input the plugins update in place, as a TensorRT engine's pool binding is. A plugin node's initializer
inputs (a MoE layer's router and experts) are read once, as torch tensors, when the engine opens.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper

from toolchain.engine.api import BUILD_CONFIG, MODEL_NAME, EngineSpec, StepTokens, tokens_on_host
from toolchain.engine.collectives import COLLECTIVE_OPS, CollectiveAttrs, Communicator, LocalComm, run_collective
from toolchain.engine.contract import PLUGIN_DOMAIN, Batch
from toolchain.engine.ops import OP_ATTRS, OPS, AttentionAttrs, MoEAttrs
from toolchain.engine.trt_ops import LOWERED_DOMAIN, LOWERED_OPS, lower_for_ort
from toolchain.errors import UserError


@dataclass
class _Segment:
    session: object  # onnxruntime.InferenceSession
    inputs: list[str]
    outputs: list[str]


@dataclass
class _Plugin:
    op: str
    attrs: AttentionAttrs | MoEAttrs | CollectiveAttrs
    inputs: list[str]
    outputs: list[str]
    weights: dict[str, torch.Tensor]  # its initializer inputs, by name
    name: str = ""  # the node's name (a collective's errors say it)


@dataclass
class _Reference:
    """A node the load-time lowering made of TensorRT's FP4 / MXFP8 ops (trt_ops.py), run by its reference."""

    op: str
    attrs: dict[str, Any]
    inputs: list[str]
    outputs: list[str]
    weights: dict[str, torch.Tensor]


def available_cores() -> int:
    """The cores this process may actually use: its CPU affinity, capped by a cgroup CPU quota (a container's
    `cpu.max`), not the machine's count, which ONNX Runtime's default would take."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, int(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return cores


THREADS_ENV = "TRTBUILD_ORT_THREADS"


def ort_threads(requested: int = 0) -> int:
    """ONNX Runtime's intra-op threads: `requested` when given, else $TRTBUILD_ORT_THREADS (to pin the thread
    count, e.g. to check that results do not depend on it), else every core this process may use."""
    if requested:
        return requested
    value = os.environ.get(THREADS_ENV, "").strip()
    if not value:
        return available_cores()
    if not value.isdigit() or int(value) < 1:
        raise UserError(f"{THREADS_ENV}={value!r}: expected a whole number of threads, 1 or more (or unset it)")
    return int(value)


def _skeleton(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with large initializers' bytes dropped (dims and types kept), small enough to serialize for
    shape inference whatever the model's size; small ones (shapes, axes) keep their values, which inference reads."""
    skeleton = onnx.ModelProto()
    skeleton.CopyFrom(model)
    for tensor in skeleton.graph.initializer:
        if len(tensor.raw_data) > 4096:
            tensor.ClearField("raw_data")
    return skeleton


def _split(model: onnx.ModelProto) -> list[tuple[list[onnx.NodeProto], onnx.NodeProto | None]]:
    """Runs of standard nodes, each followed by the plugin node (or lowered TensorRT op: trt_ops.py) that ends it
    (None after the last run)."""
    parts: list[tuple[list[onnx.NodeProto], onnx.NodeProto | None]] = []
    run: list[onnx.NodeProto] = []
    for node in model.graph.node:
        if node.domain == LOWERED_DOMAIN and node.op_type in LOWERED_OPS:
            parts.append((run, node))
            run = []
        elif node.domain == PLUGIN_DOMAIN:
            if node.op_type not in OPS and node.op_type not in COLLECTIVE_OPS:
                raise ValueError(f"no reference implementation for {node.domain}::{node.op_type}")
            parts.append((run, node))
            run = []
        else:
            run.append(node)
    parts.append((run, None))
    return parts


def _plugin_inputs(
    step: _Plugin | _Reference, values: dict[str, np.ndarray], kv_cache: torch.Tensor
) -> list[torch.Tensor]:
    """A plugin node's inputs: the pool itself (never a copy: the op writes it in place), its weights, and the
    values computed so far (torch views of ONNX Runtime's arrays)."""
    inputs = []
    for name in step.inputs:
        if name == "kv_cache":
            inputs.append(kv_cache)
        elif name in step.weights:
            inputs.append(step.weights[name])
        else:
            inputs.append(torch.from_numpy(values[name]))
    return inputs


class OrtEngine:
    """Run an engine directory's model.onnx on CPU (the `Engine` protocol of api.py). Engine facts come from the
    spec; the graph is only checked against it."""

    def __init__(self, spec: EngineSpec, threads: int = 0, comm: Communicator | None = None):
        """`comm` runs the graph's collective ops (one rank of a multi-rank engine, issue 27); a one-rank world's
        LocalComm by default."""
        import onnxruntime as ort

        self.spec = spec
        self.comm: Communicator = LocalComm() if comm is None else comm
        self.vocab_size = spec.vocab_size
        self.tokens_per_block = spec.limits.tokens_per_block
        model_path = spec.engine_dir / MODEL_NAME
        if not model_path.is_file():
            raise UserError(f"{spec.engine_dir}: no {MODEL_NAME}; the engine directory is incomplete, rebuild it")
        model = onnx.load(str(model_path))  # external data (past 2 GiB) included
        model = lower_for_ort(model, str(model_path))  # TensorRT's FP4 / MXFP8 forms made runnable (trt_ops.py)
        inferred = onnx.shape_inference.infer_shapes(_skeleton(model))
        types = {v.name: v for v in [*inferred.graph.value_info, *model.graph.input, *model.graph.output]}
        inits = {t.name: t for t in model.graph.initializer}
        parts = _split(model)
        graph_outputs = {o.name for o in model.graph.output}
        options = ort.SessionOptions()
        options.intra_op_num_threads = ort_threads(threads)
        # one session per segment: idle thread pools must sleep, not spin, or they starve the next segment and
        # the reference ops between them (bench/engine.py on 2 cores: decode 13x, prefill 6x slower when they spin)
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.steps: list[_Segment | _Plugin | _Reference] = []
        for index, (nodes, plugin) in enumerate(parts):
            later: set[str] = set(graph_outputs)
            for rest, after in parts[index + 1 :]:
                later.update(i for n in rest for i in n.input)
                if after is not None:
                    later.update(after.input)
            if plugin is not None:
                later.update(plugin.input)
            produced = [o for n in nodes for o in n.output]
            consumed = [i for n in nodes for i in n.input if i]
            seg_inputs = sorted({i for i in consumed if i not in inits and i not in produced})
            seg_outputs = [o for o in produced if o in later]
            if nodes:
                sub = helper.make_graph(
                    nodes,
                    f"segment{index}",
                    [types[i] for i in seg_inputs],
                    [types[o] for o in seg_outputs],
                    [inits[i] for i in sorted({i for i in consumed if i in inits})],
                )
                sub_model = helper.make_model(sub, opset_imports=[o for o in model.opset_import if o.domain == ""])
                sub_model.ir_version = model.ir_version
                if sub_model.ByteSize() >= 2**31:
                    raise UserError(
                        f"{model_path}: segment {index} of the graph holds over 2 GiB of weights, more than one ONNX "
                        "Runtime session takes; the CPU engine runs models up to ~1.5 B parameters per layer group"
                    )
                session = ort.InferenceSession(
                    sub_model.SerializeToString(), options, providers=["CPUExecutionProvider"]
                )
                self.steps.append(_Segment(session, seg_inputs, seg_outputs))
            if plugin is not None and plugin.domain == LOWERED_DOMAIN:
                attrs = {a.name: helper.get_attribute_value(a) for a in plugin.attribute}
                weights = {
                    i: torch.from_numpy(numpy_helper.to_array(inits[i]).copy()) for i in plugin.input if i in inits
                }
                self.steps.append(_Reference(plugin.op_type, attrs, list(plugin.input), list(plugin.output), weights))
            elif plugin is not None:
                attrs = {a.name: helper.get_attribute_value(a) for a in plugin.attribute}
                attrs = {k: v.decode() if isinstance(v, bytes) else v for k, v in attrs.items()}
                op = plugin.op_type
                try:
                    parsed = OP_ATTRS[op].from_attributes(op, attrs)
                except (TypeError, ValueError) as e:
                    raise UserError(f"{model_path}: {e}; the graph is from another trtbuild version, rebuild it") from e
                weights = {
                    i: torch.from_numpy(numpy_helper.to_array(inits[i]).copy()) for i in plugin.input if i in inits
                }
                self.steps.append(
                    _Plugin(
                        op, parsed, list(plugin.input), list(plugin.output), weights, plugin.name or plugin.output[0]
                    )
                )
        # logits; a non-last pipeline stage's is the hidden states it sent on to the next stage (export.py)
        self.output = model.graph.output[0].name
        self._check_graph(model, model_path)

    def _check_graph(self, model: onnx.ModelProto, model_path: Path) -> None:
        """The graph and the spec must describe the same engine (a mismatch means a tampered or mixed-up dir)."""
        kv = self.spec.kv_cache
        pool = next(i for i in model.graph.input if i.name == "kv_cache").type.tensor_type.shape.dim
        # a non-last pipeline stage outputs its hidden states, no logits (export.py): only the vocab is not checked
        out = next((o for o in model.graph.output if o.name == "logits"), None)
        vocab = self.vocab_size if out is None else out.type.tensor_type.shape.dim[1].dim_value
        attrs = next(s.attrs for s in self.steps if isinstance(s, _Plugin) and isinstance(s.attrs, AttentionAttrs))
        graph = (pool[0].dim_value, vocab, attrs.tokens_per_block, attrs.kv_cache_dtype, attrs.num_kv_heads)
        spec = (kv.num_layers, self.vocab_size, kv.tokens_per_block, kv.dtype, kv.num_kv_heads)
        if graph != spec or attrs.head_size != kv.head_size:
            raise UserError(
                f"{model_path} (layers, vocab, tokens/block, KV dtype, KV heads = {graph}) does not match its "
                f"{BUILD_CONFIG} {spec}; rebuild the engine"
            )

    def new_kv_cache(self, num_blocks: int) -> torch.Tensor:
        """A zeroed pool for `num_blocks` blocks (fp8 pools are held as their bytes, uint8)."""
        kv = self.spec.kv_cache
        return torch.zeros(kv.pool_shape(num_blocks), dtype=kv.storage_dtype)

    def forward(self, batch: Batch, kv_cache: torch.Tensor) -> np.ndarray:
        # the reference ops are small gathers and einsums: torch's thread pool spinning beside ONNX Runtime's (and
        # beside any other work on the machine) made a decode step 8x slower on 2 busy cores (docs/benchmarks.md)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return self._forward(batch, kv_cache)
        finally:
            torch.set_num_threads(threads)

    def forward_tokens(self, batch: Batch, kv_cache: torch.Tensor, sampled: Sequence[int]) -> StepTokens:
        return tokens_on_host(self.forward(batch, kv_cache), sampled)

    def _forward(self, batch: Batch, kv_cache: torch.Tensor) -> np.ndarray:
        kv = self.spec.kv_cache
        expected, dtype = kv.pool_shape(kv_cache.shape[1]), kv.storage_dtype
        if tuple(kv_cache.shape) != expected or kv_cache.dtype != dtype:
            raise ValueError(f"KV pool {tuple(kv_cache.shape)} {kv_cache.dtype}; this engine needs [*, blocks] {dtype}")
        batch.check(self.tokens_per_block)
        batch.check_blocks(kv_cache.shape[1], self.tokens_per_block)
        values: dict[str, np.ndarray] = dict(batch.feeds())
        memo: dict[Any, Any] = {}  # the batch's geometry, worked out by the first layer's ops for all (ops._memo)
        for step in self.steps:
            if isinstance(step, _Segment):
                results = step.session.run(step.outputs, {n: values[n] for n in step.inputs})  # type: ignore[attr-defined]
                values.update(zip(step.outputs, results, strict=True))
                continue
            if isinstance(step, _Reference):
                out = LOWERED_OPS[step.op](step.attrs, *_plugin_inputs(step, values, kv_cache))
            elif isinstance(step.attrs, CollectiveAttrs):  # issue 27: run by this rank's communicator
                x = _plugin_inputs(step, values, kv_cache)[0]
                out = run_collective(self.comm, step.op, step.attrs, x, step.name)
            else:
                out = OPS[step.op](step.attrs, *_plugin_inputs(step, values, kv_cache), memo=memo)
            outs = out if isinstance(out, tuple) else (out,)  # a plugin may have several outputs (MoESort's two)
            values.update((name, o.numpy()) for name, o in zip(step.outputs, outs, strict=True))
        return values[self.output]
