"""Registers the trtbuild plugins with TensorRT through `tensorrt.plugin` (quickly deployable plugins, ahead of
time: shape and type functions, then the Triton kernel's PTX and its launch, so an engine needs no Python at run
time).

Imported by toolchain/engine/tensorrt_backend.py before the ONNX parser meets the `trtbuild::KVCacheWrite` and
`trtbuild::PagedAttention` nodes. `@trtp.aot_impl` returns (kernel name, PTX compiled for the build GPU's SM with
this node's attributes as constexprs, KernelLaunchParams, SymIntExprs of the int32 scalars); TensorRT launches
the kernel with input pointers, then those scalars, then output pointers — the order of every kernel's parameters
(toolchain/plugins/kernels/common.py), with Triton's two hidden trailing scratch pointers stripped from the PTX by
the compile (toolchain/plugins/compile.py). Names, grids, blocks and scalars come from launch.py.

KVCacheWrite writes the pool, an input, in place; the aliasing is not declared to TensorRT (it would take a
second plugin output, so a graph and kernel-signature change): docs/kernels.md says why and what a GPU run must
check first. A graph omits q_scaling at 1.0 (AttentionAttrs.to_attributes) and tensorrt.plugin has no default
field values: TensorRT must parse the graph as engine/onnx_fields.complete_plugin_fields returns it. That copy also
names a PagedAttention node with sinks=1 `PagedAttentionSinks` (onnx_fields.SINKS_PLUGIN): a plugin's inputs are
fixed, and attention with sinks takes a seventh, the heads' float32 sink logits, which the kernel takes as its
seventh pointer (after the pool, before the int32 scalars).

The MoE op is split in that copy too (engine/moe_split.py) into MoESort and the experts kernel's fc and proj stages,
registered at the end of this module (nine plugins: the stages in four fixed input lists each).

Tested without TensorRT against the `tensorrt.plugin` contract (tests/plugins/test_registration.py); not yet run
with TensorRT: no machine of this project has had it.
"""

# No `from __future__ import annotations`: tensorrt.plugin reads the decorated functions' annotations with
# inspect.signature and checks them as classes (issubclass of TensorDesc, KernelLaunchParams, ...; its _validate.py).
import importlib
import inspect
from dataclasses import MISSING, fields
from typing import Any

import numpy as np
import numpy.typing as np_typing
import tensorrt as trt
import tensorrt.plugin as trtp

from toolchain.engine import collectives, moe_split
from toolchain.engine.onnx_fields import SINKS_PLUGIN
from toolchain.engine.ops import OP_FIELDS, AttentionAttrs, MoEAttrs
from toolchain.manifest import gpu_info
from toolchain.plugins import launch
from toolchain.plugins.kernels import common, moe, moe_sort

# TensorRT's type names (AutoTuneCombination strings; trt.DataType members) of the graph's tensors: activations in
# the engine's float type; the pool in the activations' type, or INT8, or FP8 for the graph's FLOAT8E4M3FN
# (toolchain/engine/export.py KV_ONNX); position ids, lengths and block tables INT32.
TRT_TYPE_NAMES = {"float32": "FP32", "float16": "FP16", "bfloat16": "BF16", "int8": "INT8", "fp8": "FP8"}
_DATA_TYPE_MEMBERS = {"float32": "FLOAT", "float16": "HALF", "bfloat16": "BF16", "int8": "INT8", "fp8": "FP8"}


def dtype_name(dtype: Any) -> str | None:
    """Our name of a trt.DataType ("float16", "int8", "fp8", ...), None for a type no kernel takes. Looked up when
    called: importing this module only registers functions."""
    for name, member in _DATA_TYPE_MEMBERS.items():
        if dtype == getattr(trt.DataType, member):
            return name
    return None


def combinations() -> list[tuple[str, str]]:
    """(activation, pool dtype) pairs a kernel serves (common.check_types): the pool in the activations' own float
    type, or int8 / fp8 codes."""
    return [(act, pool) for act in common.ACTIVATIONS for pool in (act, "int8", "fp8")]


