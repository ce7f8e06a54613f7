"""Logprobs through the runtime (issue 29): every generated token's logprob and every prompt position's equal the
log-softmax of the engine's own scorer (`EngineSession.all_logits`, the same engine run over the whole sequence at
once) -- greedy and sampled, batched with plain rows, across chunked prefill and after a preemption -- and plain
greedy rows batched with them still keep their logits on the device."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch
from conftest import save_random_llama
from fakes import Spy

from tests.runtime.logprob_bound import run_keeping_logprobs, tolerance
from toolchain.checkpoint.convert import convert
from toolchain.engine.api import open_engine
from toolchain.engine.build import BuildOptions, build_engine
from toolchain.evaluate.engine_eval import EngineSession
from toolchain.runtime.logprobs import log_softmax, token_logprob
from toolchain.runtime.loop import Runtime
from toolchain.runtime.request import Request, SamplingParams, Status, TokenLogprob
from toolchain.runtime.scheduler import Scheduler


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp("lp")
    convert(save_random_llama(tmp / "hf", num_attention_heads=8, num_key_value_heads=2), tmp / "ckpt")
    opts = BuildOptions(backend="onnxruntime", tokens_per_block=4, max_batch_size=4, max_num_tokens=24)
    build_engine(tmp / "ckpt", tmp / "engine", opts)
    return open_engine(tmp / "engine")


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, 90, (int(torch.randint(5, 26, (1,), generator=gen)),), generator=gen).tolist()
        for _ in range(n)
    ]


def check_against_scorer(engine: Any, request: Request, lps: list[TokenLogprob]) -> None:
    """The request's logprobs (generated, and prompt ones when asked) against the scorer's log-softmax."""
    assert request.status is Status.FINISHED, request.error
    seq = request.prompt + request.generated
    logits = EngineSession(engine).all_logits(torch.tensor([seq]))[0]
    ref = np.stack([log_softmax(row) for row in logits.numpy()])
    tol = tolerance(logits)
    p = request.params
    expected: list[tuple[int, int, int]] = []  # (position, row, top) to check
    if p.prompt_logprobs is not None:
        assert len(request.prompt_lps) == len(request.prompt) and request.prompt_lps[0] is None
        expected += [(pos, pos - 1, p.prompt_logprobs) for pos in range(1, len(request.prompt))]
    got = list(request.prompt_lps[1:]) if p.prompt_logprobs is not None else []
    if p.logprobs is not None:
        assert [lp.token for lp in lps] == request.generated
        got += lps
        expected += [(pos, pos - 1, p.logprobs) for pos in range(len(request.prompt), len(seq))]
    assert len(got) == len(expected)
    for lp, (pos, row, top) in zip(got, expected, strict=True):
        assert lp is not None and lp.token == seq[pos]
        assert abs(lp.logprob - ref[row, seq[pos]]) <= tol, (pos, lp.logprob, ref[row, seq[pos]])
        chosen = ref[row, seq[pos]]  # its rank: tokens within the tolerance of it may rank either side
        assert lp.rank is not None
        assert np.count_nonzero(ref[row] >= chosen + tol) < lp.rank <= np.count_nonzero(ref[row] >= chosen - tol)
        assert len(lp.top) == top
        kth = np.sort(ref[row])[::-1][top - 1] if top else np.inf
        for t, value in lp.top:
            assert abs(value - ref[row, t]) <= tol and value >= kth - tol
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)


def run(rt: Runtime, jobs: list[tuple[list[int], SamplingParams]]) -> list[tuple[Request, list[TokenLogprob]]]:
    return run_keeping_logprobs(rt, jobs)


def test_token_logprob_top_ties_by_id_and_rank() -> None:
    row = np.array([1.0, 3.0, 3.0, 2.0, 3.0], dtype=np.float32)
    lp = token_logprob(row, 3, 2)
    lse = np.log(np.exp(row.astype(np.float64)).sum())
    assert lp.top == ((1, 3.0 - lse), (2, 3.0 - lse)) and lp.logprob == 2.0 - lse and lp.rank == 4
    assert token_logprob(row, 0, 0).top == () and token_logprob(row, 0, 0).rank == 5
    assert token_logprob(row, 2, 1).rank == 3  # ties rank together, counted as at least as likely (vLLM's)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logprobs_equal_the_scorer_batched_with_plain_rows(engine: Any, temperature: float) -> None:
    ps = prompts(4, seed=1)
    asked = SamplingParams(max_new_tokens=8, temperature=temperature, seed=3, logprobs=5, prompt_logprobs=3)
    plain = SamplingParams(max_new_tokens=8)
    runs = run(Runtime(engine, num_blocks=64), [(ps[0], asked), (ps[1], plain), (ps[2], asked), (ps[3], plain)])
    for r, lps in (runs[0], runs[2]):
        check_against_scorer(engine, r, lps)
    alone = run(Runtime(engine, num_blocks=64), [(ps[1], plain)])[0][0]
    assert runs[1][0].generated == alone.generated  # the plain rows are untouched


def test_prompt_logprobs_across_chunked_prefill(engine: Any) -> None:
    limits = replace(engine.spec.limits, max_num_tokens=5)  # a 20-token prompt takes four chunks
    ps = prompts(3, seed=2)
    params = SamplingParams(max_new_tokens=4, logprobs=0, prompt_logprobs=2)
    for r, lps in run(Runtime(engine, limits, num_blocks=64), [(p, params) for p in ps]):
        check_against_scorer(engine, r, lps)


def test_prompt_logprobs_after_a_preemption(engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pool far too small and 5-token chunks: requests are preempted mid-prompt (part of their prompt logprobs
    collected) and after it; the recomputed rows change nothing."""
    victims: list[tuple[int, int]] = []  # (prompt positions collected, prompt length) of each preempted request
    preempt = Scheduler._preempt

    def record(self: Scheduler, victim: Request) -> None:
        victims.append((len(victim.prompt_lps), len(victim.prompt)))
        preempt(self, victim)

    monkeypatch.setattr(Scheduler, "_preempt", record)
    ps = prompts(6, seed=4)
    params = SamplingParams(max_new_tokens=10, temperature=1.0, seed=7, logprobs=1, prompt_logprobs=1)
    rt = Runtime(engine, replace(engine.spec.limits, max_num_tokens=5), num_blocks=12, watermark=0.0)
    runs = run(rt, [(p, params) for p in ps])
    assert any(0 < got < length for got, length in victims) and any(got == length for got, length in victims)
    for r, lps in runs:
        check_against_scorer(engine, r, lps)


