"""Speculative decoding under sampling, through the runtime (issue 30): host rows verify each drafted position with
the acceptance rule (runtime/rejection.py) on the row their pipeline processed in the state after the tokens before
it. Checked: (1) with a draft sampling from its own q, the tokens emitted by verification follow the target's
distribution (χ² over 3 000 seeded requests on a bigram fake engine, top-k 4 on half); (2) with point-mass drafts
(n-gram's kind) a seeded request's output equals the same request without speculation, token for token, also with
presence / frequency / repetition penalties, logit_bias, min_tokens and logprobs; (3) the logprobs of drafted
positions on a real engine (ORT, random tiny Llama) equal the non-speculative run's within the float32 bound;
(4) grammar requests speculate: refused drafts are cut before the engine call, each drafted position gets its
own mask from the worker's fill, seeded output equals the output without speculation."""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from typing import Any

import llguidance.numpy
import numpy as np
import pytest
import torch
from chi2 import chi2_pvalue
from conftest import save_random_llama
from fakes import VOCAB, FakeEngine, Spy, fake_limits, next_token
from spec_helpers import ScriptedProposer, check_blocks

from tests.runtime.logprob_bound import run_keeping_logprobs, tolerance
from toolchain.checkpoint.convert import convert
from toolchain.checkpoint.tiny import byte_level_tokenizer
from toolchain.engine.api import open_engine
from toolchain.engine.build import BuildOptions, build_engine
from toolchain.runtime import rejection
from toolchain.runtime.loop import Runtime
from toolchain.runtime.request import (
    FinishReason,
    GrammarSpec,
    Request,
    SamplingParams,
    Status,
    TokenLogprob,
)
from toolchain.runtime.scheduler import Scheduled
from toolchain.runtime.speculative import Draft, SpecConfig

# -- (1) a draft sampling from q: the target's distribution, through the runtime ----------------------------------
V = 6
_g = torch.Generator().manual_seed(11)
LOGIT_P = torch.randn(V, V, generator=_g, dtype=torch.float64) * 1.5  # the target: a row per previous token
Q = torch.softmax(LOGIT_P + torch.randn(V, V, generator=_g, dtype=torch.float64), -1)  # the draft, close to it


def bigram(context: np.ndarray) -> np.ndarray:
    return LOGIT_P[int(context[-1])].numpy().astype(np.float32)


class BigramDraft:
    """A draft model sampling from q(.|previous token) with its own stream, reporting q with each token (what a
    draft engine at temperature > 0 does)."""

    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.drafted = 0

    def propose(self, scheduled: Sequence[Scheduled]) -> list[Draft | None]:
        out: list[Draft | None] = []
        for s in scheduled:
            if not s.spec:
                out.append(None)
                continue
            prev, tokens, rows = s.request.tokens[-1], [], []
            for _ in range(s.spec):
                rows.append(Q[prev].numpy())
                prev = int(torch.multinomial(Q[prev], 1, generator=self.generator))
                tokens.append(prev)
            self.drafted += len(tokens)
            out.append(Draft(tokens, np.stack(rows)))
        return out

    def release(self, request: Request) -> None:
        pass


def top_k_rows(logits: torch.Tensor, k: int) -> torch.Tensor:
    """softmax over each row's k largest logits (the sampler's top-k, written out independently)."""
    cut = torch.sort(logits, dim=-1, descending=True).values[:, k - 1 : k]
    return torch.softmax(logits.masked_fill(logits < cut, float("-inf")), -1)