def type_combination(activation: str, pool: str, sinks: bool = False) -> str:
    """An AutoTuneCombination string, one type per I/O in order: first input, 4 x int32, pool, with sinks their
    FP32 input, the output."""
    act, kv = TRT_TYPE_NAMES[activation], TRT_TYPE_NAMES[pool]
    return f"{act}, INT32, INT32, INT32, INT32, {kv}, {'FP32, ' if sinks else ''}{act}"


def _tune(sinks: bool = False) -> list[Any]:
    return [trtp.AutoTuneCombination(type_combination(a, k, sinks), "LINEAR") for a, k in combinations()]


def attrs_of(op: str, values: dict[str, Any]) -> AttentionAttrs:
    """The node's attributes (TensorRT passes op's fields only) as AttentionAttrs, other fields at their defaults."""
    defaults = {f.name: f.default for f in fields(AttentionAttrs) if f.default is not MISSING}
    return AttentionAttrs(**{**defaults, **{k: v for k, v in values.items() if k in OP_FIELDS[op]}})


def build_arch() -> str:
    """The SM TensorRT builds for: GPU 0's, read from nvidia-smi as the manifest does."""
    sm = gpu_info()["sm"]
    if sm is None:
        raise RuntimeError("trtbuild plugins: no GPU visible to read its SM from; TensorRT builds need one")
    return f"sm_{sm}"


def compiled(op: str, a: AttentionAttrs, activation: str) -> Any:
    """op's kernel compiled for the build GPU with these attributes: `.name`, `.ptx` (the hidden scratch
    parameters stripped), `.shared` (dynamic shared memory bytes)."""
    compile_module = importlib.import_module("toolchain.plugins.compile")
    return compile_module.compile_kernel(op, a, activation, build_arch())


def _activation(desc: Any, what: str) -> str:
    name = dtype_name(desc.dtype)
    if name not in common.ACTIVATIONS:
        raise ValueError(f"{what} dtype {desc.dtype}: the kernels take {', '.join(common.ACTIVATIONS)}")
    return name


def aot(
    op: str, first: Any, new_lens: Any, block_tables: Any, kv_cache: Any, values: dict[str, Any], sinks: Any = None
) -> Any:
    """aot_impl's answer for either op: (kernel name, PTX, KernelLaunchParams, SymIntExprs of the int32 scalars).
    `sinks`: the PagedAttentionSinks plugin's seventh input, there exactly when the node's sinks field is 1."""
    a = attrs_of(op, values)
    activation = _activation(first, f"{op} input 0")
    if op == "PagedAttention" and bool(a.sinks) != (sinks is not None):
        plugin = f"trtbuild::{SINKS_PLUGIN if sinks is not None else op}"
        raise ValueError(
            f"{plugin} with sinks={a.sinks}: attention with sinks is the seven-input {SINKS_PLUGIN} plugin, "
            f"without them the six-input {op}; TensorRT must parse the graph as "
            "engine/onnx_fields.complete_plugin_fields returns it"
        )
    if sinks is not None and (dtype_name(sinks.dtype) != "float32" or len(sinks.shape_expr) != 1):
        raise ValueError(
            f"{SINKS_PLUGIN}: sinks input of type {sinks.dtype} with {len(sinks.shape_expr)} dims; expected FP32 "
            f"[num_heads] ({a.num_heads}), as engine/export.py writes it"
        )
    if dtype_name(kv_cache.dtype) != a.kv_cache_dtype:  # the graph types the pool as kv_cache_dtype
        raise ValueError(
            f"{op}: kv_cache tensor of type {kv_cache.dtype} but kv_cache_dtype={a.kv_cache_dtype!r} needs "
            f"{TRT_TYPE_NAMES.get(a.kv_cache_dtype, a.kv_cache_dtype)}; rebuild the graph (trtbuild build)"
        )
    kernel = compiled(op, a, activation)
    dims = launch.batch_dims(first.shape_expr, new_lens.shape_expr, block_tables.shape_expr, kv_cache.shape_expr)
    plan = launch.describe(op, a, dims, int(kernel.shared))
    if kernel.name != plan.kernel:
        raise RuntimeError(f"{op}: compiled entry {kernel.name!r} is not the launched kernel {plan.kernel!r}")
    launch.check_ptx(op, a, activation, kernel.ptx)
    params = trtp.KernelLaunchParams()
    params.grid_x, params.grid_y, params.grid_z = plan.grid
    params.block_x = plan.block_x
    params.shared_mem = plan.shared_mem
    args = trtp.SymIntExprs(len(plan.scalars))
    for i, value in enumerate(plan.scalars):
        args[i] = trtp.SymInt32(value)
    return plan.kernel, kernel.ptx, params, args


