"""The acceptance rule of runtime/rejection.py keeps the target's distribution (Leviathan et al. 2023, Chen et al.
2023): on a toy target p(.|previous token) and draft q(.|previous token) over 6 tokens, 3 drafted per step, the first
two emitted tokens of 10 000 seeded runs follow p's joint distribution (Pearson's χ² over the 36 cells), for drafts
sampled from q and for point-mass drafts (n-gram's sample-and-compare); the same test catches a broken rule (the
rejected position drawn from p instead of the residual). Plus the rule's draw discipline: a point-mass position
draws exactly what `sample` draws, a greedy row draws nothing."""

from __future__ import annotations

import bisect
import itertools
import math
import random
import time

import numpy as np
import pytest
import torch
from chi2 import chi2_pvalue

from toolchain.runtime import rejection
from toolchain.runtime.rejection import verify_position
from toolchain.runtime.request import SamplingParams
from toolchain.runtime.sampler import distribution, sample

V, K, N = 6, 3, 10_000
BOS = V  # the context before the first token
_g = torch.Generator().manual_seed(0)
LOGIT_P = torch.randn(V + 1, V, generator=_g, dtype=torch.float64) * 1.5  # a row per previous token (and BOS)
LOGIT_Q = LOGIT_P + torch.randn(V + 1, V, generator=_g, dtype=torch.float64)  # a draft close to the target, not equal
P = torch.softmax(LOGIT_P, -1)
Q = torch.softmax(LOGIT_Q, -1)
Q_CDF = [list(itertools.accumulate(row)) for row in Q.tolist()]  # the drafter samples q by inversion (fast)
T1 = SamplingParams(temperature=1.0)


def speculate(prev: int, rng: torch.Generator, drafter: random.Random, point_mass: bool) -> list[int]:
    """One speculative step after `prev`: K tokens drafted from q (the drafter's own stream), verified left to right
    with the rule (the request's stream `rng`), the bonus from p when all are accepted. A point-mass draft is
    verified as q = δ_d (the rule holds for any draft chosen without looking at the target's draws)."""
    drafts, qs, ctx = [], [], prev
    for _ in range(K):
        d = min(bisect.bisect_right(Q_CDF[ctx], drafter.random()), V - 1)
        drafts.append(d)
        qs.append(None if point_mass else Q[ctx].numpy())
        ctx = d
    out, ctx = [], prev
    for d, q in zip(drafts, qs, strict=True):
        token, hit = verify_position(LOGIT_P[ctx].clone(), d, q, T1, rng)
        out.append(token)
        if not hit:
            return out
        ctx = d
    out.append(sample(LOGIT_P[ctx].clone(), T1, rng))
    return out


def first_two(point_mass: bool, seed: int = 1) -> torch.Tensor:
    rng, drafter = torch.Generator().manual_seed(seed), random.Random(seed + 1)
    counts = torch.zeros(V, V, dtype=torch.float64)
    for _ in range(N):
        out = speculate(BOS, rng, drafter, point_mass)
        while len(out) < 2:
            out += speculate(out[-1], rng, drafter, point_mass)
        counts[out[0], out[1]] += 1
    return counts


EXPECTED = P[BOS][:, None] * P[:V] * N  # P(first = a, second = b) = p(a | BOS) p(b | a)


@pytest.mark.parametrize("point_mass", [False, True], ids=["q-sampled", "point-mass"])
def test_the_first_two_emitted_tokens_follow_the_target(point_mass: bool) -> None:
    start = time.perf_counter()
    chi2, p, df = chi2_pvalue(first_two(point_mass), EXPECTED)
    print(
        f"{'point-mass' if point_mass else 'q-sampled'}: chi2 {chi2:.1f} df {df} p {p:.3f} "
        f"({N} runs, {time.perf_counter() - start:.1f} s)"
    )
    assert p > 0.001, (chi2, p)


def test_a_rule_drawing_rejections_from_p_fails_the_same_test(monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: the test has the power to see a wrong rule (the residual replaced by p: rejected positions then
    over-weight the tokens q favours)."""
    monkeypatch.setattr(rejection, "residual", lambda p, q: p)
    chi2, p, df = chi2_pvalue(first_two(point_mass=False), EXPECTED)
    print(f"bug control: chi2 {chi2:.1f} df {df} p {p:.3g}")
    assert p < 1e-6, (chi2, p)


def test_a_point_mass_position_draws_what_sample_draws() -> None:
    """Sample-and-compare spends the request's stream exactly as a plain step: same token, same state after."""
    rows = torch.randn(200, 50, generator=torch.Generator().manual_seed(5), dtype=torch.float64) * 3
    params = SamplingParams(temperature=0.8, top_k=10, top_p=0.9)
    a, b = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    hits = 0
    for i, row in enumerate(rows):
        draft = int(torch.argmax(row)) if i % 2 else i % 50
        token, hit = verify_position(row.clone(), draft, None, params, a)
        assert token == sample(row.clone(), params, b) and hit == (token == draft)
        hits += hit
    assert torch.equal(a.get_state(), b.get_state())
    assert 0 < hits < len(rows)  # both branches ran


def test_a_greedy_row_takes_the_argmax_and_draws_nothing() -> None:
    g = torch.Generator().manual_seed(3)
    state = g.get_state()
    row = torch.tensor([0.5, 2.0, 2.0, -1.0], dtype=torch.float64)  # a tie: the first index, as `sample`
    assert verify_position(row, 1, None, SamplingParams(), g) == (1, True)
    assert verify_position(row, 2, np.full(4, 0.25), SamplingParams(), g) == (1, False)
    assert torch.equal(g.get_state(), state)


def test_a_draft_outside_top_k_is_always_rejected_and_never_emitted() -> None:
    row = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64))
    params = SamplingParams(temperature=1.0, top_k=2)
    q = np.array([0.1, 0.1, 0.7, 0.1])
    g = torch.Generator().manual_seed(0)
    emitted = [verify_position(row.clone(), 2, q, params, g) for _ in range(300)]
    assert all(not hit and token in (0, 1) for token, hit in emitted)
    # the residual is p - q where positive: {0: 0.4/0.7 - 0.1, 1: 0.3/0.7 - 0.1} renormalized
    p = distribution(row, params)
    assert math.isclose(float(p[0]), 0.4 / 0.7) and float(p[2]) == 0.0


def test_a_draft_distribution_of_another_size_is_refused() -> None:
    with pytest.raises(ValueError, match="5 entries, the target's row 4"):
        verify_position(torch.zeros(4, dtype=torch.float64), 1, np.full(5, 0.2), T1, torch.Generator())
