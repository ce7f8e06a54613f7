"""Reference implementations of our plugin ops: the single semantic definition of each. The CPU engine runs them
between ONNX Runtime segments; the CUDA plugins are checked against them; their attributes are the plugin fields.

Two ops per layer (domain `trtbuild`), each one CUDA kernel launch in the plugin (plugins/):

KVCacheWrite
  inputs   qkv [num_tokens, (heads + 2 kv_heads) * head_size], position_ids [num_tokens], context_lens [num_seqs],
           new_lens [num_seqs], block_tables [num_seqs, max_blocks], kv_cache (the pool, written in place)
  outputs  q [num_tokens, heads * head_size] (after rotary)
  q and k get rotary embedding at their positions (rotate-half / GPT-NeoX style, with the configured scaling: linear,
  llama3, or YaRN with its attention factor on cos and sin, reference/rope.py); the
  new tokens' k and v are stored (quantized with kv_scale when the pool is int8 / fp8; when it is nvfp4, quantized
  to NVFP4 in blocks of 16 along head_size over the global scale kv_scale and stored dequantized, in float32:
  quantize/methods/kv_cache.py) at their slots.

PagedAttention
  inputs   q [num_tokens, heads * head_size], position_ids, context_lens, new_lens, block_tables, kv_cache, then,
           when sinks, sinks [heads] (float32: one logit per head in every query's softmax denominator, gpt-oss)
  outputs  out [num_tokens, heads * head_size]
  each new token attends, causally, to every cached and new token of its own sequence at positions <= its own (and
  > its own - sliding_window when there is one), reading K and V from the pool (dequantized); query head h reads
  KV head h // (heads / kv_heads). Scores are q.k / (sqrt(head_size) * q_scaling).

One op per mixture-of-experts layer (issue 26), in place of the dense MLP's GEMMs:

MoE
  inputs   x [num_tokens, hidden] (the normed hidden states), router_weight [experts, hidden],
           fc_weight [experts, fc_rows, hidden], proj_weight [experts, hidden, inter], then, when use_bias,
           fc_bias [experts, fc_rows] and proj_bias [experts, hidden], then, when router_bias, router_bias [experts]
           (inter = expert_inter_size; fc_rows = 2 * inter when gated: [up; gate], the activation on the second
           half, TensorRT-LLM's `fc` of `MixtureOfExperts`, else inter)
  outputs  y [num_tokens, hidden]
  router logits x @ router_weight^T (+ router_bias) in float32; per token the top_k experts and their weights as
  router_norm says (spec.ROUTER_NORMS: softmax_topk, softmax_topk_renormalise, topk_softmax, each computed as
  transformers' router of that kind computes it, so torch.topk breaks ties as there); y = sum over the chosen
  experts e of weight_e * proj_e(up_e(x) * act(gate_e(x))) (gated; gpt-oss's clamped SwiGLU where swiglu_alpha /
  swiglu_beta / swiglu_limit say so) or proj_e(act(fc_e(x))). The weights are the layer's, as ONNX initializers
  (the checkpoint's tensors: docs/engine.md). Fields: number_of_experts, top_k, expert_hidden_size,
  expert_inter_size, use_bias, swiglu_alpha, swiglu_beta, swiglu_limit (TensorRT-LLM's MixtureOfExperts fields of
  those names, tensorrt_llm/layers/moe.py; our swiglu_limit 0 is its None); router_norm, activation
  (spec.ACTIVATIONS), gated and router_bias are ours (TensorRT-LLM folds gating into activation_type, swiglu / geglu,
  and its normalization_mode enum has no plain softmax-then-top-k without renormalising).
  Quantized experts (docs/quantization.md): the weights arrive dequantized (DequantizeLinear before the node); then,
  when fp8_inputs or int8_inputs, fc_input_scale and proj_input_scale [E] follow the biases (each expert's routed
  rows quantize-dequantized at its own static scale before its fc and its proj GEMM), and, when prequant,
  fc_prequant [E, hidden] and proj_prequant [E, inter] float32 after them (each expert's rows multiplied by its own
  1/s first: AWQ and SmoothQuant experts).
  Experts split over ranks (issue 27: expert and expert-tensor parallelism, sharding.py): expert_offset and
  num_local_experts say which experts [offset, offset + num_local_experts) this rank's weights hold (0, 0: all).
  Every rank routes every token over all number_of_experts (the router is whole) and computes only the assignments
  to its experts, with its expert_inter_size (the rank's slice of each expert's width); the weights' and the
  per-expert inputs' first dim is num_local_experts. y is then the rank's partial sum, completed by an
  AllReduce over the tp group after the node (TensorRT-LLM's MixtureOfExperts, tensorrt_llm/layers/moe.py).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

from toolchain.checkpoint.spec import ACTIVATIONS, ROUTER_NORMS
from toolchain.engine.collectives import COLLECTIVE_ATTRS, COLLECTIVE_FIELDS, CollectiveAttrs
from toolchain.engine.geometry import blocks_for
from toolchain.quantize.core import FP8_E4M3_MAX
from toolchain.quantize.methods.nvfp4 import nvfp4_qdq
from toolchain.reference.model import ACTIVATIONS as ACTIVATION_FNS
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
    rotary_scaling_type: str = "none"  # "none", "linear", "llama3", "yarn"
    rotary_scaling_factor: float = 1.0
    rotary_low_freq_factor: float = 1.0
    rotary_high_freq_factor: float = 4.0
    rotary_original_max_positions: int = 8192
    # YaRN (gpt-oss; reference/rope.py): the ramp's rotations, whether its ends are floored / ceiled, and the factor
    # cos and sin are multiplied by (computed at export from the config, rope.attention_factor)
    rotary_beta_fast: float = 32.0
    rotary_beta_slow: float = 1.0
    rotary_truncate: int = 1
    rotary_attention_factor: float = 1.0
    sliding_window: int = 0  # 0: attend to the whole context
    kv_cache_dtype: str = "float32"  # float32, float16, bfloat16, int8, fp8, nvfp4 (NVFP4 values in float32)
    kv_scale: float = 1.0  # dequantization factor of an int8 / fp8 pool; nvfp4: the global scale of the writes
    # Attention scores are q.k / (sqrt(head_size) * q_scaling): TensorRT-LLM's gpt_attention field of that name
    # (tensorrt_llm/_torch/modules/attention.py: "qk_scale = 1 / (sqrt(head_dim) * q_scaling)"; Gemma 2 / 3 set
    # q_scaling = sqrt(query_pre_attn_scalar / head_size) in tensorrt_llm/models/gemma/model.py).
    q_scaling: float = 1.0
    # 1: a sinks input [num_heads] (float32) follows the pool: one learned logit per head that joins each query's
    # softmax denominator and attends to nothing (gpt-oss; transformers' eager_attention_forward with sinks)
    sinks: int = 0

    def __post_init__(self) -> None:
        if self.sinks not in (0, 1):
            raise ValueError(f"attention sinks {self.sinks!r}: expected 0 or 1 (1: a sinks input per head)")
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
        if self.rotary_scaling_type == "yarn":
            return {
                "rope_type": "yarn",
                "factor": self.rotary_scaling_factor,
                "original_max_position_embeddings": self.rotary_original_max_positions,
                "beta_fast": self.rotary_beta_fast,
                "beta_slow": self.rotary_beta_slow,
                "truncate": bool(self.rotary_truncate),
                "attention_factor": self.rotary_attention_factor,
            }
        if self.rotary_scaling_type != "llama3":
            raise ValueError(f"rotary_scaling_type {self.rotary_scaling_type!r}: expected none, linear, llama3 or yarn")
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
    "PagedAttention": _COMMON | {"sliding_window", "q_scaling", "sinks"},
}
# Fields added after graphs were first pinned, and the value at which to_attributes leaves them out of the graph.
OMITTED_AT: dict[str, Any] = {
    "q_scaling": 1.0,
    "fp8_inputs": 0,
    "int8_inputs": 0,
    "prequant": 0,
    "sinks": 0,
    "rotary_beta_fast": 32.0,
    "rotary_beta_slow": 1.0,
    "rotary_truncate": 1,
    "rotary_attention_factor": 1.0,
    "swiglu_alpha": 1.0,
    "swiglu_beta": 0.0,
    "swiglu_limit": 0.0,
    "expert_offset": 0,
    "num_local_experts": 0,
}


def _store(x: torch.Tensor, a: AttentionAttrs, pool_dtype: torch.dtype) -> torch.Tensor:
    if a.kv_cache_dtype == "int8":
        return torch.round(x / a.kv_scale).clamp(-128, 127).to(torch.int8)
    if a.kv_cache_dtype == "fp8":  # saturate first: torch turns out-of-range values into NaN
        return (x / a.kv_scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    if a.kv_cache_dtype == "nvfp4":  # the NVFP4-dequantized values themselves, in the float32 pool
        return nvfp4_qdq(x.float(), torch.tensor([a.kv_scale], dtype=torch.float32)).to(pool_dtype)
    return x.to(pool_dtype)


def _load(codes: torch.Tensor, a: AttentionAttrs, dtype: torch.dtype) -> torch.Tensor:
    if a.kv_cache_dtype == "int8":
        return codes.to(dtype) * a.kv_scale
    if a.kv_cache_dtype == "fp8":
        return codes.view(torch.float8_e4m3fn).to(dtype) * a.kv_scale
    return codes.to(dtype)


def _memo(memo: dict[Any, Any] | None, key: tuple[Any, ...], make: Callable[[], Any]) -> Any:
    """`make()`, computed once per engine call when the caller passes a `memo` (one dict per batch): what depends
    only on the batch's geometry and the attributes in `key` (rotary angles, pool rows, masks) is the same for
    every layer, and recomputing it per layer was a fifth of a decode step (docs/performance.md)."""
    if memo is None:
        return make()
    value = memo.get(key)
    if value is None:
        value = memo[key] = make()
    return value


def _write_rows(
    position_ids: torch.Tensor, new_lens: torch.Tensor, block_tables: torch.Tensor, kvh: int, tpb: int
) -> torch.Tensor:
    """Row of each new token's K per KV head in a layer's pool seen as [blocks * 2 * kv_heads * tokens_per_block,
    head_size] (row ((block * 2 + kv) * kv_heads + head) * tokens_per_block + slot), flattened [tokens * kv_heads];
    V's rows are these + kv_heads * tokens_per_block."""
    positions = position_ids.long()
    seq_of = torch.repeat_interleave(torch.arange(new_lens.shape[0]), new_lens.long())
    blocks = block_tables.long()[seq_of, positions // tpb]
    rows = ((blocks * (2 * kvh))[:, None] + torch.arange(kvh)[None, :]) * tpb + (positions % tpb)[:, None]
    return rows.reshape(-1)


def kv_cache_write(
    a: AttentionAttrs,
    qkv: torch.Tensor,
    position_ids: torch.Tensor,
    context_lens: torch.Tensor,
    new_lens: torch.Tensor,
    block_tables: torch.Tensor,
    kv_cache: torch.Tensor,
    memo: dict[Any, Any] | None = None,
) -> torch.Tensor:
    """Write the new tokens' K (after rotary) and V into `kv_cache` in place (an fp8 pool is held as uint8);
    return q after rotary [num_tokens, heads * head_size]. `memo`: see _memo."""
    del context_lens  # in the op's inputs for the contract; positions come from position_ids (Batch.check ties them)
    t, h, kvh, d = qkv.shape[0], a.num_heads, a.num_kv_heads, a.head_size
    dtype = qkv.dtype
    compute = torch.float64 if dtype == torch.float64 else torch.float32  # rotary never in fp16 / bf16
    qkv = qkv.to(compute)
    qk = qkv[:, : (h + kvh) * d].reshape(t, h + kvh, d)  # q's and k's heads, rotated together
    v = qkv[:, (h + kvh) * d :].reshape(t, kvh, d)
    if a.rotary_style == "neox":
        scaling = (a.rotary_scaling_type, a.rotary_scaling_factor, a.rotary_low_freq_factor, a.rotary_high_freq_factor)
        yarn = (a.rotary_beta_fast, a.rotary_beta_slow, a.rotary_truncate, a.rotary_attention_factor)
        cos, sin = _memo(
            memo,
            ("cos_sin", d, a.rotary_base, *scaling, *yarn, a.rotary_original_max_positions, compute),
            lambda: [c[:, None] for c in cos_sin(position_ids.long(), d, a.rotary_base, a.rotary_scaling(), compute)],
        )
        qk = apply_rotary(qk, cos, sin)  # cos / sin [tokens, 1, head_size]: the same angles for every head
    elif a.rotary_style != "none":
        raise ValueError(f"KVCacheWrite: rotary_style {a.rotary_style!r}")
    rows = _memo(
        memo,
        ("write_rows", kvh, a.tokens_per_block),
        lambda: _write_rows(position_ids, new_lens, block_tables, kvh, a.tokens_per_block),
    )
    flat = kv_cache[a.layer].view(-1, d)  # a view: the writes land in the caller's pool (view, never a copy)
    flat.index_copy_(0, rows, _store(qk[:, h:], a, flat.dtype).reshape(-1, d))
    flat.index_copy_(0, rows + kvh * a.tokens_per_block, _store(v, a, flat.dtype).reshape(-1, d))
    return qk[:, :h].reshape(t, h * d).to(dtype)


def _tile_rows(blocks: torch.Tensor, kvh: int) -> torch.Tensor:
    """Rows of a layer's pool seen as [blocks * 2 * kv_heads, tokens_per_block * head_size] (one row: one block's
    tokens of one K or V head) for block ids [..., j], ordered [K/V, ..., kv head, j]: one index_select lands them
    as K and V [2, ..., kv_heads, j * tokens_per_block, head_size], the layout attention reads, with no permute."""
    kv = torch.arange(2).view(2, *[1] * blocks.dim(), 1)
    head = torch.arange(kvh).view(kvh, 1)
    return ((blocks.unsqueeze(-2) * 2 + kv) * kvh + head).reshape(-1)


@dataclass(frozen=True)
class _DecodeGroup:
    """Single-token sequences attended together: their K / V tiles, gathered as one [2, n, kv_heads, L, d]."""

    rows: torch.Tensor | None  # their rows in the batch; None: every row of the batch, in order
    positions: torch.Tensor  # [n]
    tiles: torch.Tensor  # pool tile rows (_tile_rows) of [n, blocks], a sequence's last block repeated past its end
    stale_tiles: torch.Tensor  # gathered tiles wholly past their sequence's position (the repeats)
    stale_rows: torch.Tensor  # rows [tiles * tpb] (one token of one head) of the last tiles' slots past it


@dataclass(frozen=True)
class _AttentionPlan:
    """A batch's attention geometry, the same for every layer: its multi-token sequences (prefill chunks) and its
    single-token sequences (decode steps), in groups of similar length (a sequence of 300 tokens beside ones of 20
    would have them all gather and attend over 300 slots)."""

    chunks: list[tuple[int, int, int, int]]  # (sequence, first row, new tokens, cached tokens)
    decodes: list[_DecodeGroup]

    @classmethod
    def of(
        cls,
        positions: torch.Tensor,
        contexts: torch.Tensor,
        new_lens: torch.Tensor,
        tables: torch.Tensor,
        tpb: int,
        kvh: int,
    ) -> _AttentionPlan:
        lens, ctxs = new_lens.tolist(), contexts.tolist()
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        chunks = [(s, starts[s], n, ctx) for s, (n, ctx) in enumerate(zip(lens, ctxs, strict=True)) if n > 1]
        decodes = [s for s, n in enumerate(lens) if n == 1]
        if not decodes:
            return cls(chunks, [])
        everything = len(decodes) == len(lens)
        rows = torch.tensor([starts[s] for s in decodes], dtype=torch.long)
        blocks = positions.long()[rows] // tpb + 1
        # groups by blocks needed, in powers of two: at most 2x the tiles any sequence needs, log2(max) groups
        bucket = torch.frexp(blocks.double() - 0.5)[1]
        groups = []
        for b in torch.unique(bucket).tolist():
            members = (bucket == b).nonzero()[:, 0]
            one = everything and members.numel() == len(decodes)
            groups.append(
                cls._group(
                    None if one else rows[members],
                    positions.long()[rows[members]],
                    tables.long()[torch.tensor(decodes)[members]],
                    tpb,
                    kvh,
                )
            )
        return cls(chunks, groups)

    @staticmethod
    def _group(
        rows: torch.Tensor | None, positions: torch.Tensor, tables: torch.Tensor, tpb: int, kvh: int
    ) -> _DecodeGroup:
        n = positions.shape[0]
        last = positions // tpb
        width = int(last.max()) + 1
        # a sequence's columns past its last block read that block again (zeroed after the gather, and never
        # another sequence's block or a table entry the batch does not vouch for)
        cols = torch.minimum(torch.arange(width)[None, :], last[:, None])
        tiles = _tile_rows(tables.gather(1, cols), kvh)  # [2, n, kvh, width]
        repeat = (cols < torch.arange(width)[None, :])[None, :, None, :].expand(2, n, kvh, width)
        stale_tiles = repeat.reshape(-1).nonzero()[:, 0]
        # the last tile's slots past the position: [2, n, kvh, width, tpb] flattened, only at column `last`
        past = torch.arange(tpb)[None, :] > (positions % tpb)[:, None]  # [n, tpb]
        at = (torch.arange(width)[None, :] == last[:, None])[:, :, None] & past[:, None, :]  # [n, width, tpb]
        stale_rows = at[None, :, None].expand(2, n, kvh, width, tpb).reshape(-1).nonzero()[:, 0]
        return _DecodeGroup(rows, positions, tiles, stale_tiles, stale_rows)


def paged_attention(
    a: AttentionAttrs,
    q: torch.Tensor,
    position_ids: torch.Tensor,
    context_lens: torch.Tensor,
    new_lens: torch.Tensor,
    block_tables: torch.Tensor,
    kv_cache: torch.Tensor,
    sinks: torch.Tensor | None = None,
    memo: dict[Any, Any] | None = None,
) -> torch.Tensor:
    """Causal attention of each new token over its sequence's cached and new tokens, read from the pool.

    Sequences with several new tokens (prefill chunks) are computed one by one, single-token sequences (decode
    steps) together in one pass, both through torch's fused scaled_dot_product_attention (grouped-query heads
    without repeating K / V; scores and softmax in float32 at least). `sinks` [num_heads] when a.sinks: each head's
    logit joins the softmax as one more key whose value is zero (so it takes probability and adds nothing).
    `memo`: see _memo."""
    if (sinks is not None) != bool(a.sinks) or (sinks is not None and tuple(sinks.shape) != (a.num_heads,)):
        shape = None if sinks is None else tuple(sinks.shape)
        raise ValueError(
            f"PagedAttention sinks={a.sinks} with a sinks input of shape {shape}: expected "
            f"{'(' + str(a.num_heads) + ',)' if a.sinks else 'no sinks input'}"
        )
    t, h, kvh, d = q.shape[0], a.num_heads, a.num_kv_heads, a.head_size
    dtype = q.dtype
    compute = torch.float64 if dtype == torch.float64 else torch.float32  # scores and softmax in fp32 at least
    q = q.reshape(t, h, d).to(compute)
    pool = kv_cache[a.layer]
    tpb, scale = a.tokens_per_block, 1 / (math.sqrt(d) * a.q_scaling)  # at q_scaling 1: SDPA's own 1 / sqrt(d)
    plan: _AttentionPlan = _memo(
        memo,
        ("attention_plan", tpb, kvh),
        lambda: _AttentionPlan.of(position_ids, context_lens, new_lens, block_tables, tpb, kvh),
    )
    sink = None if sinks is None else sinks.to(compute)
    if len(plan.decodes) == 1 and plan.decodes[0].rows is None:  # a decode step: every sequence one query
        return _decode_attention(a, q, plan.decodes[0], pool, compute, scale, sink).reshape(t, h * d).to(dtype)
    out = torch.empty(t, h, d, dtype=compute)
    for group in plan.decodes:
        assert group.rows is not None
        out[group.rows] = _decode_attention(a, q[group.rows], group, pool, compute, scale, sink)
    tiles = pool.view(-1, tpb * d)
    positions = position_ids.long()
    for s, start, n, ctx in plan.chunks:
        total = ctx + n
        blocks = block_tables[s, : blocks_for(total, tpb)].long()
        kv = tiles.index_select(0, _tile_rows(blocks, kvh))  # K and V [2, kv_heads, blocks * tpb, d]: one gather
        kv = _load(kv.view(2, kvh, -1, d)[:, :, :total], a, compute)
        query_pos, key_pos = positions[start : start + n, None], torch.arange(total)[None, :]
        allowed = key_pos <= query_pos
        if a.sliding_window:
            allowed &= query_pos - key_pos < a.sliding_window
        mask = allowed[None, None]
        if sink is not None:  # a zero key and value after the last, its score the head's sink (an additive mask)
            kv = torch.nn.functional.pad(kv, (0, 0, 0, 1))
            mask = _sink_mask(mask.expand(1, h, n, total), sink.view(1, h, 1, 1), compute)
        out[start : start + n] = torch.nn.functional.scaled_dot_product_attention(
            q[start : start + n].transpose(0, 1)[None],
            kv[0][None],
            kv[1][None],
            attn_mask=mask,
            enable_gqa=kvh != h,
            scale=scale,
        )[0].transpose(0, 1)
    return out.reshape(t, h * d).to(dtype)


def _sink_mask(allowed: torch.Tensor, sink: torch.Tensor, compute: torch.dtype) -> torch.Tensor:
    """The additive mask of attention with sinks: 0 where `allowed` [..., keys], -inf elsewhere, then one more
    column, the sink logits (broadcast to [..., 1]), for the zero key and value padded after the last key."""
    scores = torch.zeros(allowed.shape, dtype=compute).masked_fill_(~allowed, float("-inf"))
    return torch.cat([scores, sink.expand(*allowed.shape[:-1], 1)], dim=-1)


def _decode_attention(
    a: AttentionAttrs,
    q: torch.Tensor,
    group: _DecodeGroup,
    pool: torch.Tensor,
    compute: torch.dtype,
    scale: float,
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per sequence, the group's sequences at once, over the keys 0..L-1 of its longest, masked per
    sequence. K and V come from one gather of whole tiles (a block's tokens of one head: 4 KB copies, not 256-byte
    rows, and no permute after); gathered slots past a sequence's position are zeroed, so stale bytes there
    (another request's, or NaN) cannot leak through a masked score (NaN + -inf) or a zero probability (0 * NaN)."""
    n, h, d = q.shape
    kvh, tpb = pool.shape[2], a.tokens_per_block
    kv = pool.view(-1, tpb * d).index_select(0, group.tiles)  # a copy, never the pool: zeroed in place below
    kv.index_fill_(0, group.stale_tiles, 0)
    kv.view(-1, d).index_fill_(0, group.stale_rows, 0)
    kv = _load(kv.view(2, n, kvh, -1, d), a, compute)
    query_pos, key_pos = group.positions[:, None], torch.arange(kv.shape[3])[None, :]
    valid = key_pos <= query_pos
    if a.sliding_window:
        valid &= query_pos - key_pos < a.sliding_window
    mask = valid[:, None, None, :]
    if sink is not None:  # as in paged_attention: a zero key and value, scored by the head's sink
        kv = torch.nn.functional.pad(kv, (0, 0, 0, 1))
        mask = _sink_mask(mask.expand(n, kvh, h // kvh, -1), sink.view(1, kvh, h // kvh, 1), compute)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.reshape(n, kvh, h // kvh, d),  # a KV head's query heads as its queries: GQA with no repeat of K / V
        kv[0],
        kv[1],
        attn_mask=mask,
        scale=scale,
    )
    return out.reshape(n, h, d)


MOE_OP = "MoE"  # plugin name = ONNX op_type (domain trtbuild) of a mixture-of-experts layer


@dataclass(frozen=True)
class MoEAttrs:
    """The MoE op's fields (ONNX attributes of the node); see the module docstring."""

    number_of_experts: int
    top_k: int
    expert_hidden_size: int
    expert_inter_size: int
    router_norm: str = "softmax_topk"  # spec.ROUTER_NORMS
    activation: str = "silu"  # spec.ACTIVATIONS
    gated: int = 1  # fc = [up; gate], proj(up * act(gate)); 0: proj(act(fc))
    use_bias: int = 0  # fc_bias and proj_bias inputs
    router_bias: int = 0  # a router_bias input (gpt-oss)
    # gpt-oss's clamped SwiGLU (spec.ExpertsFFN; TensorRT-LLM's MoE swiglu_alpha / swiglu_beta / swiglu_limit):
    # gate * sigmoid(alpha * gate) * (up + beta), the gate clamped to at most the limit and the up to [-limit,
    # limit]; swiglu_limit 0: no clamp. At their defaults (plain up * silu(gate)) they stay out of the graph.
    swiglu_alpha: float = 1.0
    swiglu_beta: float = 0.0
    swiglu_limit: float = 0.0
    fp8_inputs: int = 0  # fc_input_scale and proj_input_scale inputs [E] (fp8 experts): each expert's routed rows
    # quantize-dequantized to E4M3 at its own static scale before its fc and its proj GEMM
    int8_inputs: int = 0  # the same two input scales [E] (w8a8_sq experts), the rows quantize-dequantized to int8
    # (round half to even, saturated to [-128, 127], as ONNX QuantizeLinear) instead of E4M3
    # fc_prequant [E, hidden] and proj_prequant [E, inter] float32 inputs after the input scales (AWQ / SmoothQuant
    # experts): each expert's routed rows multiplied by its own 1/s before the input quantization and the GEMM, as
    # TensorRT-LLM's `prequant_scaling_factor` (its MoE shares one (1, in_features) across the experts,
    # tensorrt_llm/layers/moe.py `MOEWeightWrapper`; ours is per expert: quantize/experts.py)
    prequant: int = 0
    # the experts this rank's weights hold, [expert_offset, expert_offset + num_local_experts); 0, 0: all of them
    expert_offset: int = 0
    num_local_experts: int = 0

    def __post_init__(self) -> None:
        for name in ("number_of_experts", "top_k", "expert_hidden_size", "expert_inter_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MoE {name} {value!r}: expected a positive integer")
        if self.top_k > self.number_of_experts:
            raise ValueError(f"MoE top_k {self.top_k} exceeds number_of_experts {self.number_of_experts}")
        for name in ("expert_offset", "num_local_experts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"MoE {name} {value!r}: expected an integer >= 0")
        if self.expert_offset + self.local_experts > self.number_of_experts:
            raise ValueError(
                f"MoE experts {self.expert_offset} .. {self.expert_offset + self.local_experts - 1} "
                f"(expert_offset, num_local_experts): expected within the {self.number_of_experts} experts"
            )
        if self.router_norm not in ROUTER_NORMS:
            raise ValueError(f"MoE router_norm {self.router_norm!r}: expected one of {', '.join(ROUTER_NORMS)}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"MoE activation {self.activation!r}: expected one of {', '.join(ACTIVATIONS)}")
        for name in ("gated", "use_bias", "router_bias", "fp8_inputs", "int8_inputs", "prequant"):
            if getattr(self, name) not in (0, 1):
                raise ValueError(f"MoE {name} {getattr(self, name)!r}: expected 0 or 1")
        if self.fp8_inputs and self.int8_inputs:
            raise ValueError("MoE fp8_inputs and int8_inputs are both 1: expected at most one input quantization")
        if not (self.swiglu_alpha > 0 and self.swiglu_limit >= 0 and math.isfinite(self.swiglu_beta)):
            raise ValueError(
                f"MoE swiglu_alpha {self.swiglu_alpha!r}, swiglu_beta {self.swiglu_beta!r}, swiglu_limit "
                f"{self.swiglu_limit!r}: expected alpha > 0, a finite beta, limit >= 0 (0: no clamp)"
            )
        if self.clamped_swiglu and (not self.gated or self.activation != "silu"):
            raise ValueError(
                f"MoE swiglu_alpha/beta/limit apply to gated silu experts, not activation {self.activation!r} "
                f"gated {self.gated}"
            )

    @property
    def local_experts(self) -> int:
        """How many experts this rank computes (num_local_experts, 0 meaning all)."""
        return self.num_local_experts or self.number_of_experts

    @property
    def clamped_swiglu(self) -> bool:
        return (self.swiglu_alpha, self.swiglu_beta, self.swiglu_limit) != (1.0, 0.0, 0.0)

    @property
    def fc_rows(self) -> int:
        return 2 * self.expert_inter_size if self.gated else self.expert_inter_size

    def to_attributes(self, op: str) -> dict[str, Any]:
        """As AttentionAttrs.to_attributes: the fields at their OMITTED_AT value (fp8_inputs, the swiglu ones) stay
        out of the graph, so a float MoE graph stays byte-identical."""
        return {
            k: v for k, v in asdict(self).items() if k in OP_FIELDS[op] and not (k in OMITTED_AT and v == OMITTED_AT[k])
        }

    @classmethod
    def from_attributes(cls, op: str, attrs: dict[str, Any]) -> MoEAttrs:
        unknown = set(attrs) - OP_FIELDS[op]
        if unknown:
            raise ValueError(f"{op}: unknown attributes {sorted(unknown)}")
        return cls(**attrs)


OP_FIELDS[MOE_OP] = {f.name for f in fields(MoEAttrs)}


def route(
    a: MoEAttrs, x: torch.Tensor, router_weight: torch.Tensor, router_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [tokens, top_k] float32, experts [tokens, top_k] int64) of each token, as transformers' routers
    compute them: logits in float32 (TensorRT-LLM's router is float32 too, "routing is sensitive"), then
    softmax over all experts and torch.topk of the probabilities (Qwen2/3-MoE, Mixtral; renormalised over the k
    for softmax_topk_renormalise), or torch.topk of the logits and a softmax over the k (topk_softmax, gpt-oss).
    The same tensor reaches torch.topk as there, so ties break the same way."""
    logits = torch.nn.functional.linear(
        x.float(), router_weight.float(), None if router_bias is None else router_bias.float()
    )
    if a.router_norm == "topk_softmax":
        top, experts = torch.topk(logits, a.top_k, dim=-1)
        return torch.softmax(top, dim=-1), experts
    top, experts = torch.topk(torch.softmax(logits, dim=-1), a.top_k, dim=-1)
    if a.router_norm == "softmax_topk_renormalise":
        top = top / top.sum(dim=-1, keepdim=True)
    return top, experts


def _qdq(x: torch.Tensor, scale: torch.Tensor, a: MoEAttrs) -> torch.Tensor:
    """x quantized at a static scale and back: to E4M3 (fp8_inputs; saturated at ±448, as ONNX QuantizeLinear's
    saturate=1) or to int8 (int8_inputs; round half to even, saturated to [-128, 127], as QuantizeLinear)."""
    s = scale.to(x.dtype)
    if a.int8_inputs:
        return torch.round(x / s).clamp(-128, 127) * s
    return (x / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).to(x.dtype) * s


def moe(
    a: MoEAttrs,
    x: torch.Tensor,
    router_weight: torch.Tensor,
    fc_weight: torch.Tensor,
    proj_weight: torch.Tensor,
    *biases: torch.Tensor,
    memo: dict[Any, Any] | None = None,
) -> torch.Tensor:
    """The MoE layer's output [tokens, hidden] (module docstring): `biases` are fc_bias and proj_bias when
    use_bias, then router_bias when router_bias. Computed as a grouped-GEMM kernel does: the (token, expert)
    assignments sorted by expert, each expert's tokens gathered into one GEMM through fc, the activation, one
    GEMM through proj, scaled by their router weights and scatter-added back; an expert no token chose costs
    nothing. In float32 (float64 for float64 x). `memo` is unused (the routing differs per layer).
    fp8_inputs (fp8 experts): two more inputs after the biases, fc_input_scale and proj_input_scale [E]; each
    expert's rows are quantize-dequantized to E4M3 at its own scale before its fc and before its proj GEMM;
    int8_inputs (w8a8_sq experts) the same to int8. prequant (AWQ / SmoothQuant experts): two more inputs after
    those, fc_prequant [E, hidden] and proj_prequant [E, inter]; each expert's rows multiplied by its own row of
    them first. Split experts (expert_offset, num_local_experts): the weights and per-expert inputs hold the local
    experts only; the others' assignments are skipped (their rows of y stay 0: another rank adds them)."""
    del memo
    quantized_inputs = a.fp8_inputs or a.int8_inputs
    extra = 2 * a.use_bias + a.router_bias + 2 * quantized_inputs + 2 * a.prequant
    if len(biases) != extra:
        raise ValueError(
            f"MoE: {len(biases)} bias inputs, expected {extra} (use_bias {a.use_bias}, router_bias "
            f"{a.router_bias}, fp8_inputs {a.fp8_inputs}, int8_inputs {a.int8_inputs}, prequant {a.prequant}: "
            "two input scales, two prequant inputs counted with them)"
        )
    prequant = biases[len(biases) - 2 :] if a.prequant else None
    biases = biases[: len(biases) - 2] if a.prequant else biases
    scales = biases[len(biases) - 2 :] if quantized_inputs else None
    biases = biases[: len(biases) - 2] if quantized_inputs else biases
    fc_bias, proj_bias = (biases[0], biases[1]) if a.use_bias else (None, None)
    router_bias = biases[-1] if a.router_bias else None
    t, e, k, inter = x.shape[0], a.number_of_experts, a.top_k, a.expert_inter_size
    local, first = a.local_experts, a.expert_offset
    expected = {
        "x": (x, (t, a.expert_hidden_size)),
        "router_weight": (router_weight, (e, a.expert_hidden_size)),
        "fc_weight": (fc_weight, (local, a.fc_rows, a.expert_hidden_size)),
        "proj_weight": (proj_weight, (local, a.expert_hidden_size, inter)),
    }
    if prequant is not None:
        expected |= {
            "fc_prequant": (prequant[0], (local, a.expert_hidden_size)),
            "proj_prequant": (prequant[1], (local, inter)),
        }
    for name, (tensor, shape) in expected.items():
        if tuple(tensor.shape) != shape:
            raise ValueError(f"MoE {name} {tuple(tensor.shape)}: expected {shape} from the op's attributes")
    dtype = x.dtype
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    weights, experts = route(a, x, router_weight, router_bias)
    act = ACTIVATION_FNS[a.activation]
    xc = x.to(compute)
    out = torch.zeros(t, a.expert_hidden_size, dtype=compute)
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)  # assignments grouped by expert, tokens in order within each
    counts = torch.bincount(flat, minlength=e).tolist()
    tokens, scale = order // k, weights.reshape(-1)[order].to(compute)
    start = 0
    for routed, n in enumerate(counts):
        expert = routed - first  # the index into this rank's weights
        if n == 0 or not 0 <= expert < local:
            start += n
            continue
        rows = tokens[start : start + n]
        xe = xc[rows] if prequant is None else xc[rows] * prequant[0][expert].to(compute)
        xe = xe if scales is None else _qdq(xe, scales[0][expert], a)
        h = torch.nn.functional.linear(
            xe, fc_weight[expert].to(compute), None if fc_bias is None else fc_bias[expert].to(compute)
        )
        if a.clamped_swiglu:  # gpt-oss (reference/model.py `swiglu`, transformers' GptOssExperts._apply_gate)
            up, gate = h.chunk(2, dim=-1)
            if a.swiglu_limit:
                gate = gate.clamp(max=a.swiglu_limit)
                up = up.clamp(min=-a.swiglu_limit, max=a.swiglu_limit)
            h = gate * torch.sigmoid(gate * a.swiglu_alpha) * (up + a.swiglu_beta)
        elif a.gated:  # [up; gate]: the second half activated (TensorRT-LLM's MoE fc, DenseFFN.gate_up_fused)
            up, gate = h.chunk(2, dim=-1)
            h = up * act(gate)
        else:
            h = act(h)
        if prequant is not None:
            h = h * prequant[1][expert].to(compute)
        if scales is not None:
            h = _qdq(h, scales[1][expert], a)
        y = torch.nn.functional.linear(
            h, proj_weight[expert].to(compute), None if proj_bias is None else proj_bias[expert].to(compute)
        )
        out.index_add_(0, rows, y * scale[start : start + n, None])
        start += n
    return out.to(dtype)


OPS: dict[str, Callable[..., torch.Tensor]] = {
    "KVCacheWrite": kv_cache_write,
    "PagedAttention": paged_attention,
    MOE_OP: moe,
}
# the attributes' class of each op (what the CPU engine parses a node's attributes into)
OP_ATTRS: dict[str, type[AttentionAttrs] | type[MoEAttrs] | type[CollectiveAttrs]] = {
    "KVCacheWrite": AttentionAttrs,
    "PagedAttention": AttentionAttrs,
    MOE_OP: MoEAttrs,
}
# the collective ops of multi-rank engines (issue 27): attributes only; they run through a Communicator, not OPS
OP_ATTRS.update(COLLECTIVE_ATTRS)
OP_FIELDS.update(COLLECTIVE_FIELDS)