@trtp.register("trtbuild::KVCacheWrite")
def _kv_write_desc(
    qkv: trtp.TensorDesc,
    position_ids: trtp.TensorDesc,
    context_lens: trtp.TensorDesc,
    new_lens: trtp.TensorDesc,
    block_tables: trtp.TensorDesc,
    kv_cache: trtp.TensorDesc,
    layer: int,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    tokens_per_block: int,
    rotary_style: str,
    rotary_base: float,
    rotary_scaling_type: str,
    rotary_scaling_factor: float,
    rotary_low_freq_factor: float,
    rotary_high_freq_factor: float,
    rotary_original_max_positions: int,
    rotary_beta_fast: float,
    rotary_beta_slow: float,
    rotary_truncate: int,
    rotary_attention_factor: float,
    kv_cache_dtype: str,
    kv_scale: float,
) -> trtp.TensorDesc:
    out = qkv.like()  # q after rotary: [num_tokens, num_heads * head_size]
    out.shape_expr[1] = num_heads * head_size
    return out


@trtp.autotune("trtbuild::KVCacheWrite")
def _kv_write_tune(
    qkv: trtp.TensorDesc,
    position_ids: trtp.TensorDesc,
    context_lens: trtp.TensorDesc,
    new_lens: trtp.TensorDesc,
    block_tables: trtp.TensorDesc,
    kv_cache: trtp.TensorDesc,
    outputs: tuple[trtp.TensorDesc],
) -> list[trtp.AutoTuneCombination]:
    return _tune()


@trtp.aot_impl("trtbuild::KVCacheWrite")
def _kv_write_impl(
    qkv: trtp.TensorDesc,
    position_ids: trtp.TensorDesc,
    context_lens: trtp.TensorDesc,
    new_lens: trtp.TensorDesc,
    block_tables: trtp.TensorDesc,
    kv_cache: trtp.TensorDesc,
    layer: int,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    tokens_per_block: int,
    rotary_style: str,
    rotary_base: float,
    rotary_scaling_type: str,
    rotary_scaling_factor: float,
    rotary_low_freq_factor: float,
    rotary_high_freq_factor: float,
    rotary_original_max_positions: int,
    rotary_beta_fast: float,
    rotary_beta_slow: float,
    rotary_truncate: int,
    rotary_attention_factor: float,
    kv_cache_dtype: str,
    kv_scale: float,
    outputs: tuple[trtp.TensorDesc],
    tactic: int,
) -> tuple[str, str, trtp.KernelLaunchParams, trtp.SymIntExprs]:
    values = dict(locals())
    return aot("KVCacheWrite", qkv, new_lens, block_tables, kv_cache, values)  # type: ignore[no-any-return]


@trtp.register("trtbuild::PagedAttention")
def _attention_desc(
    q: trtp.TensorDesc,
    position_ids: trtp.TensorDesc,
    context_lens: trtp.TensorDesc,
    new_lens: trtp.TensorDesc,
    block_tables: trtp.TensorDesc,
    kv_cache: trtp.TensorDesc,
    layer: int,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    tokens_per_block: int,
    sliding_window: int,
    kv_cache_dtype: str,
    kv_scale: float,
    q_scaling: float,
    sinks: int,
) -> trtp.TensorDesc:
    return q.like()


@trtp.autotune("trtbuild::PagedAttention")
def _attention_tune(
    q: trtp.TensorDesc,
    position_ids: trtp.TensorDesc,
    context_lens: trtp.TensorDesc,
    new_lens: trtp.TensorDesc,
    block_tables: trtp.TensorDesc,
    kv_cache: trtp.TensorDesc,
    outputs: tuple[trtp.TensorDesc],
) -> list[trtp.AutoTuneCombination]:
    return _tune()


