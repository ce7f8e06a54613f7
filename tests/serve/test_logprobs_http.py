"""Logprobs and echo through the server (issue 29): completions' `logprobs`, `echo` (and echo with max_tokens 0),
vLLM's `prompt_logprobs`, chat's `logprobs`/`top_logprobs`, streamed and not, in vLLM's shapes, over HTTP and
through the official openai client; every number equals the log-softmax of the engine's own scorer
(`EngineSession.all_logits` on a second copy of the engine); and the refusals, each naming its field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from tests.runtime.logprob_bound import tolerance
from tests.serve.helpers import MODEL, TIMEOUT, Running, error_of, post, sse_events
from toolchain.engine.api import open_engine
from toolchain.evaluate.engine_eval import EngineSession
from toolchain.runtime.logprobs import log_softmax

PROMPT = [5, 72, 101, 108, 108, 111, 44, 32, 119]  # byte-level tiny tokenizer: one token per byte


class Scorer:
    """The engine's own log-softmax over a whole sequence, from a second copy of the served engine."""

    def __init__(self, engine_dir: Path) -> None:
        self.session = EngineSession(open_engine(engine_dir))

    def __call__(self, seq: list[int]) -> tuple[np.ndarray, float]:
        logits = self.session.all_logits(torch.tensor([seq]))[0]
        return np.stack([log_softmax(row) for row in logits.numpy()]), tolerance(logits)

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        return self.session.greedy([prompt], [n])[0]


@pytest.fixture(scope="module")
def scorer(engine_dir: Path) -> Scorer:
    return Scorer(engine_dir)


def strings(tokenizer: Any, ids: list[int]) -> list[str]:
    return [tokenizer.decode([t]) for t in ids]


def completion(server: Running, **body: Any) -> dict[str, Any]:
    response = post(server.url, {"model": MODEL, "temperature": 0, **body})
    assert response.status_code == 200, response.text
    return dict(response.json()["choices"][0])


def check_completion_logprobs(
    lp: dict[str, Any], seq: list[int], first: int, top: int, scorer: Scorer, tokenizer: Any
) -> None:
    """`lp` covers positions first.. of `seq` (position 0 without a logprob when first is 0)."""
    assert set(lp) == {"text_offset", "token_logprobs", "tokens", "top_logprobs"}
    ref, tol = scorer(seq)
    assert lp["tokens"] == strings(tokenizer, seq[first:])
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
    for k, (value, best) in enumerate(zip(lp["token_logprobs"], lp["top_logprobs"], strict=True)):
        pos = first + k
        if pos == 0:
            assert value is None and best is None
            continue
        assert abs(value - ref[pos - 1, seq[pos]]) <= tol
        order = np.argsort(-ref[pos - 1], kind="stable")[:top]
        expected = {tokenizer.decode([int(seq[pos])]): ref[pos - 1, seq[pos]]}
        expected.update({tokenizer.decode([int(t)]): ref[pos - 1, t] for t in order})
        assert list(best) == list(expected)  # the chosen token first, then the top N, best first
        assert all(abs(best[k] - expected[k]) <= tol for k in best)


def test_completion_logprobs_equal_the_scorer(server: Running, scorer: Scorer, tokenizer: Any) -> None:
    choice = completion(server, prompt=PROMPT, max_tokens=6, logprobs=3)
    out = scorer.greedy(PROMPT, 6)
    assert len(out) == 6 and choice["text"] == tokenizer.decode(out)
    check_completion_logprobs(choice["logprobs"], PROMPT + out, len(PROMPT), 3, scorer, tokenizer)
    assert "prompt_logprobs" not in choice


def test_streamed_completion_logprobs_equal_the_whole_response(server: Running) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 2, "stream": True}
    whole = completion(server, **{k: v for k, v in body.items() if k != "stream"})["logprobs"]
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=TIMEOUT) as response:
        chunks = [e["choices"][0] for e in sse_events(response.iter_lines()) if e["choices"]]
    parts = [c["logprobs"] for c in chunks if c["logprobs"] is not None]
    assert len(parts) == 6 and all(len(c["tokens"]) == 1 for c in parts)
    same = ("tokens", "token_logprobs", "top_logprobs")
    assert {k: [x for c in parts for x in c[k]] for k in same} == {k: whole[k] for k in same}
    sent = 0  # a chunk's text_offset: the text streamed before it (vLLM's previous_text_lens), not the token strings'
    for c in chunks:
        if c["logprobs"] is not None:
            assert c["logprobs"]["text_offset"] == [sent]
        sent += len(c["text"])


def test_echo_puts_the_prompt_and_its_logprobs_first(server: Running, scorer: Scorer, tokenizer: Any) -> None:
    prompt = "Hello, w"
    ids = list(tokenizer.encode(prompt))
    choice = completion(server, prompt=prompt, max_tokens=4, logprobs=2, echo=True)
    out = scorer.greedy(ids, 4)
    assert choice["text"] == prompt + tokenizer.decode(out)
    check_completion_logprobs(choice["logprobs"], ids + out, 0, 2, scorer, tokenizer)
    only = completion(server, prompt=prompt, max_tokens=0, logprobs=2, echo=True)  # lm-eval's scoring request
    assert only["text"] == prompt and only["finish_reason"] == "length"
    assert {k: v[: len(ids)] for k, v in choice["logprobs"].items()} == only["logprobs"]
    plain = completion(server, prompt=prompt, max_tokens=4, echo=True)
    assert plain["text"] == choice["text"] and plain["logprobs"] is None


