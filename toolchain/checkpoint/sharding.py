"""Tensor and pipeline parallelism: which rank holds which slice of which tensor, as TensorRT-LLM lays it out.

Facts from TensorRT-LLM (tensorrt_llm/mapping.py, models/llama/convert.py, models/convert_utils.py,
_utils.py::pad_vocab_size):
- rank = pp_rank * tp_size + tp_rank; files are rank{rank}.safetensors.
- Pipeline stages take `torch.tensor_split(range(L), pp)` layers (the first L % pp stages get one more);
  layer indices are renumbered from 0 in every rank file; the embeddings live on the first stage, ln_f and
  lm_head on the last.
- Column-parallel weights (qkv, mlp.fc, mlp.gate) split on dim 0, their biases too, and so do attention sinks
  (gpt-oss: one logit per query head, so each rank holds its heads'); row-parallel weights
  (attention.dense, mlp.proj) split on dim 1 and keep their bias whole; norms are replicated.
- A fused gate/up `mlp.fc` (Phi-3: [up; gate] stacked) splits each half on its own and stacks the rank's halves
  again ("gate_up"), so every rank holds [up_r; gate_r] (its swiglu splits its input in two halves).
- qkv splits q, k and v separately by heads and concatenates [q_r; k_r; v_r]. With fewer KV heads than
  ranks, each KV head is repeated tp/kv times so every rank holds exactly one (tp must be a multiple of kv).
- lm_head, the embedding (use_parallel_embedding, sharding dim 0) and GPT's position embedding are
  zero-padded to a multiple of tp rows, then split on dim 0.
- A mixture-of-experts layer ("experts", tensorrt_llm/layers/moe.py `MixtureOfExperts`): each tp group holds the
  experts as moe_ep expert groups of moe_tp = tp / moe_ep ranks (`Mapping.for_parallel`). Tp rank t is expert
  rank t % moe_ep and expert-TP rank t // moe_ep (TensorRT-LLM's mapping, parallel/mapping.py `RankMapping`). Its
  experts are the contiguous run `ep_experts` of E / moe_ep (its `experts_per_node`), and of each expert the
  inter slice I / moe_tp (its `expert_inter_size`): mlp.fc's [up; gate] halves are each split on their rows and
  stacked again (as "gate_up", per expert), mlp.proj on its last dim. The router (and its bias) is replicated:
  every rank routes every token over all E experts; the layer's output is one all-reduce over the tp group.
  A proj bias (gpt-oss) must be added once per expert: moe-TP rank 0 of each expert group holds it, the others
  hold zeros (TensorRT-LLM instead adds bias / tp_size on every rank; zeros keep the split exact, and
  `unshard` takes moe-TP rank 0's). Quantized experts are never split: convert writes float checkpoints and
  quantize refuses split ones (TP engines come from unquantized checkpoints).

`shard` splits convert's numpy arrays; `unshard` joins the torch tensors the reference forward loads.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from toolchain.checkpoint.spec import FFN, DenseFFN, ExpertsFFN, experts_unsupported
from toolchain.checkpoint.trtllm import ModelConfig
from toolchain.errors import UserError

if TYPE_CHECKING:
    import torch

Split = Literal["replicate", "column", "row", "qkv", "vocab", "gate_up", "experts"]
_LAYER = re.compile(r"transformer\.layers\.(\d+)\.(.+)")
FIRST_STAGE = ("transformer.vocab_embedding.", "transformer.position_embedding.")
LAST_STAGE = ("transformer.ln_f.", "lm_head.")


# How a tensor is split follows from its TensorRT-LLM name alone: the name says which layer type holds it.
_SPLITS: tuple[tuple[re.Pattern[str], Split], ...] = (
    (re.compile(r"(transformer\.(vocab|position)_embedding|lm_head)\.weight"), "vocab"),
    (re.compile(r".*\.attention\.qkv\.(weight|bias)"), "qkv"),
    (re.compile(r".*\.(attention\.dense|mlp\.proj)\.weight"), "row"),
    (re.compile(r".*\.mlp\.(fc|gate)\.(weight|bias)"), "column"),
    (re.compile(r".*\.attention\.sinks"), "column"),  # one logit per query head (gpt-oss): a rank's own heads
)


def split_of(name: str, ffn: FFN | None = None) -> Split:
    """'replicate' for norms, row-parallel biases and qk-norms. GPT's learned position embedding is split like
    the vocabulary (tensorrt_llm/models/gpt/convert.py `split_embedding`). `ffn`: the feed-forward block of the
    layer holding `name` (None: a plain or gated one, split as its name says)."""
    split: Split = next((split for pattern, split in _SPLITS if pattern.fullmatch(name)), "replicate")
    return split if ffn is None or ".mlp." not in name else ffn_split(ffn, name, split)


def ffn_split(ffn: FFN, name: str, split: Split) -> Split:
    """How tensor `name` of a feed-forward block splits, `split` being what its name says: the one place sharding
    dispatches on the FFN. A fused gate/up mlp.fc splits each half on its own ("gate_up"); a mixture of experts'
    tensors are "experts" (`expert_part` says how each one splits)."""
    match ffn:
        case DenseFFN(gate_up_fused=True) if split == "column" and ".mlp.fc." in name:
            return "gate_up"
        case DenseFFN():
            return split
        case ExpertsFFN():
            return "experts"


PACKINGS = ("", "stacked", "mxfp4")  # Rule.packing


@dataclass(frozen=True)
class Rule:
    """One output tensor: TRT-LLM name <- HF source(s) (concatenated on dim 0), and whether the sources are stored
    transposed (GPT-2's Conv1D keeps [in, out]). `experts` > 0: the sources are that many experts' tensors, each
    expert's consecutive, and the result is stacked [experts, rows / experts, ...] (convert fills it expert by
    expert); `dtype`: the tensor's own dtype instead of the checkpoint's (a MoE router: float32)."""

    dst: str
    srcs: tuple[str, ...]
    transpose: bool = False
    offset: float = 0.0  # added in float32 before the cast (Gemma's norms: TensorRT-LLM stores 1 + w)
    halves_swapped: bool = False  # the two halves of dim 0 exchanged (Phi-3: HF's [gate; up] -> [up; gate])
    ffn: FFN | None = None  # the feed-forward block the tensor belongs to, which says how it splits (`ffn_split`)
    experts: int = 0
    dtype: str | None = None  # a checkpoint dtype name (trtllm.DTYPES)
    # One source holding every expert (gpt-oss) instead of one per expert: "stacked", a tensor [E, ...] (`transpose`
    # swaps its last two dims: [E, in, out] -> [E, out, in]); "mxfp4", the (blocks, scales) pair of one in MXFP4,
    # dequantized to [E, out, in] (docs/conversion.md). `interleaved`: dim 1 alternates gate and up rows (even the
    # gate), written as [up; gate].
    packing: str = ""
    interleaved: bool = False

    def __post_init__(self) -> None:
        if self.packing not in PACKINGS:
            raise ValueError(f"Rule {self.dst}: packing {self.packing!r} is not one of {PACKINGS}")

    @property
    def split(self) -> Split:
        return split_of(self.dst, self.ffn)


def check_parallel(cfg: ModelConfig, tp: int, pp: int, source: str, moe_ep: int = 1) -> None:
    """Refuse splits TensorRT-LLM cannot run, naming the sizes that would work."""
    if tp < 1 or pp < 1 or moe_ep < 1:
        raise UserError(f"--tp, --pp and --moe-ep must be at least 1 (got tp={tp}, pp={pp}, moe_ep={moe_ep})")
    if not _tp_ok(cfg, tp):
        valid = [n for n in _divisors(cfg.num_attention_heads) if _tp_ok(cfg, n)]
        raise UserError(
            f"{source}: tensor-parallel size {tp} (--tp, convert.tp) does not divide this model "
            f"(num_attention_heads {cfg.num_attention_heads}, "
            f"num_key_value_heads {cfg.num_key_value_heads}, intermediate_size {cfg.intermediate_size}); "
            f"valid: {', '.join(map(str, valid))}"
        )
    _check_experts(cfg, tp, moe_ep, source)
    if pp > cfg.num_hidden_layers:
        raise UserError(
            f"{source}: pipeline-parallel size {pp} (--pp, convert.pp) exceeds num_hidden_layers "
            f"{cfg.num_hidden_layers}; use at most that"
        )


def _check_experts(cfg: ModelConfig, tp: int, moe_ep: int, source: str) -> None:
    """moe_ep must divide tp, the experts split over moe_ep and each expert's width over moe_tp = tp / moe_ep
    (TensorRT-LLM's MixtureOfExperts raises on either remainder)."""
    from toolchain.checkpoint.spec import spec_of  # the registry (spec_of) imports this module

    if tp == 1 and moe_ep == 1:  # nothing to split: no need to build the model's layer list
        return
    ffns = [ls.ffn for ls in spec_of(cfg, source).layers if isinstance(ls.ffn, ExpertsFFN)]
    if not ffns:
        if moe_ep != 1:
            raise UserError(f"{source}: --moe-ep {moe_ep} (expert parallelism) needs a mixture-of-experts model; use 1")
        return
    for ffn in ffns:
        if ffn.shared is not None:
            raise experts_unsupported(f"{source}: --tp {tp}", ffn)
        if not _moe_ok(ffn, tp, moe_ep):
            valid = [ep for ep in _divisors(tp) if _moe_ok(ffn, tp, ep)]
            raise UserError(
                f"{source}: expert-parallel size {moe_ep} (--moe-ep) at tp {tp} does not split this model's "
                f"experts ({ffn.num_experts} experts of width {ffn.expert_intermediate_size}: moe_ep must divide "
                f"tp and the experts, tp / moe_ep the width); valid --moe-ep at tp {tp}: "
                f"{', '.join(map(str, valid)) or 'none (choose another --tp)'}"
            )


def _moe_ok(ffn: ExpertsFFN, tp: int, moe_ep: int) -> bool:
    if tp % moe_ep or ffn.num_experts % moe_ep:
        return False
    return ffn.expert_intermediate_size % (tp // moe_ep) == 0


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def _tp_ok(cfg: ModelConfig, tp: int) -> bool:
    kv = cfg.num_key_value_heads
    kv_ok = kv % tp == 0 or tp % kv == 0
    return cfg.num_attention_heads % tp == 0 and cfg.intermediate_size % tp == 0 and kv_ok


def stage_layers(num_layers: int, pp: int) -> list[range]:
    base, extra = divmod(num_layers, pp)
    stages, start = [], 0
    for p in range(pp):
        size = base + (1 if p < extra else 0)
        stages.append(range(start, start + size))
        start += size
    return stages


def local_name(dst: str, layers: range, first: bool, last: bool) -> str | None:
    """`dst` as named in a stage holding `layers`, or None when the tensor lives on another stage."""
    match = _LAYER.fullmatch(dst)
    if match:
        layer = int(match.group(1))
        return f"transformer.layers.{layer - layers.start}.{match.group(2)}" if layer in layers else None
    if dst.startswith(FIRST_STAGE):
        return dst if first else None
    if dst.startswith(LAST_STAGE):
        return dst if last else None
    raise AssertionError(f"{dst}: not assigned to a pipeline stage")


def kept_name(dst: str, layers: Sequence[int]) -> str | None:
    """`dst` as named in a model made of the decoder `layers` only, renumbered 0..n-1 as `local_name` renumbers a
    pipeline stage's (convert --layers: a stand-in draft model), or None when its layer is dropped."""
    match = _LAYER.fullmatch(dst)
    if match is None:
        return dst
    layer = int(match.group(1))
    return f"transformer.layers.{layers.index(layer)}.{match.group(2)}" if layer in layers else None


def padded_vocab(vocab: int, tp: int) -> int:
    return math.ceil(vocab / tp) * tp


ExpertPart = Literal["router", "fc", "fc_bias", "proj", "proj_bias"]
_EXPERT_PART = re.compile(r".*\.mlp\.(router|fc|proj)\.(weight|bias)")


def expert_part(name: str) -> ExpertPart:
    """Which tensor of a mixture-of-experts layer `name` is (module docstring: how each splits)."""
    match = _EXPERT_PART.fullmatch(name)
    if match is None:
        raise AssertionError(f"{name}: not a mixture-of-experts tensor (router, fc, proj)")
    kind, what = match.groups()
    if kind == "router":
        return "router"
    return f"{kind}_bias" if what == "bias" else kind  # type: ignore[return-value]


@dataclass(frozen=True)
class _ExpertSlice:
    """Tp rank `rank`'s part of the experts: experts [first, first + count), rows [inter_rank * n, ...) of
    each half (n = inter / moe_tp), and whether it holds the proj bias (moe-TP rank 0)."""

    first: int
    count: int
    moe_tp: int
    moe_tp_rank: int


def _expert_slice(cfg: ModelConfig, num_experts: int, rank: int) -> _ExpertSlice:
    ep, moe_tp = cfg.mapping.moe_ep_size, cfg.mapping.moe_tp_size
    if ep * moe_tp != cfg.mapping.tp_size or num_experts % ep:
        raise UserError(
            f"mapping: moe_ep_size {ep} * moe_tp_size {moe_tp} with {num_experts} experts does not split over "
            f"tp_size {cfg.mapping.tp_size}; reconvert the checkpoint"
        )
    per_rank = num_experts // ep
    return _ExpertSlice((rank % ep) * per_rank, per_rank, moe_tp, rank // ep)  # RankMapping's moe_ep / moe_tp rank


def _experts_shape(shape: tuple[int, ...], name: str, cfg: ModelConfig) -> tuple[int, ...]:
    part = expert_part(name)
    if part == "router":
        return shape
    ep, moe_tp = cfg.mapping.moe_ep_size, cfg.mapping.moe_tp_size
    local = (shape[0] // ep, *shape[1:])
    if part in ("fc", "fc_bias"):
        return (local[0], local[1] // moe_tp, *local[2:])
    if part == "proj":
        return (*local[:-1], local[-1] // moe_tp)
    return local


def _experts_shard(tensor: Array, name: str, cfg: ModelConfig, rank: int, gated: bool) -> Array:
    part = expert_part(name)
    if part == "router":
        return tensor
    s = _expert_slice(cfg, tensor.shape[0], rank)
    mine = tensor[s.first : s.first + s.count]
    if part == "fc" or part == "fc_bias":
        halves = [_chunk(mine, 2, h, axis=1) for h in range(2)] if gated else [mine]
        return np.ascontiguousarray(np.concatenate([_chunk(h, s.moe_tp, s.moe_tp_rank, axis=1) for h in halves], 1))
    if part == "proj":
        return np.ascontiguousarray(_chunk(mine, s.moe_tp, s.moe_tp_rank, axis=mine.ndim - 1))
    return np.ascontiguousarray(mine if s.moe_tp_rank == 0 else np.zeros_like(mine))


def shard_shape(shape: tuple[int, ...], split: Split, cfg: ModelConfig, tp: int, name: str = "") -> tuple[int, ...]:
    """The shape of `shard`'s slices; `name` as there."""
    if tp == 1 or split == "replicate" or (split == "row" and len(shape) == 1):
        return shape
    if split == "experts":
        return _experts_shape(shape, name, cfg)
    if split == "row":
        return (shape[0], shape[1] // tp, *shape[2:])
    if split == "vocab":
        return (padded_vocab(shape[0], tp) // tp, *shape[1:])
    if split == "qkv":
        q, kv = _qkv_heads(cfg, tp)
        return ((q + 2 * kv) * cfg.head_size, *shape[1:])
    return (shape[0] // tp, *shape[1:])


def _qkv_heads(cfg: ModelConfig, tp: int) -> tuple[int, int]:
    return cfg.num_attention_heads // tp, max(cfg.num_key_value_heads // tp, 1)


Array = np.ndarray[Any, Any]


def _chunk(array: Array, parts: int, index: int, axis: int = 0) -> Array:
    """`torch.chunk(parts, axis)[index]`: chunks of ceil(n / parts) along `axis`, a view."""
    size = -(-array.shape[axis] // parts)
    return array[(slice(None),) * axis + (slice(index * size, (index + 1) * size),)]


def shard(
    tensor: Array, split: Split, cfg: ModelConfig, tp: int, rank: int, name: str = "", gated: bool = True
) -> Array:
    """The slice of `tensor` that TP rank `rank` holds (contiguous). "experts" tensors need their `name` (which
    of the layer's tensors) and whether the experts are `gated` (fc = [up; gate]); `cfg.mapping` says moe_ep."""
    if tp == 1 or split == "replicate" or (split == "row" and tensor.ndim == 1):
        return tensor
    if split == "experts":
        return _experts_shard(tensor, name, cfg, rank, gated)
    if split == "row":
        return np.ascontiguousarray(_chunk(tensor, tp, rank, axis=1))
    if split == "vocab":
        pad = padded_vocab(tensor.shape[0], tp) - tensor.shape[0]
        if pad:
            tensor = np.concatenate([tensor, np.zeros((pad, *tensor.shape[1:]), tensor.dtype)])
        return np.ascontiguousarray(_chunk(tensor, tp, rank))
    if split == "qkv":
        d = cfg.head_size
        q_rows, kv_rows = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
        q, k, v = tensor[:q_rows], tensor[q_rows : q_rows + kv_rows], tensor[q_rows + kv_rows :]
        kv = cfg.num_key_value_heads
        if kv >= tp:
            k, v = _chunk(k, tp, rank), _chunk(v, tp, rank)
        else:  # replicate: rank r holds KV head r // (tp / kv)
            head = rank // (tp // kv)
            k, v = k[head * d : (head + 1) * d], v[head * d : (head + 1) * d]
        return np.concatenate([_chunk(q, tp, rank), k, v])
    if split == "gate_up":
        return np.concatenate([_chunk(_chunk(tensor, 2, half), tp, rank) for half in range(2)])
    return np.ascontiguousarray(_chunk(tensor, tp, rank))


def unshard(
    parts: list[torch.Tensor], split: Split, cfg: ModelConfig, full_rows: int, name: str = "", gated: bool = True
) -> torch.Tensor:
    """Inverse of `shard` over all TP ranks (drops vocab padding and repeated KV heads; `name`, `gated` as
    there)."""
    import torch

    tp = len(parts)
    if tp == 1 or split == "replicate" or (split == "row" and parts[0].dim() == 1):
        return parts[0]
    if split == "experts":
        return _experts_unshard(parts, name, cfg, gated)
    if split == "row":
        return torch.cat(parts, dim=1)
    if split == "vocab":
        return torch.cat(parts)[:full_rows]
    if split == "qkv":
        q_local, kv_local = _qkv_heads(cfg, tp)
        d = cfg.head_size
        pieces = [torch.split(p, [q_local * d, kv_local * d, kv_local * d]) for p in parts]
        step = max(tp // cfg.num_key_value_heads, 1)  # ranks sharing one replicated KV head
        qs = [p[0] for p in pieces]
        ks = [p[1] for p in pieces][::step]
        vs = [p[2] for p in pieces][::step]
        return torch.cat([*qs, *ks, *vs])
    if split == "gate_up":
        halves = [p.chunk(2) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(parts)


def _experts_unshard(parts: list[torch.Tensor], name: str, cfg: ModelConfig, gated: bool) -> torch.Tensor:
    """The experts from every tp rank: each expert group's moe-TP slices joined, the groups stacked in order."""
    import torch

    part = expert_part(name)
    if part == "router":
        return parts[0]
    ep, moe_tp = cfg.mapping.moe_ep_size, cfg.mapping.moe_tp_size
    groups = [[parts[t * ep + g] for t in range(moe_tp)] for g in range(ep)]  # tp rank = moe_tp_rank * ep + ep_rank
    joined = []
    for group in groups:
        if part in ("fc", "fc_bias"):
            halves = [p.chunk(2, dim=1) for p in group] if gated else [(p,) for p in group]
            joined.append(torch.cat([torch.cat([h[i] for h in halves], dim=1) for i in range(len(halves[0]))], dim=1))
        elif part == "proj":
            joined.append(torch.cat(group, dim=-1))
        else:
            joined.append(group[0])
    return torch.cat(joined)
