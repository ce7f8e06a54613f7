"""Reading multi-rank checkpoints back: merge the ranks, or run the tensor-parallel forward pass.

`tp_logits` evaluates the model the way TP GPUs do — each rank computes its heads and its slice of the MLP,
row-parallel partial outputs are summed (the all-reduce) and the bias added once, the vocab-parallel
embedding sums per-rank lookups, and lm_head slices are concatenated — so agreement with the TP=1 logits
proves the split, not only the bytes.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import torch
import torch.nn.functional as F

from toolchain.checkpoint.sharding import padded_vocab, split_of, stage_layers, unshard
from toolchain.checkpoint.trtllm import ModelConfig, load_rank, read_config
from toolchain.reference.model import ReferenceModel
from toolchain.reference.rope import cos_sin

_LAYER = re.compile(r"transformer\.layers\.(\d+)\.(.+)")
_ROW_BIASES = ("attention.dense.bias", "mlp.proj.bias")


def load_ranks(directory: Path) -> tuple[ModelConfig, list[dict[str, torch.Tensor]]]:
    cfg = read_config(directory)
    return cfg, [load_rank(directory, r) for r in range(cfg.mapping.world_size)]


def merge_ranks(directory: Path) -> dict[str, torch.Tensor]:
    """The TP=1/PP=1 tensors, rebuilt from every rank file (vocab padding and repeated KV heads removed)."""
    cfg, ranks = load_ranks(directory)
    tp, pp = cfg.mapping.tp_size, cfg.mapping.pp_size
    merged: dict[str, torch.Tensor] = {}
    for p, layers in enumerate(stage_layers(cfg.num_hidden_layers, pp)):
        for name in ranks[cfg.mapping.rank(0, p)]:
            parts = [ranks[cfg.mapping.rank(t, p)][name] for t in range(tp)]
            match = _LAYER.fullmatch(name)
            full = f"transformer.layers.{int(match.group(1)) + layers.start}.{match.group(2)}" if match else name
            rows = cfg.max_position_embeddings if "position_embedding" in name else cfg.vocab_size
            merged[full] = unshard(parts, split_of(name), cfg, rows)
    return merged


def _lookup(models: list[ReferenceModel], name: str, ids: torch.Tensor, rows: int, tp: int) -> torch.Tensor:
    """A vocab-parallel embedding: each rank looks up the ids in its row range, the results are summed."""
    per_rank = padded_vocab(rows, tp) // tp
    parts = [
        F.embedding((ids - t * per_rank).clamp(0, per_rank - 1), m.w[name])
        * ((ids >= t * per_rank) & (ids < (t + 1) * per_rank))[..., None]
        for t, m in enumerate(models)
    ]
    return torch.stack(parts).sum(0)


def tp_logits(directory: Path, input_ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Logits [batch, seq, vocab] of a TP checkpoint (pp_size 1), computed rank by rank."""
    cfg, ranks = load_ranks(directory)
    tp = cfg.mapping.tp_size
    assert cfg.mapping.pp_size == 1, "tp_logits runs a single pipeline stage"
    local = dataclasses.replace(
        cfg,
        num_attention_heads=cfg.num_attention_heads // tp,
        num_key_value_heads=max(cfg.num_key_value_heads // tp, 1),
        intermediate_size=cfg.intermediate_size // tp,
    )
    models = [ReferenceModel(local, {k: v for k, v in w.items() if not k.endswith(_ROW_BIASES)}, dtype) for w in ranks]
    w0 = {k: v.to(dtype) for k, v in ranks[0].items()}
    ids = input_ids if input_ids.dim() == 2 else input_ids[None]
    h = _lookup(models, "transformer.vocab_embedding.weight", ids, cfg.vocab_size, tp)
    positions = torch.arange(ids.shape[1])
    rope = None
    if cfg.position_embedding_type == "learned_absolute":
        h = h + _lookup(models, "transformer.position_embedding.weight", positions, cfg.max_position_embeddings, tp)
    else:
        rope = cos_sin(positions, cfg.head_size, cfg.rotary_base, cfg.rotary_scaling, dtype)
    lead = models[0]
    for i in range(cfg.num_hidden_layers):
        layer = f"transformer.layers.{i}"
        x = lead._norm(h, f"{layer}.input_layernorm")
        h = h + sum(m._attention(x, layer, rope) for m in models) + w0.get(f"{layer}.attention.dense.bias", 0)
        x = lead._norm(h, f"{layer}.post_layernorm")
        h = h + sum(m._mlp(x, layer) for m in models) + w0.get(f"{layer}.mlp.proj.bias", 0)
    h = lead._norm(h, "transformer.ln_f")
    return torch.cat([F.linear(h, m.w["lm_head.weight"]) for m in models], dim=-1)[..., : cfg.vocab_size]
