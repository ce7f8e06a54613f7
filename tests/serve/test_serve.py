"""`trtbuild serve` end to end on loopback: the official `openai` client, 64 concurrent streams equal to greedy
generation alone, a disconnect that frees its KV blocks, API keys and 401/429/400 in OpenAI's error shape, drain on
SIGTERM and the refusals to start (through the real CLI in a subprocess), Prometheus metrics that add up, and the
probes.

Servers run in this process (uvicorn in a thread, on a socket bound here to 127.0.0.1:0) except where a signal or
an exit code is the subject. Every client call has a timeout and every wait a deadline, so no test can hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.serve.helpers import (
    KEYS,
    MAX_SEQ_LEN,
    MODEL,
    TIMEOUT,
    Running,
    error_of,
    free_port,
    greedy,
    metric,
    post,
    running,
    sse_events,
    status_of,
    wait_until,
)
from toolchain import __version__
from toolchain.engine.api import load_tokenizer, open_engine
from toolchain.runtime.llm_engine import LLMEngine
from toolchain.runtime.request import SamplingParams
from toolchain.serve import ENGINE_HEADER
from toolchain.serve.app import start_warm_up
from toolchain.serve.protocol import ACCEPTED_UNUSED


# -- 1. the official openai client ------------------------------------------------------------------------------
def test_completions_through_the_openai_client(server: Running, tokenizer: Any, engine_sha256: str) -> None:
    client, prompt = server.client(), "The build farm"
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert raw.headers[ENGINE_HEADER] == engine_sha256
    done = raw.parse()
    assert done.model == MODEL and done.choices[0].finish_reason == "length" and done.choices[0].text
    assert done.usage is not None
    assert done.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert done.usage.completion_tokens == 12
    assert done.usage.total_tokens == done.usage.prompt_tokens + 12

    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == done.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage == done.usage
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_text_is_what_the_tokens_add_to_the_prompt(server: Running, tokenizer: Any) -> None:
    """Issue 29 item 5 through the server: for random prompts (multi-byte characters split over byte tokens), the
    text, streamed or not, is decode(prompt + output) minus decode(prompt)."""
    rng = random.Random(29)
    words = ["build", "farm", "café", "中文", "🦙", "naïve", "—", "ok.", "\n", "42", " "]
    for _ in range(6):
        prompt = " ".join(rng.choices(words, k=rng.randint(1, 6)))
        ids = tokenizer.encode(prompt)
        body = {**greedy(10), "prompt": prompt}
        done = post(server.url, body).json()
        [ref] = server.state.llm.generate([ids], SamplingParams(max_new_tokens=10, temperature=0))
        assert done["usage"]["completion_tokens"] == len(ref.token_ids)
        full = tokenizer.decode(ids + ref.token_ids, skip_special_tokens=True)
        head = tokenizer.decode(ids, skip_special_tokens=True)
        assert full.startswith(head) and done["choices"][0]["text"] == full[len(head) :], prompt
        with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=TIMEOUT) as r:
            chunks = [e["choices"][0]["text"] for e in sse_events(r.iter_lines()) if e["choices"]]
        assert "".join(chunks) == done["choices"][0]["text"]  # (the random model writes invalid bytes too: U+FFFD
        # in its text is what a full decode gives; tests/runtime/test_detokenize_text.py streams valid text)


def test_chat_completions_through_the_openai_client(server: Running, tokenizer: Any, engine_sha256: str) -> None:
    client = server.client()
    messages: Any = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a GPU."}]
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=9, temperature=0)
    assert raw.headers[ENGINE_HEADER] == engine_sha256
    done = raw.parse()
    choice = done.choices[0]
    assert choice.message.role == "assistant" and choice.message.content and choice.finish_reason == "length"
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt_ids = prompt_ids["input_ids"] if hasattr(prompt_ids, "keys") else prompt_ids
    assert done.usage is not None
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (len(prompt_ids), 9)

    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=9,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == choice.message.content
    assert with_choices[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage == done.usage


def test_models_list_names_the_served_model_and_engine(server: Running, engine_sha256: str) -> None:
    raw = server.client().models.with_raw_response.list()
    assert raw.headers[ENGINE_HEADER] == engine_sha256
    models = raw.parse().data
    assert [m.id for m in models] == [MODEL]
    extra = models[0].model_extra or {}
    assert extra["engine_sha256"] == engine_sha256 and extra["max_model_len"] == MAX_SEQ_LEN
    manifest = json.loads((server.state.spec.engine_dir / "manifest.json").read_text())
    built = datetime.fromisoformat(manifest["created_utc"]).timestamp()
    assert models[0].created == int(built) > 0  # the engine's build time, not 0
    assert "quantization" not in extra  # unquantized: TensorRT-LLM's default block (group_size 128...) is not shown
    assert server.state.spec.quantization  # ... although the engine's config has one


def test_accepted_fields_that_are_not_acted_on_are_still_accepted(server: Running) -> None:
    """Extra fields are refused by name (BAD_REQUESTS), except the ones clients send today that the server
    accepts without acting on (protocol.ACCEPTED_UNUSED: the lead decides each); lm-eval's and AIPerf's requests
    go through."""
    chat_only = {"tools", "tool_choice", "parallel_tool_calls", "top_logprobs"}
    for name in ACCEPTED_UNUSED:
        path, body = (
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
            if name in chat_only
            else ("/v1/completions", {"prompt": "hi"})
        )
        response = post(server.url, {**greedy(1), **body, name: None}, path=path)
        assert response.status_code == 200, (name, response.text)
    lm_eval = {**greedy(2), "prompt": "Q: 2+2?\nA:", "stop": ["\n"], "seed": 1234}
    aiperf = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "min_tokens": 2,
    }
    assert post(server.url, lm_eval).status_code == 200
    assert post(server.url, aiperf, path="/v1/chat/completions").status_code == 200


# -- vLLM's /tokenize and /detokenize, /version -----------------------------------------------------------------
def test_tokenize_and_detokenize_in_vllms_shapes(server: Running, tokenizer: Any) -> None:
    text = "The build farm 🦙"
    ids = tokenizer.encode(text)
    out = post(server.url, {"model": MODEL, "prompt": text}, path="/tokenize")
    assert out.status_code == 200, out.text
    assert out.json() == {"count": len(ids), "max_model_len": MAX_SEQ_LEN, "tokens": ids}
    bare = post(server.url, {"prompt": text, "add_special_tokens": False, "return_token_strs": True}, path="/tokenize")
    assert bare.json()["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    assert bare.json()["token_strs"] == tokenizer.convert_ids_to_tokens(bare.json()["tokens"])
    back = post(server.url, {"model": MODEL, "tokens": bare.json()["tokens"]}, path="/detokenize")
    assert back.status_code == 200 and back.json() == {"prompt": text}

    messages = [{"role": "user", "content": "hi there"}]
    chat = post(server.url, {"messages": messages}, path="/tokenize").json()
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt_ids = prompt_ids["input_ids"] if hasattr(prompt_ids, "keys") else prompt_ids
    assert chat["tokens"] == list(prompt_ids)  # what /v1/chat/completions feeds the model
    served = server.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=1)  # type: ignore[arg-type]
    assert served.usage is not None and served.usage.prompt_tokens == chat["count"]
    no_gen = post(server.url, {"messages": messages, "add_generation_prompt": False}, path="/tokenize").json()
    assert no_gen["count"] < chat["count"]


def test_tokenize_detokenize_and_version_need_a_key(keyed: Running, engine_sha256: str) -> None:
    for path, body in [("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [5]})]:
        assert error_of(post(keyed.url, body, path=path), 401)["type"] == "authentication_error"
        assert post(keyed.url, body, key=KEYS["alice"], path=path).status_code == 200
    assert httpx.get(f"{keyed.url}/version", timeout=TIMEOUT).status_code == 401
    version = httpx.get(f"{keyed.url}/version", headers={"Authorization": f"Bearer {KEYS['alice']}"}, timeout=TIMEOUT)
    assert version.status_code == 200
    body = version.json()
    manifest = json.loads((keyed.state.spec.engine_dir / "manifest.json").read_text())
    assert body["version"] == __version__
    assert body["engine"]["sha256"] == engine_sha256
    assert body["engine"]["created_utc"] == manifest["created_utc"]
    assert body["engine"]["built_by"]["version"] == manifest["toolchain"]["version"]


# -- 2. concurrency ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_64_concurrent_streams_each_equal_greedy_alone(server: Running, engine_dir: Path, tokenizer: Any) -> None:
    prompts = [f"Request {i}: {'xyzzy' * (i % 5)} build {i * 7919 % 1000}" for i in range(64)]
    new = 12
    peak = [0]
    observe = server.state.llm.on_step
    assert observe is not None

    def on_step(rt: Any) -> None:
        peak[0] = max(peak[0], rt.num_running)
        observe(rt)

    server.state.llm.on_step = on_step
    try:
        results = asyncio.run(asyncio.wait_for(_stream_all(server, prompts, new), 2 * TIMEOUT))
    finally:
        server.state.llm.on_step = observe
    assert peak[0] > 1, "the 64 requests never shared a batch"

    eos = int(tokenizer.eos_token_id)
    with LLMEngine(open_engine(engine_dir), load_tokenizer(engine_dir)) as llm:
        params = SamplingParams(max_new_tokens=new, temperature=0, stop_token_ids=(eos,))
        alone = [llm.generate([p], params)[0] for p in prompts]
    for prompt, (text, finish, completion_tokens), ref in zip(prompts, results, alone, strict=True):
        assert completion_tokens == len(ref.token_ids), prompt
        assert finish == {"length": "length", "stop_token": "stop"}[ref.finish_reason], prompt
        assert text == ref.text, prompt
    assert len({r[0] for r in results}) > 1, "every prompt gave the same text: the comparison proves little"


async def _stream_all(server: Running, prompts: list[str], new: int) -> list[tuple[str, str, int]]:
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)

    async def one(prompt: str) -> tuple[str, str, int]:
        stream = await client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=new,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, finish, used = [], "", -1
        async for chunk in stream:
            if chunk.choices:
                text.append(chunk.choices[0].text)
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage is not None:
                used = chunk.usage.completion_tokens
        return "".join(text), finish, used

    async with client:
        return await asyncio.gather(*(one(p) for p in prompts))


# -- 3. a client that goes away ---------------------------------------------------------------------------------
def test_a_disconnected_stream_is_aborted_and_frees_its_blocks(server: Running) -> None:
    before = server.metrics()
    body = {**greedy(MAX_SEQ_LEN - 16), "prompt": "disconnect me", "stream": True}
    # On a loaded machine a free-running engine loop can finish the whole request before the client reads two
    # events. From its third step the loop waits for the client: up to 0.2 s a step until it has read two events
    # (a token need not make an event: the detokenizer may hold text back), then until it has left.
    llm, observe, steps = server.state.llm, server.state.llm.on_step, [0]
    read_two, release = threading.Event(), threading.Event()

    def held(rt: Any) -> None:
        if observe is not None:
            observe(rt)
        steps[0] += 1
        if steps[0] >= 3 and read_two.wait(0.2):
            release.wait(TIMEOUT)

    llm.on_step = held
    try:
        with (
            httpx.Client(timeout=TIMEOUT) as http,
            http.stream("POST", f"{server.url}/v1/completions", json=body) as response,
        ):
            assert response.status_code == 200
            for n, _ in enumerate(sse_events(response.iter_lines()), 1):
                if n == 2:
                    read_two.set()
                    break
            assert server.state.llm.runtime.blocks.num_used > 0  # still generating when the client leaves
    finally:
        release.set()
        llm.on_step = observe

    def freed() -> bool:
        text = server.metrics()
        return metric(text, "vllm:kv_cache_usage_perc") == 0 and metric(text, "vllm:num_requests_running") == 0

    wait_until(freed, "the KV cache to be empty after the disconnect", timeout=10)
    assert server.state.llm.runtime.blocks.num_used == 0 and server.state.inflight == 0
    after = server.metrics()
    aborted = metric(after, "vllm:request_success_total", finished_reason="abort")
    assert aborted == metric(before, "vllm:request_success_total", finished_reason="abort") + 1
    assert metric(after, "vllm:request_success_total", finished_reason="length") == metric(
        before, "vllm:request_success_total", finished_reason="length"
    )


# -- 4. keys, limits, bad requests ------------------------------------------------------------------------------
def test_requests_without_a_valid_key_get_401(keyed: Running, engine_sha256: str) -> None:
    body = {**greedy(2), "prompt": "hello"}
    for key in (None, "sk-wrong", KEYS["alice"] + "x"):
        response = post(keyed.url, body, key)
        assert error_of(response, 401)["type"] == "authentication_error"
        assert response.headers[ENGINE_HEADER] == engine_sha256
    with pytest.raises(openai.AuthenticationError):
        keyed.client("sk-wrong").models.list()
    assert post(keyed.url, body, KEYS["alice"]).status_code == 200
    assert keyed.client(KEYS["alice"]).models.list().data[0].id == MODEL


def test_requests_per_minute_limit_gives_429_with_retry_after(keyed: Running) -> None:
    body = {**greedy(2), "prompt": "rpm"}
    assert [post(keyed.url, body, KEYS["slow"]).status_code for _ in range(2)] == [200, 200]
    third = post(keyed.url, body, KEYS["slow"])
    assert error_of(third, 429)["type"] == "rate_limit_error"
    assert int(third.headers["Retry-After"]) >= 1
    assert post(keyed.url, body, KEYS["alice"]).status_code == 200  # limits are per key


def test_tokens_per_minute_limit_reserves_prompt_plus_max_tokens(keyed: Running) -> None:
    prompt = "abcdefghij"  # 10 byte tokens; 10 + 60 = 70 of the key's 100 tokens a minute
    assert post(keyed.url, {**greedy(60), "prompt": prompt}, KEYS["thrifty"]).status_code == 200
    second = post(keyed.url, {**greedy(60), "prompt": prompt}, KEYS["thrifty"])
    assert error_of(second, 429)["type"] == "rate_limit_error"
    assert int(second.headers["Retry-After"]) >= 1
    never = post(keyed.url, {**greedy(100), "prompt": prompt}, KEYS["thrifty"])  # 110 > 100: no wait helps
    assert error_of(never, 400)["param"] == "max_tokens"
    assert post(keyed.url, {**greedy(5), "prompt": prompt}, KEYS["thrifty"]).status_code == 200  # 15 fit


def test_a_full_queue_gives_429_and_costs_no_rate_limit(one_at_a_time: Path, keys_file: Path) -> None:
    with running(one_at_a_time, api_keys=keys_file, max_queue=1) as small:
        first, second = _Streamed(), _Streamed()
        long = {**greedy(100), "prompt": "queue"}
        readers = [
            threading.Thread(target=s.read, args=(small.url + "/v1/completions", long, KEYS["alice"]))
            for s in (first, second)
        ]
        readers[0].start()
        assert first.started.wait(TIMEOUT)
        readers[1].start()
        wait_until(lambda: small.state.llm.runtime.num_waiting == 1, "the second request to wait")
        short = {**greedy(2), "prompt": "no room"}
        # hold the step loop while the queue is full: on a busy machine the first request could otherwise finish
        # and the second leave the queue between two of these posts (the queue check itself needs no loop)
        hold, observe = threading.Event(), small.state.llm.on_step

        def held(rt: Any) -> None:
            if observe is not None:
                observe(rt)
            hold.wait(TIMEOUT)

        small.state.llm.on_step = held
        try:
            for key in ("alice", "slow", "slow"):  # `slow` may make 2 requests a minute: refusals must not count
                full = post(small.url, short, KEYS[key])
                assert error_of(full, 429)["type"] == "overloaded" and int(full.headers["Retry-After"]) >= 1
        finally:
            small.state.llm.on_step = observe
            hold.set()
        for reader in readers:
            reader.join(TIMEOUT)
        assert [(s.finish, s.usage["completion_tokens"]) for s in (first, second)] == [("length", 100)] * 2
        assert [post(small.url, short, KEYS["slow"]).status_code for _ in range(2)] == [200, 200]
        statuses = asyncio.run(asyncio.wait_for(_burst(small.url, 12), 2 * TIMEOUT))
        text = small.metrics()
    codes = [code for code, _, _ in statuses]
    assert set(codes) <= {200, 429} and codes.count(429) >= 1 and codes.count(200) >= 1, codes
    for code, retry_after, error_type in statuses:
        if code == 429:
            assert int(retry_after) >= 1 and error_type == "overloaded"
    assert metric(text, "trtbuild_rejections_total", reason="queue") == 3 + codes.count(429)
    assert metric(text, "trtbuild_rejections_total", reason="rate") == 0


async def _burst(url: str, n: int) -> list[tuple[int, str, str]]:
    """n concurrent requests: each one's status, Retry-After and error type."""
    headers = {"Authorization": f"Bearer {KEYS['alice']}"}
    async with httpx.AsyncClient(timeout=TIMEOUT, headers=headers) as http:

        async def one(i: int) -> tuple[int, str, str]:
            r = await http.post(f"{url}/v1/completions", json={**greedy(40), "prompt": f"burst {i}"})
            kind = r.json()["error"]["type"] if r.status_code != 200 else ""
            return r.status_code, r.headers.get("Retry-After", ""), kind

        return await asyncio.gather(*(one(i) for i in range(n)))


