"""The host-side logits pipeline (runtime/processors.py) and min_p (runtime/sampler.py), on rows and through the
runtime: each parameter's rule on a known row (repetition against transformers' own processor), incremental counts,
the stop-token and stop-string rules of min_tokens / include_stop_str_in_output, and a batch that mixes every
parameter with plain greedy rows (which keep their solo output and never bring a row to the host)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import save_random_llama
from fakes import FakeEngine, Spy
from test_host_rows import PROMPTS

from toolchain.checkpoint.convert import convert
from toolchain.checkpoint.tiny import byte_level_tokenizer
from toolchain.engine.api import open_engine
from toolchain.engine.build import BuildOptions, build_engine
from toolchain.runtime.loop import Runtime
from toolchain.runtime.processors import build_pipeline
from toolchain.runtime.request import Request, SamplingParams, TokenEvent
from toolchain.runtime.sampler import sample

VOCAB = 32
EOS = 2


def row(seed: int = 0) -> torch.Tensor:
    """A float64 scores row with positive and negative logits (the repetition rule depends on the sign)."""
    return torch.from_numpy(np.random.default_rng(seed).normal(0.0, 3.0, VOCAB))


def run_pipeline(params: SamplingParams, prompt: list[int], output: list[int], scores: torch.Tensor) -> torch.Tensor:
    """The scores for the token after `output`, the pipeline having accepted `output` one token at a time."""
    pipeline = build_pipeline(params, prompt, VOCAB)
    assert pipeline is not None
    request = Request(list(prompt), params)
    for token in output:
        pipeline.accepted(token)
        request.append(token)
    return pipeline.apply(scores.clone(), request)


def test_neutral_parameters_build_no_pipeline() -> None:
    """Plain requests keep today's path: no pipeline object at all (and greedy ones stay device rows)."""
    for params in (SamplingParams(), SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1)):
        assert build_pipeline(params, [1, 2, 3], VOCAB) is None
    assert build_pipeline(SamplingParams(presence_penalty=0.5), [1], VOCAB) is not None
    # min_tokens with no stop token to mask (ignore_eos, as AIPerf sends it) changes no row either
    assert build_pipeline(SamplingParams(min_tokens=5), [1], VOCAB) is None
    assert not SamplingParams(min_tokens=5).needs_host_logits
    assert build_pipeline(SamplingParams(min_tokens=5, stop_token_ids=(EOS,)), [1], VOCAB) is not None


def test_repetition_penalty_equals_transformers_processor() -> None:
    """HF's RepetitionPenaltyLogitsProcessor over prompt + output (what vLLM's rule is): equal on the same row.
    Tolerance: HF computes in the row's dtype (float64 here), the same two operations: equal to 1 ulp."""
    from transformers import RepetitionPenaltyLogitsProcessor

    prompt, output, scores = [3, 7, 7, 11], [20, 3, 25], row(1)
    ours = run_pipeline(SamplingParams(repetition_penalty=1.3), prompt, output, scores)
    theirs = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([prompt + output]), scores.clone()[None])[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-15, atol=0)
    seen = sorted(set(prompt + output))
    assert (ours[seen] < scores[seen]).all()  # both signs pushed down
    unseen = [t for t in range(VOCAB) if t not in seen]
    assert torch.equal(ours[unseen], scores[unseen])


def test_presence_and_frequency_follow_openais_rule_over_output_tokens_only() -> None:
    """logit - frequency * count - presence * (count > 0), counting generated tokens (a prompt token is not)."""
    prompt, output, scores = [5, 6], [9, 9, 9, 4, 5], row(2)
    ours = run_pipeline(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), prompt, output, scores)
    counts = torch.bincount(torch.tensor(output), minlength=VOCAB).double()
    expected = scores - 0.25 * counts - 0.5 * (counts > 0).double()
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)
    assert ours[6] == scores[6]  # in the prompt only


def test_counts_are_incremental_and_survive_repeated_applies() -> None:
    """apply() does not count: a step that is retried (or a preempted request recomputed) sees the same scores."""
    params = SamplingParams(frequency_penalty=1.0)
    pipeline = build_pipeline(params, [1], VOCAB)
    assert pipeline is not None
    request = Request([1], params)
    pipeline.accepted(4)
    first = pipeline.apply(row(3), request)
    again = pipeline.apply(row(3), request)
    assert torch.equal(first, again) and first[4] == row(3)[4] - 1.0


