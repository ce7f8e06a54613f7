"""The MoE routing's sort on the device (toolchain/plugins/kernels/moe_sort.py), run by Triton's interpreter, against
`moe.sort_by_expert` (torch's stable argsort and bincount, what the experts kernel was tested with): the same
assignments and offsets, exactly (a sort has no tolerance)."""

from __future__ import annotations

import pytest
import torch

from toolchain.engine.ops import MoEAttrs, route
from toolchain.plugins.kernels import moe, moe_sort


def _random_routing(tokens: int, top_k: int, experts: int, seed: int) -> torch.Tensor:
    """[tokens, top_k] distinct experts per token, as top-k chooses them (in no particular order)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])


# (tokens, top_k, experts): one token; top_k = E (every expert takes every token: ties everywhere); E = 1; E not a
# power of two (ids in [E, E_BLOCK) are no expert); more assignments than one chunk (BLOCK = 64) and a partial last
# chunk; a Qwen3-30B-A3B-like layer (128 experts, top 8) with most experts idle at a few tokens
CASES = [(1, 1, 1), (1, 4, 8), (1, 3, 3), (6, 3, 3), (9, 2, 5), (40, 4, 4), (33, 2, 7), (100, 8, 128), (3, 8, 128)]


@pytest.mark.parametrize(("tokens", "top_k", "experts"), CASES, ids=lambda v: str(v))
def test_the_kernel_sorts_as_sort_by_expert(tokens: int, top_k: int, experts: int) -> None:
    routing = _random_routing(tokens, top_k, experts, seed=tokens * 1000 + experts)
    got, want = moe_sort.sort(routing, experts), moe.sort_by_expert(routing, experts)
    assert got[0].dtype == got[1].dtype == torch.int32
    assert torch.equal(got[0], want[0]), (got[0].tolist(), want[0].tolist())
    assert torch.equal(got[1], want[1]), (got[1].tolist(), want[1].tolist())


def test_ties_keep_token_order_and_idle_experts_get_empty_ranges() -> None:
    """Every token on expert 2 (ties: tokens in order, the j-th choice of each), experts 0 and 3 idle."""
    routing = torch.tensor([[2, 1], [2, 4], [1, 2], [2, 4], [4, 2]])
    assignments, offsets = moe_sort.sort(routing, 5)
    assert offsets.tolist() == [0, 0, 2, 7, 7, 10]
    assert assignments.tolist() == [1, 4, 0, 2, 5, 6, 9, 3, 7, 8]
    assert torch.equal(assignments, moe.sort_by_expert(routing, 5)[0])


def test_a_real_routing_with_tied_logits() -> None:
    """route's top-k on tied router logits (two identical router rows, so two experts tie on every token) gives the
    order the experts kernel reads; the device sort agrees with torch's."""
    a = MoEAttrs(6, 3, 16, 8)
    gen = torch.Generator().manual_seed(5)
    router = torch.randn(6, 16, generator=gen)
    router[4] = router[1]
    _, experts = route(a, torch.randn(70, 16, generator=gen), router)
    got, want = moe_sort.sort(experts, 6), moe.sort_by_expert(experts, 6)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_ids_outside_the_experts_are_neither_counted_nor_written() -> None:
    """TensorRT's tactic timing runs a plugin on buffers of its own: an id < 0 or >= E must not make the kernel
    write outside its outputs. Guard words around the outputs stay as they were; the known ids still sort."""
    routing = torch.tensor([[0, 7], [-3, 1], [1, 100], [2, 0]], dtype=torch.int32)
    n, e = routing.numel(), 3
    guard = -12345
    assignments = torch.full((n + 2,), guard, dtype=torch.int32)
    offsets = torch.full((e + 3,), guard, dtype=torch.int32)
    a = MoEAttrs(e, 2, 1, 1)
    moe_sort.sort_kernel[(1, 1, 1)](
        routing, 4, assignments[1:-1], offsets[1:-1], **moe_sort.constexprs(a, "float16"), num_warps=moe_sort.NUM_WARPS
    )
    assert assignments[0] == assignments[-1] == offsets[0] == offsets[-1] == guard
    assert offsets[1:-1].tolist() == [0, 2, 4, 5]  # experts 0, 1, 2: 2, 2 and 1 assignments; 3 ids dropped
    assert assignments[1:6].tolist() == [0, 7, 3, 4, 6]


def test_the_launch_is_one_program_with_the_token_count_as_its_scalar() -> None:
    a = MoEAttrs(128, 8, 2048, 768)
    assert moe_sort.grid(a, 4096) == (1, 1, 1)
    assert moe_sort.scalars(a, 17) == [17]
    sig = moe_sort.signature(a, "bfloat16")
    assert [t for t in sig.values() if t != "constexpr"] == ["*i32", "i32", "*i32", "*i32"]
    assert moe_sort.constexprs(a, "float16") == {"TOP_K": 8, "E": 128, "E_BLOCK": 128, "BLOCK": moe_sort.BLOCK}
    assert moe_sort.constexprs(MoEAttrs(5, 2, 1, 1), "float32")["E_BLOCK"] == 8
