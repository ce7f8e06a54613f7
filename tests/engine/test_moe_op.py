"""The MoE reference op (toolchain/engine/ops.py `moe`) against a naive float64 dense mixture (every expert on every
token, masked by the routing), and its routing against transformers' routers (ties included)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.nn import functional as F

from toolchain.checkpoint.spec import ROUTER_NORMS
from toolchain.engine.ops import MoEAttrs, moe, route

HIDDEN, INTER = 48, 40
# float32 against float64: each output sums hidden + inter products of O(1) terms, each rounded at ~6e-8 (2^-24),
# so |error| / scale stays near sqrt(88) * 6e-8 ~ 6e-7; 1e-5 of the output's scale leaves a 15x margin
TOL = 1e-5


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


NAIVE_ACT: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": _gelu_tanh,
    "gelu_pytorch_tanh": _gelu_tanh,
    "relu": F.relu,
}


def make(
    a: MoEAttrs, tokens: int, seed: int, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """x, router_weight, fc_weight, proj_weight and the op's bias inputs, random (std 1 / sqrt(fan-in): O(1)
    activations)."""
    g = torch.Generator().manual_seed(seed)
    e, h = a.number_of_experts, a.expert_hidden_size

    def rand(*shape: int, fan_in: int = 1) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, dtype=torch.float64) / math.sqrt(fan_in)).to(dtype)

    x = rand(tokens, h)
    biases = [rand(e, a.fc_rows), rand(e, h)] if a.use_bias else []
    if a.router_bias:
        biases.append(rand(e))
    return (
        x,
        rand(e, h, fan_in=h) * 4,
        rand(e, a.fc_rows, h, fan_in=h),
        rand(e, h, a.expert_inter_size, fan_in=INTER),
        biases,
    )


def naive(
    a: MoEAttrs,
    x: torch.Tensor,
    router_weight: torch.Tensor,
    fc: torch.Tensor,
    proj: torch.Tensor,
    biases: list[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, chosen experts as a [tokens, experts] mask), float64, dense: a gate per (token, expert), zero where
    the expert is not among the token's top k, and every expert computed on every token."""
    x, router_weight, fc, proj = (t.double() for t in (x, router_weight, fc, proj))
    biases = [b.double() for b in biases]
    logits = x @ router_weight.T
    if a.router_bias:
        logits = logits + biases[-1]
    kth = logits.topk(a.top_k, dim=-1).values[:, -1:]
    chosen = logits >= kth  # top k by logit = top k by probability (softmax is monotone)
    if a.router_norm == "topk_softmax":
        gates = torch.softmax(logits.masked_fill(~chosen, -math.inf), dim=-1)
    else:
        gates = torch.softmax(logits, dim=-1) * chosen
        if a.router_norm == "softmax_topk_renormalise":
            gates = gates / gates.sum(dim=-1, keepdim=True)
    out = torch.zeros_like(x)
    for e in range(a.number_of_experts):
        h = x @ fc[e].T + (biases[0][e] if a.use_bias else 0)
        if a.gated:
            up, gate = h[:, : a.expert_inter_size], h[:, a.expert_inter_size :]
            h = up * NAIVE_ACT[a.activation](gate)
        else:
            h = NAIVE_ACT[a.activation](h)
        y = h @ proj[e].T + (biases[1][e] if a.use_bias else 0)
        out += gates[:, e : e + 1] * y
    return out, chosen


def check(a: MoEAttrs, tokens: int = 37, seed: int = 0) -> None:
    x, rw, fc, proj, biases = make(a, tokens, seed)
    got = moe(a, x, rw, fc, proj, *biases)
    want, chosen = naive(a, x, rw, fc, proj, biases)
    assert got.dtype == torch.float32 and got.shape == want.shape
    scale = want.abs().max().item()
    err = (got.double() - want).abs().max().item()
    assert err <= TOL * scale, f"{a}: max-abs {err:.3g}, scale {scale:.3g}"
    _, experts = route(a, x, rw, biases[-1] if a.router_bias else None)
    picked = torch.zeros_like(chosen).scatter_(1, experts, True)
    assert torch.equal(picked, chosen), "the op chose other experts than the float64 routing"


def attrs(**kw: Any) -> MoEAttrs:
    base: dict[str, Any] = dict(number_of_experts=8, top_k=2, expert_hidden_size=HIDDEN, expert_inter_size=INTER)
    return MoEAttrs(**{**base, **kw})


@pytest.mark.parametrize("norm", ROUTER_NORMS)
@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_every_router_norm_matches_the_dense_float64_mixture(norm: str, top_k: int) -> None:
    check(attrs(router_norm=norm, top_k=top_k), seed=top_k)


@pytest.mark.parametrize(
    "kw",
    [
        dict(activation="gelu"),
        dict(activation="relu", gated=0),
        dict(activation="gelu_pytorch_tanh", gated=0, use_bias=1),
        dict(use_bias=1, router_bias=1, router_norm="topk_softmax"),
        dict(router_bias=1),
    ],
)
def test_activations_ungated_experts_and_biases(kw: dict[str, Any]) -> None:
    check(attrs(**kw), seed=5)


