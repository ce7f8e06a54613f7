"""Serving a multi-rank engine (issue 27, D9/D10), and what a rank failure does: a dead worker or a timed-out
collective is terminal.

The step loop ends every request with the reason and refuses new ones, /health and /ready answer 503 with the
reason, streams end with an SSE error event, and `trtbuild serve` exits 3 after closing the engine; an ordinary
engine error stays per batch, and a drain is unaffected. First on the fake rank-0 facade of tests/fakes.py
(`FakeRankedEngine`: health(), close(), a rank that dies or times out), in this process: milliseconds per step,
so the bounds asserted are the server's own (watchdog, linger, shutdown). Then (slow) on a real TP=2 engine:
`python -m toolchain serve` in a subprocess of its own session, its rank 1 a spawned process found among the
server's children in /proc, answering the `openai` client, then SIGKILLed or SIGSTOPped mid-stream.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from fakes import FakeEngine, FakeRankedEngine, expected_output

from toolchain.checkpoint.convert import convert
from toolchain.checkpoint.tiny import make_tiny_llama
from toolchain.engine.api import load_tokenizer, open_engine
from toolchain.engine.build import BuildOptions, build_engine
from toolchain.errors import UserError
from toolchain.runtime.llm_engine import EngineFailed, LLMEngine
from toolchain.runtime.request import FinishReason, SamplingParams
from toolchain.serve import EXIT_ENGINE_FAILED
from toolchain.serve import server as server_module
from toolchain.serve.app import ServeOptions, ServerState, create_app, start_warm_up
from toolchain.serve.server import FAILURE_LINGER_S, FORCE_EXIT_S, WATCH_INTERVAL_S, DrainingServer, EngineFailedExit

MODEL = "ranked"
TIMEOUT = 30.0  # every client call and wait: a test fails rather than hangs
# from the failure to run() returning: the watchdog's poll, the linger, uvicorn's shutdown (bounded by the forced
# exit), closing the engine; 2 s of slack for a busy 2-core machine
EXIT_BOUND_S = WATCH_INTERVAL_S + FAILURE_LINGER_S + FORCE_EXIT_S + 2.0


class Chars:
    """A tokenizer of one character per id, so that streamed events carry text (the fake's ids are < 320)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(
        self, ids: list[int], skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool = False
    ) -> str:
        return "".join(chr(i) for i in ids)


def wait_until(condition: Callable[[], bool], what: str, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.02)


@dataclass
class Served:
    """A server on 127.0.0.1 run by server.run() on a thread, as `trtbuild serve` runs it (watchdog included)."""

    state: ServerState
    server: DrainingServer
    port: int
    thread: threading.Thread
    outcome: dict[str, Any]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.url + path, timeout=TIMEOUT)

    def status(self, path: str) -> int | None:
        try:
            return httpx.get(self.url + path, timeout=2.0).status_code
        except httpx.TransportError:
            return None


@contextlib.contextmanager
def serving(engine: FakeEngine) -> Iterator[Served]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    state = ServerState(engine, Chars(), ServeOptions(port=port, served_model_name=MODEL), None)
    config = uvicorn.Config(create_app(state), log_level="warning", access_log=False, lifespan="off")
    server = DrainingServer(config, state)
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            server_module.run(server, [sock])
            outcome["result"] = "returned"
        except EngineFailedExit as e:
            outcome["result"] = e
        outcome["ended"] = time.monotonic()

    thread = threading.Thread(target=target, daemon=True)  # uvicorn installs signal handlers on the main thread only
    thread.start()
    served = Served(state, server, port, thread, outcome)
    try:
        start_warm_up(state)
        wait_until(lambda: served.status("/ready") == 200, "the server to be ready")
        yield served
    finally:
        server.should_exit = True
        thread.join(timeout=TIMEOUT)
        sock.close()


