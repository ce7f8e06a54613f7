"""Structured output in the runtime (runtime/guided.py): grammars compile or say why, the mask forbids exactly what
the grammar forbids, a finished grammar allows only EOS, constrained requests end inside their grammar on a noise
engine, and the masks are computed while the engine call runs (not after it)."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from toolchain.checkpoint.tiny import byte_level_tokenizer
from toolchain.engine.api import Limits, StepTokens
from toolchain.engine.contract import Batch
from toolchain.runtime.guided import GrammarError, Guide, compile_grammar
from toolchain.runtime.loop import Runtime
from toolchain.runtime.request import FinishReason, GrammarSpec, Request, SamplingParams

VOCAB = 320  # the tiny Llama's: more ids than the byte-level tokenizer's 259, as real models pad their vocabularies
EOS = 2


class NoiseEngine:
    """Random logits for every row (a fresh draw per call, seeded): what an untrained model looks like to a
    grammar. `delay` seconds per call, and the time each call started and returned, for the overlap test."""

    def __init__(self, delay: float = 0.0, seed: int = 0) -> None:
        self.vocab_size, self.tokens_per_block, self.delay = VOCAB, 4, delay
        self.limits = Limits(max_batch_size=16, max_num_tokens=512, max_seq_len=256, tokens_per_block=4, num_blocks=512)
        self.spec = SimpleNamespace(limits=self.limits)
        self.rng = np.random.default_rng(seed)
        self.calls: list[tuple[float, float]] = []

    def new_kv_cache(self, num_blocks: int) -> torch.Tensor:
        return torch.zeros(1)

    def forward(self, batch: Batch, kv_cache: torch.Tensor) -> np.ndarray:
        return self.rng.normal(size=(len(batch.logits_index), VOCAB)).astype(np.float32)

    def forward_tokens(self, batch: Batch, kv_cache: torch.Tensor, sampled: Sequence[int]) -> StepTokens:
        started = time.perf_counter()
        logits = self.forward(batch, kv_cache)
        if self.delay:
            time.sleep(self.delay)
        self.calls.append((started, time.perf_counter()))
        return StepTokens(logits.argmax(axis=1), {i: logits[i] for i in sampled})


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return byte_level_tokenizer()


def runtime(tokenizer: Any, engine: NoiseEngine | None = None) -> Runtime:
    engine = engine or NoiseEngine()
    return Runtime(engine, engine.limits, tokenizer=tokenizer)  # type: ignore[arg-type]


def constrained(spec: GrammarSpec, seed: int, max_new_tokens: int = 120) -> SamplingParams:
    return SamplingParams(max_new_tokens, 1.0, seed=seed, stop_token_ids=(EOS,), grammar=spec)


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}


def test_compile_errors_carry_llguidance_messages() -> None:
    with pytest.raises(GrammarError, match="unclosed group"):
        compile_grammar(GrammarSpec("regex", "a(b"))
    with pytest.raises(GrammarError, match="frob"):
        compile_grammar(GrammarSpec("json_schema", json.dumps({"type": "frob"})))
    with pytest.raises(GrammarError, match="list of strings"):
        compile_grammar(GrammarSpec("choice", "[]"))
    with pytest.raises(GrammarError, match="unknown grammar kind"):
        compile_grammar(GrammarSpec("xml", ""))
    assert compile_grammar(GrammarSpec("choice", '["a", "b"]'))


def test_a_bad_grammar_fails_its_request_alone(tokenizer: Any) -> None:
    rt = runtime(tokenizer)
    bad = rt.add_request([5, 6], constrained(GrammarSpec("regex", "a(b"), 0))
    good = rt.add_request([5, 6], SamplingParams(4, 0.0))
    rt.run()
    assert bad.finish_reason is FinishReason.ERROR and "does not compile" in (bad.error or "")
    assert good.finish_reason is FinishReason.LENGTH


def test_a_failed_mask_fails_its_rows_not_the_step(tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(self: Guide, pairs: Any, masks: Any) -> None:
        raise RuntimeError("mask size mismatch")

    monkeypatch.setattr(Guide, "_fill", broken)
    rt = runtime(tokenizer)
    constrained_request = rt.add_request([5, 6], constrained(GrammarSpec("regex", "[a-z]+"), 0))
    plain = rt.add_request([5, 7], SamplingParams(4, 0.0))
    rt.run()
    assert constrained_request.finish_reason is FinishReason.ERROR
    assert "mask size mismatch" in (constrained_request.error or "")
    assert plain.finish_reason is FinishReason.LENGTH and len(plain.generated) == 4


def test_mask_allows_what_the_grammar_allows(tokenizer: Any) -> None:
    guide = Guide(tokenizer, VOCAB)
    request = Request([5], constrained(GrammarSpec("regex", "[ab]c"), 0))
    assert guide.add(request) is None
    scores = torch.zeros(VOCAB, dtype=torch.float64)
    guide.mask(request, scores)
    allowed = {tokenizer.decode([i]) for i in torch.nonzero(scores == 0).flatten().tolist()}
    assert allowed == {"a", "b"}
    assert guide.accept(request, tokenizer.convert_tokens_to_ids("a")) is None
    assert guide.accept(request, tokenizer.convert_tokens_to_ids("a")) is not None  # "aa" leaves the grammar
    request = Request([5], constrained(GrammarSpec("regex", "[ab]c"), 0))
    guide.add(request)
    for ch in "bc":
        scores = torch.zeros(VOCAB, dtype=torch.float64)
        guide.mask(request, scores)
        assert guide.accept(request, tokenizer.convert_tokens_to_ids(ch)) is None
    scores = torch.zeros(VOCAB, dtype=torch.float64)
    guide.mask(request, scores)  # complete: only EOS
    assert torch.nonzero(scores == 0).flatten().tolist() == [EOS]
    guide.rollback(request, 1)  # back to "b": "c" is the only way on (issue 30's rejected drafts)
    scores = torch.zeros(VOCAB, dtype=torch.float64)
    guide.mask(request, scores)
    assert torch.nonzero(scores == 0).flatten().tolist() == [tokenizer.convert_tokens_to_ids("c")]
    guide.close()


@pytest.mark.parametrize(
    ("spec", "check"),
    [
        (GrammarSpec("json_schema", json.dumps(SCHEMA)), lambda t: set(json.loads(t)) == {"name", "age", "ok"}),
        # [0-9], not \d: llguidance follows Rust's regex crate, where \d is any Unicode decimal digit (noise finds them)
        (GrammarSpec("regex", "[0-9]{3}-[a-z]{2,5}"), lambda t: re.fullmatch("[0-9]{3}-[a-z]{2,5}", t)),
        (GrammarSpec("choice", '["red", "green", "blue", "cyan"]'), lambda t: t in {"red", "green", "blue", "cyan"}),
        (GrammarSpec("grammar", 'start: "x" ("+" "x")* "=" /[0-9]/'), lambda t: re.fullmatch(r"x(\+x)*=[0-9]", t)),
    ],
    ids=["json_schema", "regex", "choice", "lark"],
)
def test_noise_stays_inside_the_grammar(tokenizer: Any, spec: GrammarSpec, check: Any) -> None:
    rt = runtime(tokenizer)
    requests = [rt.add_request([1, 60 + i], constrained(spec, seed=i)) for i in range(16)]
    plain = rt.add_request([1, 70], SamplingParams(8, 0.0))
    rt.run()
    for r in requests:
        assert r.finish_reason is FinishReason.STOP_TOKEN and r.generated[-1] == EOS, r.error
        text = tokenizer.decode(r.generated[:-1])
        assert check(text), text
    assert plain.finish_reason is FinishReason.LENGTH and len(plain.generated) == 8


def test_masks_are_computed_while_the_engine_runs(tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A slow engine (20 ms a call) and a mask fill that records when it ran: every fill starts after its step's
    engine call started and before it returned, i.e. on the worker thread beside the engine call."""
    engine = NoiseEngine(delay=0.02)
    rt = runtime(tokenizer, engine)
    fills: list[tuple[float, str]] = []
    original = Guide._fill

    def recording(self: Guide, pairs: Any, masks: Any) -> None:
        fills.append((time.perf_counter(), threading.current_thread().name))
        original(self, pairs, masks)

    monkeypatch.setattr(Guide, "_fill", recording)
    rt.add_request([1, 2], constrained(GrammarSpec("regex", "[a-z]{5}"), 0))
    rt.run()
    assert len(fills) == 6  # five letters and the EOS
    assert all(name.startswith("trtbuild-guide") for _, name in fills)
    # the i-th fill belongs to the i-th engine call after the prompt's: it began before that call returned
    calls = engine.calls[-len(fills) :]
    assert all(when < returned for (when, _), (_, returned) in zip(fills, calls, strict=True))
    rt.guide.close()