@trtp.aot_impl("trtbuild::PagedAttention")
def _attention_impl(
    q: trtp.TensorDesc,
    position_ids: trtp.TensorDesc,
    context_lens: trtp.TensorDesc,
    new_lens: trtp.TensorDesc,
    block_tables: trtp.TensorDesc,
    kv_cache: trtp.TensorDesc,
    layer: int,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    tokens_per_block: int,
    sliding_window: int,
    kv_cache_dtype: str,
    kv_scale: float,
    q_scaling: float,
    sinks: int,
    outputs: tuple[trtp.TensorDesc],
    tactic: int,
) -> tuple[str, str, trtp.KernelLaunchParams, trtp.SymIntExprs]:
    values = dict(locals())
    return aot("PagedAttention", q, new_lens, block_tables, kv_cache, values)  # type: ignore[no-any-return]


@trtp.register("trtbuild::PagedAttentionSinks")
def _attention_sinks_desc(
    q: trtp.TensorDesc,
    position_ids: trtp.TensorDesc,
    context_lens: trtp.TensorDesc,
    new_lens: trtp.TensorDesc,
    block_tables: trtp.TensorDesc,
    kv_cache: trtp.TensorDesc,
    sink_logits: trtp.TensorDesc,
    layer: int,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    tokens_per_block: int,
    sliding_window: int,
    kv_cache_dtype: str,
    kv_scale: float,
    q_scaling: float,
    sinks: int,
) -> trtp.TensorDesc:
    return q.like()


@trtp.autotune("trtbuild::PagedAttentionSinks")
def _attention_sinks_tune(
    q: trtp.TensorDesc,
    position_ids: trtp.TensorDesc,
    context_lens: trtp.TensorDesc,
    new_lens: trtp.TensorDesc,
    block_tables: trtp.TensorDesc,
    kv_cache: trtp.TensorDesc,
    sink_logits: trtp.TensorDesc,
    outputs: tuple[trtp.TensorDesc],
) -> list[trtp.AutoTuneCombination]:
    return _tune(sinks=True)


@trtp.aot_impl("trtbuild::PagedAttentionSinks")
def _attention_sinks_impl(
    q: trtp.TensorDesc,
    position_ids: trtp.TensorDesc,
    context_lens: trtp.TensorDesc,
    new_lens: trtp.TensorDesc,
    block_tables: trtp.TensorDesc,
    kv_cache: trtp.TensorDesc,
    sink_logits: trtp.TensorDesc,
    layer: int,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    tokens_per_block: int,
    sliding_window: int,
    kv_cache_dtype: str,
    kv_scale: float,
    q_scaling: float,
    sinks: int,
    outputs: tuple[trtp.TensorDesc],
    tactic: int,
) -> tuple[str, str, trtp.KernelLaunchParams, trtp.SymIntExprs]:
    values = dict(locals())
    return aot("PagedAttention", q, new_lens, block_tables, kv_cache, values, sink_logits)  # type: ignore[no-any-return]


# --- the MoE op's plugins (engine/moe_split.py): MoESort, and the experts kernel's fc and proj stages -----------------
#
# One plugin per fixed input list: MoESort (experts); MoEFc / MoEProj with "Bias" and / or "Prequant" appended when
# the layer has biases / AWQ-SmoothQuant 1/s vectors (moe_split.stage_op). Nine plugins with the same
# attributes (every MoE field, in MoEAttrs' order), so their functions are made here with explicit signatures
# (`__signature__`, which inspect.signature — and so tensorrt.plugin's validation — reads) instead of written out
# nine times.

_P = inspect.Parameter
_FIELD_TYPES = {"int": int, "float": float, "str": str}
MOE_FIELDS = [(f.name, _FIELD_TYPES[str(f.type)]) for f in fields(MoEAttrs)]


def _signature(inputs: list[str], tail: list[tuple[str, Any]], returns: Any, attrs: bool = True) -> inspect.Signature:
    params = [_P(n, _P.POSITIONAL_OR_KEYWORD, annotation=trtp.TensorDesc) for n in inputs]
    params += [_P(n, _P.POSITIONAL_OR_KEYWORD, annotation=t) for n, t in MOE_FIELDS] if attrs else []
    params += [_P(n, _P.POSITIONAL_OR_KEYWORD, annotation=t) for n, t in tail]
    return inspect.Signature(params, return_annotation=returns)


