"""A speculating server (issue 30) on the tiny engine: vLLM's four vllm:spec_decode_* counters equal the runtime's
SpecStats after a workload whose acceptance is known in advance, the per-position children are there from the start,
inter-token latency is observed once per engine step (not per token: several tokens arrive per step), the request
log line carries the request's speculation counts, and the output is plain greedy's.

The drafts come from a scripted proposer installed on the server's runtime (the n-gram proposer's output on random
weights is not known in advance): it drafts the request's true greedy continuation (taken from the same server with
speculation idle) with the positions from CORRECT on made wrong, so every full draft accepts exactly CORRECT tokens.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.serve.helpers import MODEL, Running, metric, post, running, wait_until
from tests.serve.test_serve import server_log
from toolchain.runtime.request import Request, SamplingParams
from toolchain.runtime.scheduler import Scheduled
from toolchain.runtime.speculative import Draft, SpecConfig

K = 3  # drafted positions per step at most
CORRECT = 2  # the scripted drafts' first CORRECT positions are the true continuation, the rest wrong
PROMPTS = [[5, 17, 29, 41], [7, 7, 7, 7, 7, 7], [100, 90, 80], [3, 250, 11, 64, 9]]  # token ids: exact keys
MAX_TOKENS = 12


class Nothing:
    """Drafts nothing: the runtime decodes one token per step (the reference run)."""

    def propose(self, scheduled: Sequence[Scheduled]) -> list[Draft | None]:
        return [None] * len(scheduled)

    def release(self, request: Request) -> None:
        pass


class Oracle(Nothing):
    """Drafts the known greedy continuation of each prompt, wrong from position CORRECT on."""

    def __init__(self, truth: dict[tuple[int, ...], list[int]], vocab: int) -> None:
        self.truth, self.vocab = truth, vocab

    def propose(self, scheduled: Sequence[Scheduled]) -> list[Draft | None]:
        out: list[Draft | None] = []
        for s in scheduled:
            rest = self.truth[tuple(s.request.prompt)][len(s.request.generated) :] if s.spec else []
            tokens = [t if j < CORRECT else (t + 1) % self.vocab for j, t in enumerate(rest[: s.spec])]
            out.append(Draft(tokens) if tokens else None)
        return out


def body(prompt: str | list[int]) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def speculating(engine_dir: Path) -> Iterator[Running]:
    with running(engine_dir, speculation=SpecConfig("ngram", K)) as r:
        yield r


def test_counters_equal_the_runtimes_and_itl_is_per_step(speculating: Running) -> None:
    state = speculating.state
    runtime = state.llm.runtime
    idle = runtime.proposer
    runtime.proposer = Nothing()  # the reference: each prompt's greedy output, one token per step
    completions = state.llm.generate(list(PROMPTS), SamplingParams(MAX_TOKENS))
    plain = {tuple(p): c for p, c in zip(PROMPTS, completions, strict=True)}
    assert all(len(c.token_ids) == MAX_TOKENS for c in plain.values())
    assert runtime.spec_stats.drafts == 0
    before = speculating.metrics()

    runtime.proposer = Oracle({p: c.token_ids for p, c in plain.items()}, state.spec.vocab_size)
    try:
        with server_log() as logged:
            for prompt in PROMPTS:  # one at a time: each request's steps are its own
                response = post(speculating.url, body(prompt))
                assert response.status_code == 200, response.text
                assert response.json()["choices"][0]["text"] == plain[tuple(prompt)].text, "greedy output changed"
    finally:
        runtime.proposer = idle
    stats = runtime.spec_stats
    wait_until(lambda: metric(speculating.metrics(), "vllm:spec_decode_num_drafts_total") == stats.drafts, "a step")
    after = speculating.metrics()

    def grew(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert grew("vllm:spec_decode_num_drafts_total") == stats.drafts > 0
    assert grew("vllm:spec_decode_num_draft_tokens_total") == stats.draft_tokens
    assert grew("vllm:spec_decode_num_accepted_tokens_total") == stats.accepted
    per_pos = [grew("vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(i)) for i in range(K)]
    assert per_pos == [*stats.per_pos, *[0] * (K - len(stats.per_pos))]
    # known in advance: every draft's first position is right, positions from CORRECT on never are
    assert per_pos[0] == stats.drafts and per_pos[CORRECT:] == [0] * (K - CORRECT)
    rate = grew("vllm:spec_decode_num_accepted_tokens_total") / grew("vllm:spec_decode_num_draft_tokens_total")
    assert rate == stats.acceptance_rate and CORRECT / K <= rate < 1  # drafts cut short near max_tokens run higher

    # ITL: one observation per engine step after a request's first; each step emitted accepted + 1 tokens
    tokens_after_first = len(PROMPTS) * (MAX_TOKENS - 1)
    steps_after_first = tokens_after_first - stats.accepted
    assert grew("vllm:inter_token_latency_seconds_count") == steps_after_first < tokens_after_first
    assert grew("vllm:request_time_per_output_token_seconds_count") == len(PROMPTS)  # TPOT: once per request

    lines = [line for line in logged.lines if line.get("event") == "request"]
    assert len(lines) == len(PROMPTS) and all(line["completion_tokens"] == MAX_TOKENS for line in lines)
    assert sum(line["spec_drafts"] for line in lines) == stats.drafts
    assert sum(line["spec_draft_tokens"] for line in lines) == stats.draft_tokens
    assert sum(line["spec_accepted_tokens"] for line in lines) == stats.accepted
    for line in lines:  # each request's own counts: at most CORRECT accepted per draft, some drafts every request
        assert line["spec_drafts"] > 0 and line["spec_accepted_tokens"] <= CORRECT * line["spec_drafts"]


def test_without_speculation_the_families_and_log_fields_are_absent(server: Running) -> None:
    text = server.metrics()
    assert "vllm:spec_decode" not in text  # vLLM registers them only with a speculative config
    with server_log() as logged:
        assert post(server.url, body("plain")).status_code == 200
    [line] = [line for line in logged.lines if line.get("event") == "request"]
    assert not {k for k in line if k.startswith("spec_")}


def test_a_draft_server_opens_the_draft_and_closes_it_with_the_engine(
    engine_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`serve --draft DIR`: prepare opens the draft (checked against the engine), the runtime gets it, and closing
    the server's engine closes it too; the engine itself serves as its own draft here (same tokenizer and limits)."""
    closed: list[Any] = []
    with running(engine_dir, speculation=SpecConfig("draft", 2), draft=engine_dir) as r:
        draft = r.state.draft_engine
        assert draft is not None and draft is not r.state.engine
        assert draft.spec.engine_dir == engine_dir
        assert r.state.llm.runtime.speculation == SpecConfig("draft", 2)
        monkeypatch.setattr(draft, "close", lambda: closed.append(draft), raising=False)
        response = post(r.url, body([5, 17, 29, 41]))
        assert response.status_code == 200, response.text
        r.state.close_engine()  # what server.run does when it stops (this in-process helper does not)
        assert closed == [draft]


def test_a_draft_method_without_a_draft_dir_is_refused(engine_dir: Path) -> None:
    from toolchain.errors import UserError
    from toolchain.serve.app import ServeOptions
    from toolchain.serve.server import prepare

    with pytest.raises(UserError, match="--draft DIR goes with method draft"):
        prepare(engine_dir, ServeOptions(speculation=SpecConfig("draft", 2)))
