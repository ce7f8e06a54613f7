"""Which part of the model a rank holds, and who its peers are: `RankMapping`, the checkpoint's `Mapping` at one
rank. Every rank question (tp / pp / expert rank, groups, previous and next pipeline stage, layers, experts, local
heads) is answered here, with TensorRT-LLM's formulas (tensorrt_llm/mapping.py, `Mapping`), so that no other code
does rank arithmetic. Ranks are numbered as the checkpoint's files are: rank = pp_rank * tp_size + tp_rank.

Context parallelism and MoE clusters are not supported (cp_size 1, moe_cluster_size 1), so TensorRT-LLM's groups
reduce to: tp groups contiguous, pp groups strided by tp_size, moe_tp groups strided by moe_ep_size inside a tp
group, moe_ep groups contiguous runs of moe_ep_size inside a tp group.
"""

from __future__ import annotations

from dataclasses import dataclass

from toolchain.checkpoint.sharding import stage_layers
from toolchain.checkpoint.trtllm import Mapping, ModelConfig
from toolchain.errors import UserError


@dataclass(frozen=True)
class RankMapping:
    """`mapping` seen from `rank`; validated at construction."""

    mapping: Mapping
    rank: int

    def __post_init__(self) -> None:
        m = self.mapping
        if m.cp_size != 1:
            raise UserError(f"mapping: cp_size {m.cp_size}: context parallelism is not supported (expected 1)")
        if m.moe_tp_size * m.moe_ep_size != m.tp_size:
            raise UserError(
                f"mapping: moe_tp_size {m.moe_tp_size} * moe_ep_size {m.moe_ep_size} != tp_size {m.tp_size} "
                "(experts are split over the tp group: reconvert the checkpoint)"
            )
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank < m.world_size:
            raise UserError(f"rank {self.rank!r}: expected 0 .. {m.world_size - 1} (world_size {m.world_size})")

    @property
    def world_size(self) -> int:
        return self.mapping.world_size

    @property
    def tp_size(self) -> int:
        return self.mapping.tp_size

    @property
    def pp_size(self) -> int:
        return self.mapping.pp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def moe_tp_rank(self) -> int:
        return self.tp_rank // self.mapping.moe_ep_size

    @property
    def moe_ep_rank(self) -> int:
        return self.tp_rank % self.mapping.moe_ep_size

    @property
    def tp_group(self) -> tuple[int, ...]:
        """The ranks of this pipeline stage (they all-reduce together)."""
        start = self.pp_rank * self.tp_size
        return tuple(range(start, start + self.tp_size))

    @property
    def pp_group(self) -> tuple[int, ...]:
        """The ranks holding the same tp slice on every stage, first stage first."""
        return tuple(range(self.tp_rank, self.world_size, self.tp_size))

    @property
    def moe_tp_group(self) -> tuple[int, ...]:
        ep = self.mapping.moe_ep_size
        start = self.pp_rank * self.tp_size
        return tuple(range(start + self.moe_ep_rank, start + self.tp_size, ep))

    @property
    def moe_ep_group(self) -> tuple[int, ...]:
        ep = self.mapping.moe_ep_size
        start = self.pp_rank * self.tp_size + self.moe_tp_rank * ep
        return tuple(range(start, start + ep))

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def prev_pp_rank(self) -> int:
        """The rank this one receives activations from (wrapping, as TensorRT-LLM's: the first stage's is the
        last stage's rank; callers check is_first_stage)."""
        return (self.rank - self.tp_size) % self.world_size

    @property
    def next_pp_rank(self) -> int:
        """The rank this one sends activations to (wrapping, as prev_pp_rank)."""
        return (self.rank + self.tp_size) % self.world_size

    def layers(self, num_layers: int) -> range:
        """The global layer indices this rank's stage holds (the first num_layers % pp stages hold one more)."""
        if self.pp_size > num_layers:
            raise UserError(f"pp_size {self.pp_size} > {num_layers} layers: every stage needs a layer")
        return stage_layers(num_layers, self.pp_size)[self.pp_rank]

    def ep_experts(self, num_experts: int) -> range:
        """The experts this rank computes: a contiguous run of num_experts / moe_ep_size."""
        ep = self.mapping.moe_ep_size
        if num_experts % ep:
            raise UserError(f"{num_experts} experts do not split over moe_ep_size {ep}")
        per_rank = num_experts // ep
        return range(self.moe_ep_rank * per_rank, (self.moe_ep_rank + 1) * per_rank)

    def local_heads(self, cfg: ModelConfig) -> tuple[int, int]:
        """(query heads, KV heads) this rank holds: heads / tp, and KV heads / tp or 1 when there are fewer KV
        heads than ranks (each rank then holds a replicated copy of KV head tp_rank // (tp / kv))."""
        heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
        if heads % self.tp_size or (kv % self.tp_size and self.tp_size % kv):
            raise UserError(
                f"{heads} attention heads / {kv} KV heads do not split over tp_size {self.tp_size} "
                "(convert's check_parallel refuses such checkpoints)"
            )
        return heads // self.tp_size, max(kv // self.tp_size, 1)

    def ranks(self) -> tuple[RankMapping, ...]:
        """This mapping at every rank, rank 0 first."""
        return tuple(RankMapping(self.mapping, r) for r in range(self.world_size))
