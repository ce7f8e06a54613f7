"""Experts split over ranks in the MoE op (issue 27, slice D): each rank routes every token over all experts and
computes only its own (expert_offset, num_local_experts) at its slice of each expert's width; the ranks' outputs
summed (the AllReduce after the node) are the unsplit op's."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from toolchain.checkpoint.sharding import shard
from toolchain.checkpoint.trtllm import Mapping, ModelConfig
from toolchain.engine.ops import OMITTED_AT, MoEAttrs, moe

E, H, INTER, T = 8, 16, 12, 10
# float64 inputs run in float64: the only difference between the split and the unsplit sums is their order
TOL = 64 * torch.finfo(torch.float64).eps


def _cfg(tp: int, moe_ep: int) -> ModelConfig:
    return ModelConfig(
        architecture="MixtralForCausalLM", dtype="float32", vocab_size=32, hidden_size=H, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, head_size=8, intermediate_size=INTER, hidden_act="silu",
        norm_epsilon=1e-5, max_position_embeddings=64, mapping=Mapping.for_parallel(tp, 1, moe_ep),
    )  # fmt: skip


def _weights(bias: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w = {
        "router.weight": torch.randn(E, H, generator=g, dtype=torch.float64),
        "fc.weight": torch.randn(E, 2 * INTER, H, generator=g, dtype=torch.float64) / 4,
        "proj.weight": torch.randn(E, H, INTER, generator=g, dtype=torch.float64) / 4,
    }
    if bias:
        w |= {
            "fc.bias": torch.randn(E, 2 * INTER, generator=g, dtype=torch.float64),
            "proj.bias": torch.randn(E, H, generator=g, dtype=torch.float64),
            "router.bias": torch.randn(E, generator=g, dtype=torch.float64),
        }
    return w


def _inputs(a: MoEAttrs, w: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    biases = [w["fc.bias"], w["proj.bias"]] if a.use_bias else []
    return [
        w["router.weight"],
        w["fc.weight"],
        w["proj.weight"],
        *biases,
        *([w["router.bias"]] if a.router_bias else []),
    ]


@pytest.mark.parametrize(("tp", "moe_ep"), [(2, 2), (2, 1), (4, 2), (4, 4), (8, 8)])
@pytest.mark.parametrize("gpt_oss", [False, True])
def test_ranks_partial_outputs_sum_to_the_whole_layer(tp: int, moe_ep: int, gpt_oss: bool) -> None:
    extra = {"use_bias": 1, "router_bias": 1, "swiglu_alpha": 1.7, "swiglu_limit": 0.8} if gpt_oss else {}
    a = MoEAttrs(number_of_experts=E, top_k=3, expert_hidden_size=H, expert_inter_size=INTER, **extra)
    w = _weights(gpt_oss)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    whole = moe(a, x, *_inputs(a, w))
    cfg, moe_tp = _cfg(tp, moe_ep), tp // moe_ep
    partials = []
    for rank in range(tp):
        local = {
            k: torch.from_numpy(shard(v.numpy(), "experts", cfg, tp, rank, f"transformer.layers.0.mlp.{k}"))
            for k, v in w.items()
        }
        per_rank = E // moe_ep
        ra = dataclasses.replace(
            a, expert_offset=(rank % moe_ep) * per_rank, num_local_experts=per_rank, expert_inter_size=INTER // moe_tp
        )
        partials.append(moe(ra, x, *_inputs(ra, local)))
    assert any(p.abs().max() > 0 for p in partials[1:])  # every rank has work: the test splits something
    torch.testing.assert_close(torch.stack(partials).sum(0), whole, rtol=0, atol=TOL * whole.abs().max().item())


def test_local_experts_are_checked_and_stay_out_of_single_rank_graphs() -> None:
    a = MoEAttrs(number_of_experts=E, top_k=2, expert_hidden_size=H, expert_inter_size=INTER)
    assert "expert_offset" not in a.to_attributes("MoE") and "num_local_experts" not in a.to_attributes("MoE")
    assert (OMITTED_AT["expert_offset"], OMITTED_AT["num_local_experts"]) == (0, 0)
    ranked = dataclasses.replace(a, expert_offset=4, num_local_experts=4)
    assert ranked.to_attributes("MoE") == {**a.to_attributes("MoE"), "expert_offset": 4, "num_local_experts": 4}
    assert MoEAttrs.from_attributes("MoE", ranked.to_attributes("MoE")) == ranked
    with pytest.raises(ValueError, match=r"MoE experts 6 \.\. 9 \(expert_offset, num_local_experts\): expected within "
                       r"the 8 experts"):  # fmt: skip
        dataclasses.replace(a, expert_offset=6, num_local_experts=4)
    with pytest.raises(ValueError, match=r"MoE fc_weight \(8, 24, 16\): expected \(4, 24, 16\)"):
        w = _weights(False)
        moe(ranked, torch.zeros(1, H, dtype=torch.float64), *_inputs(ranked, w))
    router = torch.cat([torch.ones(4, H), -torch.ones(4, H)]).double()  # positive tokens pick experts 0 .. 3
    x = torch.rand(T, H, dtype=torch.float64) + 0.1
    assert torch.equal(moe(ranked, x, router, w["fc.weight"][4:], w["proj.weight"][4:]), torch.zeros(T, H).double())
    assert moe(ranked, x, -router, w["fc.weight"][4:], w["proj.weight"][4:]).abs().min() > 0


def test_the_triton_experts_kernel_refuses_split_experts_by_name() -> None:
    """The kernel's grid and weight indexing assume every expert is local: a rank's split MoE is refused in one
    line (multi-rank engines run on the onnxruntime backend), before any launch."""
    from toolchain.plugins.kernels import moe as kernel

    a = MoEAttrs(number_of_experts=E, top_k=2, expert_hidden_size=H, expert_inter_size=INTER)
    kernel.check(kernel.Stage(a, "fc"), "float32")  # all experts: accepted
    ranked = dataclasses.replace(a, expert_offset=4, num_local_experts=4)
    refusal = (
        r"MoE experts 4 \.\. 7 of 8 \(expert_offset, num_local_experts: an expert- or tensor-parallel rank\) have no "
        r"kernel yet; multi-rank MoE engines run on the onnxruntime backend"
    )
    with pytest.raises(ValueError, match=refusal):
        kernel.check(kernel.Stage(ranked, "proj"), "float32")
    with pytest.raises(ValueError, match=r"have no kernel yet"):
        kernel.moe(ranked, torch.zeros(1, H), *_inputs(ranked, _weights(False)))
