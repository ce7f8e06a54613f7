"""What the server tests share: an in-process server on loopback (`running`), the tiny engine builder, and small
HTTP/SSE/metrics helpers. The fixtures are in conftest.py beside this file (module-scoped: each test module gets
its own engine and server).
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from toolchain.engine.build import BuildOptions, build_engine
from toolchain.serve.app import ServeOptions, ServerState, create_app, start_warm_up
from toolchain.serve.server import DrainingServer, prepare

MAX_SEQ_LEN = 128
MODEL = "tiny-serve"  # --served-model-name of the in-process servers
TIMEOUT = 30.0  # seconds, for every client call and wait: a test fails rather than hangs
KEYS = {"alice": "sk-alice-5f0c2b7e", "slow": "sk-slow-91d4a3c0", "thrifty": "sk-thrifty-0be77f12"}
LIMITS = {"alice": "", "slow": ":rpm=2", "thrifty": ":tpm=100"}


@dataclass
class Running:
    state: ServerState
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, timeout=TIMEOUT, max_retries=0)

    def metrics(self) -> str:
        response = httpx.get(f"{self.url}/metrics", timeout=TIMEOUT)
        assert response.status_code == 200
        return response.text


@contextlib.contextmanager
def running(engine_dir: Path, warm_up: bool = True, **options: Any) -> Iterator[Running]:
    """A real server in this process on 127.0.0.1 (a port bound here first, so no race): ready when yielded, or
    only alive with warm_up=False."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    state = prepare(engine_dir, ServeOptions(port=port, served_model_name=MODEL, **options))
    config = uvicorn.Config(create_app(state), log_level="warning", access_log=False, lifespan="off")
    server = DrainingServer(config, state)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()  # uvicorn installs signal handlers on the main thread only: none here
    try:
        if warm_up:
            start_warm_up(state)
            wait_until(lambda: status_of(f"http://127.0.0.1:{port}/ready") == 200, "the server to be ready")
        else:
            wait_until(lambda: status_of(f"http://127.0.0.1:{port}/health") == 200, "the server to answer")
        yield Running(state, port)
    finally:
        server.should_exit = True
        thread.join(timeout=TIMEOUT)
        state.llm.close()
        sock.close()


# -- helpers ----------------------------------------------------------------------------------------------------
def wait_until(condition: Callable[[], bool], what: str, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.05)


def status_of(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=2.0).status_code
    except httpx.TransportError:
        return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of the samples called `name` (as exposed: counters end in _total) whose labels include `labels`."""
    values = [
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    assert values, f"no sample {name}{labels} in /metrics"
    return float(sum(values))


def post(url: str, body: Any, key: str | None = None, path: str = "/v1/completions") -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if isinstance(body, bytes):
        return httpx.post(url + path, content=body, headers=headers, timeout=TIMEOUT)
    return httpx.post(url + path, json=body, headers=headers, timeout=TIMEOUT)


def error_of(response: httpx.Response, status: int) -> dict[str, Any]:
    """OpenAI's error JSON, exactly: {"error": {"message", "type", "param", "code"}}."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["code"] == status and body["error"]["message"]
    return dict(body["error"])


def sse_events(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[len("data: ") :])


def greedy(max_tokens: int) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": max_tokens, "temperature": 0}


def build_serving_engine(checkpoint: Path, name: str, max_batch_size: int) -> Path:
    opts = BuildOptions(
        backend="onnxruntime", max_seq_len=MAX_SEQ_LEN, max_batch_size=max_batch_size, max_num_tokens=512
    )
    build_engine(checkpoint, checkpoint.parent / name, opts)
    return checkpoint.parent / name