@dataclass
class Stream:
    """One streaming completion read to its end on a thread."""

    texts: list[str] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)
    finish: str | None = None
    status: int | None = None
    done: bool = False
    started: threading.Event = field(default_factory=threading.Event)
    ended_at: float = 0.0

    def read(self, url: str, max_tokens: int, model: str = MODEL) -> None:
        body = {"model": model, "prompt": "rank", "max_tokens": max_tokens, "temperature": 0, "stream": True}
        with httpx.Client(timeout=TIMEOUT) as http, http.stream("POST", url + "/v1/completions", json=body) as r:
            self.status = r.status_code
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    self.done = True
                elif line.startswith("data: "):
                    event = json.loads(line[len("data: ") :])
                    if "error" in event:
                        self.errors.append(event["error"])
                    else:
                        self.texts.append(event["choices"][0]["text"])
                        self.finish = event["choices"][0]["finish_reason"] or self.finish
                    if len(self.texts) >= 2:
                        self.started.set()
        self.ended_at = time.monotonic()


def _start_stream(url: str, max_tokens: int) -> tuple[Stream, threading.Thread]:
    stream = Stream()
    reader = threading.Thread(target=stream.read, args=(url, max_tokens), daemon=True)
    reader.start()
    assert stream.started.wait(TIMEOUT), "the stream never started"
    return stream, reader


