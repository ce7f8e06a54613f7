"""Greedy speculative decoding with the real n-gram proposer is exact (issue 30): every request's output equals plain
greedy decoding, token for token, under everything the runtime does at once — batching, prefill chunks beside verify
chunks, prefix sharing, preemption (max_utilization) and its absence (guaranteed_no_evict), stop tokens inside an
accepted run, max_new_tokens and max_seq_len at the edge, a cancel mid-run — with the block books checked after every
step. Then the same on a real model: stories260K through the ONNX Runtime engine, text prompts, k 1 and 4."""

from __future__ import annotations

import random
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fakes import FakeEngine, fake_limits, next_token
from spec_helpers import check_blocks

from toolchain.runtime.loop import Runtime
from toolchain.runtime.request import Request, SamplingParams, Status
from toolchain.runtime.speculative import Draft, SpecConfig

MOTIFS = [[11, 12, 13], [21, 22], [31, 32, 33, 34], [41, 42, 43]]


def model(context: Sequence[int] | np.ndarray) -> int:
    """A fake model that mostly continues from its last token in a short cycle (so the n-gram drafts are often
    right) and, on a sixth of the contexts, from the whole context (so they are often wrong, and a stale token
    anywhere in the cache changes the output)."""
    ids = [int(t) for t in context]
    if zlib.crc32(np.asarray(ids, dtype=np.int64).tobytes()) % 6 == 0:
        return next_token(ids)
    return local(ids[-1])


def local(last: int) -> int:
    return 3 + (last * 5) % 13


def chain(start: int, n: int) -> list[int]:
    out = [start]
    while len(out) < n:
        out.append(local(out[-1]))
    return out


def greedy(prompt: list[int], n: int, stop: tuple[int, ...] = ()) -> list[int]:
    context, out = list(prompt), []
    for _ in range(n):
        out.append(model(context))
        context.append(out[-1])
        if out[-1] in stop:
            break
    return out


def make_prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts built from repeated motifs and runs of the model's own cycle (the n-gram proposer finds matches in
    them); every fourth shares 8 or 12 tokens (2-3 full blocks of 4) with the others of its kind."""
    rng = random.Random(seed)
    shared = {8: [rng.randrange(3, 300) for _ in range(8)], 12: [rng.randrange(3, 300) for _ in range(12)]}
    out = []
    for i in range(n):
        body: list[int] = []
        while len(body) < rng.randrange(3, 20):
            pick = rng.random()
            body += rng.choice(MOTIFS) if pick < 0.5 else chain(rng.randrange(3, 300), 4) if pick < 0.8 else [0]
            body[-1] = body[-1] or rng.randrange(3, 300)
        out.append((shared[8 if i % 8 == 0 else 12] if i % 4 == 0 else []) + body)
    return out


class Recording:
    """The runtime's n-gram proposer, keeping each request's draft of the current step."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.now: dict[str, list[int]] = {}  # this step's drafts (cleared by `run`)
        self.proposed = 0

    def propose(self, scheduled: Sequence[Any]) -> list[Draft | None]:
        drafts: list[Draft | None] = self.inner.propose(scheduled)
        for s, d in zip(scheduled, drafts, strict=True):
            self.now[s.request.id] = d.tokens if d is not None else []
            self.proposed += len(d.tokens) if d is not None else 0
        return drafts

    def release(self, request: Request) -> None:
        self.inner.release(request)


def speculating(policy: str, num_blocks: int, max_seq_len: int) -> tuple[Runtime, Recording]:
    limits = fake_limits(max_batch_size=8, max_num_tokens=20, max_seq_len=max_seq_len, num_blocks=num_blocks)
    rt = Runtime(
        FakeEngine(limits, model=model),  # type: ignore[arg-type]
        policy=policy,
        speculation=SpecConfig("ngram", num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=4),
    )
    recorder = Recording(rt.proposer)
    rt.proposer = recorder
    return rt, recorder


