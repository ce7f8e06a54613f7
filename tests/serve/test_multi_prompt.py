"""Several prompts in one /v1/completions request, as vLLM answers them (vllm/entrypoints/openai/completion/
serving.py: one engine request per prompt, one choice per prompt indexed in prompt order, usage summed, streamed
chunks naming their choice's index): the answer equals the prompts sent one by one, greedy, text and token ids alike;
a bad prompt is refused by its index before any runs.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tests.runtime.logprob_bound import tolerance
from tests.serve.helpers import (  # the in-process server helpers (fixtures: tests/serve/fixtures.py)
    MAX_SEQ_LEN,
    MODEL,
    TIMEOUT,
    Running,
    metric,
    post,
    running,
    sse_events,
)

PROMPTS = ["The build farm", "A tiny model said", "Once upon a time, in a kernel"]
MAX_TOKENS = 9


@pytest.fixture(scope="module")
def server(engine_dir: Path) -> Iterator[Running]:
    with running(engine_dir) as r:
        yield r


def greedy(prompt: Any, **more: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **more}


def solo(server: Running, prompts: list[Any]) -> list[dict[str, Any]]:
    """Each prompt alone: its choice and usage."""
    out = []
    for p in prompts:
        response = post(server.url, greedy(p))
        assert response.status_code == 200, response.text
        body = response.json()
        assert len(body["choices"]) == 1
        out.append({"choice": body["choices"][0], "usage": body["usage"]})
    return out


@pytest.mark.parametrize("kind", ["text", "token ids"])
def test_three_prompts_in_one_request_equal_three_alone(
    server: Running,
    tokenizer: Any,
    kind: str,
) -> None:
    prompts: list[Any] = PROMPTS if kind == "text" else [tokenizer.encode(p) for p in PROMPTS]
    alone = solo(server, prompts)
    response = post(server.url, greedy(prompts))
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "text_completion" and body["model"] == MODEL
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    for got, want in zip(body["choices"], alone, strict=True):
        assert got["text"] == want["choice"]["text"] and got["finish_reason"] == want["choice"]["finish_reason"]
        assert got["text"]  # the tiny model says something for each
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert body["usage"][key] == sum(a["usage"][key] for a in alone), key


def test_streamed_chunks_name_their_choice(server: Running) -> None:
    alone = solo(server, PROMPTS)
    body = greedy(PROMPTS, stream=True, stream_options={"include_usage": True})
    text: dict[int, str] = defaultdict(str)
    finish: dict[int, str] = {}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=TIMEOUT) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = list(sse_events(iter(lines)))
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1  # one response, one id
    *parts, tail = chunks
    for c in parts:
        assert c["object"] == "text_completion" and len(c["choices"]) == 1 and c.get("usage") is None, c
        choice = c["choices"][0]
        text[choice["index"]] += choice["text"]
        if choice["finish_reason"] is not None:
            assert choice["index"] not in finish  # once per choice
            finish[choice["index"]] = choice["finish_reason"]
    assert dict(text) == {i: a["choice"]["text"] for i, a in enumerate(alone)}
    assert finish == {i: a["choice"]["finish_reason"] for i, a in enumerate(alone)}
    assert tail["choices"] == [] and tail["usage"]["completion_tokens"] == sum(
        a["usage"]["completion_tokens"] for a in alone
    )
    assert tail["usage"]["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in alone)


def test_a_bad_prompt_is_refused_by_its_index_and_nothing_runs(server: Running) -> None:
    before = server.metrics()
    too_long = [5] * MAX_SEQ_LEN
    response = post(server.url, greedy([[5, 6, 7], too_long, [8, 9]]))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "prompt" and error["message"].startswith("prompt 1 of 3: "), error
    empty = post(server.url, greedy(["fine", ""]))
    assert empty.status_code == 400 and "prompt 1 of 2 is empty" in empty.json()["error"]["message"]
    after = server.metrics()
    assert metric(after, "vllm:request_success_total") == metric(before, "vllm:request_success_total")
    assert metric(after, "trtbuild_rejections_total", reason="bad_request") == (
        metric(before, "trtbuild_rejections_total", reason="bad_request") + 2
    )


def test_each_prompt_is_a_request_in_the_metrics(server: Running) -> None:
    before = server.metrics()
    response = post(server.url, greedy(PROMPTS))
    assert response.status_code == 200
    after = server.metrics()
    grew = metric(after, "vllm:request_success_total") - metric(before, "vllm:request_success_total")
    assert grew == len(PROMPTS)
    assert metric(after, "vllm:num_requests_running") == 0 and metric(after, "vllm:kv_cache_usage_perc") == 0
    usage = response.json()["usage"]
    assert (
        metric(after, "vllm:prompt_tokens_total") - metric(before, "vllm:prompt_tokens_total")
        == (usage["prompt_tokens"])
    )


@pytest.mark.parametrize("max_tokens", [0, 3])
def test_echo_and_logprobs_per_prompt_equal_each_alone(server: Running, tokenizer: Any, max_tokens: int) -> None:
    """lm-eval's loglikelihood requests at batch_size > 1: several id prompts with echo and logprobs; each choice
    (echoed text, prompt and generated logprobs) equals the prompt's own request's."""
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    more = {"echo": True, "logprobs": 1, "max_tokens": max_tokens}
    alone = []
    for p in prompts:
        response = post(server.url, greedy(p, **more))
        assert response.status_code == 200, response.text
        alone.append(response.json()["choices"][0])
    response = post(server.url, greedy(prompts, **more))
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    for i, (got, want) in enumerate(zip(choices, alone, strict=True)):
        assert got["index"] == i
        assert got["text"] == want["text"] and got["text"].startswith(tokenizer.decode(prompts[i]))
        assert got["logprobs"]["tokens"] == want["logprobs"]["tokens"]
        # other packings of the same engine: the float32 bound of tests/runtime/logprob_bound.py (logits ~5 here)
        bound = tolerance(torch.tensor(5.0))
        assert got["logprobs"]["token_logprobs"] == pytest.approx(want["logprobs"]["token_logprobs"], abs=bound)
        assert len(got["logprobs"]["token_logprobs"]) == len(prompts[i]) + max_tokens
    streamed = post(server.url, greedy(prompts, stream=True, **more))
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "stream"
