"""Reference implementations of our plugin ops: the single semantic definition of each. The CPU engine runs them
between ONNX Runtime segments; the CUDA plugins are checked against them; their attributes are the plugin fields.

Two ops per layer (domain `trtbuild`), each one CUDA kernel launch in the plugin (plugins/):

KVCacheWrite
  inputs   qkv [num_tokens, (heads + 2 kv_heads) * head_size], position_ids [num_tokens], context_lens [num_seqs],
           new_lens [num_seqs], block_tables [num_seqs, max_blocks], kv_cache (the pool, written in place)
  outputs  q [num_tokens, heads * head_size] (after rotary)
  q and k get rotary embedding at their positions (rotate-half / GPT-NeoX style, with the configured scaling); the
  new tokens' k and v are stored (quantized with kv_scale when the pool is int8 / fp8) at their slots.

PagedAttention
  inputs   q [num_tokens, heads * head_size], position_ids, context_lens, new_lens, block_tables, kv_cache
  outputs  out [num_tokens, heads * head_size]
  each new token attends, causally, to every cached and new token of its own sequence at positions <= its own (and
  > its own - sliding_window when there is one), reading K and V from the pool (dequantized); query head h reads
  KV head h // (heads / kv_heads). Scores are q.k / (sqrt(head_size) * q_scaling).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

from toolchain.quantize.core import FP8_E4M3_MAX
from toolchain.reference.rope import apply_rotary, cos_sin


@dataclass(frozen=True)
class AttentionAttrs:
    """The plugin's fields (ONNX attributes of the node, TensorRT plugin fields)."""

    layer: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    tokens_per_block: int
    rotary_style: str = "neox"  # "neox" (rotate-half) or "none" (learned absolute positions, GPT-2)
    rotary_base: float = 10000.0
    rotary_scaling_type: str = "none"  # "none", "linear", "llama3"
    rotary_scaling_factor: float = 1.0
    rotary_low_freq_factor: float = 1.0
    rotary_high_freq_factor: float = 4.0
    rotary_original_max_positions: int = 8192
    sliding_window: int = 0  # 0: attend to the whole context
    kv_cache_dtype: str = "float32"  # float32, float16, bfloat16, int8, fp8
    kv_scale: float = 1.0  # dequantization factor of an int8 / fp8 pool
    # Attention scores are q.k / (sqrt(head_size) * q_scaling): TensorRT-LLM's gpt_attention field of that name
    # (tensorrt_llm/_torch/modules/attention.py: "qk_scale = 1 / (sqrt(head_dim) * q_scaling)"; Gemma 2 / 3 set
    # q_scaling = sqrt(query_pre_attn_scalar / head_size) in tensorrt_llm/models/gemma/model.py).
    q_scaling: float = 1.0

    def __post_init__(self) -> None:
        q = self.q_scaling
        if isinstance(q, bool) or not isinstance(q, numbers.Real) or not math.isfinite(q) or q <= 0:
            raise ValueError(
                f"attention q_scaling {q!r}: expected a finite number > 0 (scores are divided by "
                "sqrt(head_size) * q_scaling; 1.0 for the standard scale)"
            )

    def to_attributes(self, op: str) -> dict[str, Any]:
        """The fields op `op` uses (OP_FIELDS), less those at their value in every graph built before the field
        existed (OMITTED_AT): graphs that do not use a newer field stay byte-identical (tests/test_pinned_bytes.py)
        and from_attributes gives it back its default."""
        return {
            k: v for k, v in asdict(self).items() if k in OP_FIELDS[op] and not (k in OMITTED_AT and v == OMITTED_AT[k])
        }

    @classmethod
    def from_attributes(cls, op: str, attrs: dict[str, Any]) -> AttentionAttrs:
        unknown = set(attrs) - OP_FIELDS[op]
        if unknown:
            raise ValueError(f"{op}: unknown attributes {sorted(unknown)}")
        return cls(**attrs)  # an omitted field (OMITTED_AT) takes its default

    def rotary_scaling(self) -> dict[str, Any] | None:
        if self.rotary_scaling_type == "none":
            return None
        if self.rotary_scaling_type == "linear":
            return {"rope_type": "linear", "factor": self.rotary_scaling_factor}
        if self.rotary_scaling_type != "llama3":
            raise ValueError(f"rotary_scaling_type {self.rotary_scaling_type!r}: expected none, linear or llama3")
        return {
            "rope_type": "llama3",
            "factor": self.rotary_scaling_factor,
            "low_freq_factor": self.rotary_low_freq_factor,
            "high_freq_factor": self.rotary_high_freq_factor,
            "original_max_position_embeddings": self.rotary_original_max_positions,
        }


