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

Tested without TensorRT against the `tensorrt.plugin` contract (tests/plugins/test_registration.py); not yet run
with TensorRT: no machine of this project has had it.
"""

# No `from __future__ import annotations`: tensorrt.plugin reads the decorated functions' annotations with
# inspect.signature and checks them as classes (issubclass of TensorDesc, KernelLaunchParams, ...; its _validate.py).
import importlib
from dataclasses import MISSING, fields
from typing import Any

import tensorrt as trt
import tensorrt.plugin as trtp

from toolchain.engine.onnx_fields import SINKS_PLUGIN
from toolchain.engine.ops import OP_FIELDS, AttentionAttrs
from toolchain.manifest import gpu_info
from toolchain.plugins import launch
from toolchain.plugins.kernels import common

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
