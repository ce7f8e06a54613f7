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
from toolchain.checkpoint.spec import ExpertsFFN, LayerSpec, spec_of
from toolchain.checkpoint.trtllm import ModelConfig, load_rank, read_config
from toolchain.reference.model import ReferenceModel

_LAYER = re.compile(r"transformer\.layers\.(\d+)\.(.+)")


def load_ranks(directory: Path) -> tuple[ModelConfig, list[dict[str, torch.Tensor]]]:
    cfg = read_config(directory)
    return cfg, [load_rank(directory, r) for r in range(cfg.mapping.world_size)]


def merge_ranks(directory: Path) -> dict[str, torch.Tensor]:
    """The TP=1/PP=1 tensors, rebuilt from every rank file (vocab padding and repeated KV heads removed)."""
    cfg, ranks = load_ranks(directory)
    tp, pp = cfg.mapping.tp_size, cfg.mapping.pp_size
    layers_of = spec_of(cfg).layers
    merged: dict[str, torch.Tensor] = {}
    for p, layers in enumerate(stage_layers(cfg.num_hidden_layers, pp)):
        for name in ranks[cfg.mapping.rank(0, p)]:
            parts = [ranks[cfg.mapping.rank(t, p)][name] for t in range(tp)]
            match = _LAYER.fullmatch(name)
            full, ffn = name, None
            if match:
                index = int(match.group(1)) + layers.start
                full, ffn = f"transformer.layers.{index}.{match.group(2)}", layers_of[index].ffn
            rows = cfg.max_position_embeddings if "position_embedding" in name else cfg.vocab_size
            gated = not isinstance(ffn, ExpertsFFN) or ffn.gated
            merged[full] = unshard(parts, split_of(name, ffn), cfg, rows, name, gated)
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


class TensorParallelModel(ReferenceModel):
    """The reference forward with every block computed rank by rank: the layer structure is ReferenceModel's
    (its spec's), only the blocks whose weights are split are overridden."""

    def __init__(self, cfg: ModelConfig, ranks: list[dict[str, torch.Tensor]], dtype: torch.dtype):
        tp = cfg.mapping.tp_size
        super().__init__(cfg, ranks[0], dtype)  # replicated tensors (norms) are read from rank 0
        local = dataclasses.replace(
            cfg,
            num_attention_heads=cfg.num_attention_heads // tp,
            num_key_value_heads=max(cfg.num_key_value_heads // tp, 1),
            intermediate_size=cfg.intermediate_size // tp,
        )
        self.shards = [ReferenceModel(local, w, dtype) for w in ranks]
        for shard in self.shards:
            shard.row_biases = False  # added once, after the sum

    def _sum(self, parts: list[torch.Tensor], bias: str | None) -> torch.Tensor:
        """Row-parallel partial outputs summed (the all-reduce), the bias added once."""
        total = torch.stack(parts).sum(0)
        return total if bias is None else total + self.w[bias]

    def attention(self, x: torch.Tensor, ls: LayerSpec, positions: torch.Tensor) -> torch.Tensor:
        parts = [m.attention(x, m.spec.layers[ls.index], positions) for m in self.shards]
        return self._sum(parts, f"{ls.prefix}.attention.dense.bias" if ls.dense_bias else None)

    def mlp(self, x: torch.Tensor, ls: LayerSpec) -> torch.Tensor:
        parts = [m.mlp(x, m.spec.layers[ls.index]) for m in self.shards]
        return self._sum(parts, f"{ls.prefix}.mlp.proj.bias" if ls.ffn.bias else None)

    def lookup(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        tp = len(self.shards)
        h = _lookup(self.shards, "transformer.vocab_embedding.weight", input_ids, self.config.vocab_size, tp)
        if self.spec.learned_positions:
            rows = self.config.max_position_embeddings
            h = h + _lookup(self.shards, "transformer.position_embedding.weight", positions, rows, tp)
        return h

    def head(self, h: torch.Tensor) -> torch.Tensor:
        x = self.final_norm(h)
        return torch.cat([F.linear(x, m.w["lm_head.weight"]) for m in self.shards], dim=-1)[..., : self.spec.vocab_size]


def tp_logits(directory: Path, input_ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Logits [batch, seq, vocab] of a TP checkpoint (pp_size 1), computed rank by rank."""
    cfg, ranks = load_ranks(directory)
    assert cfg.mapping.pp_size == 1, "tp_logits runs a single pipeline stage"
    return TensorParallelModel(cfg, ranks, dtype).forward(input_ids)
