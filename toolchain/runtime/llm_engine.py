"""The Generation API: many callers, one engine. `generate`, `bench`, eval's golden replay and `serve` all go
through it, so what is gated is what is served.

One background thread owns the `Runtime` and runs its step loop; callers on any thread `submit` a prompt (text or
token ids) with sampling params and get a `RequestStream` of `TokenEvent`s, iterable from plain threads or from an
asyncio event loop; `abort(request_id)` stops one. Commands from callers are queued and applied by the loop thread
between steps, so the runtime is never touched concurrently. A request ends with one final event, always: finished,
cancelled, timed out, refused, or failed because the engine raised.

`heartbeat` is the loop's last sign of life (after every step, and twice a second while idle): a health check that
reads it notices an engine call that hangs, which a check of the process alone would not.

Failures: an engine call that raises fails the requests of that batch, and the loop goes on. A rank failure of a
multi-rank engine (a `CollectiveError`, or a reason from the engine's optional `health()`: "rank 1 died (exit -9)")
is terminal instead: the ranks' state no longer agrees and no later step could be trusted, so the loop ends every
request with that reason, stops, sets `fatal`, and refuses later submits (`EngineFailed`). The server exits on it and
its supervisor starts the group again.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from toolchain.engine.api import Engine
from toolchain.engine.collectives import CollectiveError
from toolchain.runtime.loop import Runtime
from toolchain.runtime.request import FinishReason, Request, SamplingParams, Status, TokenEvent

_IDLE_TICK_S = 0.5


class EngineFailed(RuntimeError):
    """A submit to an engine loop that a rank failure stopped for good."""


def engine_health(engine: Engine) -> str | None:
    """Why `engine` cannot run any more (a multi-rank engine's dead or hung rank), or None. Engines without a
    `health()` (single-rank ones) are healthy as long as their calls return."""
    check = getattr(engine, "health", None)
    if not callable(check):
        return None
    try:
        reason = check()
    except Exception as e:  # a health check that cannot tell is not a healthy answer
        return f"the engine's health check raised {type(e).__name__}: {e}"
    return str(reason) if reason else None


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(
        self, ids: list[int], skip_special_tokens: bool = ..., clean_up_tokenization_spaces: bool = ...
    ) -> str: ...


@dataclass(frozen=True)
class Completion:
    request_id: str
    prompt_tokens: int
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    error: str | None


class RequestStream:
    """The events of one request, in order, ending with the one whose `finish_reason` is set."""

    def __init__(
        self,
        request_id: str,
        prompt: list[int],
        loop: asyncio.AbstractEventLoop | None = None,
        sink: Callable[[RequestStream, TokenEvent], None] | None = None,
    ):
        """`sink`: where an asyncio stream's events go first (LLMEngine batches them into one hand-off per step
        and event loop); without one, each event crosses to the event loop on its own."""
        self.request_id, self.prompt = request_id, prompt
        self._sink = sink
        self.request: Request | None = None  # set by the loop thread on admission: timings for metrics
        self._loop = loop
        self._sync: queue.SimpleQueue[TokenEvent] = queue.SimpleQueue()
        self._async: asyncio.Queue[TokenEvent] | None = asyncio.Queue() if loop is not None else None
        self._completion: Completion | None = None

    def put(self, event: TokenEvent) -> None:
        """Called by the loop thread."""
        if self._loop is not None and self._async is not None:
            if self._sink is not None:
                self._sink(self, event)
                return
            with contextlib.suppress(RuntimeError):  # the caller's event loop closed: nobody is listening
                self._loop.call_soon_threadsafe(self._async.put_nowait, event)
        else:
            self._sync.put(event)

    def __iter__(self) -> Iterator[TokenEvent]:
        if self._async is not None:
            raise TypeError("this stream was opened for asyncio: use `async for`")
        while True:
            event = self._sync.get()
            yield event
            if event.finished:
                return

    async def get(self, timeout: float | None = None) -> TokenEvent:
        """The next event (asyncio streams); asyncio.TimeoutError after `timeout` s, with nothing lost."""
        if self._async is None:
            raise TypeError("this stream was opened without an event loop: use `for`")
        try:  # an event already there costs no task and no timer (wait_for makes both)
            return self._async.get_nowait()
        except asyncio.QueueEmpty:
            return await asyncio.wait_for(self._async.get(), timeout)

    async def __aiter__(self) -> AsyncIterator[TokenEvent]:
        while True:
            event = await self.get()
            yield event
            if event.finished:
                return

    def result(self) -> Completion:
        """Block until the request ends (plain threads only); the events are consumed, the result is kept."""
        if self._completion is not None:
            return self._completion
        ids: list[int] = []
        text: list[str] = []
        for event in self:
            if event.token is not None:
                ids.append(event.token)
            text.append(event.text)
        assert event.finish_reason is not None  # the stream ends on its finishing event
        self._completion = Completion(
            self.request_id, len(self.prompt), ids, "".join(text), event.finish_reason, event.error
        )
        return self._completion


def _deliver(batch: list[tuple[RequestStream, TokenEvent]]) -> None:
    """On the event loop: queue each event on its stream."""
    for stream, event in batch:
        assert stream._async is not None
        stream._async.put_nowait(event)


class LLMEngine:
    """A runtime behind a thread: `submit` / `abort` from anywhere; `close` (or `with`) stops the loop."""

    _ids = itertools.count()

    def __init__(self, engine: Engine, tokenizer: Tokenizer | None = None, **runtime_options: Any):
        self.engine, self.tokenizer = engine, tokenizer
        # the loop thread decodes with its own copy: a fast tokenizer used from two threads at once can fail with
        # "Already borrowed" (its Rust state is not shared-mutable)
        own = copy.deepcopy(tokenizer) if tokenizer is not None else None
        self.runtime = Runtime(engine, tokenizer=own, **runtime_options)
        self._inbox: deque[Callable[[], object]] = deque()
        self._wake = threading.Event()
        self._stop = False  # close() was called: no new commands
        self._stopped = False  # the loop thread has ended everything and returned
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._async_out: list[tuple[RequestStream, TokenEvent]] = []  # written by the loop thread only
        self.heartbeat = time.monotonic()
        self.failure: str | None = None  # the last engine error, for health checks and logs
        self.fatal: str | None = None  # the rank failure that stopped the loop for good (see the module docstring)
        self.on_step: Callable[[Runtime], None] | None = None  # called by the loop thread after each step

    # -- callers ------------------------------------------------------------------------------------------------
    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            return [int(t) for t in prompt]
        if self.tokenizer is None:
            raise ValueError("a text prompt needs the engine's tokenizer; pass token ids instead")
        return list(self.tokenizer.encode(prompt))

    def submit(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> RequestStream:
        """Queue a request; with `loop`, the stream is consumed with `async for` on that event loop."""
        ids = self.encode(prompt)
        stream = RequestStream(request_id or f"gen-{next(self._ids)}", ids, loop, self._to_async)
        params = params or SamplingParams()

        def admit() -> None:
            try:
                stream.request = self.runtime.add_request(ids, params, stream.request_id, timeout, stream.put)
            except ValueError as e:  # a duplicate id: end this stream, leave the live one alone
                stream.put(TokenEvent(stream.request_id, None, "", FinishReason.ERROR, str(e), len(ids), 0))

        self._command(admit)
        return stream

    def abort(self, request_id: str) -> None:
        """Cancel a request (no-op if it already ended); its blocks are freed before the next step."""
        self._command(lambda: self.runtime.cancel(request_id))

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | None = None) -> list[Completion]:
        """Submit all, wait for all (in-flight batched together); results in order."""
        streams = [self.submit(p, params) for p in prompts]
        return [s.result() for s in streams]

    @property
    def num_pending(self) -> int:
        """Submitted and not yet running: the waiting queue plus commands not yet applied."""
        return len(self._inbox) + self.runtime.num_waiting

    # -- the loop thread ----------------------------------------------------------------------------------------
    def _command(self, fn: Callable[[], object]) -> None:
        with self._lock:  # no command can slip in after close() decided to stop: it would never be answered
            if self.fatal is not None:
                raise EngineFailed(f"the engine failed and its loop stopped: {self.fatal}")
            if self._stop:
                raise RuntimeError("the engine loop is closed")
            self._inbox.append(fn)
        self.start()
        self._wake.set()

    def _to_async(self, stream: RequestStream, event: TokenEvent) -> None:
        self._async_out.append((stream, event))

    def _dispatch(self) -> None:
        """Hand this round's events to their event loops: one thread-safe call per loop, not one per token."""
        if not self._async_out:
            return
        items, self._async_out = self._async_out, []
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, TokenEvent]]] = {}
        for stream, event in items:
            assert stream._loop is not None
            by_loop.setdefault(stream._loop, []).append((stream, event))
        for loop, batch in by_loop.items():
            with contextlib.suppress(RuntimeError):  # that event loop closed: nobody is listening
                loop.call_soon_threadsafe(_deliver, batch)

    def start(self) -> None:
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="trtbuild-step-loop", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        rt = self.runtime
        while not self._stopped:
            self._wake.clear()
            try:
                self._round(rt)
            except Exception as e:  # a bug outside the engine call: end what is live, keep the loop alive
                self.failure = f"{type(e).__name__}: {e}"
                with contextlib.suppress(Exception):
                    rt.end_all(Status.FAILED, FinishReason.ERROR, f"internal error: {self.failure}")
                self._dispatch()
            self.heartbeat = time.monotonic()

    def _round(self, rt: Runtime) -> None:
        while self._inbox:
            self._inbox.popleft()()
        if self._stop:
            with self._lock:  # closed to new commands: apply the last ones, then end everything still live
                while self._inbox:
                    self._inbox.popleft()()
            rt.end_all(Status.CANCELLED, FinishReason.SHUTDOWN)
            self._dispatch()
            self._stopped = True
            return
        down = engine_health(self.engine)  # before the step: a rank already gone would only make it wait
        if down is not None:
            self._fail(rt, down)
            return
        if not rt.has_work:
            self._dispatch()
            self._wake.wait(_IDLE_TICK_S)
            return
        steps = rt.steps
        try:
            rt.step()
        except Exception as e:  # an engine failure ends the requests in flight, not the server ...
            down = engine_health(self.engine)
            if down is None and isinstance(e, CollectiveError):
                down = str(e)
            if down is not None:  # ... unless a rank failed: then nothing after this step can be trusted
                self._fail(rt, down)
                return
            self.failure = f"{type(e).__name__}: {e}"
            rt.end_all(Status.FAILED, FinishReason.ERROR, f"engine error: {self.failure}")
        if self.on_step is not None:
            self.on_step(rt)
        self._dispatch()
        if rt.steps == steps:  # nothing could be scheduled: wait for a command instead of spinning
            self._wake.wait(0.001)

    def _fail(self, rt: Runtime, reason: str) -> None:
        """A rank failure: end every request with it, refuse new ones, stop the loop."""
        self.failure = reason
        with self._lock:
            self.fatal = reason  # from here on _command refuses: the inbox only shrinks
        while self._inbox:  # admit what was submitted already, so that it ends below with the reason
            self._inbox.popleft()()
        rt.end_all(Status.FAILED, FinishReason.ERROR, f"engine error: {reason}")
        self._dispatch()
        self._stopped = True

    @property
    def alive(self) -> bool:
        """The loop thread runs (or has not been needed yet)."""
        return not self._stopped and (self._thread is None or self._thread.is_alive())

    def close(self) -> None:
        """Stop the loop; requests still live end with finish reason "shutdown"."""
        with self._lock:
            if self._stop:
                return
            self._stop = True
        if self._thread is None:
            self._stopped = True
            return
        self._wake.set()
        self._thread.join(timeout=30)

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