def _function(name: str, sig: inspect.Signature, body: Any) -> Any:
    """A function of signature `sig` calling body(arguments by name)."""

    def fn(*args: Any, **kwargs: Any) -> Any:
        return body(sig.bind(*args, **kwargs).arguments)

    fn.__name__ = fn.__qualname__ = name
    fn.__signature__ = sig  # type: ignore[attr-defined]
    return fn


def moe_attrs(values: dict[str, Any]) -> MoEAttrs:
    return MoEAttrs(**{n: values[n] for n, _ in MOE_FIELDS})


def _check_entry(op: str, attrs: Any, activation: str, name: str, ptx: str) -> None:
    """The PTX entry takes exactly the kernel module's runtime parameters (launch.check_ptx for any compiled op)."""
    from toolchain.plugins.kernels import COMPILED

    sig = COMPILED[op].signature(attrs, activation)
    want = [".u64" if t.startswith("*") else ".u32" for t in sig.values() if t != "constexpr"]
    got = [".u32" if t == ".s32" else t for t in launch.ptx_parameter_types(ptx, name)]
    if got != want:
        raise ValueError(
            f"{op}: PTX entry {name} takes ({', '.join(got)}), TensorRT will pass ({', '.join(want)}): compile it "
            "with toolchain.plugins.compile, which strips Triton's hidden scratch parameters"
        )


def _launch(op: str, attrs: Any, activation: str, grid: tuple[Any, Any, Any], scalars: list[Any]) -> Any:
    """aot_impl's answer: (entry, PTX for the build GPU, KernelLaunchParams, SymIntExprs of the int32 scalars)."""
    from toolchain.plugins.kernels import COMPILED, COMPILED_FUNCTIONS

    kernel = compiled(op, attrs, activation)
    name = str(COMPILED_FUNCTIONS[op].__name__)
    if kernel.name != name:
        raise RuntimeError(f"{op}: compiled entry {kernel.name!r} is not the launched kernel {name!r}")
    _check_entry(op, attrs, activation, name, kernel.ptx)
    params = trtp.KernelLaunchParams()
    params.grid_x, params.grid_y, params.grid_z = grid
    params.block_x = launch.WARP_SIZE * int(COMPILED[op].NUM_WARPS)
    params.shared_mem = int(kernel.shared)
    args = trtp.SymIntExprs(len(scalars))
    for i, value in enumerate(scalars):
        args[i] = trtp.SymInt32(value)
    return name, kernel.ptx, params, args


def _refuse_quantized_inputs(plugin: str, a: MoEAttrs) -> None:
    if a.fp8_inputs or a.int8_inputs:
        raise ValueError(
            f"trtbuild::{plugin}: fp8_inputs {a.fp8_inputs} / int8_inputs {a.int8_inputs}: the experts kernel has no "
            "input quantization (fp8 and w8a8_sq experts); build those on the CPU engine (--backend onnxruntime)"
        )


def _int32(desc: Any, what: str) -> None:
    if desc.dtype != trt.DataType.INT32:
        raise ValueError(f"{what} of type {desc.dtype}: expected INT32 (engine/moe_split.py casts TopK's indices)")


_SORT = f"trtbuild::{moe_split.SORT_OP}"
_SORT_SIG = _signature(["experts"], [], tuple[trtp.TensorDesc, trtp.TensorDesc])


def _sort_desc(v: dict[str, Any]) -> tuple[Any, Any]:
    """assignments [T * top_k] and offsets [E + 1], INT32."""
    tokens = v["experts"].shape_expr[0]
    return (
        trtp.from_shape_expr((tokens * v["top_k"],), trt.DataType.INT32),
        trtp.from_shape_expr((v["number_of_experts"] + 1,), trt.DataType.INT32),
    )


def _sort_impl(v: dict[str, Any]) -> Any:
    a = moe_attrs(v)
    _int32(v["experts"], f"{_SORT} experts")
    tokens = v["experts"].shape_expr[0]
    return _launch(moe_split.SORT_OP, a, "float16", moe_sort.grid(a, tokens), moe_sort.scalars(a, tokens))