def _check_failed_server(served: Served, reason: str, failed_at: float) -> None:
    """After a rank failure: probes and new requests say why, then run() ends with exit 3, the engine closed."""
    health = served.get("/health")
    assert health.status_code == 503 and reason in health.json()["status"], health.text
    ready = served.get("/ready")
    assert ready.status_code == 503 and reason in ready.json()["status"], ready.text
    probe = served.get("/health/generate")
    assert probe.status_code == 503 and reason in probe.json()["status"], probe.text
    refused = httpx.post(served.url + "/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=TIMEOUT)
    assert refused.status_code == 503 and reason in refused.json()["error"]["message"], refused.text
    assert refused.headers["Retry-After"] == "1"

    served.thread.join(timeout=EXIT_BOUND_S + 5)
    assert not served.thread.is_alive(), "the server did not stop after the rank failure"
    result = served.outcome["result"]
    assert isinstance(result, EngineFailedExit), result
    assert result.exit_code == EXIT_ENGINE_FAILED == 3 and reason in str(result)
    assert served.outcome["ended"] - failed_at < EXIT_BOUND_S
    engine = served.state.engine
    assert isinstance(engine, FakeRankedEngine) and engine.closed == 1
    # closed as soon as the failure was seen, while the server lingered, not after it stopped
    assert engine.closed_at - failed_at < WATCH_INTERVAL_S + 1.0 < FAILURE_LINGER_S
    with socket.socket() as again:  # the port is free again
        again.bind(("127.0.0.1", served.port))


# -- the step loop ------------------------------------------------------------------------------------------------
def test_an_ordinary_engine_error_fails_its_batch_only() -> None:
    engine = FakeRankedEngine()
    with LLMEngine(engine) as llm:
        engine.broken = True
        failed = llm.submit([5, 6, 7], SamplingParams(max_new_tokens=3)).result()
        assert failed.finish_reason is FinishReason.ERROR and "fake engine failure" in (failed.error or "")
        engine.broken = False
        ok = llm.submit([5, 6, 7], SamplingParams(max_new_tokens=3)).result()
        assert ok.finish_reason is FinishReason.LENGTH and ok.token_ids == expected_output([5, 6, 7], 3)
        assert llm.alive and llm.fatal is None


def test_a_collective_error_stops_the_loop_for_good() -> None:
    engine = FakeRankedEngine()
    with LLMEngine(engine) as llm:
        engine.time_out(1)
        failed = llm.submit([5, 6, 7], SamplingParams(max_new_tokens=3)).result()
        assert failed.finish_reason is FinishReason.ERROR
        assert "rank 1: AllReduce after layer 0 mlp.proj on group [0, 1]" in (failed.error or "")
        wait_until(lambda: not llm.alive, "the loop to stop", 5)
        assert llm.fatal is not None and llm.fatal.startswith("rank 1: AllReduce")
        calls = engine.calls
        with pytest.raises(EngineFailed, match="rank 1: AllReduce"):
            llm.submit([5], SamplingParams(max_new_tokens=1))
        assert engine.calls == calls


def test_a_rank_that_dies_while_idle_stops_the_loop() -> None:
    engine = FakeRankedEngine()
    with LLMEngine(engine) as llm:
        assert llm.submit([9], SamplingParams(max_new_tokens=2)).result().error is None
        engine.kill_rank(1)
        wait_until(lambda: not llm.alive, "the idle loop to notice the dead rank", 2)  # an idle tick is 0.5 s
        assert llm.fatal == "rank 1 died (exit -9)"
        with pytest.raises(EngineFailed, match=r"rank 1 died \(exit -9\)"):
            llm.submit([9], SamplingParams(max_new_tokens=2))


def test_a_plain_error_with_a_dead_rank_behind_it_is_terminal() -> None:
    """gloo's error for a vanished peer is a plain RuntimeError; the facade's health() says it was a rank."""
    engine = FakeRankedEngine(delay_s=0.005)
    with LLMEngine(engine) as llm:
        stream = llm.submit([1, 2, 3], SamplingParams(max_new_tokens=200))
        wait_until(lambda: engine.calls >= 3, "a few steps")
        engine.kill_rank(1, code=-15)
        result = stream.result()
        assert result.finish_reason is FinishReason.ERROR and "rank 1 died (exit -15)" in (result.error or "")
        assert 3 <= len(result.token_ids) < 200
        wait_until(lambda: not llm.alive, "the loop to stop", 5)


# -- the server ---------------------------------------------------------------------------------------------------
@pytest.mark.slow  # FAILURE_LINGER_S (2 s) of the ~2.5 s is the server keeping /health up to say why
def test_a_dead_rank_turns_health_red_ends_the_stream_and_exits_3() -> None:
    engine = FakeRankedEngine(delay_s=0.01)
    with serving(engine) as served:
        stream, reader = _start_stream(served.url, max_tokens=200)
        engine.kill_rank(1)
        killed_at = time.monotonic()
        wait_until(lambda: served.status("/health") == 503, "/health to say 503", 2)
        reader.join(TIMEOUT)
        assert stream.status == 200 and stream.texts and stream.finish is None
        (error,) = stream.errors
        assert "rank 1 died (exit -9)" in error["message"] and error["type"] == "server_error"
        assert stream.done
        _check_failed_server(served, "rank 1 died (exit -9)", killed_at)


@pytest.mark.slow
def test_a_collective_timeout_ends_the_stream_and_exits_3() -> None:
    engine = FakeRankedEngine(delay_s=0.01)
    with serving(engine) as served:
        stream, reader = _start_stream(served.url, max_tokens=200)
        engine.time_out(1, hang_s=0.3)
        timed_out_at = time.monotonic() + 0.3
        reader.join(TIMEOUT)
        (error,) = stream.errors
        reason = "rank 1: AllReduce after layer 0 mlp.proj on group [0, 1] failed (timeout 0.3 s): timed out"
        assert reason in error["message"]
        _check_failed_server(served, reason, timed_out_at)


def test_a_drain_on_a_multi_rank_engine_is_unaffected() -> None:
    engine = FakeRankedEngine(delay_s=0.005)
    with serving(engine) as served:
        stream, reader = _start_stream(served.url, max_tokens=60)
        served.server.handle_exit(signal.SIGTERM, None)
        wait_until(lambda: served.status("/ready") == 503, "/ready to say 503 while draining", 5)
        assert served.status("/health") == 200
        reader.join(TIMEOUT)
        assert stream.finish == "length" and not stream.errors and stream.done
        served.thread.join(TIMEOUT)
        assert served.outcome["result"] == "returned"
        assert engine.closed == 1 and engine.down is None


def test_the_cli_exits_3_when_a_rank_fails(cli: Callable[..., Any], monkeypatch: pytest.MonkeyPatch) -> None:
    engine = FakeRankedEngine()
    monkeypatch.setattr(server_module, "FAILURE_LINGER_S", 0.1)  # nobody reads /health here: no need to linger
    monkeypatch.setattr(server_module, "open_engine", lambda _: engine)
    monkeypatch.setattr(server_module, "load_tokenizer", lambda _: Chars())

    def kill_after_warm_up() -> None:
        wait_until(lambda: engine.calls >= 1, "the warm-up step")
        engine.kill_rank(1)

    threading.Thread(target=kill_after_warm_up, daemon=True).start()
    result = cli("serve", "fake-engine", "--port", "0")
    assert result.exit_code == 3, result.output
    assert "the engine failed: rank 1 died (exit -9)" in result.output
    assert engine.closed == 1


def test_under_torchrun_only_rank_0_serves(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """Every rank runs the same `trtbuild serve`; a rank > 0 runs its part inside open_engine (which returns only on
    rank 0), ignoring SIGTERM / SIGINT (rank 0 drains, then stops it) and without reading the API keys. If
    open_engine returns there, the engine was single-rank: refused."""
    opened: list[tuple[str, Any, Any]] = []

    def open_engine(engine_dir: Any) -> FakeEngine:
        opened.append((str(engine_dir), signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)))
        return FakeEngine()

    monkeypatch.setattr(server_module, "open_engine", open_engine)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    options = ServeOptions(host="0.0.0.0", api_keys=tmp_path / "not-mounted-on-workers")
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        with pytest.raises(UserError, match="torchrun started this process as rank 1 of 2, but the engine is single"):
            server_module.prepare(tmp_path / "engine", options)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    assert opened == [(str(tmp_path / "engine"), signal.SIG_IGN, signal.SIG_IGN)]
    monkeypatch.setenv("RANK", "0")  # rank 0 is the server: it checks its keys before it opens the engine
    with pytest.raises(UserError, match="not-mounted-on-workers"):
        server_module.prepare(tmp_path / "engine", options)
    assert len(opened) == 1


# -- a real TP=2 engine: `trtbuild serve` in a subprocess, its worker a spawned process (slow) ----------------------
REAL_MODEL = "tiny-tp2"
REAL_SEQ_LEN = 512  # long enough that a stream is still running when its worker is killed


@pytest.fixture(scope="module")
def tp2_engines(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The tiny Llama (8 heads, 2 KV heads) built unsplit and over tp=2: -> (TP=1 engine, TP=2 engine)."""
    tmp = tmp_path_factory.mktemp("serve-tp2")
    make_tiny_llama(tmp / "hf")
    opts = BuildOptions(backend="onnxruntime", max_seq_len=REAL_SEQ_LEN, max_batch_size=4, max_num_tokens=256)
    for tp in (1, 2):
        convert(tmp / "hf", tmp / f"ckpt-tp{tp}", tp=tp)
        build_engine(tmp / f"ckpt-tp{tp}", tmp / f"engine-tp{tp}", opts)
    return tmp / "engine-tp1", tmp / "engine-tp2"


@dataclass
class CliServer:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def status(self, path: str) -> int | None:
        try:
            return httpx.get(self.url + path, timeout=2.0).status_code
        except httpx.TransportError:
            return None

    def children(self) -> dict[int, str]:
        """The server's child processes: pid -> command line (from /proc: the same user's processes, read only)."""
        found = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError):
                fields = stat.read_text().rsplit(")", 1)[1].split()
                if int(fields[1]) == self.proc.pid:  # the field after the state is the parent's pid
                    found[int(stat.parent.name)] = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        return found

    def worker_pid(self) -> int:
        """Rank 1: the server's one child started by multiprocessing's spawn (the other may be its resource
        tracker)."""
        (pid,) = [pid for pid, cmd in self.children().items() if "spawn_main" in cmd]
        return pid


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def cli_server(engine_dir: Path, tmp_path: Path, collective_timeout: float = 30.0) -> Iterator[CliServer]:
    """`python -m toolchain serve ENGINE` in its own session (so that its process group is its and its ranks'),
    ready when yielded; killed with its group at the end whatever happened."""
    port = _free_port()
    log = tmp_path / "serve.log"
    env = {**os.environ, "TRTBUILD_COLLECTIVE_TIMEOUT": str(collective_timeout), "TRTBUILD_ORT_THREADS": "1"}
    argv = [sys.executable, "-m", "toolchain", "serve", str(engine_dir), "--port", str(port)]
    with log.open("w") as stderr:
        proc = subprocess.Popen(
            [*argv, "--served-model-name", REAL_MODEL], stdout=subprocess.DEVNULL, stderr=stderr, env=env,
            start_new_session=True,
        )  # fmt: skip
    server = CliServer(proc, port, log)
    try:
        wait_until(lambda: proc.poll() is not None or server.status("/ready") == 200, "the TP=2 server", 120)
        assert proc.poll() is None, log.read_text()
        yield server
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def _group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def _fail_the_worker(
    server: CliServer, sig: signal.Signals, reason: str, health_within: float, exit_within: float
) -> float:
    """Stream, signal the worker, then: the stream ends with an error event matching `reason`, /health says 503
    with it within `health_within` s, the server exits 3 within `exit_within` s, its process group is empty, its
    port binds again. -> seconds from the signal to the exit."""
    worker = server.worker_pid()
    stream = Stream()
    reader = threading.Thread(target=stream.read, args=(server.url, REAL_SEQ_LEN - 16, REAL_MODEL), daemon=True)
    reader.start()
    assert stream.started.wait(TIMEOUT), "the stream never started"
    os.kill(worker, sig)
    failed_at = time.monotonic()
    wait_until(lambda: server.status("/health") == 503, "/health to say 503", health_within)
    health = httpx.get(server.url + "/health", timeout=TIMEOUT)
    assert health.status_code == 503 and re.search(reason, health.json()["status"]), health.text
    reader.join(TIMEOUT)
    assert stream.status == 200 and stream.texts and stream.finish is None and stream.done
    (error,) = stream.errors
    assert re.search(reason, error["message"]), error
    code = server.proc.wait(timeout=exit_within + 5)
    exited_after = time.monotonic() - failed_at
    log = server.log.read_text()
    assert code == 3, log
    assert exited_after < exit_within, f"exit {exited_after:.1f} s after the failure"
    assert re.search(f"the engine failed: .*({reason})", log), log
    wait_until(lambda: _group_gone(server.proc.pid), "every process of the server's group to exit", 5)
    with socket.socket() as again:
        again.bind(("127.0.0.1", server.port))
    return exited_after


@pytest.mark.slow
def test_a_tp2_engine_serves_the_openai_client_until_its_worker_is_killed(
    tp2_engines: tuple[Path, Path], tmp_path: Path
) -> None:
    one, two = tp2_engines
    prompt = "The build farm"
    with LLMEngine(open_engine(one), load_tokenizer(one)) as llm:  # what the single-rank engine generates
        expected = llm.generate([prompt], SamplingParams(max_new_tokens=12, temperature=0))[0].text
    with cli_server(two, tmp_path) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)
        (card,) = client.models.list().data
        assert card.id == REAL_MODEL
        done = client.completions.create(model=REAL_MODEL, prompt=prompt, max_tokens=12, temperature=0)
        assert done.choices[0].finish_reason == "length" and done.usage is not None
        assert done.usage.completion_tokens == 12 and done.choices[0].text == expected
        chunks = client.completions.create(model=REAL_MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True)
        streamed = list(chunks)
        assert "".join(c.choices[0].text for c in streamed if c.choices) == expected
        assert streamed[-1].choices[0].finish_reason == "length"
        assert "2 ranks: tp=2 pp=1" in server.log.read_text()
        # Now the worker dies. Whichever rank 0 notices first names it: its process monitor, or the collective
        # whose peer closed its socket; either way at once, not after the collective timeout (the default 30 s).
        dead = r"rank 1 died \(exit -9\)|rank 0: \w+ .* on group \[0, 1\] failed .* waiting for rank 1"
        took = _fail_the_worker(server, signal.SIGKILL, dead, health_within=2.0, exit_within=10.0)
    print(f"SIGKILL: exit 3 after {took:.2f} s")


@pytest.mark.slow
def test_a_hung_worker_times_out_and_the_server_exits_3(tp2_engines: tuple[Path, Path], tmp_path: Path) -> None:
    timeout = 3.0
    # D9's bound: the collective timeout + 5 s. A stopped process ignores SIGTERM, so DistributedEngine.close()
    # kills a failed engine's ranks without waiting for one (parallel/engine.py stop_ranks).
    hung = r"rank 0: \w+ .* on group \[0, 1\] failed \(timeout 3 s\)"
    with cli_server(tp2_engines[1], tmp_path, collective_timeout=timeout) as server:
        bound = timeout + 5
        took = _fail_the_worker(server, signal.SIGSTOP, hung, health_within=timeout + 2, exit_within=bound)
    print(f"SIGSTOP: exit 3 after {took:.2f} s (collective timeout {timeout:g} s)")
