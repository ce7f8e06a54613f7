"""Text exactly as the model produced it (issue 29, item 5): the completion's text is decode(prompt + output) minus
decode(prompt), streamed or not, for SentencePiece (stories260K's tokenizer: a leading-space marker, byte fallback)
and byte-level BPE (a GPT-2-style tokenizer with merges, trained here). Through the detokenizer and through the
runtime, whose event texts are what the server streams and joins."""

from __future__ import annotations

import random
from typing import Any

import pytest
from fakes import FakeEngine

from toolchain.runtime.detokenizer import IncrementalDetokenizer
from toolchain.runtime.loop import Runtime
from toolchain.runtime.request import SamplingParams, TokenEvent

REPLACEMENT = "\ufffd"
WORDS = ["a", "dog", "named", "Max", "café", "中文", "日本語", "🦙", "naïve", "—", "ok.", "Hello", ",", "\n", "42"]


@pytest.fixture(scope="module")
def sentencepiece(stories: Any) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(stories)


@pytest.fixture(scope="module")
def byte_bpe() -> Any:
    """GPT-2's scheme: byte-level pre-tokenizer (spaces as 'Ġ' inside tokens), BPE merges, byte-level decoder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    rng = random.Random(1)
    tok.train_from_iterator([" ".join(rng.choices(WORDS, k=12)) for _ in range(300)], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")  # type: ignore[no-untyped-call]
    assert any(t.startswith("Ġ") and len(t) > 1 for t in fast.get_vocab())  # merges that carry the space
    return fast


def texts(seed: int) -> tuple[str, str]:
    rng = random.Random(seed)
    return " ".join(rng.choices(WORDS, k=rng.randint(1, 8))), " ".join(rng.choices(WORDS, k=rng.randint(1, 12)))


def case(tok: Any, seed: int) -> tuple[list[int], list[int], str]:
    """A prompt (with the tokenizer's special tokens), an output, and the text the output adds to the prompt's."""
    prompt_text, output_text = texts(seed)
    prompt = list(tok.encode(prompt_text))
    output = list(tok.encode((" " if seed % 2 else "") + output_text, add_special_tokens=False))
    full = tok.decode(prompt + output, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    head = tok.decode(prompt, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert full.startswith(head)
    return prompt, output, full[len(head) :]


@pytest.mark.parametrize("family", ["sentencepiece", "byte_bpe"])
def test_streamed_text_is_what_the_output_adds_to_the_prompt(family: str, request: pytest.FixtureRequest) -> None:
    tok = request.getfixturevalue(family)
    split_characters = 0
    for seed in range(60):
        prompt, output, want = case(tok, seed)
        detok = IncrementalDetokenizer(tok, prompt=prompt)
        pieces = [detok.add(t) for t in output] + [detok.flush()]
        assert "".join(pieces) == want, (seed, pieces)
        assert not any(REPLACEMENT in p for p in pieces), (seed, pieces)  # a character split over tokens waits
        split_characters += pieces.count("")
    assert split_characters > 10  # the cases do split multi-byte characters across tokens


def test_the_first_word_keeps_its_leading_space(sentencepiece: Any) -> None:
    """The issue's case: after '... a dog named' the model's '▁Max' is ' Max', as transformers decodes it."""
    prompt = sentencepiece.encode("Once upon a time there was a dog named")
    output = sentencepiece.encode("Max.", add_special_tokens=False)
    assert sentencepiece.convert_ids_to_tokens(output[0]).startswith("▁")
    detok = IncrementalDetokenizer(sentencepiece, prompt=prompt)
    assert "".join([detok.add(t) for t in output] + [detok.flush()]) == " Max."
    unseeded = IncrementalDetokenizer(sentencepiece)  # what the server sent before
    assert "".join([unseeded.add(t) for t in output] + [unseeded.flush()]) == "Max."


@pytest.mark.parametrize("family", ["sentencepiece", "byte_bpe"])
def test_runtime_events_carry_the_text_the_output_adds(family: str, request: pytest.FixtureRequest) -> None:
    """Through the runtime (what `generate` and the server stream, and what the server joins when not streaming),
    with a stop string that ends the text early."""
    tok = request.getfixturevalue(family)
    for seed in range(0, 40, 3):
        prompt, output, want = case(tok, seed)

        def model(context: Any, p: int = len(prompt), o: list[int] = output) -> int:
            return o[len(context) - p]

        rt = Runtime(FakeEngine(model=model, vocab_size=len(tok)), tokenizer=tok)
        events: list[TokenEvent] = []
        rt.add_request(prompt, SamplingParams(max_new_tokens=len(output)), on_event=events.append)
        rt.run()
        assert "".join(e.text for e in events) == want, seed
        assert not any(REPLACEMENT in e.text for e in events)
        stop = want.strip()[-3:]
        if len(stop) == 3 and REPLACEMENT not in stop:
            rt = Runtime(FakeEngine(model=model, vocab_size=len(tok)), tokenizer=tok)
            events = []
            params = SamplingParams(max_new_tokens=len(output), stop_strings=(stop,))
            rt.add_request(prompt, params, on_event=events.append)
            rt.run()
            assert "".join(e.text for e in events) == want[: want.find(stop)], seed


def test_generate_on_stories_keeps_the_first_words_space(
    cli: Any, stories: Any, sentencepiece: Any, tmp_path: Any
) -> None:
    """The issue's report, end to end: `trtbuild generate` on stories260K (SentencePiece) gives the text
    transformers' greedy output adds to the prompt, its leading space included."""
    import json

    import torch
    from transformers import AutoModelForCausalLM

    from toolchain.checkpoint.convert import convert
    from toolchain.engine.build import BuildOptions, build_engine

    convert(stories, tmp_path / "ckpt")
    build_engine(tmp_path / "ckpt", tmp_path / "engine", BuildOptions(backend="onnxruntime", max_seq_len=64))
    prompt, new = "Once upon a time, there was a dog named", 8
    ids = sentencepiece(prompt, return_tensors="pt").input_ids
    model = AutoModelForCausalLM.from_pretrained(stories, dtype=torch.float32)
    out = model.generate(ids, max_new_tokens=new, do_sample=False)[0].tolist()
    full = sentencepiece.decode(out, skip_special_tokens=True)
    want = full[len(sentencepiece.decode(ids[0].tolist(), skip_special_tokens=True)) :]
    assert want.startswith(" ")  # the model's first token starts a word
    done = cli("generate", tmp_path / "engine", "--prompt", prompt, "--max-new-tokens", str(new), "--json")
    assert done.exit_code == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["tokens"] == out[ids.shape[1] :]
    assert result["text"] == want
