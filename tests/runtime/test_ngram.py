"""The n-gram proposer (issue 30) against vLLM's definition (vllm/v1/spec_decode/ngram_proposer.py,
`_find_longest_matched_ngram_and_propose_tokens`): its docstring example, longest n first, earliest occurrence,
fewer than k at the end, nothing below prompt_lookup_min, the scheduler's slot cap; the incremental index equals a
plain scan of the whole context, grown token by token, and stays right across preemption; release drops it."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from fakes import FakeEngine

from toolchain.runtime.loop import Runtime
from toolchain.runtime.ngram import NgramIndex, NgramProposer
from toolchain.runtime.request import Request, SamplingParams
from toolchain.runtime.scheduler import Scheduled
from toolchain.runtime.speculative import SpecConfig


def scan(tokens: Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
    """vLLM's proposal by brute force: for n from max down to min, the earliest p with tokens[p:p+n] equal to the
    last n tokens and a token after it (p + n < len), then the <= k tokens after it."""
    total = len(tokens)
    if total < min_n:
        return []
    for n in range(min(max_n, total), min_n - 1, -1):
        for p in range(total - n):
            if list(tokens[p : p + n]) == list(tokens[total - n :]):
                return list(tokens[p + n : p + n + k])
    return []


def propose(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    return NgramIndex(min_n, max_n).lookup(tokens, k)


def test_vllms_docstring_example() -> None:
    # [4,2,3] has no earlier occurrence; [2,3] does at 1: the (only three) tokens after it
    assert propose([1, 2, 3, 4, 2, 3], 2, 3, 4) == [4, 2, 3]


def test_the_longest_match_wins_then_the_earliest_occurrence() -> None:
    # suffix [7,8,9]: the 2-gram [8,9] occurs at 1 (followed by 50), the 3-gram [7,8,9] at 4 (followed by 60)
    tokens = [1, 8, 9, 50, 7, 8, 9, 60, 61, 2, 7, 8, 9]
    assert propose(tokens, 2, 3, 2) == [60, 61]
    assert propose(tokens, 2, 2, 2) == [50, 7]  # max 2: the earliest 2-gram
    # two occurrences of the same 3-gram: the earlier one
    tokens = [5, 6, 7, 1, 5, 6, 7, 2, 5, 6, 7]
    assert propose(tokens, 3, 3, 1) == [1]


def test_fewer_than_k_at_the_end_and_overlapping_occurrences() -> None:
    assert propose([3, 3, 3], 2, 4, 4) == [3]  # [3,3] at 0 overlaps the suffix; one token after it
    assert propose([1, 2, 1, 2], 2, 2, 5) == [1, 2]


def test_nothing_below_the_minimum_or_without_a_match() -> None:
    assert propose([4], 2, 4, 3) == []  # shorter than prompt_lookup_min
    assert propose([1, 2, 3, 4, 5], 1, 3, 3) == []  # no token repeats
    assert propose([1, 2, 9, 3, 2], 2, 4, 3) == []  # only a 1-gram [2] matches
    assert propose([1, 2, 9, 3, 2], 1, 4, 3) == [9, 3, 2]
    assert propose([1, 2, 1, 2], 2, 2, 0) == []


def test_the_index_equals_a_scan_on_random_contexts_grown_token_by_token() -> None:
    rng = random.Random(30)
    checked = drafted = 0
    for _ in range(200):
        vocab = rng.choice((2, 3, 5, 12))  # small vocabularies: many repeats, ties and overlaps
        min_n = rng.randrange(1, 4)
        max_n = rng.randrange(min_n, 6)
        k = rng.randrange(1, 6)
        tokens: list[int] = []
        index = NgramIndex(min_n, max_n)
        for _ in range(rng.randrange(1, 60)):
            tokens.extend(rng.randrange(vocab) for _ in range(rng.choice((1, 1, 1, 3))))  # 1 or several per step
            got = index.lookup(tokens, k)
            assert got == scan(tokens, min_n, max_n, k), (tokens, min_n, max_n, k)
            checked += 1
            drafted += bool(got)
    assert checked > 2000 and drafted > checked // 3  # the comparison covered many proposals


def scheduled(request: Request, spec: int) -> Scheduled:
    return Scheduled(request, request.tokens[request.num_computed :], request.num_computed, spec)


def test_the_proposer_drafts_at_most_the_reserved_slots_and_releases_its_index() -> None:
    proposer = NgramProposer(SpecConfig("ngram", num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=3))
    r = Request([1, 2, 3, 4, 5, 1, 2], SamplingParams(max_new_tokens=8))
    r.num_computed = len(r.tokens) - 1
    one, none = proposer.propose([scheduled(r, 2), scheduled(r, 0)])
    assert one is not None and one.tokens == [3, 4] and none is None  # the slots cap k, as max_seq_len does
    assert isinstance(r.spec_state, NgramIndex)
    proposer.release(r)
    assert r.spec_state is None


def test_the_index_is_right_after_preemption() -> None:
    # a pool of 12 blocks for 4 sequences of up to 40 tokens: max_utilization preempts and recomputes
    prompts = [[*[7, 8, 9, 7, 8, 9, 7, 8][: 5 + i], 10 + i] for i in range(4)]

    def looping(context: object) -> int:  # a model that repeats itself: the n-gram drafts get accepted
        ids = list(context)  # type: ignore[call-overload]
        return 3 + (ids[-1] * 7 + ids[-2]) % 11 if len(ids) > 1 else 5

    engine = FakeEngine(model=looping)  # type: ignore[arg-type]
    rt = Runtime(engine, num_blocks=12, speculation=SpecConfig("ngram", num_speculative_tokens=4))
    reqs = [rt.add_request(p, SamplingParams(max_new_tokens=32)) for p in prompts]
    while rt.has_work:
        rt.step()
        for r in reqs:
            if isinstance(r.spec_state, NgramIndex):
                assert r.spec_state.indexed <= len(r.tokens)
    want = []
    for p in prompts:
        context = list(p)
        for _ in range(32):
            context.append(looping(context))
        want.append(context[len(p) :])
    assert [r.generated for r in reqs] == want
    assert rt.scheduler.preempted > 0 and rt.spec_stats.accepted > 0
    assert all(r.spec_state is None for r in reqs)  # released at the end


@pytest.mark.parametrize("bad", [(0, 2), (3, 2)])
def test_bad_lookup_lengths_are_refused(bad: tuple[int, int]) -> None:
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpecConfig("ngram", prompt_lookup_min=bad[0], prompt_lookup_max=bad[1])