trtp.register(_SORT)(_function("_moe_sort_desc", _SORT_SIG, _sort_desc))
trtp.autotune(_SORT)(
    _function(
        "_moe_sort_tune",
        _signature(["experts"], [("outputs", tuple[trtp.TensorDesc, trtp.TensorDesc])],
                   list[trtp.AutoTuneCombination], attrs=False),
        lambda v: [trtp.AutoTuneCombination("INT32, INT32, INT32", "LINEAR")],
    )
)  # fmt: skip
trtp.aot_impl(_SORT)(
    _function(
        "_moe_sort_impl",
        _signature(["experts"], [("outputs", tuple[trtp.TensorDesc, trtp.TensorDesc]), ("tactic", int)],
                   tuple[str, str, trtp.KernelLaunchParams, trtp.SymIntExprs]),
        _sort_impl,
    )
)  # fmt: skip


def stage_inputs(stage: str, use_bias: bool, prequant: bool) -> list[str]:
    """The stage plugin's inputs in order (the experts kernel's pointers before `out`)."""
    src = "x" if stage == "fc" else "h"
    return [src, "assignments", "offsets", "weights", f"{stage}_weight"] + (
        [f"{stage}_bias"] if use_bias else []
    ) + ([f"{stage}_prequant"] if prequant else [])  # fmt: skip


def stage_combination(stage: str, activation: str, use_bias: bool, prequant: bool) -> str:
    """An AutoTuneCombination string: src and weight (and bias) in the activations' type, the sorted ids INT32, the
    router weights and the prequant vectors FP32; out h in the activations' type (fc) or FP32 (proj)."""
    act = TRT_TYPE_NAMES[activation]
    types = [act, "INT32", "INT32", "FP32", act] + ([act] if use_bias else []) + (["FP32"] if prequant else [])
    return ", ".join([*types, act if stage == "fc" else "FP32"])


def _stage_desc(stage: str, v: dict[str, Any]) -> Any:
    """h [T * top_k, I] in the activations' type (fc), out [T * top_k, H] FP32 (proj); T = dim 0 of weights."""
    rows = v["weights"].shape_expr[0] * v["top_k"]
    if stage == "fc":
        return trtp.from_shape_expr((rows, v["expert_inter_size"]), v["x"].dtype)
    return trtp.from_shape_expr((rows, v["expert_hidden_size"]), trt.DataType.FLOAT)


def _stage_impl(plugin: str, stage: str, v: dict[str, Any]) -> Any:
    a = moe_attrs(v)
    _refuse_quantized_inputs(plugin, a)
    if plugin != moe_split.stage_op(stage, a):
        raise ValueError(
            f"trtbuild::{plugin} with use_bias={a.use_bias} prequant={a.prequant}: that layer's {stage} is the "
            f"trtbuild::{moe_split.stage_op(stage, a)} plugin (fixed inputs); TensorRT must parse the graph as "
            "engine/onnx_fields.complete_plugin_fields returns it"
        )
    src = v["x" if stage == "fc" else "h"]
    activation = _activation(src, f"trtbuild::{plugin} input 0")
    _int32(v["assignments"], f"trtbuild::{plugin} assignments")
    _int32(v["offsets"], f"trtbuild::{plugin} offsets")
    for name in ("weights", f"{stage}_prequant"):
        if name in v and dtype_name(v[name].dtype) != "float32":
            raise ValueError(f"trtbuild::{plugin} {name} of type {v[name].dtype}: expected FP32")
    for name in (f"{stage}_weight", f"{stage}_bias"):
        if name in v and dtype_name(v[name].dtype) != activation:
            raise ValueError(
                f"trtbuild::{plugin} {name} of type {v[name].dtype}: expected the activations' "
                f"{TRT_TYPE_NAMES[activation]} (export.py casts expert weights to the engine dtype)"
            )
    s = moe.Stage(a, stage)
    return _launch(moe.OP, s, activation, moe.grid(s, v["weights"].shape_expr[0]), [])


