"""The step loop: each step schedules, runs ONE engine call over the packed batch (decodes and prefill chunks
together), samples, and retires finished requests. It drives any backend through the engine I/O contract."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch

from toolchain.engine.contract import Batch
from toolchain.runtime.blocks import BlockManager
from toolchain.runtime.request import Request, SamplingParams, Status
from toolchain.runtime.sampler import sample
from toolchain.runtime.scheduler import Scheduler


class Engine(Protocol):
    tokens_per_block: int

    def new_kv_cache(self, num_blocks: int) -> torch.Tensor: ...

    def forward(self, batch: Batch, kv_cache: torch.Tensor) -> np.ndarray: ...


class Runtime:
    def __init__(
        self,
        engine: Engine,
        limits: dict[str, Any],
        num_blocks: int | None = None,
        policy: str = "max_utilization",
        prefix_sharing: bool = True,
        detokenize: Callable[[list[int]], str] | None = None,
        clock: Callable[[], float] = time.monotonic,
        watermark: float = 0.01,
    ):
        self.engine, self.limits, self.clock, self.detokenize = engine, limits, clock, detokenize
        blocks = num_blocks or limits["num_blocks"]
        self.blocks = BlockManager(blocks, engine.tokens_per_block, watermark, prefix_sharing)
        self.scheduler = Scheduler(
            self.blocks, limits["max_batch_size"], limits["max_num_tokens"], limits["max_seq_len"], policy
        )
        self.pool = engine.new_kv_cache(blocks)
        self.requests: dict[str, Request] = {}
        self.utilization: list[tuple[float, float]] = []  # (time, fraction of blocks in use) after each step
        self.steps = 0

    # -- requests -----------------------------------------------------------------------------------------------
    def add_request(
        self,
        prompt: list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
        on_token: Callable[[Request, int], None] | None = None,
    ) -> Request:
        now = self.clock()
        request = Request(list(prompt), params or SamplingParams(), arrival=now, on_token=on_token)
        if request_id:
            request.id = request_id
        request.deadline = now + timeout if timeout else None
        total = len(prompt) + request.params.max_new_tokens
        vocab = getattr(self.engine, "vocab_size", None)
        if request.id in self.requests:
            raise ValueError(f"request id {request.id!r} is already in use")
        self.requests[request.id] = request
        if not prompt:
            self._fail(request, "empty prompt")
        elif request.params.stop_strings and self.detokenize is None:
            self._fail(request, "stop strings need a tokenizer (detokenize) in the runtime")
        elif vocab is not None and not all(0 <= t < vocab for t in prompt):
            self._fail(request, f"prompt has token ids outside the vocabulary [0, {vocab})")
        elif total > self.limits["max_seq_len"]:
            self._fail(
                request,
                f"prompt {len(prompt)} + max_new_tokens {request.params.max_new_tokens} exceeds the "
                f"engine's max_seq_len {self.limits['max_seq_len']}",
            )
        elif -(-total // self.blocks.tokens_per_block) > self.blocks.num_blocks - self.blocks.watermark_blocks:
            self._fail(request, f"needs more KV blocks than the whole pool ({self.blocks.num_blocks}) holds")
        else:
            self.scheduler.add(request)
        return request

    def cancel(self, request_id: str) -> None:
        """Stop a request now; its blocks are freed at once."""
        request = self.requests[request_id]
        if request.done:
            return
        self._retire(request, Status.CANCELLED, "cancelled")

    def _retire(self, request: Request, status: Status, reason: str, error: str | None = None) -> None:
        if request in self.scheduler.waiting:
            self.scheduler.waiting.remove(request)
        self.scheduler.free(request)
        request.status, request.finish_reason, request.error = status, reason, error
        request.finished_at = self.clock()

    def _fail(self, request: Request, error: str) -> None:
        self._retire(request, Status.FAILED, "error", error)

    @property
    def has_work(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    # -- the loop -----------------------------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """One engine call; returns the requests that ended in it."""
        now = self.clock()
        ended = []
        for request in [*self.scheduler.waiting, *self.scheduler.running]:
            if request.deadline is not None and now > request.deadline:
                self._retire(
                    request, Status.FAILED, "timeout", f"timed out after {request.deadline - request.arrival:g} s"
                )
                ended.append(request)
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return ended
        for s in scheduled:
            if s.request.first_scheduled is None:
                s.request.first_scheduled = now
        batch = Batch.from_sequences(
            [s.tokens for s in scheduled], [s.context_len for s in scheduled], [s.request.blocks for s in scheduled]
        )
        logits = self.engine.forward(batch, self.pool)
        self.steps += 1
        streamed: list[tuple[Request, int]] = []
        for s, row in zip(scheduled, logits, strict=True):
            request = s.request
            if request.done:  # cancelled while this step ran
                continue
            request.num_computed += len(s.tokens)
            self.blocks.register(request.tokens, request.blocks, request.num_computed)
            if request.pending:  # a prefill chunk with more to come: its logits are not a prediction yet
                continue
            token = sample(row, request.params, request.generator)
            request.generated.append(token)
            if request.first_token is None:
                request.first_token = self.clock()
            streamed.append((request, token))
            reason = self._stop_reason(request, token)
            if reason:
                self._retire(request, Status.FINISHED, reason)
                ended.append(request)
        for request, token in streamed:  # user code last, on a consistent state (it may cancel requests)
            if request.on_token is not None:
                request.on_token(request, token)
        self.utilization.append((self.clock(), self.blocks.num_used / self.blocks.num_blocks))
        return ended

    def _stop_reason(self, request: Request, token: int) -> str | None:
        p = request.params
        if token in p.stop_token_ids:
            return "stop_token"
        if p.stop_strings and self.detokenize is not None:
            text = self.detokenize(request.generated)
            if any(stop in text for stop in p.stop_strings):
                return "stop_string"
        if len(request.generated) >= p.max_new_tokens:
            return "length"
        return None

    def run(self) -> None:
        while self.has_work:
            self.step()
