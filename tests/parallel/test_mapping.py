"""RankMapping against the examples in TensorRT-LLM's tensorrt_llm/mapping.py (`Mapping` docstring and its
group / rank formulas, read at NVIDIA/TensorRT-LLM commit 05ebebb2), and against the checkpoint's file numbering."""

from __future__ import annotations

import pytest

from toolchain.checkpoint.trtllm import Mapping, ModelConfig
from toolchain.errors import UserError
from toolchain.parallel.mapping import RankMapping


def _groups(mapping: Mapping, group: str) -> list[tuple[int, ...]]:
    return sorted({getattr(r, group) for r in RankMapping(mapping, 0).ranks()})


def test_tp4_pp2_groups_match_trtllm_docstring() -> None:
    # "A node with 8 GPUs, tp_size = 4, cp_size = 1, pp_size = 2": tp [0..3], [4..7]; pp [0,4], [1,5], [2,6], [3,7]
    m = Mapping.for_parallel(4, 2)
    assert _groups(m, "tp_group") == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert _groups(m, "pp_group") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    r6 = RankMapping(m, 6)
    assert (r6.tp_rank, r6.pp_rank, r6.tp_group, r6.pp_group) == (2, 1, (4, 5, 6, 7), (2, 6))
    assert r6.is_last_stage and not r6.is_first_stage
    # prev / next wrap by tp_size * cp_size, as TensorRT-LLM's prev_pp_rank / next_pp_rank
    assert (r6.prev_pp_rank, r6.next_pp_rank) == (2, 2)
    assert (RankMapping(m, 1).prev_pp_rank, RankMapping(m, 1).next_pp_rank) == (5, 5)


def test_tp2_pp2_groups_match_trtllm_docstring() -> None:
    # "2 nodes with 8 GPUs, tp_size 2, pp_size 2, cp_size 2" less cp: tp [0,1], [2,3]; pp [0,2], [1,3]
    m = Mapping.for_parallel(2, 2)
    assert _groups(m, "tp_group") == [(0, 1), (2, 3)]
    assert _groups(m, "pp_group") == [(0, 2), (1, 3)]


def test_rank_numbering_is_the_checkpoint_files() -> None:
    m = Mapping.for_parallel(4, 3)
    for r in RankMapping(m, 0).ranks():
        assert m.rank(r.tp_rank, r.pp_rank) == r.rank


def test_moe_tp2_ep4_groups_match_trtllm_docstring() -> None:
    # "A node with 8 GPUs, moe_tp_size = 2, moe_ep_size = 4": moe_tp [0,4], [1,5], [2,6], [3,7]; moe_ep [0..3], [4..7]
    m = Mapping(world_size=8, tp_size=8, moe_tp_size=2, moe_ep_size=4)
    assert _groups(m, "moe_tp_group") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert _groups(m, "moe_ep_group") == [(0, 1, 2, 3), (4, 5, 6, 7)]
    r5 = RankMapping(m, 5)
    assert (r5.moe_tp_rank, r5.moe_ep_rank) == (1, 1)  # tp_rank // ep, tp_rank % ep
    assert r5.ep_experts(16) == range(4, 8)


def test_moe_tp2_ep4_pp2_groups_match_trtllm_docstring() -> None:
    # "2 nodes with 16 GPUs, moe_tp_size = 2, moe_ep_size = 4, pp_size = 2"
    m = Mapping(world_size=16, tp_size=8, pp_size=2, moe_tp_size=2, moe_ep_size=4)
    assert _groups(m, "moe_tp_group") == [(0, 4), (1, 5), (2, 6), (3, 7), (8, 12), (9, 13), (10, 14), (11, 15)]
    assert _groups(m, "moe_ep_group") == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11), (12, 13, 14, 15)]
    assert _groups(m, "pp_group") == [(i, i + 8) for i in range(8)]


def test_layers_split_as_tensor_split() -> None:
    # pp_layers: torch.tensor_split, the first num_layers % pp stages one layer more
    m = Mapping.for_parallel(2, 3)
    assert [RankMapping(m, r).layers(8) for r in (0, 1, 2, 3, 4, 5)] == [
        range(0, 3),
        range(0, 3),
        range(3, 6),
        range(3, 6),
        range(6, 8),
        range(6, 8),
    ]
    with pytest.raises(UserError, match="pp_size 3 > 2 layers"):
        RankMapping(m, 0).layers(2)


def _cfg(heads: int, kv: int) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM", dtype="float32", vocab_size=64, hidden_size=heads * 8,
        num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=kv, head_size=8,
        intermediate_size=32, hidden_act="silu", norm_epsilon=1e-5, max_position_embeddings=64,
    )  # fmt: skip


def test_local_heads_split_and_replicate_kv() -> None:
    assert RankMapping(Mapping.for_parallel(2, 1), 1).local_heads(_cfg(8, 2)) == (4, 1)
    assert RankMapping(Mapping.for_parallel(4, 1), 3).local_heads(_cfg(8, 2)) == (2, 1)  # KV replicated
    assert RankMapping(Mapping.for_parallel(2, 1), 0).local_heads(_cfg(8, 8)) == (4, 4)
    with pytest.raises(UserError, match="do not split over tp_size 4"):
        RankMapping(Mapping.for_parallel(4, 1), 0).local_heads(_cfg(6, 6))


def test_invalid_mappings_are_refused() -> None:
    with pytest.raises(UserError, match=r"expected 0 \.\. 3"):
        RankMapping(Mapping.for_parallel(2, 2), 4)
    with pytest.raises(UserError, match="moe_tp_size 1 \\* moe_ep_size 1 != tp_size 2"):
        RankMapping(Mapping(world_size=2, tp_size=2), 0)
    with pytest.raises(UserError, match="do not split over moe_ep_size 2"):
        RankMapping(Mapping(world_size=2, tp_size=2, moe_tp_size=1, moe_ep_size=2), 0).ep_experts(3)
