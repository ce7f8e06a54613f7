"""KVCacheWrite in Triton: rotary on q and k, the new tokens' k and v stored into the paged pool in place.

Same contract as the reference op `toolchain.engine.ops.kv_cache_write` (its docstring is the op's definition):
`kv_cache_write(a, qkv, position_ids, context_lens, new_lens, block_tables, kv_cache)` here takes the same
arguments and returns the same q; one launch of `kv_write_kernel` over `grid(a, num_tokens)`.

SKELETON: the kernel body is a placeholder until issue 25's kv_write branch lands.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from toolchain.engine.ops import AttentionAttrs
from toolchain.plugins.kernels import common

OP = "KVCacheWrite"
NUM_WARPS = 4


@triton.jit
def kv_write_kernel(
    qkv,
    position_ids,
    context_lens,
    new_lens,
    block_tables,
    kv_cache,
    num_tokens,
    num_seqs,
    max_blocks,
    num_blocks,
    layer,
    kv_scale_bits,
    q_out,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TOKENS_PER_BLOCK: tl.constexpr,
    KV: tl.constexpr,
):
    t = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)
    x = tl.load(qkv + t * (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_SIZE + d, mask=d < HEAD_SIZE)
    tl.store(q_out + t * NUM_HEADS * HEAD_SIZE + d, x, mask=d < HEAD_SIZE)


def check(a: AttentionAttrs, activation: str) -> None:
    common.check_types(a.kv_cache_dtype, a.head_size, activation)


def signature(a: AttentionAttrs, activation: str) -> dict[str, str]:
    """triton.compile's signature: the TensorRT-ordered parameters, then every constexpr."""
    check(a, activation)
    sig = common.common_signature(activation, a.kv_cache_dtype, "qkv", "q_out")
    return {**sig, **dict.fromkeys(constexprs(a, activation), "constexpr")}


def constexprs(a: AttentionAttrs, activation: str) -> dict[str, Any]:
    return {
        "NUM_HEADS": a.num_heads,
        "NUM_KV_HEADS": a.num_kv_heads,
        "HEAD_SIZE": a.head_size,
        "BLOCK_D": triton.next_power_of_2(a.head_size),
        "TOKENS_PER_BLOCK": a.tokens_per_block,
        "KV": common.KV_CODES[a.kv_cache_dtype],
    }


def scalars(a: AttentionAttrs, num_tokens: Any, num_seqs: Any, max_blocks: Any, num_blocks: Any) -> list[Any]:
    """The int32 arguments in order (common.SCALARS); the dims may be TensorRT symbolic expressions."""
    return [num_tokens, num_seqs, max_blocks, num_blocks, a.layer, common.float_bits(a.kv_scale)]


def grid(a: AttentionAttrs, num_tokens: Any) -> tuple[Any, Any, Any]:
    """One program per new token."""
    return num_tokens, 1, 1


def kv_cache_write(
    a: AttentionAttrs,
    qkv: torch.Tensor,
    position_ids: torch.Tensor,
    context_lens: torch.Tensor,
    new_lens: torch.Tensor,
    block_tables: torch.Tensor,
    kv_cache: torch.Tensor,
) -> torch.Tensor:
    activation = str(qkv.dtype).removeprefix("torch.")
    check(a, activation)
    t = qkv.shape[0]
    q = torch.empty(t, a.num_heads * a.head_size, dtype=qkv.dtype, device=qkv.device)
    dims = scalars(a, t, new_lens.shape[0], block_tables.shape[1], kv_cache.shape[1])
    kv_write_kernel[grid(a, t)](
        qkv, position_ids, context_lens, new_lens, block_tables, kv_cache, *dims, q,
        **constexprs(a, activation), num_warps=NUM_WARPS, **common.OPTIONS,
    )  # fmt: skip
    return q