def _register_stage(stage: str, use_bias: bool, prequant: bool) -> None:
    a = MoEAttrs(1, 1, 1, 1, use_bias=int(use_bias), prequant=int(prequant))
    plugin = moe_split.stage_op(stage, a)
    pid, inputs, out = f"trtbuild::{plugin}", stage_inputs(stage, use_bias, prequant), tuple[trtp.TensorDesc]
    combos = [stage_combination(stage, act, use_bias, prequant) for act in common.ACTIVATIONS]
    trtp.register(pid)(
        _function(f"_{plugin}_desc", _signature(inputs, [], trtp.TensorDesc), lambda v: _stage_desc(stage, v))
    )
    trtp.autotune(pid)(
        _function(
            f"_{plugin}_tune",
            _signature(inputs, [("outputs", out)], list[trtp.AutoTuneCombination], attrs=False),
            lambda v: [trtp.AutoTuneCombination(c, "LINEAR") for c in combos],
        )
    )
    trtp.aot_impl(pid)(
        _function(
            f"_{plugin}_impl",
            _signature(inputs, [("outputs", out), ("tactic", int)],
                       tuple[str, str, trtp.KernelLaunchParams, trtp.SymIntExprs]),
            lambda v: _stage_impl(plugin, stage, v),
        )
    )  # fmt: skip


for _stage in moe.STAGES:
    for _bias in (False, True):
        for _prequant in (False, True):
            _register_stage(_stage, _bias, _prequant)


# --- the collective ops of multi-rank engines (engine/collectives.py, issue 27): AllReduce, AllGather, Send, Recv ---
#
# Not kernels: each enqueue hands its tensor to this process's `Communicator` (NCCL through torch.distributed on a
# GPU, parallel/ slice B), so these are `trtp.impl` (Python, JIT) plugins, not `aot_impl` ones: TensorRT calls
# `_collective_impl` with its stream and the I/O as `trtp.Tensor`s, which torch wraps without a copy
# (`torch.as_tensor(..., device="cuda")` reads `__cuda_array_interface__`). The communicator's work is issued on
# TensorRT's stream (`torch.cuda.ExternalStream` made current: ProcessGroupNCCL orders its own stream after the
# current one and the current one after the collective), so the collective sits where the graph puts it.
# The fields are TensorRT-LLM's (collectives.py) and every one is on every node (to_attributes writes them all):
# engine/onnx_fields.complete_plugin_fields has nothing to fill. `group` is an INT32 array field (numpy, as
# tensorrt.plugin takes arrays). Nothing here has run: no machine of this project has TensorRT, and NCCL needs one
# GPU per rank (docs/kernels.md). The multi-rank build refuses TensorRT until it has (engine/build.py).

_COMMUNICATOR: list[Any] = []  # this process's Communicator, set by the multi-rank runtime before the first step


def set_communicator(comm: Any) -> None:
    """The Communicator the collective plugins of this process's engine run through (one rank per process)."""
    _COMMUNICATOR[:] = [comm]


def communicator(plugin: str) -> Any:
    if not _COMMUNICATOR:
        raise RuntimeError(
            f"trtbuild::{plugin}: no communicator set in this process; a multi-rank engine's rank must call "
            "tensorrt_registration.set_communicator(comm) before its first step"
        )
    return _COMMUNICATOR[0]


_INT32_ARRAY = np_typing.NDArray[np.int32]
_GROUP_FIELDS: list[tuple[str, Any]] = [("group", _INT32_ARRAY), ("type_id", int)]
COLLECTIVE_FIELDS: dict[str, list[tuple[str, Any]]] = {
    collectives.ALL_REDUCE_OP: [
        *_GROUP_FIELDS, ("strategy", int), ("config", int), ("fusion_op", int), ("counter", int), ("eps", float),
        ("affine", int), ("bias", int), ("scale", int),
    ],
    collectives.ALL_GATHER_OP: [*_GROUP_FIELDS, ("axis", int)],
    collectives.SEND_OP: [("tgt_rank", int), ("type_id", int)],
    collectives.RECV_OP: [("src_rank", int), ("type_id", int)],
}  # fmt: skip
_COLLECTIVE_INPUT = {collectives.RECV_OP: "like"}  # the others take x


def collective_attrs(op: str, values: dict[str, Any]) -> collectives.CollectiveAttrs:
    """The node's fields as its attrs class (group an int tuple, whatever array TensorRT passes)."""
    found = {n: values[n] for n, _ in COLLECTIVE_FIELDS[op]}
    if "group" in found:
        found["group"] = tuple(int(r) for r in found["group"])
    return collectives.COLLECTIVE_ATTRS[op](**found)