def test_extreme_sampling_parameters_fail_no_one_else(server: Running) -> None:
    """A sampling failure on the step loop ends every request in the batch: the server must not let one in."""
    before = server.metrics()
    innocent = _Streamed()
    long = {**greedy(100), "prompt": "innocent"}
    reader = threading.Thread(target=innocent.read, args=(server.url + "/v1/completions", long))
    reader.start()
    assert innocent.started.wait(TIMEOUT)
    tiny = post(server.url, {**greedy(5), "prompt": "cold", "temperature": 5e-324})  # greedy, as in vLLM
    assert tiny.status_code == 200 and tiny.json()["choices"][0]["finish_reason"] == "length", tiny.text
    huge_seed = post(server.url, {**greedy(5), "prompt": "seed", "temperature": 1.0, "seed": 2**64})
    assert error_of(huge_seed, 400)["param"] == "seed"
    reader.join(TIMEOUT)
    alone = post(server.url, {**greedy(100), "prompt": "innocent"}).json()  # greedy: the same tokens, undisturbed
    assert (innocent.finish, innocent.usage) == (alone["choices"][0]["finish_reason"], alone["usage"])
    errors = "vllm:request_success_total"
    assert metric(server.metrics(), errors, finished_reason="error") == metric(before, errors, finished_reason="error")