def test_streamed_echo_sends_the_prompt_with_the_first_token(server: Running) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "logprobs": 1, "echo": True}
    whole = completion(server, **body)
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=TIMEOUT) as r:
        chunks = [e["choices"][0] for e in sse_events(r.iter_lines()) if e["choices"]]
    assert "".join(c["text"] for c in chunks) == whole["text"]
    parts = [c["logprobs"] for c in chunks if c["logprobs"] is not None]
    assert len(parts[0]["tokens"]) == len(PROMPT) + 1  # the prompt's positions and the first token's
    same = ("tokens", "token_logprobs", "top_logprobs")  # text_offset: see the test above
    assert {k: [x for c in parts for x in c[k]] for k in same} == {k: whole["logprobs"][k] for k in same}


def test_prompt_logprobs_in_vllms_shape(server: Running, scorer: Scorer, tokenizer: Any) -> None:
    choice = completion(server, prompt=PROMPT, max_tokens=1, prompt_logprobs=2)
    ref, tol = scorer(PROMPT)
    lps = choice["prompt_logprobs"]
    assert len(lps) == len(PROMPT) and lps[0] is None and choice["logprobs"] is None
    for pos in range(1, len(PROMPT)):
        entries, row = lps[pos], ref[pos - 1]
        chosen = entries[str(PROMPT[pos])]
        assert abs(chosen["logprob"] - row[PROMPT[pos]]) <= tol
        assert chosen["decoded_token"] == tokenizer.decode([PROMPT[pos]])
        assert chosen["rank"] == np.count_nonzero(row >= row[PROMPT[pos]] - tol)
        best = np.argsort(-row, kind="stable")[:2]
        assert set(entries) == {str(PROMPT[pos])} | {str(int(t)) for t in best}
        for rank, t in enumerate(best, start=1):
            assert entries[str(int(t))]["rank"] == rank or int(t) == PROMPT[pos]


def test_chat_logprobs_equal_the_scorer(server: Running, scorer: Scorer, tokenizer: Any) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 5, "temperature": 0, "logprobs": True}
    response = post(server.url, {**body, "top_logprobs": 3}, path="/v1/chat/completions")
    assert response.status_code == 200, response.text
    content = response.json()["choices"][0]["logprobs"]["content"]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = list(tokenizer.encode(text, add_special_tokens=False))
    out = scorer.greedy(prompt, 5)
    ref, tol = scorer(prompt + out)
    assert len(content) == 5
    for k, c in enumerate(content):
        row = ref[len(prompt) + k - 1]
        assert set(c) == {"token", "logprob", "bytes", "top_logprobs"} and c["token"] == tokenizer.decode([out[k]])
        assert c["bytes"] == list(c["token"].encode("utf-8", errors="replace"))
        assert abs(c["logprob"] - row[out[k]]) <= tol
        best = np.argsort(-row, kind="stable")[:3]
        assert [t["token"] for t in c["top_logprobs"]] == strings(tokenizer, [int(t) for t in best])
        assert all(abs(t["logprob"] - row[b]) <= tol for t, b in zip(c["top_logprobs"], best, strict=True))
    plain = post(server.url, {**body, "logprobs": False, "top_logprobs": 0}, path="/v1/chat/completions")
    assert plain.status_code == 200 and plain.json()["choices"][0]["logprobs"] is None  # 0 without logprobs: fine


def test_the_openai_client_reads_them_streamed_and_not(server: Running) -> None:
    client = server.client()
    done = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2)
    lp = done.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and len(lp.token_logprobs) == 5
    streamed = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2, stream=True
    )
    assert [x for c in streamed if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.tokens or []] == (
        lp.tokens
    )
    messages: Any = [{"role": "user", "content": "Hi"}]
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 5 and all(len(c.top_logprobs) == 2 for c in content)
    chunks = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2, stream=True
    )
    parts = [x for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.content or []]
    assert [(p.token, p.logprob, [t.token for t in p.top_logprobs]) for p in parts] == [
        (c.token, c.logprob, [t.token for t in c.top_logprobs]) for c in content
    ]


@pytest.mark.parametrize(
    ("path", "extra", "param", "says"),
    [
        ("/v1/completions", {"logprobs": 21}, "logprobs", "21"),
        ("/v1/completions", {"logprobs": -1}, "logprobs", "-1 (every token"),
        ("/v1/completions", {"prompt_logprobs": 21}, "prompt_logprobs", "between 0 and 20"),
        ("/v1/completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "cannot be streamed"),
        ("/v1/chat/completions", {"top_logprobs": 3}, "top_logprobs", "needs logprobs"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "21"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs", "-1"),
        ("/v1/chat/completions", {"echo": True}, "echo", "/v1/completions"),
    ],
)
def test_refusals_name_the_field(server: Running, path: str, extra: dict[str, Any], param: str, says: str) -> None:
    base: dict[str, Any] = {"model": MODEL, "max_tokens": 2}
    base.update({"messages": [{"role": "user", "content": "Hi"}]} if "chat" in path else {"prompt": PROMPT})
    error = error_of(post(server.url, {**base, **extra}, path=path), 400)
    assert error["param"] == param and says in error["message"], error
