"""How each plugin op becomes one kernel launch: kernel name, grid and the int32 scalar arguments, in the order the
kernels in plugins/attention.cu take them (inputs, scalars, outputs). Pure functions over dims that may be ints or
TensorRT's symbolic expressions (anything with + * and //), so TensorRT's registration, the tests and the GPU check
(plugins/gpu_check.py) share them. The split-K attention (`*_split` + reduce) is not launched by the registration
(one kernel per plugin); the GPU check runs it, described here beside the launch it splits."""

from __future__ import annotations

import struct
from typing import Any

from toolchain.engine.ops import AttentionAttrs

BLOCK_THREADS = 128
MAX_GROUP = 8  # query heads per attention block on the 64 / 128 head-dim paths, 4 on the generic one
ACTIVATIONS = {"float16": "f16", "bfloat16": "bf16"}
KV = {"float16": "f16", "bfloat16": "bf16", "fp8": "fp8", "int8": "int8"}
SCALING = {"none": 0, "linear": 1, "llama3": 2}


def float_bits(x: float) -> int:
    """A float32 passed through an int32 kernel argument (the kernel reads it back with __int_as_float)."""
    return int(struct.unpack("<i", struct.pack("<f", x))[0])


def _kv(a: AttentionAttrs, activation: str) -> str:
    if a.kv_cache_dtype in ("float16", "bfloat16") and a.kv_cache_dtype != activation:
        raise ValueError(f"KV cache {a.kv_cache_dtype} with {activation} activations has no kernel")
    if a.kv_cache_dtype not in KV:
        raise ValueError(f"KV cache dtype {a.kv_cache_dtype!r} has no kernel; choose one of {', '.join(KV)}")
    return KV[a.kv_cache_dtype]


def head_path(head_size: int) -> str:
    if head_size > 256 or head_size % 2:
        raise ValueError(f"head_size {head_size}: the kernels take even head sizes up to 256")
    return {64: "hd64", 128: "hd128"}.get(head_size, "generic")


def kv_write_kernel(a: AttentionAttrs, activation: str) -> str:
    return f"trtbuild_kv_write_{ACTIVATIONS[activation]}_{_kv(a, activation)}"


def attention_kernel(a: AttentionAttrs, activation: str) -> str:
    return f"trtbuild_attention_{ACTIVATIONS[activation]}_{_kv(a, activation)}_{head_path(a.head_size)}"


def _common_scalars(a: AttentionAttrs, num_tokens: Any, num_seqs: Any, max_blocks: Any, num_blocks: Any) -> list[Any]:
    """The scalars both kernels take first: batch geometry (symbolic in TensorRT), then the layer's shape."""
    dims = [num_tokens, num_seqs, max_blocks, num_blocks]
    return [*dims, a.layer, a.num_heads, a.num_kv_heads, a.head_size, a.tokens_per_block]


def kv_write_scalars(a: AttentionAttrs, num_tokens: Any, num_seqs: Any, max_blocks: Any, num_blocks: Any) -> list[Any]:
    rotary = [
        int(a.rotary_style == "neox"),
        float_bits(a.rotary_base),
        SCALING[a.rotary_scaling_type],
        float_bits(a.rotary_scaling_factor),
        float_bits(a.rotary_low_freq_factor),
        float_bits(a.rotary_high_freq_factor),
        a.rotary_original_max_positions,
    ]
    return [*_common_scalars(a, num_tokens, num_seqs, max_blocks, num_blocks), *rotary, float_bits(a.kv_scale)]


def kv_write_grid(num_tokens: Any) -> tuple[Any, int, int]:
    """One block per new token."""
    return num_tokens, 1, 1


def attention_scalars(a: AttentionAttrs, num_tokens: Any, num_seqs: Any, max_blocks: Any, num_blocks: Any) -> list[Any]:
    """The common scalars, then window, kv_scale and q_scaling (floats as bits); the split variant then `splits`."""
    common = _common_scalars(a, num_tokens, num_seqs, max_blocks, num_blocks)
    return [*common, a.sliding_window, float_bits(a.kv_scale), float_bits(a.q_scaling)]


def attention_grid(a: AttentionAttrs, num_tokens: Any) -> tuple[Any, int, int]:
    """(tokens, kv heads x chunks of query heads, 1): one block per token and KV head group chunk."""
    per_block = MAX_GROUP if head_path(a.head_size) != "generic" else MAX_GROUP // 2
    group = a.num_heads // a.num_kv_heads
    return num_tokens, a.num_kv_heads * -(-group // per_block), 1


def output_width(a: AttentionAttrs) -> int:
    """Both ops output [num_tokens, heads * head_size]."""
    return a.num_heads * a.head_size


def attention_split_kernel(a: AttentionAttrs, activation: str) -> str:
    """The split-K variant of `attention_kernel`: grid z splits the keys; it takes `splits` after the scalars and
    writes partial outputs and (max, sum) pairs, which `reduce_kernel` combines."""
    return f"{attention_kernel(a, activation)}_split"


def attention_split_grid(a: AttentionAttrs, num_tokens: Any, splits: int) -> tuple[Any, int, int]:
    x, y, _ = attention_grid(a, num_tokens)
    return x, y, splits


def reduce_kernel(activation: str) -> str:
    """Combines the split-K partials: grid (tokens * heads), scalars (tokens, heads, head_size, splits)."""
    return f"trtbuild_attention_reduce_{ACTIVATIONS[activation]}"
