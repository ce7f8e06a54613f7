"""Draft-target speculation (issue 30, D4/D9): the draft proposer drafts exactly what the draft engine run alone would
(so its KV pool, indexed by the target's blocks, is right after catch-ups, full acceptance, preemption and prefix
sharing), greedy output with a draft is plain greedy's, and a draft that cannot serve a target is refused naming
both engines and the first difference.

The target is stories260K (5 layers) and the draft its layers {0, 1, 2, 4} made by `convert --layers`, both built
for the CPU engine (ONNX Runtime, float32)."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from spec_helpers import check_blocks

from toolchain.checkpoint.convert import convert
from toolchain.checkpoint.tiny import byte_level_tokenizer
from toolchain.engine.api import Engine, load_tokenizer, open_engine
from toolchain.engine.build import BuildOptions, build_engine
from toolchain.engine.contract import Batch
from toolchain.errors import UserError
from toolchain.runtime.draft import DraftProposer, check_draft
from toolchain.runtime.loop import Runtime
from toolchain.runtime.request import Request, SamplingParams
from toolchain.runtime.scheduler import Scheduled
from toolchain.runtime.speculative import Draft, SpecConfig

LAYERS = [0, 1, 2, 4]
OPTS: dict[str, Any] = {
    "backend": "onnxruntime",
    "tokens_per_block": 4,
    "max_seq_len": 256,
    "max_batch_size": 8,
    "max_num_tokens": 96,
}
TEXTS = [
    "Once upon a time, there was a little girl named Lily.",
    "Tom had a big red ball.",
    "One day, a cat",
    "The sun was shining and the birds were singing.",
    "Sam and his mom went to the park.",
    "There was a small dog who loved to run.",
    "Lily wanted to play with her friend Ben.",
    "Once upon a time, in a big forest, there lived a bear.",
    "The little boy found a shiny stone.",
    "Mia liked to draw pictures of flowers.",
    "It was a rainy day, so Tim stayed inside.",
    "A bird sat on the tree and",
    "Once upon a time, there was a big truck.",
    "Anna had a new toy. She",
    "The fish swam in the blue water.",
    "Max was a happy puppy. One day,",
    "Sue went to the store with her dad.",
    "Once upon a time, there was a kind old man.",
    "The children played in the snow all day.",
    "Ben saw a big box in the garden.",
    "Lucy and her cat were best friends.",
    "The moon was bright that night.",
    "Once upon a time, a frog lived in a pond.",
    "Jack wanted to fly like a bird.",
]


@pytest.fixture(scope="module")
def built(stories: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("draft")
    convert(stories, root / "t-ckpt")
    build_engine(root / "t-ckpt", root / "target", BuildOptions(**OPTS))
    convert(stories, root / "d-ckpt", layers=LAYERS)
    build_engine(root / "d-ckpt", root / "draft", BuildOptions(**OPTS))
    return root


@pytest.fixture(scope="module")
def target(built: Path) -> Engine:
    return open_engine(built / "target")


@pytest.fixture(scope="module")
def draft(built: Path) -> Engine:
    return open_engine(built / "draft")


@pytest.fixture(scope="module")
def prompts(built: Path) -> list[list[int]]:
    tok = load_tokenizer(built / "target")
    return [list(tok(t).input_ids) for t in TEXTS]


def alone(engine: Engine, tokens: Sequence[int], k: int) -> list[int]:
    """`engine`'s own greedy continuation of `tokens`, k tokens: one prefill, then one token a call, in a fresh pool
    (no runtime, no other sequence)."""
    n = len(tokens) + k
    blocks = list(range(-(-n // engine.tokens_per_block)))
    pool = engine.new_kv_cache(len(blocks))
    out: list[int] = []
    feed, at = list(tokens), 0
    for _ in range(k):
        row = engine.forward_tokens(Batch.from_sequences([feed], [at], [blocks]), pool, []).greedy
        at += len(feed)
        out.append(int(row[0]))
        feed = [out[-1]]
    return out


class Recorder:
    """Wraps a runtime's draft proposer: each draft with the tokens it followed, the catch-up it needed (tokens of
    the request the draft pool did not hold) and whether the request had been preempted or found a cached prefix."""

    def __init__(self, rt: Runtime) -> None:
        proposer = rt.proposer
        assert isinstance(proposer, DraftProposer)
        self.proposer, self.inner = proposer, proposer.propose
        self.records: list[tuple[list[int], list[int], int, bool, bool]] = []
        self.catch_ups: dict[str, list[int]] = {}  # request id -> its catch-up before each of its drafts
        proposer.propose = self.propose  # type: ignore[method-assign]

    def propose(self, scheduled: Sequence[Scheduled]) -> list[Draft | None]:
        before = [
            (list(s.request.tokens), len(s.request.tokens) - self.proposer.progress(s.request), s.request)
            for s in scheduled
        ]
        out = self.inner(scheduled)
        for (tokens, catch_up, request), d in zip(before, out, strict=True):
            if d is not None:
                assert d.probs is None  # greedy requests: the draft's argmax, a point mass
                self.records.append((tokens, d.tokens, catch_up, request.preemptions > 0, request.num_cached > 0))
                self.catch_ups.setdefault(request.id, []).append(catch_up)
        return out


def run_checked(rt: Runtime) -> None:
    while rt.has_work:
        rt.step()
        check_blocks(rt)


def test_proposals_are_the_drafts_own_greedy_continuation(
    target: Engine, draft: Engine, prompts: list[list[int]]
) -> None:
    """Every proposal equals the draft engine's greedy continuation run alone, including after a fully accepted
    draft (a 2-token catch-up), after preemption (the draft recomputes: its blocks are new) and on a shared prefix
    (the draft re-prefills it). A small pool forces preemptions; prompts repeated with other endings share blocks."""
    shared = prompts[0][:9]  # two full blocks of 4 and a bit
    ps = [p for p in prompts[:8]] + [shared + p[1:5] for p in prompts[8:12]]
    rt = Runtime(target, num_blocks=48, speculation=SpecConfig("draft", num_speculative_tokens=4), draft_engine=draft)
    rec = Recorder(rt)
    reqs = [rt.add_request(p, SamplingParams(max_new_tokens=24)) for p in ps]
    run_checked(rt)
    assert rt.scheduler.preempted > 0 and rt.blocks.prefix_hits > 0
    kinds = {"catch-up 2": 0, "preempted": 0, "shared prefix": 0}
    for tokens, drafted, catch_up, preempted, cached in rec.records:
        assert drafted == alone(draft, tokens, len(drafted)), (len(tokens), catch_up, preempted, cached)
        kinds["catch-up 2"] += catch_up == 2
        kinds["preempted"] += preempted
        kinds["shared prefix"] += cached
    assert all(kinds.values()), kinds  # each case was exercised
    # and the output is plain greedy's
    plain = Runtime(target)
    want = [plain.add_request(p, SamplingParams(max_new_tokens=24)) for p in ps]
    plain.run()
    assert [r.generated for r in reqs] == [r.generated for r in want]


def test_the_target_as_its_own_draft_is_always_accepted(target: Engine, prompts: list[list[int]]) -> None:
    """A draft that is the target drafts the target's greedy continuation: every drafted token is accepted, so
    every catch-up after the first is 2 tokens (the last drafted token and the bonus), and a stale or misplaced
    draft KV would show as a rejection."""
    rt = Runtime(target, speculation=SpecConfig("draft", num_speculative_tokens=3), draft_engine=target)
    rec = Recorder(rt)
    reqs = [rt.add_request(p, SamplingParams(max_new_tokens=20)) for p in prompts[:8]]
    run_checked(rt)
    stats = rt.spec_stats
    assert stats.draft_tokens > 0 and stats.accepted == stats.draft_tokens
    assert all(r.spec.drafts > 0 for r in reqs)
    for r in reqs:  # the first catch-up is the prompt and first token; every later one the draft's last and bonus
        assert rec.catch_ups[r.id][1:] == [2] * (len(rec.catch_ups[r.id]) - 1), rec.catch_ups[r.id]


@pytest.mark.slow  # ~2.6 s on 2 shared cores: 24 prompts x 64 tokens, plain and speculative
def test_greedy_with_the_draft_is_plain_greedy(
    target: Engine, draft: Engine, prompts: list[list[int]], capsys: pytest.CaptureFixture[str]
) -> None:
    plain = Runtime(target)
    want = [plain.add_request(p, SamplingParams(max_new_tokens=64)) for p in prompts]
    plain.run()
    rt = Runtime(target, speculation=SpecConfig("draft", num_speculative_tokens=4), draft_engine=draft)
    got = [rt.add_request(p, SamplingParams(max_new_tokens=64)) for p in prompts]
    run_checked(rt)
    assert [r.generated for r in got] == [r.generated for r in want]
    s = rt.spec_stats
    assert s.accepted > 0 and rt.steps < plain.steps
    with capsys.disabled():
        print(
            f"\nstories260K, draft layers {LAYERS}, k=4, 24 prompts x 64: acceptance {s.acceptance_rate:.3f}, "
            f"mean accepted length {s.mean_accepted_length:.2f}, per position "
            f"{[round(n / s.drafts, 3) for n in s.per_pos]}, target steps {rt.steps} vs {plain.steps}"
        )


def test_catch_up_past_the_drafts_token_budget_drafts_nothing_that_step(
    target: Engine, draft: Engine, prompts: list[list[int]]
) -> None:
    """A catch-up longer than the draft's max_num_tokens is fed in part, with no draft for that sequence this step;
    the next step catches up the rest and drafts."""
    proposer = DraftProposer(SpecConfig("draft", num_speculative_tokens=2), draft)
    proposer.limits = type(proposer.limits)(**{**proposer.limits.__dict__, "max_num_tokens": 8})
    r = Request(prompts[0] + prompts[1])  # 20+ tokens, as if prefilled by the target
    r.blocks = list(range(10))
    r.num_computed = len(r.tokens) - 1
    s = Scheduled(r, r.tokens[-1:], r.num_computed, spec=2)
    assert proposer.propose([s]) == [None] and proposer.progress(r) == 8
    while proposer.progress(r) + 8 < len(r.tokens):
        assert proposer.propose([s]) == [None]
    (d,) = proposer.propose([s])
    assert d is not None and d.tokens == alone(draft, r.tokens, 2)


def test_the_draft_pool_grows_to_the_runtimes_block_ids(draft: Engine, prompts: list[list[int]]) -> None:
    """A runtime pool larger than the draft engine's default (`Runtime(num_blocks=...)`): the draft pool grows to
    hold the highest block id, keeping what it held."""
    proposer = DraftProposer(SpecConfig("draft", num_speculative_tokens=2), draft)
    have = proposer.pool.shape[1]
    low, high = Request(prompts[3]), Request(prompts[4])
    for r, first in ((low, 0), (high, have + 5)):
        r.blocks = list(range(first, first + 8))
        r.num_computed = len(r.tokens) - 1
    (d,) = proposer.propose([Scheduled(low, low.tokens[-1:], low.num_computed, spec=2)])
    (e,) = proposer.propose([Scheduled(high, high.tokens[-1:], high.num_computed, spec=2)])
    assert proposer.pool.shape[1] == have + 13
    assert d is not None and e is not None and e.tokens == alone(draft, high.tokens, 2)
    low.append(d.tokens[0])  # the first draft accepted, then a token of the target's: low's KV survived the growth
    low.append(d.tokens[0] + 1)
    low.num_computed = len(low.tokens) - 1
    assert proposer.progress(low) == len(low.tokens) - 1  # the prompt and the accepted draft: a 1-token catch-up
    (d2,) = proposer.propose([Scheduled(low, low.tokens[-1:], low.num_computed, spec=2)])
    assert d2 is not None and d2.tokens == alone(draft, low.tokens, 2)


def test_a_sampled_request_drafts_from_the_drafts_own_distribution(draft: Engine, prompts: list[list[int]]) -> None:
    """temperature > 0: each drafted token is drawn from q = the draft's softmax at the request's temperature (top-k
    applied as `sampler.sample` applies it), q's rows come with the draft for the acceptance rule, and the draws
    follow the request's seed."""
    import numpy as np
    import torch

    def drafted(seed: int, **params: Any) -> Draft:
        proposer = DraftProposer(SpecConfig("draft", num_speculative_tokens=3), draft)
        r = Request(prompts[2], SamplingParams(temperature=0.8, seed=seed, **params))
        r.blocks = list(range(8))
        r.num_computed = len(r.tokens) - 1
        (d,) = proposer.propose([Scheduled(r, r.tokens[-1:], r.num_computed, spec=3)])
        assert d is not None
        return d

    d = drafted(5)
    assert d.probs is not None and d.probs.shape == (3, draft.vocab_size)
    # the draft's rows, fed as the proposer feeds them: the prompt, then each drafted token
    n = len(prompts[2]) + 3
    blocks = list(range(-(-n // draft.tokens_per_block)))
    pool = draft.new_kv_cache(len(blocks))
    feed, at = list(prompts[2]), 0
    for j, token in enumerate(d.tokens):
        logits = draft.forward(Batch.from_sequences([feed], [at], [blocks]), pool)[0]
        want = torch.softmax(torch.from_numpy(logits.astype(np.float64)) / 0.8, -1).numpy()
        np.testing.assert_allclose(d.probs[j], want, rtol=1e-12, atol=0)  # the same float32 row, float64 rounding
        assert d.probs[j][token] > 0
        feed, at = [token], at + len(feed)
    assert drafted(5).tokens == d.tokens  # the seed decides the draws
    assert len({tuple(drafted(s).tokens) for s in range(6)}) > 1  # and they are draws
    top1 = drafted(7, top_k=1)  # top-k 1 leaves the argmax alone: q one-hot on it
    assert top1.probs is not None and (top1.probs.max(axis=1) == 1.0).all()
    assert top1.tokens == alone(draft, prompts[2], 3)


# -- refusals ---------------------------------------------------------------------------------------------------


def built_draft(root: Path, name: str, ckpt: Path, **opts: Any) -> Engine:
    build_engine(ckpt, root / name, BuildOptions(**{**OPTS, **opts}))
    return open_engine(root / name)


def test_another_tokenizer_is_refused_naming_both_and_the_first_token(
    target: Engine, built: Path, stories: Path, tmp_path: Path
) -> None:
    """The tiny model's byte-level tokenizer (toolchain/checkpoint/tiny.py) over stories' layers: same sizes, same
    bos/eos ids, another vocabulary."""
    hf = tmp_path / "hf"
    hf.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(stories / name, hf / name)
    byte_level_tokenizer().save_pretrained(hf)
    convert(hf, tmp_path / "ckpt", layers=LAYERS)
    other = built_draft(tmp_path, "bytes", tmp_path / "ckpt")
    with pytest.raises(UserError) as e:
        check_draft(target, other)
    msg = str(e.value)
    assert str(tmp_path / "bytes") in msg and str(built / "target") in msg and "another tokenizer" in msg
    t_vocab = {i: s for s, i in load_tokenizer(built / "target").get_vocab().items()}
    d_vocab = {i: s for s, i in load_tokenizer(tmp_path / "bytes").get_vocab().items()}
    first = min(i for i in t_vocab if t_vocab[i] != d_vocab.get(i))
    assert f"token id {first} is {d_vocab.get(first)!r} in the draft, {t_vocab[first]!r} in the target" in msg


@pytest.mark.parametrize(
    "opts, words",
    [
        ({"tokens_per_block": 8}, ["tokens_per_block 8 vs the target's 4", "--tokens-per-block 4"]),
        ({"max_batch_size": 4}, ["limits.max_batch_size 4 is below the target's 8", "--max-batch-size 8"]),
        ({"max_num_tokens": 64}, ["limits.max_num_tokens 64 is below the target's 96"]),
        ({"max_seq_len": 128}, ["limits.max_seq_len 128 is below the target's 256"]),
    ],
)
def test_other_blocks_or_smaller_limits_are_refused(
    target: Engine, built: Path, tmp_path: Path, opts: dict[str, Any], words: list[str]
) -> None:
    small = built_draft(tmp_path, "d", built / "d-ckpt", **opts)
    with pytest.raises(UserError) as e:
        check_draft(target, small)
    assert str(tmp_path / "d") in str(e.value) and str(built / "target") in str(e.value)
    for w in words:
        assert w in str(e.value)


def test_a_draft_without_a_tokenizer_is_refused(target: Engine, built: Path, stories: Path, tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    hf.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(stories / name, hf / name)
    convert(hf, tmp_path / "ckpt", layers=LAYERS)
    bare = built_draft(tmp_path, "bare", tmp_path / "ckpt")
    with pytest.raises(UserError, match="cannot check it shares the target's tokenizer"):
        check_draft(target, bare)
    check_draft(target, open_engine(built / "draft"))  # the stand-in draft is fine