def test_logit_bias_adds_and_min_tokens_masks_stop_tokens_until_reached() -> None:
    params = SamplingParams(logit_bias=((EOS, 100.0), (8, -3.5)), min_tokens=2, stop_token_ids=(EOS, 17))
    pipeline = build_pipeline(params, [1], VOCAB)
    assert pipeline is not None
    request = Request([1], params)
    scores = pipeline.apply(row(4), request)
    assert scores[EOS] == scores[17] == float("-inf") and scores[8] == row(4)[8] - 3.5
    for token in (5, 6):
        pipeline.accepted(token)
        request.append(token)
    scores = pipeline.apply(row(4), request)
    assert scores[EOS] == row(4)[EOS] + 100.0 and scores[17] == row(4)[17]


def test_min_p_keeps_only_tokens_within_its_share_of_the_largest_probability() -> None:
    """probs 0.5, 0.3, 0.15, 0.05: min_p 0.35 keeps p >= 0.175, i.e. the first two; min_p 1 is greedy."""
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64))
    generator = torch.Generator().manual_seed(0)
    picks = {sample(logits, SamplingParams(temperature=1.0, min_p=0.35), generator) for _ in range(300)}
    assert picks == {0, 1}
    free = {sample(logits, SamplingParams(temperature=1.0), generator) for _ in range(300)}
    assert free == {0, 1, 2, 3}
    assert {sample(logits, SamplingParams(temperature=2.0, min_p=1.0), generator) for _ in range(50)} == {0}


# -- through the runtime ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tok() -> Any:
    return byte_level_tokenizer()


def scripted(tok: Any, text: str, prompt: list[int]) -> FakeEngine:
    script = tok.encode(text, add_special_tokens=False) + [EOS] * 8
    return FakeEngine(model=lambda context: script[len(context) - len(prompt)])


def test_min_tokens_ignores_stop_tokens_and_stop_strings_until_reached(tok: Any) -> None:
    """vLLM: no stop before min_tokens, and the text of the first min_tokens tokens is not searched for stop
    strings (v1/engine/detokenizer.py moves the search start past it, less the stop's length - 1: a stop that ends
    after them still counts)."""
    prompt = tok.encode("Hi", add_special_tokens=False)
    rt = Runtime(scripted(tok, "ab. cd. ef", prompt), tokenizer=tok)
    events: dict[int, list[TokenEvent]] = {3: [], 4: []}
    stops = SamplingParams(max_new_tokens=20, stop_strings=(". ",), stop_token_ids=(EOS,))
    early = rt.add_request(prompt, stops)
    after = {n: rt.add_request(prompt, replace(stops, min_tokens=n), on_event=events[n].append) for n in events}
    masked = rt.add_request(prompt, SamplingParams(max_new_tokens=20, stop_token_ids=(EOS,), min_tokens=12))
    rt.run()
    assert early.finish_reason == "stop_string" and early.detok is not None and early.detok.text == "ab"
    texts = {n: "".join(e.text for e in events[n]) for n in events}  # what a client gets
    assert texts == {3: "ab", 4: "ab. cd"}  # ". " ends on token 4: found when 3 are exempt, not when 4 are
    assert all(r.finish_reason == "stop_string" for r in after.values())
    # the fake model wants eos after 10 tokens; masked, its row is zeros elsewhere and the argmax is token 0, twice
    assert masked.generated == [*tok.encode("ab. cd. ef", add_special_tokens=False), 0, 0, EOS]
    assert masked.finish_reason == "stop_token"


def test_include_stop_str_in_output_keeps_the_stop_and_the_stop_tokens_text(tok: Any) -> None:
    prompt = tok.encode("Hi", add_special_tokens=False)
    rt = Runtime(scripted(tok, "ab. cd", prompt), tokenizer=tok)
    x = tok.encode("d", add_special_tokens=False)[0]
    kept = rt.add_request(prompt, SamplingParams(20, stop_strings=("b.",), include_stop_str_in_output=True))
    token = rt.add_request(prompt, SamplingParams(20, stop_token_ids=(x,), include_stop_str_in_output=True))
    dropped = rt.add_request(prompt, SamplingParams(max_new_tokens=20, stop_token_ids=(x,)))
    rt.run()
    assert kept.detok is not None and kept.detok.text == "ab."
    assert token.finish_reason == dropped.finish_reason == "stop_token"
    assert token.detok is not None and token.detok.text == "ab. cd"
    assert dropped.detok is not None and dropped.detok.text == "ab. c"


