"""Structured output through the server (serve/structured.py over runtime/guided.py): on the random tiny engine
(noise, the hardest model a grammar can meet) every constrained answer at temperature 1 parses and validates and
ends with finish_reason stop; the request fields map to one constraint, two are refused naming both, one that
does not compile is refused with llguidance's message; constrained rows leave the plain rows of their batch
exactly as they are alone."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import pytest

from tests.serve.helpers import MODEL, Running, error_of, greedy, post

SCHEMA = {  # bounded: a noise model finishes it within max_tokens (unbounded strings and numbers may never end)
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "ok", "tags"],
    "additionalProperties": False,
}
REGEX = "[0-9]{3}-[a-z]{2,5}"  # [0-9]: llguidance's \d is any Unicode decimal digit (Rust's regex crate)
CHOICES = ["red", "green", "blue", "cyan"]
LARK = 'start: term ("+" term)* "=" NUMBER\nterm: "x" | "y"\nNUMBER: /[0-9]{1,3}/'  # vLLM's guided_grammar: Lark
LARK_AS_REGEX = r"[xy](\+[xy])*=[0-9]{1,3}"
FORMATS: dict[str, tuple[dict[str, Any], Callable[[str], None]]] = {
    "json_schema": (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}}},
        lambda text: jsonschema.validate(json.loads(text), SCHEMA),
    ),
    "regex": ({"guided_regex": REGEX}, lambda text: _check(re.fullmatch(REGEX, text) is not None, text)),
    "choice": ({"structured_outputs": {"choice": CHOICES}}, lambda text: _check(text in CHOICES, text)),
    "grammar": ({"guided_grammar": LARK}, lambda text: _check(re.fullmatch(LARK_AS_REGEX, text) is not None, text)),
}


def _check(ok: bool, text: str) -> None:
    assert ok, text


def _run(server: Running, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The answers to `bodies`, sent 16 at a time so that they share the engine's batches."""
    with ThreadPoolExecutor(16) as pool:
        responses = list(pool.map(lambda b: post(server.url, b), bodies))
    for r in responses:
        assert r.status_code == 200, r.text
    return [r.json()["choices"][0] for r in responses]


def _constrained(fmt: str, n: int) -> list[dict[str, Any]]:
    extra, _ = FORMATS[fmt]
    return [
        {"model": MODEL, "prompt": f"Record {i}:", "max_tokens": 100, "temperature": 1.0, "seed": i, **extra}
        for i in range(n)
    ]


def _validity(server: Running, fmt: str, n: int) -> float:
    started = time.perf_counter()
    choices = _run(server, _constrained(fmt, n))
    _, check = FORMATS[fmt]
    for c in choices:
        assert c["finish_reason"] == "stop", c
        check(c["text"])
    return time.perf_counter() - started


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_every_constrained_answer_parses_and_validates(server: Running, fmt: str) -> None:
    _validity(server, fmt, 16)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_a_hundred_answers_per_format_all_valid(server: Running, fmt: str) -> None:
    seconds = _validity(server, fmt, 100)
    print(f"{fmt}: 100/100 valid in {seconds:.1f} s")


def test_json_object_answers_are_objects(server: Running) -> None:
    """`json_object` has no bound: on noise a key can run to max_tokens (finish_reason length, as vLLM's). Every
    answer that ends on its own is a JSON object; one cut short is the prefix of one."""
    bodies = [
        {
            "model": MODEL,
            "prompt": "{",
            "max_tokens": 100,
            "temperature": 1.0,
            "seed": i,
            "response_format": {"type": "json_object"},
        }
        for i in range(16)
    ]
    choices = _run(server, bodies)
    finished = [c for c in choices if c["finish_reason"] == "stop"]
    assert finished  # about half open with "}" at once on noise
    for c in finished:
        assert isinstance(json.loads(c["text"]), dict), c["text"]
    for c in choices:
        assert c["finish_reason"] in ("stop", "length") and c["text"].startswith("{"), c


def test_the_openai_client_constrains_chat(server: Running) -> None:
    client = server.client()
    answer = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "pick"}],
        temperature=1.0,
        seed=3,
        max_tokens=90,  # the prompt is ~30 tokens of max_seq_len 128
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}},
    )
    assert answer.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(answer.choices[0].message.content or ""), SCHEMA)
    regex = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "code"}],
        max_tokens=20,
        extra_body={"guided_regex": REGEX},
    )
    assert re.fullmatch(REGEX, regex.choices[0].message.content or "")
    text = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=3, response_format={"type": "text"}
    )
    assert text.choices[0].finish_reason == "length"  # text: no constraint


@pytest.mark.parametrize(
    ("extra", "param", "needle"),
    [
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "guided_regex and guided_choice"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs.regex",
            "response_format and structured_outputs.regex",
        ),
        ({"guided_regex": "a(b"}, "guided_regex", "unclosed group"),
        ({"guided_json": {"type": "frob"}}, "guided_json", "frob"),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"guided_choice": []}, "guided_choice", "non-empty list"),
        ({"response_format": {"type": "yaml"}}, "response_format", "text, json_object, json_schema"),
        ({"response_format": {"type": "json_schema"}}, "response_format", '"schema"'),
        ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs", "'structural_tag' is not supported"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
        ({"guided_choice": ["a", "b"], "ignore_eos": True}, "ignore_eos", "the grammar decides the end"),
        ({"guided_choice": ["a", "b"], "min_tokens": 2}, "min_tokens", "the grammar decides the end"),
    ],
)
def test_constraints_refused_by_name(server: Running, extra: dict[str, Any], param: str, needle: str) -> None:
    error = error_of(post(server.url, {**greedy(4), "prompt": "x", **extra}), 400)
    assert error["param"] == param and needle in error["message"], error


def test_constrained_rows_leave_plain_rows_as_they_are_alone(server: Running) -> None:
    prompts = ["The build farm", "Once upon a time", "All tests pass"]
    alone = [c["text"] for c in _run(server, [{**greedy(24), "prompt": p} for p in prompts])]
    mixed = [{**greedy(24), "prompt": p} for p in prompts] + _constrained("json_schema", 8) + _constrained("regex", 5)
    together = _run(server, mixed)
    assert [c["text"] for c in together[: len(prompts)]] == alone