def test_a_sentencepiece_tokenizer_drives_a_grammar(stories: Path) -> None:
    """stories260K (SentencePiece, byte fallback): its pieces ("▁the") and byte tokens (<0x7B>) both reach the
    matcher; a regex answer made of pieces and single bytes is accepted and the grammar then allows only EOS."""
    from transformers import AutoTokenizer

    sp = AutoTokenizer.from_pretrained(stories)
    guide = Guide(sp, len(sp))
    request = Request(
        [1], SamplingParams(20, 1.0, stop_token_ids=(sp.eos_token_id,), grammar=GrammarSpec("regex", "[0-9]{2} cats"))
    )
    assert guide.add(request) is None
    scores = torch.zeros(len(sp), dtype=torch.float64)
    guide.mask(request, scores)
    allowed = {sp.convert_ids_to_tokens(i) for i in torch.nonzero(scores == 0).flatten().tolist()}
    assert "<0x34>" in allowed and "▁the" not in allowed  # the digit 4 as a byte token; no word may start it
    tokens = sp.encode("42 cats", add_special_tokens=False)
    assert sp.convert_ids_to_tokens(tokens[0]) == "▁"  # SentencePiece's dummy prefix: not part of a continuation
    for token in tokens[1:]:  # "4" "2" "▁c" "at" "s"
        scores = torch.zeros(len(sp), dtype=torch.float64)
        guide.mask(request, scores)
        assert scores[token] == 0, sp.convert_ids_to_tokens(token)
        assert guide.accept(request, token) is None
    scores = torch.zeros(len(sp), dtype=torch.float64)
    guide.mask(request, scores)
    assert torch.nonzero(scores == 0).flatten().tolist() == [sp.eos_token_id]
    guide.close()


def test_a_tokenizer_llguidance_refuses_is_refused_before_admission(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Built once (the server's warm-up calls prepare()), a refusal remembered rather than retried per request, and
    the server's check turns it into a 400 naming the constraint's field instead of a failed request."""
    import llguidance.hf

    from toolchain.serve.protocol import ApiError, CompletionRequest
    from toolchain.serve.structured import grammar_spec

    calls = []

    def refuse(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        raise ValueError("Only fast tokenizers are supported")

    monkeypatch.setattr(llguidance.hf, "from_tokenizer", refuse)
    guide = Guide(tokenizer, 320)
    assert "cannot drive a grammar" in (guide.prepare() or "")
    assert "fast tokenizers" in (guide.check(GrammarSpec("regex", "a+")) or "")
    body = CompletionRequest(model="m", prompt="x", guided_regex="a+")
    with pytest.raises(ApiError) as refused:
        grammar_spec(body, guide)
    assert refused.value.status == 400 and refused.value.param == "guided_regex"
    assert len(calls) == 1  # not retried