# -- a mixed batch on a real engine ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp("processors")
    convert(save_random_llama(tmp / "hf", num_attention_heads=8, num_key_value_heads=2), tmp / "ckpt")
    build_engine(tmp / "ckpt", tmp / "engine", BuildOptions(backend="onnxruntime", tokens_per_block=4))
    return open_engine(tmp / "engine")


EVERY_PARAMETER = [
    SamplingParams(max_new_tokens=6, logit_bias=((7, 5.0),)),
    SamplingParams(max_new_tokens=6, presence_penalty=1.5),
    SamplingParams(max_new_tokens=6, frequency_penalty=1.0),
    SamplingParams(max_new_tokens=6, repetition_penalty=1.3),
    SamplingParams(max_new_tokens=6, min_tokens=4, stop_token_ids=(2,)),
    SamplingParams(max_new_tokens=6, temperature=0.8, min_p=0.2, top_k=20, seed=5),
]


def test_plain_rows_keep_their_solo_output_beside_every_parameter_and_stay_on_the_device(engine: Any) -> None:
    solo = []
    for p in PROMPTS:
        rt = Runtime(engine, num_blocks=64)
        r = rt.add_request(p, SamplingParams(max_new_tokens=6))
        rt.run()
        solo.append(r.generated)
    spy = Spy(engine)
    rt = Runtime(spy, num_blocks=128)  # type: ignore[arg-type]
    plain = [rt.add_request(p, SamplingParams(max_new_tokens=6)) for p in PROMPTS]
    hosted = [rt.add_request(PROMPTS[i % len(PROMPTS)], params) for i, params in enumerate(EVERY_PARAMETER)]
    rt.run()
    assert [r.generated for r in plain] == solo
    assert all(len(c) <= len(EVERY_PARAMETER) for c in spy.calls) and any(spy.calls)
    assert any(r.generated != solo[i % len(PROMPTS)] for i, r in enumerate(hosted))  # the parameters act
    spy.calls.clear()
    for p in PROMPTS:  # the pipelines left nothing behind: a plain batch brings no row to the host
        rt.add_request(p, SamplingParams(max_new_tokens=3))
    rt.run()
    assert spy.calls and all(c == [] for c in spy.calls)


def test_aiperfs_ignore_eos_with_min_tokens_stays_on_the_device(engine: Any) -> None:
    """AIPerf asks ignore_eos and min_tokens = max_tokens: no stop token is left to mask, so the rows stay plain."""
    spy = Spy(engine)
    rt = Runtime(spy, num_blocks=64)  # type: ignore[arg-type]
    requests = [rt.add_request(p, SamplingParams(max_new_tokens=7, min_tokens=7)) for p in PROMPTS]
    rt.run()
    assert all(len(r.generated) == 7 for r in requests)
    assert spy.calls and all(c == [] for c in spy.calls)


def test_generate_cli_takes_the_penalties_and_logit_bias(cli: Any, tiny_engine: Path, tok: Any) -> None:
    base = ("generate", tiny_engine, "--prompt", "Q: 2+2?\nA:", "--max-new-tokens", "6", "--json")
    plain = json.loads(cli(*base).stdout)["tokens"]
    (z,) = tok.encode("z", add_special_tokens=False)
    forced = json.loads(cli(*base, "--logit-bias", f"{z}=100").stdout)
    assert forced["tokens"] == [z] * 6 and forced["text"] == "zzzzzz"
    penalised = json.loads(cli(*base, "--presence-penalty", "2").stdout)["tokens"]
    assert plain.count(plain[0]) > 1 and penalised.count(penalised[0]) == 1
    bad = cli(*base, "--logit-bias", "z=1")
    assert bad.exit_code != 0 and "ID=BIAS" in bad.stderr