def run(
    rt: Runtime, recorder: Recording, reqs: list[Request], cancel: list[Request] | None = None
) -> dict[str, set[int]]:
    """Step to the end, checking the block books each step (with `cancel`, cancelling at step 6 the first request
    with output, appended to it); per request, the
    output positions that were accepted drafts with more of the step's run (emitted or drafted) after them."""
    inside: dict[str, set[int]] = {r.id: set() for r in reqs}
    steps = 0
    while rt.has_work:
        before = {r.id: len(r.generated) for r in reqs}
        recorder.now = {}
        rt.step()
        check_blocks(rt)
        steps += 1
        if steps == 6 and cancel is not None:
            victim = next(r for r in reqs if r.generated and not r.done)
            assert rt.cancel(victim.id)
            cancel.append(victim)
        for r in reqs:
            new, draft = r.generated[before[r.id] :], recorder.now.get(r.id, [])
            for j in range(min(len(draft), len(new))):
                if draft[j] != new[j]:
                    break
                if j + 1 < max(len(new), len(draft)):  # an accepted draft with more of the run after it
                    inside[r.id].add(before[r.id] + j)
    return inside


@pytest.mark.parametrize(
    "policy, num_blocks",
    [("max_utilization", 24), ("guaranteed_no_evict", 60), ("max_utilization", 400)],
    ids=["preempting", "no-evict", "roomy"],
)
def test_ngram_speculation_reproduces_plain_greedy(policy: str, num_blocks: int) -> None:
    max_seq_len = 48
    prompts = make_prompts(64, seed=30)
    rng = random.Random(7)
    lengths = []
    for i, p in enumerate(prompts):  # every ninth at max_seq_len exactly, a few at 1 and 2 tokens
        n = max_seq_len - len(p) if i % 9 == 0 else (1, 2)[i % 2] if i % 11 == 0 else rng.randrange(3, 25)
        lengths.append(min(n, max_seq_len - len(p)))
    # a pilot run without stops finds, for every fifth request, a token that is an accepted draft in the middle of
    # a run: its stop token (the run's schedule is deterministic, so the real run mostly meets the same drafts)
    rt, recorder = speculating(policy, num_blocks, max_seq_len)
    pilot = [rt.add_request(p, SamplingParams(max_new_tokens=n)) for p, n in zip(prompts, lengths, strict=True)]
    inside = run(rt, recorder, pilot)
    stops: list[tuple[int, ...]] = []
    for i, r in enumerate(pilot):
        out = r.generated
        fresh = [j for j in sorted(inside[r.id]) if out[j] not in out[:j]]
        stops.append((out[fresh[0]],) if i % 5 == 0 and fresh else ())
    assert sum(map(bool, stops)) >= 3

    rt, recorder = speculating(policy, num_blocks, max_seq_len)
    reqs = [
        rt.add_request(p, SamplingParams(max_new_tokens=n, stop_token_ids=stop))
        for p, n, stop in zip(prompts, lengths, stops, strict=True)
    ]
    cancelled: list[Request] = []
    inside = run(rt, recorder, reqs, cancel=cancelled)
    for r, p, n, stop in zip(reqs, prompts, lengths, stops, strict=True):
        want = greedy(p, n, stop)
        if r in cancelled:
            assert r.status is Status.CANCELLED and 0 < len(r.generated) < n and r.generated == want[: len(r.generated)]
        else:
            assert r.status is Status.FINISHED and r.generated == want, r.id
    # stop tokens that were accepted drafts with more tokens after them in the step: the request ended there
    cut = [r for r in reqs if r.finish_reason == "stop_token" and len(r.generated) - 1 in inside[r.id]]
    assert cut, "no stop token fell inside an accepted run"
    assert sum(len(r.generated) == n for r, n in zip(reqs, lengths, strict=True) if n in (1, 2)) >= 2
    assert rt.blocks.num_used == 0
    stats = rt.spec_stats
    assert 0 < stats.accepted < stats.draft_tokens == recorder.proposed  # drafts both accepted and rejected
    assert stats.mean_accepted_length is not None and stats.mean_accepted_length > 1.3
    if num_blocks < 50 and policy == "max_utilization":
        assert rt.scheduler.preempted > 0