_COMMON = {"layer", "num_heads", "num_kv_heads", "head_size", "tokens_per_block", "kv_cache_dtype", "kv_scale"}
OP_FIELDS = {
    "KVCacheWrite": _COMMON | {f.name for f in fields(AttentionAttrs) if f.name.startswith("rotary_")},
    "PagedAttention": _COMMON | {"sliding_window", "q_scaling"},
}
# Fields added after graphs were first pinned, and the value at which to_attributes leaves them out of the graph.
OMITTED_AT: dict[str, Any] = {"q_scaling": 1.0}


def _store(x: torch.Tensor, a: AttentionAttrs, pool_dtype: torch.dtype) -> torch.Tensor:
    if a.kv_cache_dtype == "int8":
        return torch.round(x / a.kv_scale).clamp(-128, 127).to(torch.int8)
    if a.kv_cache_dtype == "fp8":  # saturate first: torch turns out-of-range values into NaN
        return (x / a.kv_scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return x.to(pool_dtype)


def _load(codes: torch.Tensor, a: AttentionAttrs, dtype: torch.dtype) -> torch.Tensor:
    if a.kv_cache_dtype == "int8":
        return codes.to(dtype) * a.kv_scale
    if a.kv_cache_dtype == "fp8":
        return codes.view(torch.float8_e4m3fn).to(dtype) * a.kv_scale
    return codes.to(dtype)


def kv_cache_write(
    a: AttentionAttrs,
    qkv: torch.Tensor,
    position_ids: torch.Tensor,
    context_lens: torch.Tensor,
    new_lens: torch.Tensor,
    block_tables: torch.Tensor,
    kv_cache: torch.Tensor,
) -> torch.Tensor:
    """Write the new tokens' K (after rotary) and V into `kv_cache` in place (an fp8 pool is held as uint8);
    return q after rotary [num_tokens, heads * head_size]."""
    del context_lens  # in the op's inputs for the contract; positions come from position_ids (Batch.check ties them)
    t, h, kvh, d = qkv.shape[0], a.num_heads, a.num_kv_heads, a.head_size
    dtype = qkv.dtype
    compute = torch.float64 if dtype == torch.float64 else torch.float32  # rotary never in fp16 / bf16
    q, k, v = torch.split(qkv.to(compute), [h * d, kvh * d, kvh * d], dim=-1)
    q, k, v = q.reshape(t, h, d), k.reshape(t, kvh, d), v.reshape(t, kvh, d)
    positions = position_ids.long()
    if a.rotary_style == "neox":
        cos, sin = cos_sin(positions, d, a.rotary_base, a.rotary_scaling(), compute)
        q = apply_rotary(q.transpose(0, 1), cos, sin).transpose(0, 1)
        k = apply_rotary(k.transpose(0, 1), cos, sin).transpose(0, 1)
    elif a.rotary_style != "none":
        raise ValueError(f"KVCacheWrite: rotary_style {a.rotary_style!r}")
    seq_of = torch.repeat_interleave(torch.arange(new_lens.shape[0]), new_lens.long())
    blocks = block_tables.long()[seq_of, positions // a.tokens_per_block]
    slots = positions % a.tokens_per_block
    pool = kv_cache[a.layer]  # a view: writes below land in the caller's pool
    pool[blocks, 0, :, slots] = _store(k, a, pool.dtype)
    pool[blocks, 1, :, slots] = _store(v, a, pool.dtype)
    return q.reshape(t, h * d).to(dtype)


def paged_attention(
    a: AttentionAttrs,
    q: torch.Tensor,
    position_ids: torch.Tensor,
    context_lens: torch.Tensor,
    new_lens: torch.Tensor,
    block_tables: torch.Tensor,
    kv_cache: torch.Tensor,
) -> torch.Tensor:
    """Causal attention of each new token over its sequence's cached and new tokens, read from the pool.

    Sequences with several new tokens (prefill chunks) are computed one by one, in the reference model's order of
    operations; single-token sequences (decode steps) together in one vectorised pass — the same function, summed
    in another order, which only matters where a quantizer downstream sits on a rounding boundary."""
    t, h, kvh, d = q.shape[0], a.num_heads, a.num_kv_heads, a.head_size
    dtype = q.dtype
    compute = torch.float64 if dtype == torch.float64 else torch.float32  # scores and softmax in fp32 at least
    group = h // kvh
    q = q.reshape(t, h, d).to(compute)
    positions = position_ids.long()
    pool = kv_cache[a.layer]
    tables = block_tables.long()
    lens, contexts = new_lens.tolist(), context_lens.tolist()
    if lens and all(n == 1 for n in lens):  # a decode step: every sequence one query, all in one pass
        return _decode_attention(a, q, positions, tables, pool, compute).reshape(t, h * d).to(dtype)
    out = torch.empty(t, h, d, dtype=compute)
    starts = torch.cumsum(new_lens.long(), 0) - new_lens.long()
    decodes = [s for s, n in enumerate(lens) if n == 1]
    for s, (n, ctx) in enumerate(zip(lens, contexts, strict=True)):
        if n <= 1:
            continue
        key_pos = torch.arange(ctx + n)
        kb, ks = tables[s, key_pos // a.tokens_per_block], key_pos % a.tokens_per_block
        keys = _load(pool[kb, 0, :, ks], a, compute).repeat_interleave(group, dim=1)  # [total, h, d]
        values = _load(pool[kb, 1, :, ks], a, compute).repeat_interleave(group, dim=1)
        rows = slice(int(starts[s]), int(starts[s]) + n)
        query_pos = positions[rows][:, None]
        allowed = key_pos[None, :] <= query_pos
        if a.sliding_window:
            allowed &= query_pos - key_pos[None, :] < a.sliding_window
        scores = torch.einsum("qhd,khd->hqk", q[rows], keys) / (math.sqrt(d) * a.q_scaling)
        probs = scores.masked_fill(~allowed[None], float("-inf")).softmax(dim=-1)
        out[rows] = torch.einsum("hqk,khd->qhd", probs, values)
    if decodes:
        out[starts[decodes]] = _decode_attention(
            a, q[starts[decodes]], positions[starts[decodes]], tables[decodes], pool, compute
        )
    return out.reshape(t, h * d).to(dtype)


def _decode_attention(
    a: AttentionAttrs,
    q: torch.Tensor,
    positions: torch.Tensor,
    tables: torch.Tensor,
    pool: torch.Tensor,
    compute: torch.dtype,
) -> torch.Tensor:
    """One query per sequence, all sequences at once: keys 0..L-1 of the longest, masked per sequence. Key
    positions past a sequence's own length read that sequence's last token instead (masked out, but never another
    sequence's block: a NaN there could otherwise leak through 0 * NaN). The product runs in torch's fused
    scaled_dot_product_attention (GQA without repeating K/V): 6x faster than einsums on a decode batch of 16."""
    n, h, d = q.shape
    kvh = pool.shape[2]
    query_pos = positions[:, None]
    key_pos = torch.arange(int(positions.max()) + 1)[None, :]
    valid = key_pos <= query_pos
    if a.sliding_window:
        valid &= query_pos - key_pos < a.sliding_window
    own = torch.minimum(key_pos, query_pos)  # [n, L]
    tpb = a.tokens_per_block
    blocks = tables.gather(1, own // tpb)
    # rows of the pool seen as [blocks * 2 * kvh * tpb, head_size]: row ((block * 2 + kv) * kvh + head) * tpb + slot;
    # one index_select per K and V lands them as [n, kvh, L, d] (2x faster than indexing the 5-d pool, same values)
    rows = ((blocks * (2 * kvh))[:, None, :] + torch.arange(kvh)[None, :, None]) * tpb + (own % tpb)[:, None, :]
    flat = pool.reshape(-1, d)
    keys = _load(flat.index_select(0, rows.reshape(-1)), a, compute).view(n, kvh, -1, d)
    values = _load(flat.index_select(0, (rows + kvh * tpb).reshape(-1)), a, compute).view(n, kvh, -1, d)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.view(n, h, 1, d),
        keys,
        values,
        attn_mask=valid[:, None, None, :],
        enable_gqa=kvh != h,
        scale=1 / (math.sqrt(d) * a.q_scaling),  # at q_scaling 1: bit-identical to SDPA's default 1 / sqrt(d)
    )
    return out.reshape(n, h, d)


OPS = {"KVCacheWrite": kv_cache_write, "PagedAttention": paged_attention}