@pytest.mark.parametrize("norm", ROUTER_NORMS)
def test_top_k_equal_to_the_expert_count(norm: str) -> None:
    check(attrs(number_of_experts=4, top_k=4, router_norm=norm), seed=9)


def test_an_expert_no_token_chose_is_never_computed() -> None:
    """Expert 3's router bias is far below the others', so no token picks it; its weights are NaN, which a dense
    loop over all experts (even masked: NaN * 0 is NaN) would spread into every token."""
    a = attrs(number_of_experts=6, top_k=2, router_norm="softmax_topk_renormalise", router_bias=1)
    x, rw, fc, proj, biases = make(a, 29, seed=3)
    biases[-1][3] = -1e4
    assert not (route(a, x, rw, biases[-1])[1] == 3).any()
    want, _ = naive(a, x, rw, fc, proj, biases)
    fc[3], proj[3] = math.nan, math.nan
    got = moe(a, x, rw, fc, proj, *biases)
    assert torch.isfinite(got).all()
    assert (got.double() - want).abs().max().item() <= TOL * want.abs().max().item()


def test_only_the_chosen_tokens_reach_an_expert() -> None:
    """Token 0 alone is routed to expert 0 (top 1): NaN weights of expert 0 reach token 0 and no other."""
    a = attrs(number_of_experts=4, top_k=1)
    x, rw, fc, proj, _ = make(a, 9, seed=4)
    experts = route(a, x, rw)[1][:, 0]
    only = int(experts[0])
    fc[only] = math.nan
    got = moe(a, x, rw, fc, proj)
    assert torch.equal(torch.isnan(got).any(dim=1), experts == only)


def _hf_router(norm: str, e: int, k: int, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.nn.Module:
    """transformers' router of the family whose routing `norm` is (5.x: softmax, topk, renormalised for Mixtral
    and Qwen3-MoE's norm_topk_prob; topk then softmax for gpt-oss)."""
    if norm == "topk_softmax":
        from transformers import GptOssConfig
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

        oss = GptOssConfig(hidden_size=weight.shape[1], num_local_experts=e, num_experts_per_tok=k)
        router: torch.nn.Module = GptOssTopKRouter(oss)  # type: ignore[no-untyped-call]
        router.bias.data = torch.zeros(e) if bias is None else bias.clone()
    else:
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

        config = Qwen3MoeConfig(
            hidden_size=weight.shape[1],
            num_experts=e,
            num_experts_per_tok=k,
            norm_topk_prob=norm == "softmax_topk_renormalise",
        )
        router = Qwen3MoeTopKRouter(config)  # type: ignore[no-untyped-call]
    router.weight.data = weight.clone()
    return router


@pytest.mark.parametrize("norm", ROUTER_NORMS)
def test_ties_break_as_in_transformers(norm: str) -> None:
    """Experts 1, 2 and 5 share a router row, 0 and 6 another: exact ties in the logits, at the k-th place for
    many tokens. The op chooses the experts transformers' router chooses, in the same order, with its weights."""
    a = attrs(number_of_experts=8, top_k=3, router_norm=norm)
    x, rw, _, _, _ = make(a, 64, seed=6)
    rw[2] = rw[5] = rw[1]
    rw[6] = rw[0]
    weights, experts = route(a, x, rw)
    _, hf_weights, hf_experts = _hf_router(norm, 8, 3, rw, None)(x)
    assert torch.equal(experts, hf_experts)
    torch.testing.assert_close(weights, hf_weights, rtol=0, atol=1e-7)
    tied = (experts.unsqueeze(-1) == torch.tensor([1, 2, 5])).any(-1).sum(-1)
    assert ((tied > 0) & (tied < 3)).any(), "no token had a tie at its k-th place: the case tests nothing"


@pytest.mark.parametrize("norm", ROUTER_NORMS)
def test_routing_matches_transformers(norm: str) -> None:
    a = attrs(number_of_experts=16, top_k=4, router_norm=norm, router_bias=int(norm == "topk_softmax"))
    x, rw, _, _, biases = make(a, 50, seed=8)
    bias = biases[-1] if a.router_bias else None
    weights, experts = route(a, x, rw, bias)
    _, hf_weights, hf_experts = _hf_router(norm, 16, 4, rw, bias)(x)
    assert torch.equal(experts, hf_experts)
    torch.testing.assert_close(weights, hf_weights, rtol=0, atol=1e-7)


def test_inputs_that_disagree_with_the_attributes_are_refused() -> None:
    a = attrs()
    x, rw, fc, proj, _ = make(a, 5, seed=1)
    with pytest.raises(ValueError, match=r"MoE fc_weight \(8, 40, 48\): expected \(8, 80, 48\)"):
        moe(a, x, rw, fc[:, :INTER], proj)
    with pytest.raises(ValueError, match="2 bias inputs, expected 0"):
        moe(a, x, rw, fc, proj, fc[:, :, 0], proj[:, :, 0])
    with pytest.raises(ValueError, match="top_k 9 exceeds number_of_experts 8"):
        attrs(top_k=9)
    with pytest.raises(ValueError, match="router_norm 'sparsemixer': expected one of"):
        attrs(router_norm="sparsemixer")