@pytest.mark.parametrize("broken", [False, True], ids=["rule", "bug control"])
def test_a_q_sampling_draft_keeps_the_targets_distribution(broken: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests of 5 tokens after the prompt [PROMPT]: the first comes from the prefill (never drafted), the first
    decode drafts 3 (max_new_tokens leaves room for 3 + the bonus), so tokens 2 and 3 are the verified ones; their
    joint is Σ_a p(a | PROMPT) p(b2 | a) p(b3 | b2) (top-k 4 applied to p on the odd requests). The control (the
    residual replaced by p) shows the test sees a wrong rule through the runtime."""
    if broken:
        monkeypatch.setattr(rejection, "residual", lambda p, q: p)
    n, prompt = 3000, 5
    start = time.perf_counter()
    engine = FakeEngine(
        fake_limits(max_batch_size=64, max_num_tokens=512, num_blocks=256), vocab_size=V, logits_model=bigram
    )
    rt = Runtime(engine, speculation=SpecConfig("ngram", num_speculative_tokens=3))
    rt.proposer = draft = BigramDraft(seed=2)  # instead of the n-gram proposer: a draft model's q-sampled drafts
    reqs = [
        rt.add_request([prompt], SamplingParams(max_new_tokens=5, temperature=1.0, seed=i, top_k=4 if i % 2 else 0))
        for i in range(n)
    ]
    rt.run()
    assert all(r.status is Status.FINISHED and len(r.generated) == 5 for r in reqs)
    observed = torch.zeros(2, V, V, dtype=torch.float64)
    for i, r in enumerate(reqs):
        observed[i % 2, r.generated[1], r.generated[2]] += 1
    expected = torch.zeros(2, V, V, dtype=torch.float64)
    for group, p in enumerate((torch.softmax(LOGIT_P, -1), top_k_rows(LOGIT_P, 4))):
        second = p[prompt] @ p  # P(token 2 = b) = Σ_a p(a | prompt) p(b | a)
        expected[group] = second[:, None] * p * (n // 2)
    cells = expected > 0  # top-k leaves cells no run can reach: they must stay empty
    assert observed[~cells].sum() == 0
    chi2, pvalue, df = chi2_pvalue(observed[cells], expected[cells], constraints=2)
    stats = rt.spec_stats
    print(
        f"runtime q-draft{' (bug control)' if broken else ''}: chi2 {chi2:.1f} df {df} p {pvalue:.3g}, "
        f"acceptance {stats.acceptance_rate:.3f}, "
        f"{n} requests in {time.perf_counter() - start:.1f} s"
    )
    assert stats.draft_tokens == draft.drafted and 0 < stats.accepted < stats.draft_tokens
    if broken:
        assert pvalue < 1e-6, (chi2, pvalue)
    else:
        assert pvalue > 0.001, (chi2, pvalue)


# -- (2) point-mass drafts: seeded output equals the output without speculation -----------------------------------
def favourite(context: Sequence[int] | np.ndarray) -> int:
    """The token `peaked` favours and the scripted drafts propose: one of 8, so tokens repeat and the penalties
    (whose counts change at every accepted position) change the distribution often."""
    return 3 + next_token(context) % 8


def peaked(context: np.ndarray) -> np.ndarray:
    """A distribution over the fake's 320 tokens with about half its mass on `favourite(context)`, the rest spread
    by the last token."""
    row: np.ndarray = np.cos(np.arange(VOCAB) * (int(context[-1]) % 13 + 1) * 0.37).astype(np.float32)
    row[favourite(context)] += 6.0
    return row


JOBS = [
    SamplingParams(max_new_tokens=24, temperature=1.0, seed=1),
    SamplingParams(max_new_tokens=24, temperature=0.8, top_k=40, top_p=0.9, seed=2),
    SamplingParams(max_new_tokens=24, temperature=1.0, presence_penalty=0.8, frequency_penalty=0.5, seed=3),
    SamplingParams(max_new_tokens=24, temperature=0.7, logit_bias=((7, 4.0), (11, -3.0)), seed=4, logprobs=2),
    SamplingParams(max_new_tokens=24, temperature=1.0, repetition_penalty=1.3, min_p=0.05, seed=5),
    SamplingParams(max_new_tokens=24, temperature=1.0, min_tokens=20, stop_token_ids=(9, 10), seed=6),
    SamplingParams(max_new_tokens=24, presence_penalty=2.0, frequency_penalty=1.5, logprobs=1),  # greedy, host rows
    SamplingParams(max_new_tokens=24, logit_bias=((5, 5.5),)),  # greedy, host rows: 5 against the favourite's 6
]


def run(rt: Runtime, jobs: Sequence[tuple[list[int], SamplingParams]]) -> list[tuple[Request, list[TokenLogprob]]]:
    return run_keeping_logprobs(rt, jobs, check_blocks)


def test_point_mass_drafts_leave_seeded_output_as_without_speculation() -> None:
    prompts = [[3 + i, 17, 40 + 3 * i, 99] for i in range(len(JOBS))]
    jobs = list(zip(prompts, JOBS, strict=True)) * 2  # two of each in the batch: their streams stay their own
    limits = fake_limits(max_batch_size=8, max_num_tokens=40, num_blocks=64)  # chunks beside verify rows
    plain = run(Runtime(FakeEngine(limits, logits_model=peaked)), jobs)
    proposer = ScriptedProposer(favourite, lambda step, j: (step + j) % 4 == 0)
    rt = Runtime(FakeEngine(limits, logits_model=peaked), speculation=SpecConfig("ngram", num_speculative_tokens=4))
    rt.proposer = proposer
    spec = run(rt, jobs)
    for (a, lps_a), (b, lps_b) in zip(plain, spec, strict=True):
        assert b.status is Status.FINISHED and b.generated == a.generated, (a.params, a.generated, b.generated)
        assert lps_b == lps_a  # each emitted token's logprob from its own raw row
        assert b.finish_reason == a.finish_reason
    stats = rt.spec_stats
    assert 0 < stats.accepted < stats.draft_tokens  # accepted and rejected positions both ran
    assert all(r.spec.drafts > 0 for r, _ in spec)  # every kind of request speculated
    assert rt.steps < sum(len(r.generated) for r, _ in plain) // 8  # fewer engine calls than plain decoding needs


def test_plain_greedy_drafts_stay_on_the_device_beside_sampled_ones() -> None:
    """Speculating plain greedy requests verify on the engine's argmax: no row of theirs comes to the host, while a
    sampled request beside them brings its k + 1 verification rows."""
    spy = Spy(FakeEngine(logits_model=peaked))
    rt = Runtime(spy, speculation=SpecConfig("ngram", num_speculative_tokens=3))  # type: ignore[arg-type]
    rt.proposer = ScriptedProposer(favourite)
    greedy = rt.add_request([4, 5, 6], SamplingParams(max_new_tokens=9))
    alone = rt.add_request([7, 8, 9], SamplingParams(max_new_tokens=9))
    rt.run()
    assert greedy.spec.accepted > 0 and all(rows == [] for rows in spy.calls)
    sampled = rt.add_request([4, 5, 6], SamplingParams(max_new_tokens=9, temperature=1.0, seed=0))
    rt.add_request([7, 8, 9], SamplingParams(max_new_tokens=9))
    spy.calls.clear()
    rt.run()
    assert sampled.spec.drafts > 0 and max(len(rows) for rows in spy.calls) == 4  # k + 1 rows, the greedy one's none
    assert alone.generated == [favourite([7, 8, 9, *alone.generated[:i]]) for i in range(9)]


# -- (4) grammars: masks per drafted position -------------------------------------------------------------------
EOS = 2
CHARS = "abcdefghijklmnopqrstuvwxyz{|}~"  # the drafts' alphabet: the last 4 are outside the grammar's [a-z]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return byte_level_tokenizer()


def test_grammar_requests_speculate_inside_their_grammar(tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Constrained requests (regex [a-z]{3,8}) with drafts over [a-z{|}~]: the drafts the grammar refuses are cut
    before the engine call (no refused token is ever fed), every output matches, the masks of the drafted positions
    come from the worker's fill (none computed alone on the step's thread), and a seeded constrained request's
    output equals its output without speculation token for token (each position's mask is the right one)."""
    ids = [tokenizer.convert_tokens_to_ids(c) for c in CHARS]
    letters, refused = set(ids[:26]), set(ids[26:])

    def likely(context: Sequence[int] | np.ndarray) -> int:
        return ids[next_token(context) % len(ids)]

    def model(context: np.ndarray) -> np.ndarray:
        row = peaked(context)
        row[likely(context)] += 6.0
        row[EOS] += 1.0 if len(context) > 6 else 0.0
        return row

    fed: list[list[int]] = []

    class Recording(FakeEngine):
        def forward(self, batch: Any, kv_cache: torch.Tensor) -> np.ndarray:
            fed.append(batch.input_ids.tolist())
            return super().forward(batch, kv_cache)

    alone: list[int] = []
    fill_alone = llguidance.numpy.fill_next_token_bitmask

    def counting(*args: Any) -> None:
        alone.append(1)
        fill_alone(*args)

    spec = GrammarSpec("regex", "[a-z]{3,8}")
    jobs = [
        (
            [1, 60 + i],
            SamplingParams(12, 1.0, seed=i, stop_token_ids=(EOS,), grammar=spec, presence_penalty=0.3 * (i % 2)),
        )
        for i in range(8)
    ]
    plain = run(Runtime(FakeEngine(logits_model=model), tokenizer=tokenizer), jobs)
    monkeypatch.setattr(llguidance.numpy, "fill_next_token_bitmask", counting)
    rt = Runtime(
        Recording(logits_model=model), tokenizer=tokenizer, speculation=SpecConfig("ngram", num_speculative_tokens=4)
    )
    rt.proposer = proposer = ScriptedProposer(likely, lambda step, j: (step + j) % 5 == 0)
    proposed: list[int] = []
    propose = proposer.propose

    def keeping(scheduled: Sequence[Scheduled]) -> list[Draft | None]:
        drafts = propose(scheduled)
        proposed.extend(t for d in drafts if d is not None for t in d.tokens)
        return drafts

    proposer.propose = keeping  # type: ignore[method-assign]
    speculated = run(rt, jobs)
    for (a, _), (b, _) in zip(plain, speculated, strict=True):
        assert b.finish_reason is FinishReason.STOP_TOKEN and b.generated[-1] == EOS, b.error
        assert re.fullmatch("[a-z]{3,8}", tokenizer.decode(b.generated[:-1]))
        assert b.generated == a.generated
    assert refused & set(proposed)  # the proposer did draft refused tokens...
    assert not refused & {t for call in fed for t in call}  # ...and none reached the engine
    assert rt.spec_stats.accepted > 0 and all(b.spec.drafts > 0 for b, _ in speculated)
    assert letters & set(proposed)
    assert alone == []


# -- (3) logprobs of drafted positions on a real engine -------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp("speclp")
    convert(save_random_llama(tmp / "hf", num_attention_heads=8, num_key_value_heads=2), tmp / "ckpt")
    opts = BuildOptions(backend="onnxruntime", tokens_per_block=4, max_batch_size=4, max_num_tokens=24)
    build_engine(tmp / "ckpt", tmp / "engine", opts)
    return open_engine(tmp / "engine")


@pytest.mark.slow  # building the engine: ~3 s on 2 cores (the fake-engine test above checks logprobs by default)
def test_drafted_positions_report_the_logprobs_of_a_plain_run(engine: Any) -> None:
    """Greedy with logprobs on the ORT engine: drafts from the plain run's own output (some positions corrupted)
    are verified on rows computed in a k+1-token chunk; tokens equal and logprobs within the float32 bound of
    logprob_bound.py (the chunk sums in another order than one-token decodes)."""
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 90, (int(n),), generator=gen).tolist() for n in (5, 9, 14, 20)]
    params = SamplingParams(max_new_tokens=12, logprobs=3)
    plain = run(Runtime(engine, num_blocks=64), [(p, params) for p in prompts])
    sequences = [r.tokens for r, _ in plain]

    def truth(context: list[int]) -> int:
        for seq in sequences:
            if len(context) < len(seq) and seq[: len(context)] == context:
                return seq[len(context)]
        return 3

    rt = Runtime(engine, num_blocks=64, speculation=SpecConfig("ngram", num_speculative_tokens=3))
    rt.proposer = ScriptedProposer(truth, lambda step, j: (step + j) % 3 == 0, vocab=engine.vocab_size)
    spec = run(rt, [(p, params) for p in prompts])
    assert 0 < rt.spec_stats.accepted < rt.spec_stats.draft_tokens
    for (a, lps_a), (b, lps_b) in zip(plain, spec, strict=True):
        assert b.generated == a.generated
        assert [lp.token for lp in lps_b] == b.generated
        tol = tolerance(torch.tensor([max(abs(v) for _, v in lp.top) for lp in lps_a]))
        for x, y in zip(lps_a, lps_b, strict=True):
            assert abs(x.logprob - y.logprob) <= tol and x.rank == y.rank
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
            assert all(abs(u - v) <= tol for (_, u), (_, v) in zip(x.top, y.top, strict=True))


