"""PagedAttention in Triton: causal attention of each new token over its sequence's tokens in the paged pool.

Same contract as the reference op `toolchain.engine.ops.paged_attention` (its docstring is the op's definition):
`paged_attention(a, q, position_ids, context_lens, new_lens, block_tables, kv_cache, sinks)` here takes the same
arguments and returns the same output; one launch of `attention_kernel` over `grid(a, num_tokens)`.

Attention sinks (gpt-oss, `a.sinks`): a seventh input pointer, the heads' float32 sink logits, after the pool; a
variant without sinks has no such parameter (`sinks` is the constexpr None there), so its PTX is unchanged. A sink
is a key whose value is zero and whose scaled score is the logit itself, as in the reference: the online softmax
starts from it (running max the sink, denominator exp(0) = 1, accumulator 0) instead of from an empty row.

One program per (new token, KV head, chunk of that KV head's query heads): prefill chunks and decode steps mix in
one launch, each token walking its own sequence's blocks. The query heads of a GQA group are the rows of one
tensor-core product, so a block's K and V tiles ([tokens_per_block, head_size], contiguous in the pool) are read
once per group, not once per query head: decode is bound by those KV bytes. A prefill chunk's tokens each read
their prefix again (from L2 on a GPU); a query-tiled prefill is not written yet.

Compiled ahead of time, the pointer parameters must be declared 16-byte aligned (ASTSource attrs
`{(i,): [["tt.divisibility", 16]]}` for each pointer; TensorRT's buffers are 256-byte aligned), as a native launch
specializes them: without it Triton cannot vectorize the tile loads (one element per thread per load) and ptxas
reported 208-255 registers with spills at head size 256 (triton 3.9, sm_80 / sm_90, 4 warps); with it none.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from toolchain.engine.ops import AttentionAttrs
from toolchain.plugins.kernels import common

OP = "PagedAttention"
# 8 warps: with 4, ptxas spilled 4-8 bytes (at 71-80 registers) in 4 of 108 fp16 / bf16 head-size-128 variants
# (sm_90a, sm_120a, 32 tokens per block); with 8, none in 132 (sm_80..120, every pool, head sizes 8 to 256,
# 16 / 32 / 64 tokens per block, GQA 4 and 20, a window), at most 97 registers. ptxas as triton.compile runs it.
NUM_WARPS = 8
# tl.dot's smallest M, N and K: a GQA group shorter than this is padded with zero query rows, a head size with zero
# columns (tokens_per_block, the other dimension, is at least 16).
MIN_DOT = 16
# The most query heads of one KV head a program takes: larger groups (MQA with many heads) are split over
# programs, which then read the KV head once each; up to 16 the accumulator stays [16, head_size] in registers.
MAX_GROUP_ROWS = 16
LOG2E = 1.4426950408889634


@triton.jit
def dot(x, y, dtype: tl.constexpr, FP32: tl.constexpr):
    """x @ y on tensor cores, accumulated in fp32. The operands: in the activation's type `dtype` on a GPU (q as
    given; K and V as codes or the pool's floats, exact in fp16 / bf16; p rounded as FlashAttention does); fp32
    with input_precision "ieee" (not TF32) for fp32 activations, and for bf16 under Triton's interpreter, whose
    bf16 tl.dot is wrong in 3.9 (triton issue 11584), so the entry point asks for it there (dot_fp32): the same
    loads, indices and masks as the compiled kernel, only the operands' type differs. fp16 runs as compiled."""
    if FP32:
        return tl.dot(x.to(tl.float32), y.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(x.to(dtype), y.to(dtype))


@triton.jit
def attention_kernel(
    q,
    position_ids,
    context_lens,
    new_lens,
    block_tables,
    kv_cache,
    sinks,
    num_tokens,
    num_seqs,
    max_blocks,
    num_blocks,
    layer,
    kv_scale_bits,
    out,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TOKENS_PER_BLOCK: tl.constexpr,
    KV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,
    QK_SCALE_LOG2: tl.constexpr,
    DOT_FP32: tl.constexpr,
    SINKS: tl.constexpr,
):
    t = tl.program_id(0)
    kv_head = tl.program_id(1) // tl.cdiv(GROUP, BLOCK_G)
    chunk = tl.program_id(1) % tl.cdiv(GROUP, BLOCK_G)
    seq, _ = common.sequence_of(t, new_lens, num_seqs)
    pos = tl.load(position_ids + t)

    g = chunk * BLOCK_G + tl.arange(0, BLOCK_G)  # query head within the group
    d = tl.arange(0, BLOCK_D)
    slot = tl.arange(0, BLOCK_N)
    rows = g < GROUP
    cols = d < HEAD_SIZE
    heads = kv_head * GROUP + g
    q_at = t.to(tl.int64) * (NUM_HEADS * HEAD_SIZE) + heads[:, None] * HEAD_SIZE + d[None, :]
    qt = tl.load(q + q_at, mask=rows[:, None] & cols[None, :], other=0.0)

    # a float pool holds the values themselves (the reference's _load ignores kv_scale); codes are decoded with
    # scale 1 (exact in the products' type) and the scale applied to the fp32 scores and output
    kv_scale = 1.0 if KV == 0 else kv_scale_bits.to(tl.float32, bitcast=True)
    score_scale = kv_scale * QK_SCALE_LOG2  # scores in log2 units: exp2 below
    act = qt.dtype

    # the pool [layers, num_blocks, 2, kv_heads, tokens_per_block, head_size]: one (block, K/V, head) tile is
    # tokens_per_block * head_size contiguous elements, walked BLOCK_N rows (keys) at a time; offsets in int64 (a
    # pool may pass 2**31 elements)
    tile = TOKENS_PER_BLOCK * HEAD_SIZE
    rows_at = slot[:, None] * HEAD_SIZE + d[None, :]
    layer_base = layer.to(tl.int64) * num_blocks * 2
    # the keys' steps from the window's first (or key 0) to the one holding the token's own position: each holds
    # at least one key the token attends to, so the running maximum is finite after the first
    first = tl.maximum(pos - SLIDING_WINDOW + 1, 0) // BLOCK_N if SLIDING_WINDOW > 0 else 0
    if SINKS:
        # the reference scores the sink's zero key with the logit itself, added after the softmax scale (and not
        # times kv_scale): in the scores' log2 units that is sink * log2(e). A padded row keeps the empty start.
        sink = tl.load(sinks + heads, mask=rows, other=float("-inf")).to(tl.float32)
        m = sink * 1.4426950408889634  # LOG2E
        lsum = tl.where(rows, 1.0, 0.0)
    else:
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        lsum = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for i in range(first, pos // BLOCK_N + 1):
        j = i // (TOKENS_PER_BLOCK // BLOCK_N)  # the sequence's block (column of its block table)
        row0 = (i % (TOKENS_PER_BLOCK // BLOCK_N)) * BLOCK_N
        block = tl.load(block_tables + seq.to(tl.int64) * max_blocks + j).to(tl.int64)
        k_at = ((layer_base + block * 2) * NUM_KV_HEADS + kv_head) * tile + row0 * HEAD_SIZE
        v_at = k_at + NUM_KV_HEADS * tile
        key = i * BLOCK_N + slot
        valid = key <= pos
        if SLIDING_WINDOW > 0:
            valid = valid & (key > pos - SLIDING_WINDOW)
        # slots past the position (or before the window) are never loaded, and V is zeroed there again: they may
        # hold another request's tokens or NaN, and NaN would survive a zero probability (0 * NaN)
        kv_mask = valid[:, None] & cols[None, :]
        k = common.decode(tl.load(kv_cache + k_at + rows_at, mask=kv_mask, other=0), 1.0, KV)
        v = common.decode(tl.load(kv_cache + v_at + rows_at, mask=kv_mask, other=0), 1.0, KV)
        v = tl.where(kv_mask, v, 0.0)
        s = tl.where(valid[None, :], dot(qt, tl.trans(k), act, DOT_FP32) * score_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.math.exp2(m - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        lsum = lsum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + dot(p, v, act, DOT_FP32)
        m = m_new

    result = acc * (kv_scale / lsum)[:, None]
    tl.store(out + q_at, common.cast(result, out.dtype.element_ty), mask=rows[:, None] & cols[None, :])


def check(a: AttentionAttrs, activation: str) -> None:
    common.check_types(a.kv_cache_dtype, a.head_size, activation)
    if a.num_heads % a.num_kv_heads:
        raise ValueError(
            f"num_heads {a.num_heads} with num_kv_heads {a.num_kv_heads}: the heads must be a multiple of the KV "
            "heads (each KV head serves an equal group of query heads)"
        )
    if a.sliding_window < 0:
        raise ValueError(f"sliding_window {a.sliding_window}: expected 0 (no window) or a window length > 0")
    if a.sinks not in (0, 1):
        raise ValueError(f"sinks {a.sinks}: expected 0 (none) or 1 (a float32 sink logit per head as an input)")


SINKS_TYPE = "*fp32"  # the sinks input: float32 whatever the activations (export.py writes it so)


def signature(a: AttentionAttrs, activation: str) -> dict[str, str]:
    """triton.compile's signature: the TensorRT-ordered parameters, then every constexpr. With sinks, their
    pointer is a seventh input after the pool; without, `sinks` is a constexpr (None) and no parameter."""
    check(a, activation)
    sig = common.common_signature(activation, a.kv_cache_dtype, "q", "out")
    inputs = list(sig.items())
    at = list(sig).index("kv_cache") + 1
    sig = dict([*inputs[:at], ("sinks", SINKS_TYPE if a.sinks else "constexpr"), *inputs[at:]])
    return {**sig, **dict.fromkeys(constexprs(a, activation), "constexpr")}


def _group_rows(a: AttentionAttrs) -> int:
    """Query-head rows per program: the GQA group padded to tl.dot's 16, at most MAX_GROUP_ROWS."""
    return max(MIN_DOT, min(int(triton.next_power_of_2(a.num_heads // a.num_kv_heads)), MAX_GROUP_ROWS))


def _key_rows(a: AttentionAttrs, activation: str) -> int:
    """Keys per step: a whole block up to head size 128 (K and V tiles up to 64 x 128), 16 keys at head size 256
    (32 took 211 registers at 4 warps). fp32 activations (ieee fp32 products without tensor cores: the CPU
    reference's dtype, not a serving one) take 16 keys a step too; 8 of their 36 GPU variants still spill."""
    block_d = max(MIN_DOT, int(triton.next_power_of_2(a.head_size)))
    return a.tokens_per_block if block_d <= 128 and activation != "float32" else MIN_DOT


def constexprs(a: AttentionAttrs, activation: str) -> dict[str, Any]:
    """The compiled-in values of the GPU variant (the one compiled ahead of time): products in the activation's
    type, except fp32 activations (ieee fp32). Under the interpreter the entry point overrides DOT_FP32 for bf16
    (dot_fp32)."""
    return {
        "NUM_HEADS": a.num_heads,
        "NUM_KV_HEADS": a.num_kv_heads,
        "HEAD_SIZE": a.head_size,
        "BLOCK_D": max(MIN_DOT, triton.next_power_of_2(a.head_size)),
        "TOKENS_PER_BLOCK": a.tokens_per_block,
        "KV": common.KV_CODES[a.kv_cache_dtype],
        "BLOCK_N": _key_rows(a, activation),
        "GROUP": a.num_heads // a.num_kv_heads,
        "BLOCK_G": _group_rows(a),
        "SLIDING_WINDOW": a.sliding_window,
        # 1 / (sqrt(head_size) * q_scaling) in float64, times log2(e) for exp2; rounded to fp32 once, in the kernel
        "QK_SCALE_LOG2": LOG2E / (math.sqrt(a.head_size) * a.q_scaling),
        "DOT_FP32": activation == "float32",
        "SINKS": bool(a.sinks),
        **({} if a.sinks else {"sinks": None}),  # no sinks pointer: a constexpr None in its place
    }


def scalars(a: AttentionAttrs, num_tokens: Any, num_seqs: Any, max_blocks: Any, num_blocks: Any) -> list[Any]:
    """The int32 arguments in order (common.SCALARS); the dims may be TensorRT symbolic expressions."""
    return [num_tokens, num_seqs, max_blocks, num_blocks, a.layer, common.float_bits(a.kv_scale)]


def grid(a: AttentionAttrs, num_tokens: Any) -> tuple[Any, Any, Any]:
    """One program per (new token, KV head, chunk of its query heads): x the token, y the KV head and chunk."""
    group = a.num_heads // a.num_kv_heads
    return num_tokens, a.num_kv_heads * -(-group // _group_rows(a)), 1


def dot_fp32(activation: str) -> bool:
    """Whether this process's launches take the fp32 products (see `dot`): for fp32 activations, and for bf16
    ones under Triton's interpreter, whose bf16 tl.dot is wrong; fp16 runs its GPU products there too."""
    interpreted = isinstance(attention_kernel, InterpretedFunction)
    return activation == "float32" or (interpreted and activation == "bfloat16")


def paged_attention(
    a: AttentionAttrs,
    q: torch.Tensor,
    position_ids: torch.Tensor,
    context_lens: torch.Tensor,
    new_lens: torch.Tensor,
    block_tables: torch.Tensor,
    kv_cache: torch.Tensor,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    activation = str(q.dtype).removeprefix("torch.")
    check(a, activation)
    if (sinks is not None) != bool(a.sinks) or (
        sinks is not None and (tuple(sinks.shape) != (a.num_heads,) or sinks.dtype != torch.float32)
    ):
        got = "none" if sinks is None else f"{sinks.dtype} {tuple(sinks.shape)}"
        want = f"float32 ({a.num_heads},)" if a.sinks else "none"
        raise ValueError(f"PagedAttention sinks={a.sinks} with a sinks input of {got}: expected {want}")
    t = q.shape[0]
    out = torch.empty(t, a.num_heads * a.head_size, dtype=q.dtype, device=q.device)
    if t == 0:
        return out
    dims = scalars(a, t, new_lens.shape[0], block_tables.shape[1], kv_cache.shape[1])
    consts = {**constexprs(a, activation), "DOT_FP32": dot_fp32(activation)}
    consts.pop("sinks", None)  # passed positionally: None (a constexpr) without sinks
    attention_kernel[grid(a, t)](
        q, position_ids, context_lens, new_lens, block_tables, kv_cache, sinks, *dims, out,
        **consts, num_warps=NUM_WARPS, **common.OPTIONS,
    )  # fmt: skip
    return out