def _type_of(op: str, a: collectives.CollectiveAttrs, desc: Any) -> Any:
    """The output's trt.DataType: type_id's (Recv), which must be the input's for the others."""
    name = {v: k for k, v in collectives.TYPE_IDS.items()}[a.type_id]
    dtype = getattr(trt.DataType, _DATA_TYPE_MEMBERS[name])
    if op != collectives.RECV_OP and desc.dtype != dtype:
        raise ValueError(f"trtbuild::{op}: input of type {desc.dtype} but type_id {a.type_id} ({name})")
    return dtype


def _collective_desc(op: str, v: dict[str, Any]) -> Any:
    """AllReduce, Send: the input's shape and type; Recv: its `like` input's shape, type_id's type; AllGather: the
    input's shape with its `axis` times the group's size."""
    a = collective_attrs(op, v)
    x = v[_COLLECTIVE_INPUT.get(op, "x")]
    dtype = _type_of(op, a, x)
    shape = list(x.shape_expr)
    if isinstance(a, collectives.AllGatherAttrs):
        axis = a.axis % len(shape)
        shape[axis] = shape[axis] * len(a.group)
    return trtp.from_shape_expr(tuple(shape), dtype)


def _collective_impl(op: str, v: dict[str, Any]) -> None:
    """The enqueue: the communicator's collective of the input, issued on TensorRT's stream, into outputs[0]."""
    a = collective_attrs(op, v)
    comm = communicator(op)
    with on_stream(int(v["stream"])):
        x, out = as_torch(v[_COLLECTIVE_INPUT.get(op, "x")]), as_torch(v["outputs"][0])
        what = f"{op} #{getattr(a, 'counter', 0)} (TensorRT)"
        out.copy_(collectives.run_collective(comm, op, a, x, what))


def as_torch(tensor: Any) -> Any:
    """A trtp.Tensor as a torch tensor on the same device memory (its __cuda_array_interface__, no copy)."""
    import torch

    return torch.as_tensor(tensor, device="cuda")


def on_stream(stream: int) -> Any:
    """TensorRT's stream made torch's current one: what torch.distributed orders its collective after."""
    import torch

    return torch.cuda.stream(torch.cuda.ExternalStream(stream))  # type: ignore[no-untyped-call]


def _register_collective(op: str) -> None:
    pid, first = f"trtbuild::{op}", _COLLECTIVE_INPUT.get(op, "x")
    attrs = COLLECTIVE_FIELDS[op]
    params = [_P(first, _P.POSITIONAL_OR_KEYWORD, annotation=trtp.TensorDesc)]
    params += [_P(n, _P.POSITIONAL_OR_KEYWORD, annotation=t) for n, t in attrs]
    trtp.register(pid)(
        _function(f"_{op}_desc", inspect.Signature(params, return_annotation=trtp.TensorDesc),
                  lambda v: _collective_desc(op, v))
    )  # fmt: skip
    out = tuple[trtp.TensorDesc]
    combos = [f"{TRT_TYPE_NAMES[act]}, {TRT_TYPE_NAMES[act]}" for act in collectives.TYPE_IDS]
    tune = [
        _P(first, _P.POSITIONAL_OR_KEYWORD, annotation=trtp.TensorDesc),
        _P("outputs", _P.POSITIONAL_OR_KEYWORD, annotation=out),
    ]
    trtp.autotune(pid)(
        _function(f"_{op}_tune", inspect.Signature(tune, return_annotation=list[trtp.AutoTuneCombination]),
                  lambda v: [trtp.AutoTuneCombination(c, "LINEAR") for c in combos])
    )  # fmt: skip
    impl = [_P(first, _P.POSITIONAL_OR_KEYWORD, annotation=trtp.Tensor)]
    impl += [_P(n, _P.POSITIONAL_OR_KEYWORD, annotation=t) for n, t in attrs]
    impl += [_P("outputs", _P.POSITIONAL_OR_KEYWORD, annotation=tuple[trtp.Tensor]),
             _P("stream", _P.POSITIONAL_OR_KEYWORD, annotation=int)]  # fmt: skip
    trtp.impl(pid)(
        _function(f"_{op}_impl", inspect.Signature(impl, return_annotation=None), lambda v: _collective_impl(op, v))
    )


for _op in (collectives.ALL_REDUCE_OP, collectives.ALL_GATHER_OP, collectives.SEND_OP, collectives.RECV_OP):
    _register_collective(_op)