def test_a_grammar_cut_of_a_sampled_draft_keeps_the_targets_distribution() -> None:
    """The target gives a, b, c equal odds; the grammar [ab]{2,4} forbids c; the draft samples a 0.1 / b 0.4 / c 0.5.
    When the grammar cuts a drafted c, the rule's residual max(p - q, 0) must decide the token there (a plain draw
    from p gave P(a) = 0.35 instead of 0.5). 2,000 seeded requests: P(second token = a) within 4 binomial standard
    errors (sqrt(0.25 / 2000) = 0.011) of 0.5."""
    from fakes import VOCAB

    from toolchain.checkpoint.tiny import byte_level_tokenizer
    from toolchain.runtime.request import GrammarSpec
    from toolchain.runtime.speculative import Draft

    tok = byte_level_tokenizer()
    a, b, c = (tok.convert_tokens_to_ids(ch) for ch in "abc")

    def model(context: np.ndarray) -> np.ndarray:
        row = np.full(VOCAB, -40.0, dtype=np.float32)
        row[[a, b, c]] = 0.0
        return row

    q = np.zeros(VOCAB)
    q[a], q[b], q[c] = 0.1, 0.4, 0.5

    class SampledDraft:
        def __init__(self) -> None:
            self.generator = torch.Generator().manual_seed(3)

        def propose(self, scheduled: Any) -> list[Draft | None]:
            return [
                Draft([int(torch.multinomial(torch.from_numpy(q), 1, generator=self.generator))], q[None, :].copy())
                if s.spec
                else None
                for s in scheduled
            ]

        def release(self, request: Any) -> None:
            pass

    engine = FakeEngine(fake_limits(max_batch_size=64, max_num_tokens=512, num_blocks=256), logits_model=model)
    rt = Runtime(engine, tokenizer=tok, speculation=SpecConfig("ngram", num_speculative_tokens=1))  # type: ignore[arg-type]
    rt.proposer = SampledDraft()
    spec = GrammarSpec("regex", "[ab]{2,4}")
    n = 2000
    reqs = [
        rt.add_request([1, 60], SamplingParams(max_new_tokens=3, temperature=1.0, seed=i, grammar=spec))
        for i in range(n)
    ]
    rt.run()
    second = [r.generated[1] for r in reqs]
    assert rt.spec_stats.drafts > n // 4  # the cut path ran (about half the drafts are a refused c)
    assert abs(np.mean([t == a for t in second]) - 0.5) < 4 * (0.25 / n) ** 0.5