# -- stories260K through the ONNX Runtime engine ------------------------------------------------------------------

STORY_PROMPTS = [
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park.",
    "One day, a little boy named Tim went to the park with his mom. He saw a big red ball.",
    "Once upon a time, there was a big dog. The dog liked to run and jump. One day, the dog saw a cat.",
    "Lily and Ben were friends. They liked to play with their toys. One day, they found a box.",
    "There was a little bird who lived in a tree. The bird liked to sing every morning.",
    "Tom had a red car. He liked to drive his car in the garden. One day, his car broke.",
    "Once upon a time, there was a kind old man. He lived in a small house near the sea.",
    "Sue wanted to bake a cake for her mom. She got some eggs and some milk.",
    "The sun was shining and the sky was blue. Amy went outside to play with her ball.",
    "Once upon a time, a little fish lived in the sea. The fish was happy and liked to swim.",
    "Max was a happy cat. He liked to sleep in the sun. One day, Max saw a mouse.",
    'Mom said, "Time for bed, Sam." Sam did not want to go to bed. He wanted to play.',
    "Once there was a girl who loved flowers. She picked red flowers and yellow flowers.",
    "The little bear was hungry. He looked for honey in the tree. He found a big pot of honey.",
    "Anna had a new doll. She gave the doll a name. She called her Rose.",
    "One day, Jack went to the store with his dad. They wanted to buy some apples.",
    "Once upon a time, there was a small frog. The frog liked to jump in the pond.",
    "Ben saw a big truck. The truck was very loud. Ben wanted to see the truck go.",
    "The girl and the boy went to the beach. They made a big sand castle.",
    "Once upon a time, there was a princess who lived in a big castle.",
    "Tim liked to draw. He drew a sun, a tree and a house. His mom liked his picture.",
    "Lucy found a shiny rock in the garden. She showed the rock to her friend.",
    "It was a rainy day. Sara could not go outside. She was sad.",
    "Once upon a time, there was a lion who was very proud. He liked to roar.",
]


@pytest.fixture(scope="module")
def stories_engine(stories: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    from toolchain.checkpoint.convert import convert
    from toolchain.engine.api import open_engine
    from toolchain.engine.build import BuildOptions, build_engine

    root = tmp_path_factory.mktemp("stories")
    convert(stories, root / "ckpt")
    options = BuildOptions(
        backend="onnxruntime", max_batch_size=8, max_num_tokens=256, max_seq_len=256, tokens_per_block=4
    )
    build_engine(root / "ckpt", root / "engine", options)
    return open_engine(root / "engine"), AutoTokenizer.from_pretrained(stories)


def run_all(engine: Any, prompts: list[list[int]], n: int, speculation: SpecConfig | None) -> tuple[list[Any], Any]:
    rt = Runtime(engine, speculation=speculation)
    reqs = [rt.add_request(p, SamplingParams(max_new_tokens=n)) for p in prompts]
    while rt.has_work:
        rt.step()
        check_blocks(rt)
    assert all(r.status is Status.FINISHED for r in reqs)
    return [r.generated for r in reqs], rt.spec_stats


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 4])
def test_stories260k_ngram_is_token_identical_to_plain_greedy(stories_engine: Any, k: int) -> None:
    engine, tok = stories_engine
    prompts = [tok(p, add_special_tokens=True)["input_ids"] for p in STORY_PROMPTS]
    plain, _ = run_all(engine, prompts, 64, None)
    spec, stats = run_all(engine, prompts, 64, SpecConfig("ngram", k, prompt_lookup_min=2, prompt_lookup_max=4))
    assert spec == plain
    assert stats.drafts > 0 and stats.accepted > 0
    print(f"stories260K n-gram [2,4] k={k}: {stats.to_json()}")
