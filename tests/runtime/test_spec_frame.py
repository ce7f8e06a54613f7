"""The speculative-decoding seam (issue 30 frame): drafts ride a decode's chunk, the target's argmax per row keeps
the agreeing run plus one token, and the output is plain greedy's whatever the drafts are — all right, all wrong,
mixed — under batching, chunked prefill, prefix sharing and preemption; a rejected draft never reaches the prefix
cache; the counters are vLLM's."""

from __future__ import annotations

import random

import pytest
from fakes import FakeEngine, expected_output, fake_limits, next_token
from spec_helpers import ScriptedProposer, check_blocks

from toolchain.runtime.loop import Runtime
from toolchain.runtime.request import SamplingParams, Status
from toolchain.runtime.speculative import SpecConfig, SpecStats


def speculating(engine: FakeEngine, proposer: ScriptedProposer, k: int = 4, **options: object) -> Runtime:
    rt = Runtime(engine, speculation=SpecConfig("ngram", num_speculative_tokens=k), **options)  # type: ignore[arg-type]
    rt.proposer = proposer  # the scripted drafts instead of the n-gram proposer
    return rt


def run_checked(rt: Runtime) -> None:
    while rt.has_work:
        rt.step()
        check_blocks(rt)


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 300) for _ in range(9)]  # two full blocks and a bit: prefix sharing
    return [
        (shared if i % 3 == 0 else []) + [rng.randrange(3, 300) for _ in range(rng.randrange(2, 14))] for i in range(n)
    ]


@pytest.mark.parametrize(
    "name, wrong",
    [
        ("all right", lambda step, j: False),
        ("all wrong", lambda step, j: True),
        ("mixed", lambda step, j: (step * 7 + j * 3) % 5 == 0),
    ],
)
def test_greedy_output_is_plain_greedy_whatever_the_drafts(name: str, wrong: object) -> None:
    ps = prompts(24, seed=1)
    proposer = ScriptedProposer(next_token, wrong)  # type: ignore[arg-type]
    # a small token budget (prefill chunks beside verify chunks) and a small pool (preemption under max_utilization)
    rt = speculating(FakeEngine(fake_limits(max_num_tokens=24, num_blocks=40)), proposer)
    reqs = [rt.add_request(p, SamplingParams(max_new_tokens=17)) for p in ps]
    run_checked(rt)
    assert [r.generated for r in reqs] == [expected_output(p, 17) for p in ps]
    assert all(r.status is Status.FINISHED for r in reqs)
    assert rt.blocks.num_used == 0  # every block back
    stats = rt.spec_stats
    assert stats.drafts > 0 and stats.draft_tokens == proposer.proposed
    if name == "all right":
        assert stats.accepted == stats.draft_tokens
        assert rt.steps < sum(17 for _ in ps) // 8  # far fewer engine calls than tokens per sequence
    if name == "all wrong":
        assert stats.accepted == 0
    assert sum(r.spec.accepted for r in reqs) == stats.accepted


def test_stops_inside_an_accepted_run_end_the_request_there() -> None:
    p = [5, 9, 14, 3]
    full = expected_output(p, 12)
    stop = full[5]
    rt = speculating(FakeEngine(), ScriptedProposer(next_token))
    r = rt.add_request(p, SamplingParams(max_new_tokens=12, stop_token_ids=(stop,)))
    short = rt.add_request(p, SamplingParams(max_new_tokens=3))  # max_new_tokens inside a run
    run_checked(rt)
    assert r.generated == full[: full.index(stop) + 1] and r.finish_reason == "stop_token"
    assert short.generated == full[:3] and short.finish_reason == "length"


def test_draft_slots_respect_the_token_budget_and_the_sequence_length() -> None:
    limits = fake_limits(max_batch_size=8, max_num_tokens=10, max_seq_len=24)
    engine = FakeEngine(limits)
    fed: list[int] = []
    forward = engine.forward

    def recording(batch, kv_cache):  # type: ignore[no-untyped-def]
        fed.append(int(batch.new_lens.sum()))
        assert int((batch.context_lens + batch.new_lens).max()) <= 24
        return forward(batch, kv_cache)

    engine.forward = recording  # type: ignore[method-assign]
    rt = speculating(engine, ScriptedProposer(next_token), k=4)
    reqs = [rt.add_request([7 + i, 8, 9], SamplingParams(max_new_tokens=21)) for i in range(4)]
    run_checked(rt)
    assert [r.generated for r in reqs] == [expected_output([7 + i, 8, 9], 21) for i in range(4)]
    assert max(fed) == 10 and all(n <= 10 for n in fed)  # drafts fill the budget, never past it


def test_spec_stats_follow_vllms_definitions() -> None:
    s = SpecStats()
    s.observe(4, 2)
    s.observe(3, 3)
    s.observe(0, 0)  # nothing drafted: not a draft
    assert (s.drafts, s.draft_tokens, s.accepted, s.per_pos) == (2, 7, 5, [2, 2, 1, 0])
    assert s.acceptance_rate == pytest.approx(5 / 7) and s.mean_accepted_length == pytest.approx(1 + 5 / 2)


def test_draft_slots_never_make_a_decode_preempt_another() -> None:
    """Every decode gets its own token's block first; draft slots take only what is left (three decodes, four
    blocks: without that order the oldest decode's slots took the block the youngest needed)."""
    from toolchain.runtime.blocks import BlockManager
    from toolchain.runtime.request import Request
    from toolchain.runtime.scheduler import Scheduler

    blocks = BlockManager(4, 4, 0.0, prefix_sharing=False)
    scheduler = Scheduler(blocks, 8, 64, "max_utilization", spec_tokens=4, max_seq_len=64)
    for i, prompt in enumerate(([1, 2, 3], [4, 5, 6], [7, 8, 9, 10])):
        r = Request(list(prompt), SamplingParams(max_new_tokens=20), arrival=float(i))
        r.append(11)  # one token generated: a decode is pending
        blocks.allocate_for(r, len(r.tokens) - 1)
        blocks.advance(r, len(r.tokens) - 1)
        r.status = Status.RUNNING
        scheduler.running.append(r)
    out = scheduler.schedule()
    assert len(out) == 3 and scheduler.preempted == 0
    assert sum(s.spec for s in out) == 3  # the slots the last free block holds, no more


def test_unused_draft_slots_go_back_to_the_prefills() -> None:
    """An n-gram proposer with nothing to propose (no repeated n-gram) costs no steps: the slots it leaves go to the
    prefill chunks of the same step."""

    def run(spec: SpecConfig | None) -> int:
        engine = FakeEngine(fake_limits(max_batch_size=16, max_num_tokens=32), model=lambda c: 3 + len(c) % 300)
        rt = Runtime(engine, speculation=spec)
        for i in range(12):
            rt.add_request(list(range(10 + 20 * i, 30 + 20 * i)), SamplingParams(max_new_tokens=40))
        rt.run()
        return rt.steps

    assert run(SpecConfig("ngram", num_speculative_tokens=4)) <= run(None) + 1


def test_a_stop_inside_an_accepted_run_counts_as_vllm_counts_it() -> None:
    """vLLM counts the drafts its rejection sampler accepted before the stop check cuts the output."""
    p = [5, 9, 14, 3]
    full = expected_output(p, 12)
    rt = speculating(FakeEngine(), ScriptedProposer(next_token))
    r = rt.add_request(p, SamplingParams(max_new_tokens=12, stop_token_ids=(full[2],)))
    run_checked(rt)
    assert r.generated == full[:3]
    first = r.spec.to_json()
    assert first["accepted_tokens"] == first["draft_tokens"]  # all right, though the output stopped inside the run