def test_prompt_logprobs_skip_the_prefix_cache(engine: Any) -> None:
    shared = list(range(10, 22))  # three full blocks
    rt = Runtime(engine, num_blocks=64)
    run(rt, [([*shared, 30, 31], SamplingParams(max_new_tokens=2))])
    before = rt.cached_tokens
    r, lps = run(rt, [([*shared, 40], SamplingParams(max_new_tokens=2, prompt_logprobs=0))])[0]
    assert rt.cached_tokens == before  # nothing taken from the cache...
    check_against_scorer(engine, r, lps)  # ...and every position reported
    run(rt, [([*shared, 50], SamplingParams(max_new_tokens=2))])
    assert rt.cached_tokens > before  # a plain request still finds it


def test_plain_greedy_rows_stay_on_the_device_beside_logprob_rows(engine: Any) -> None:
    spy = Spy(engine)
    rt = Runtime(spy, num_blocks=64)  # type: ignore[arg-type]
    ps = prompts(4, seed=5)
    jobs = [(p, SamplingParams(max_new_tokens=6)) for p in ps[:3]] + [
        (ps[3], SamplingParams(max_new_tokens=6, logprobs=2))
    ]
    assert all(len(r.generated) == 6 for r, _ in run(rt, jobs))
    # one host row per token the logprob request chose, none for the three plain requests' 18 tokens
    assert sum(map(len, spy.calls)) == 6 and all(len(c) <= 1 for c in spy.calls)
