"""Registers the trtbuild plugins with TensorRT through `tensorrt.plugin` (quickly deployable plugins, ahead of
time: shape and type functions, then PTX and launch parameters, so an engine needs no Python at run time).

Imported by toolchain/engine/tensorrt_backend.py before the ONNX parser meets the `trtbuild::KVCacheWrite` and
`trtbuild::PagedAttention` nodes. Kernel names, grids and scalar arguments come from launch.py (tested without
TensorRT); the PTX from `trtbuild plugins compile` for the SM TensorRT builds for. A graph omits q_scaling at 1.0
(AttentionAttrs.to_attributes) and tensorrt.plugin has no default field values: TensorRT must parse the graph as
engine/onnx_fields.complete_plugin_fields returns it.

Not yet run: no machine of this project has had TensorRT (docs/kernels.md).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import tensorrt as trt
import tensorrt.plugin as trtp

from toolchain.engine.ops import OP_FIELDS, AttentionAttrs
from toolchain.manifest import gpu_info
from toolchain.plugins import launch

_DTYPES = {trt.float16: "float16", trt.bfloat16: "bfloat16"}
_COMBINATIONS = [  # activation, pool dtype (TensorRT's type names for autotune)
    ("FP16", "FP16"),
    ("FP16", "INT8"),
    ("FP16", "FP8"),
    ("BF16", "BF16"),
    ("BF16", "INT8"),
    ("BF16", "FP8"),
]


def _attrs(op: str, values: dict[str, Any]) -> AttentionAttrs:
    defaults = {f.name: f.default for f in fields(AttentionAttrs) if f.name not in ("layer",)}
    return AttentionAttrs(**{**defaults, **{k: v for k, v in values.items() if k in OP_FIELDS[op]}})


def _ptx() -> str:
    """PTX for the SM of the GPU TensorRT is building on (read from nvidia-smi, as the manifest does)."""
    sm = gpu_info()["sm"]
    if sm is None:
        raise RuntimeError("trtbuild plugins: no GPU visible to read its SM from")
    from toolchain.plugins.compile import compile_plugins  # type: ignore[attr-defined]  # gone with attention.cu

    return str(compile_plugins((f"sm_{sm}",))[0].ptx.read_text())


def _sym(values: list[Any]) -> Any:
    args = trtp.SymIntExprs(len(values))
    for i, v in enumerate(values):
        args[i] = trtp.SymInt32(v)
    return args


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
    kv_cache_dtype: str,
    kv_scale: float,
) -> trtp.TensorDesc:
    out = qkv.like()
    out.shape_expr[1] = num_heads * head_size
    return out


@trtp.autotune("trtbuild::KVCacheWrite")
def _kv_write_tune(*args: Any, **kwargs: Any) -> list[Any]:
    return [trtp.AutoTuneCombination(f"{a}, INT32, INT32, INT32, INT32, {k}, {a}", "LINEAR") for a, k in _COMBINATIONS]


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
    kv_cache_dtype: str,
    kv_scale: float,
    outputs: tuple[trtp.TensorDesc],
    tactic: int,
) -> tuple[str, str, Any, Any]:
    a = _attrs("KVCacheWrite", dict(locals()))
    name = launch.kv_write_kernel(a, _DTYPES[qkv.dtype])
    params = trtp.KernelLaunchParams()
    params.grid_x, params.grid_y, params.grid_z = launch.kv_write_grid(qkv.shape_expr[0])
    params.block_x = launch.BLOCK_THREADS
    params.shared_mem = 0
    scalars = launch.kv_write_scalars(
        a, qkv.shape_expr[0], new_lens.shape_expr[0], block_tables.shape_expr[1], kv_cache.shape_expr[1]
    )
    return name, _ptx(), params, _sym(scalars)


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
) -> trtp.TensorDesc:
    return q.like()


@trtp.autotune("trtbuild::PagedAttention")
def _attention_tune(*args: Any, **kwargs: Any) -> list[Any]:
    return [trtp.AutoTuneCombination(f"{a}, INT32, INT32, INT32, INT32, {k}, {a}", "LINEAR") for a, k in _COMBINATIONS]


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
    outputs: tuple[trtp.TensorDesc],
    tactic: int,
) -> tuple[str, str, Any, Any]:
    a = _attrs("PagedAttention", dict(locals()))
    name = launch.attention_kernel(a, _DTYPES[q.dtype])
    grid = launch.attention_grid(a, q.shape_expr[0])
    params = trtp.KernelLaunchParams()
    params.grid_x, params.grid_y, params.grid_z = grid
    params.block_x = launch.BLOCK_THREADS
    params.shared_mem = 0  # static shared memory only
    scalars = launch.attention_scalars(
        a, q.shape_expr[0], new_lens.shape_expr[0], block_tables.shape_expr[1], kv_cache.shape_expr[1]
    )
    return name, _ptx(), params, _sym(scalars)