def test_a_request_past_its_timeout_gets_408_and_frees_its_blocks(engine_dir: Path) -> None:
    with running(engine_dir, request_timeout=0.01) as hasty:  # 100 tokens take far longer than 10 ms
        late = post(hasty.url, {**greedy(100), "prompt": "late"})
        assert error_of(late, 408)["type"] == "timeout"
        with httpx.stream(
            "POST",
            f"{hasty.url}/v1/completions",
            json={**greedy(100), "prompt": "late", "stream": True},
            timeout=TIMEOUT,
        ) as r:
            events = list(sse_events(r.iter_lines()))
        assert r.status_code == 200 and events[-1]["error"]["code"] == 408  # headers were sent: an error event
        wait_until(lambda: hasty.state.inflight == 0, "the timed-out requests to end", 10)
        assert hasty.state.llm.runtime.blocks.num_used == 0
        text = hasty.metrics()
    assert metric(text, "trtbuild_rejections_total", reason="timeout") == 2
    assert metric(text, "vllm:request_success_total", finished_reason="abort") == 2


BAD_REQUESTS: list[tuple[str, str, Any, str | None, str]] = [  # what, path, body, error.param, in message
    ("malformed JSON", "/v1/completions", b'{"model": "tiny-serve", "prompt": "x",', None, "JSON"),
    ("not an object", "/v1/completions", [1, 2], "body", "body"),
    ("missing prompt", "/v1/completions", {"model": MODEL}, "prompt", "prompt"),
    ("max_tokens 'x'", "/v1/completions", {**greedy(1), "prompt": "x", "max_tokens": "x"}, "max_tokens", ""),
    ("max_tokens 0", "/v1/completions", {**greedy(0), "prompt": "x"}, "max_tokens", ""),
    ("max_tokens -3", "/v1/completions", {**greedy(-3), "prompt": "x"}, "max_tokens", ""),
    ("beyond max_seq_len", "/v1/completions", {**greedy(MAX_SEQ_LEN), "prompt": "x"}, "max_tokens", ""),
    ("prompt too long", "/v1/completions", {**greedy(1), "prompt": "y" * MAX_SEQ_LEN}, "prompt", ""),
    ("token outside vocab", "/v1/completions", {**greedy(1), "prompt": [5, 10**6]}, "prompt", "vocabulary"),
    ("temperature type", "/v1/completions", {**greedy(1), "prompt": "x", "temperature": "hot"}, "temperature", ""),
    ("seed beyond 64 bits", "/v1/completions", {**greedy(1), "prompt": "x", "seed": 2**64}, "seed", ""),
    ("negative seed", "/v1/completions", {**greedy(1), "prompt": "x", "seed": -1}, "seed", ""),
    ("unknown model", "/v1/completions", {**greedy(1), "model": "gpt-9", "prompt": "x"}, "model", "gpt-9"),
    ("n=2", "/v1/completions", {**greedy(1), "prompt": "x", "n": 2}, "n", ""),
    ("empty messages", "/v1/chat/completions", {**greedy(1), "messages": []}, "messages", ""),
    ("unknown role", "/v1/chat/completions", {**greedy(1), "messages": [{"role": "robot"}]}, "messages.0.role", ""),
    ("misspelt field", "/v1/completions", {**greedy(1), "prompt": "x", "max_token": 5}, "max_token", "unknown field"),
    ("unknown chat field", "/v1/chat/completions", {**greedy(1), "messages": [], "temprature": 0}, "temprature", ""),
    ("tokenize both", "/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "prompt", "one"),
    ("tokenize neither", "/tokenize", {"model": MODEL}, "prompt", "exactly one"),
    ("tokenize unknown field", "/tokenize", {"prompt": "x", "add_bos": True}, "add_bos", "add_special_tokens"),
    ("tokenize other model", "/tokenize", {"model": "gpt-9", "prompt": "x"}, "model", "gpt-9"),
    ("detokenize outside vocab", "/detokenize", {"tokens": [5, 10**6]}, "tokens", "vocabulary"),
    ("detokenize not ids", "/detokenize", {"tokens": "hello"}, "tokens", ""),
    (
        "unknown stream option",
        "/v1/completions",
        {**greedy(1), "prompt": "x", "stream": True, "stream_options": {"continuous_usage_stats": True}},
        "stream_options.continuous_usage_stats",
        "unknown field",
    ),
    (
        "stream_options without stream",
        "/v1/completions",
        {**greedy(1), "prompt": "x", "stream_options": {"include_usage": True}},
        "stream_options",
        "stream: true",
    ),
    (
        "unknown message field",
        "/v1/chat/completions",
        {**greedy(1), "messages": [{"role": "user", "content": "x", "bogus": 1}]},
        "messages.0.bogus",
        "unknown field",
    ),
    (
        "message audio",
        "/v1/chat/completions",
        {**greedy(1), "messages": [{"role": "user", "content": "x", "audio": {"id": "a"}}]},
        "messages.audio",
        "text",
    ),
]


class LogLines(logging.Handler):
    """The server's JSON log lines (logger trtbuild.serve), parsed."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(ValueError):
            self.lines.append(json.loads(record.getMessage()))


@contextlib.contextmanager
def server_log() -> Iterator[LogLines]:
    logger, handler = logging.getLogger("trtbuild.serve"), LogLines()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def test_bad_requests_get_400_naming_the_field_and_the_server_goes_on(server: Running) -> None:
    before = server.metrics()
    with server_log() as logged:
        for what, path, body, param, said in BAD_REQUESTS:
            response = post(server.url, body, path=path)
            assert response.status_code == 400, (what, response.text)
            error = error_of(response, 400)
            assert error["type"] == "invalid_request_error", what
            assert error["param"] == param, (what, error)
            assert said in error["message"], (what, error)
    # one log line per rejected request, as per admitted one (docs/serving.md), naming the field
    refused = [line for line in logged.lines if line.get("event") == "request"]
    assert [(line["status"], line["param"]) for line in refused] == [(400, b[3]) for b in BAD_REQUESTS]
    after = server.metrics()
    for name, labels, more in [
        ("trtbuild_rejections_total", {"reason": "bad_request"}, len(BAD_REQUESTS)),
        ("vllm:request_success_total", {}, 0),  # none of them reached the engine
    ]:
        assert metric(after, name, **labels) == metric(before, name, **labels) + more, name
    ok = post(server.url, {**greedy(3), "prompt": "still here"})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


# -- 5. the CLI: drain on SIGTERM, refusals to start ------------------------------------------------------------
def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "toolchain", "serve", *args]


@pytest.mark.slow
def test_sigterm_drains_in_flight_requests_then_exits_0(engine_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "stderr.txt"
    with log.open("w") as stderr:
        proc = subprocess.Popen(
            _cli(str(engine_dir), "--port", str(port), "--drain-timeout", "120", "--served-model-name", MODEL),
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
    try:
        wait_until(
            lambda: proc.poll() is not None or status_of(f"{url}/ready") == 200, "the CLI server to be ready", 60
        )
        assert proc.poll() is None, log.read_text()
        new = MAX_SEQ_LEN - 8
        streams = [_Streamed() for _ in range(8)]  # a batch of 8: long enough to still run after the refusal
        readers = [
            threading.Thread(
                target=s.read,
                args=(f"{url}/v1/completions", {**greedy(new), "prompt": f"drain {i}"}),
            )
            for i, s in enumerate(streams)
        ]
        for reader in readers:
            reader.start()
        assert all(s.started.wait(TIMEOUT) for s in streams), "the long requests never started streaming"
        proc.send_signal(signal.SIGTERM)
        wait_until(lambda: status_of(f"{url}/ready") == 503, "/ready to say 503 while draining", 10)
        refused = post(url, {**greedy(2), "prompt": "too late"})
        refused_at = time.monotonic()
        assert error_of(refused, 503)["type"] == "unavailable" and refused.headers["Retry-After"] == "1"
        for reader in readers:
            reader.join(TIMEOUT)
        assert [(s.finish, s.usage["completion_tokens"]) for s in streams] == [("length", new)] * len(streams)
        assert max(s.ended_at for s in streams) > refused_at, "all had ended before the refusal: nothing drained"
        assert proc.wait(timeout=30) == 0
        assert "draining: 8 request(s) in flight" in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


@dataclass
class _Streamed:
    """One streaming completion read to its end on a thread: `started` is set at its first event."""

    finish: str = ""
    usage: Any = None
    ended_at: float = 0.0
    started: threading.Event = field(default_factory=threading.Event)

    def read(self, url: str, body: dict[str, Any], key: str | None = None) -> None:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.Client(timeout=TIMEOUT) as http, http.stream("POST", url, json=body, headers=headers) as response:
            for event in sse_events(response.iter_lines()):
                self.started.set()
                if event.get("choices"):
                    self.finish = event["choices"][0]["finish_reason"] or self.finish
                self.usage = event.get("usage") or self.usage
        self.ended_at = time.monotonic()


@pytest.mark.slow
def test_the_cli_refuses_to_start_unsafe_or_tampered(engine_dir: Path, tmp_path: Path) -> None:
    tampered = tmp_path / "tampered"
    shutil.copytree(engine_dir, tampered)
    with (tampered / "model.onnx").open("ab") as f:
        f.write(b"\0")
    procs = [  # both at once: most of each run is starting Python
        subprocess.Popen(
            _cli(str(engine_dir), "--host", "0.0.0.0", "--port", str(free_port())),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        ),
        subprocess.Popen(
            _cli(str(tampered), "--port", str(free_port())), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        ),
    ]
    try:
        outputs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for proc, (_, stderr), code in zip(procs, outputs, (1, 4), strict=True):  # 4: integrity.EXIT_CODE
        assert proc.returncode == code, stderr
        lines = [ln for ln in stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("error:"), stderr
    assert "--api-keys" in outputs[0][1] and "0.0.0.0" in outputs[0][1]
    assert "model.onnx" in outputs[1][1] and "manifest" in outputs[1][1]


# -- 6. metrics -------------------------------------------------------------------------------------------------
def test_metrics_add_up_to_what_was_served(engine_dir: Path, keys_file: Path, engine_sha256: str) -> None:
    with running(engine_dir, api_keys=keys_file) as fresh:
        client = fresh.client(KEYS["alice"])
        usages = [
            client.completions.create(model=MODEL, prompt="metrics one", max_tokens=4, temperature=0).usage,
            client.completions.create(model=MODEL, prompt="metrics, two", max_tokens=7, temperature=0).usage,
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "three"}], max_tokens=5, temperature=0
            ).usage,
        ]
        stream = client.completions.create(
            model=MODEL, prompt="four", max_tokens=6, temperature=0, stream=True, stream_options={"include_usage": True}
        )
        usages.append([c.usage for c in stream][-1])
        for key in (None, "sk-nope", "sk-nope-2"):
            assert post(fresh.url, {**greedy(1), "prompt": "x"}, key).status_code == 401
        assert httpx.get(f"{fresh.url}/health/generate", timeout=TIMEOUT).status_code == 200  # not a request
        text = fresh.metrics()
    k = len(usages)
    prompt = sum(u.prompt_tokens for u in usages if u is not None)
    generated = sum(u.completion_tokens for u in usages if u is not None)
    assert metric(text, "vllm:request_success_total") == k
    assert metric(text, "vllm:request_success_total", finished_reason="length", model_name=MODEL) == k
    assert metric(text, "vllm:prompt_tokens_total") == prompt
    assert metric(text, "vllm:generation_tokens_total") == generated
    assert metric(text, "vllm:time_to_first_token_seconds_count") == k
    assert metric(text, "vllm:e2e_request_latency_seconds_count") == k
    assert metric(text, "vllm:request_generation_tokens_sum") == generated
    assert metric(text, "vllm:num_requests_running") == 0 and metric(text, "vllm:kv_cache_usage_perc") == 0
    assert metric(text, "trtbuild_engine_info", engine_sha256=engine_sha256) == 1
    assert metric(text, "trtbuild_api_key_requests_total", key_id="alice") == k
    assert metric(text, "trtbuild_api_key_tokens_total", key_id="alice", kind="generation") == generated
    assert metric(text, "trtbuild_rejections_total", reason="auth") == 3
    assert not any(key in text for key in KEYS.values())


# -- 7. probes --------------------------------------------------------------------------------------------------
def test_health_and_readiness_probes(server: Running) -> None:
    assert httpx.get(f"{server.url}/health", timeout=TIMEOUT).status_code == 200
    assert httpx.get(f"{server.url}/ready", timeout=TIMEOUT).json() == {"status": "ready"}
    probe = httpx.get(f"{server.url}/health/generate", timeout=TIMEOUT)
    assert probe.status_code == 200
    assert probe.json()["status"] == "ok" and 0 <= probe.json()["token"] < server.state.llm.engine.vocab_size


def test_ready_says_503_until_warmed_up(engine_dir: Path) -> None:
    with running(engine_dir, warm_up=False) as cold:
        assert status_of(f"{cold.url}/health") == 200
        assert status_of(f"{cold.url}/ready") == 503
        assert error_of(post(cold.url, {**greedy(1), "prompt": "x"}), 503)["type"] == "unavailable"
        start_warm_up(cold.state)
        wait_until(lambda: status_of(f"{cold.url}/ready") == 200, "readiness after warm-up")
        assert post(cold.url, {**greedy(1), "prompt": "x"}).status_code == 200
