"""The step loop: each step schedules, runs ONE engine call over the packed batch (decodes and prefill chunks
together), samples, and retires finished requests. It drives any backend through the `Engine` protocol
(engine/api.py) and takes every limit from the engine's spec.

Not thread-safe: one thread owns a Runtime (llm_engine.py wraps it for many callers). A request leaves the
runtime when it ends; the caller keeps its `Request` object if it wants the result.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from toolchain.engine.api import Engine, Limits, StepTokens
from toolchain.engine.contract import Batch
from toolchain.runtime import logprobs, rejection
from toolchain.runtime.blocks import BlockManager
from toolchain.runtime.detokenizer import Decoder, IncrementalDetokenizer
from toolchain.runtime.guided import Guide
from toolchain.runtime.processors import build_pipeline
from toolchain.runtime.request import FinishReason, Request, SamplingParams, Status, TokenEvent, TokenLogprob
from toolchain.runtime.sampler import sample
from toolchain.runtime.scheduler import Scheduled, Scheduler
from toolchain.runtime.speculative import Draft, SpecConfig, SpecStats, make_proposer


class Runtime:
    def __init__(
        self,
        engine: Engine,
        limits: Limits | None = None,
        num_blocks: int | None = None,
        policy: str = "max_utilization",
        prefix_sharing: bool = True,
        tokenizer: Decoder | None = None,
        clock: Callable[[], float] = time.monotonic,
        watermark: float = 0.01,
        record_utilization: bool = False,
        speculation: SpecConfig | None = None,
        draft_engine: Engine | None = None,
    ):
        """`limits`: the engine's own unless given (tests narrow them); `tokenizer`: text in events and stop
        strings; `record_utilization`: keep (time, blocks in use) after every step, for trace replay."""
        self.engine, self.clock, self.tokenizer = engine, clock, tokenizer
        self.limits = limits or engine.spec.limits
        blocks = num_blocks or self.limits.num_blocks
        self.blocks = BlockManager(blocks, engine.tokens_per_block, watermark, prefix_sharing)
        self.speculation = speculation
        self.proposer = make_proposer(speculation, engine, draft_engine) if speculation is not None else None
        self.spec_stats = SpecStats()  # over every request, since the start
        self.scheduler = Scheduler(
            self.blocks,
            self.limits.max_batch_size,
            self.limits.max_num_tokens,
            policy,
            speculation.num_speculative_tokens if speculation is not None else 0,
            self.limits.max_seq_len,
        )
        self.pool = engine.new_kv_cache(blocks)
        self.requests: dict[str, Request] = {}  # live requests only
        self.record_utilization = record_utilization
        self.utilization: list[tuple[float, float]] = []
        self.peak_utilization = 0.0
        self.steps = 0
        self.cached_tokens = 0  # prompt tokens found in the prefix cache, over all requests
        self.step_tokens = 0  # the last step's prompt tokens computed + tokens sampled (vLLM's iteration tokens)
        self._outbox: list[tuple[Request, TokenEvent]] = []
        self._deadlines: list[tuple[float, int, Request]] = []  # heap
        self._order = itertools.count()  # ties between equal deadlines, without comparing requests
        self.guide = Guide(tokenizer, engine.vocab_size)  # structured output
        self._drafts: list[Draft | None] | None = None  # this step's drafts, set while scheduling
        self._prompt_logprobs_live = 0  # live requests that asked for prompt logprobs (their chunks' every row)

    # -- requests -----------------------------------------------------------------------------------------------
    def check_request(self, prompt: list[int], params: SamplingParams) -> str | None:
        """Why this request cannot run on this engine, or None."""
        total = len(prompt) + params.max_new_tokens
        vocab = self.engine.vocab_size
        if not prompt:
            return "empty prompt"
        if params.stop_strings and self.tokenizer is None:
            return "stop strings need a tokenizer in the runtime"
        if not all(0 <= t < vocab for t in prompt):
            return f"prompt has token ids outside the vocabulary [0, {vocab})"
        if any(not 0 <= t < vocab for t, _ in params.logit_bias):
            return f"logit_bias names token ids outside the vocabulary [0, {vocab})"
        if total > self.limits.max_seq_len:
            return (
                f"prompt {len(prompt)} + max_new_tokens {params.max_new_tokens} exceeds the engine's max_seq_len "
                f"{self.limits.max_seq_len}"
            )
        if self.blocks.blocks_for(total) > self.blocks.num_blocks - self.blocks.watermark_blocks:
            return f"needs more KV blocks than the whole pool ({self.blocks.num_blocks}) holds"
        return None

    def add_request(
        self,
        prompt: list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
        on_event: Callable[[TokenEvent], None] | None = None,
    ) -> Request:
        """Queue a request. One that cannot run here ends at once as failed (its event says why)."""
        now = self.clock()
        request = Request(list(prompt), params or SamplingParams(), arrival=now, on_event=on_event)
        if request_id:
            request.id = request_id
        if request.id in self.requests:
            raise ValueError(f"request id {request.id!r} is already in use")
        request.deadline = now + timeout if timeout else None
        if request.deadline is not None:
            heapq.heappush(self._deadlines, (request.deadline, next(self._order), request))
        if self.tokenizer is not None:
            p = request.params
            request.detok = IncrementalDetokenizer(
                self.tokenizer,
                p.stop_strings,
                p.skip_special_tokens,
                request.prompt,
                p.include_stop_str_in_output,
                p.min_tokens,
            )
        self.requests[request.id] = request
        problem = self.check_request(request.prompt, request.params)
        if not problem:
            request.pipeline = build_pipeline(request.params, request.prompt, self.engine.vocab_size)
            problem = self.guide.add(request)
        if problem:
            self._retire(request, Status.FAILED, FinishReason.ERROR, problem)
        else:
            self.scheduler.add(request)
            if request.params.prompt_logprobs is not None:
                request.admitted = True
                self._prompt_logprobs_live += 1
        self._flush()
        return request

    def cancel(self, request_id: str) -> bool:
        """Stop a live request now and free its blocks; False when no such request is live."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        self._retire(request, Status.CANCELLED, FinishReason.CANCELLED)
        self._flush()
        return True

    def end_all(self, status: Status, reason: FinishReason, error: str | None = None) -> None:
        """End every live request (shutdown, or an engine call that raised)."""
        for request in list(self.requests.values()):
            self._retire(request, status, reason, error)
        self._flush()

    def _retire(
        self, request: Request, status: Status, reason: FinishReason, error: str | None = None, text: str = ""
    ) -> None:
        if request in self.scheduler.waiting:
            self.scheduler.waiting.remove(request)
        self.scheduler.free(request)
        self._release(request)
        request.status, request.finish_reason, request.error = status, reason, error
        request.finished_at = self.clock()
        self.requests.pop(request.id, None)
        self._emit(request, None, text, reason)

    def _release(self, request: Request) -> None:
        """`request` leaves the runtime: what the guide, the proposer and the loop keep for it goes."""
        self.guide.release(request)
        if self.proposer is not None:
            self.proposer.release(request)
        if request.params.prompt_logprobs is not None and request.admitted:
            request.admitted = False
            self._prompt_logprobs_live -= 1

    def _emit(
        self,
        request: Request,
        token: int | None,
        text: str,
        reason: FinishReason | None = None,
        logprob: TokenLogprob | None = None,
    ) -> None:
        if request.on_event is not None:
            prompt_lps = None
            if request.params.prompt_logprobs is not None and not request.prompt_lps_sent and token is not None:
                prompt_lps, request.prompt_lps_sent = tuple(request.prompt_lps), True
            event = TokenEvent(
                request.id,
                token,
                text,
                reason,
                request.error,
                len(request.prompt),
                len(request.generated),
                logprob,
                prompt_lps,
                self.steps,
            )
            self._outbox.append((request, event))

    def _flush(self) -> None:
        """User callbacks last, on a consistent state (a callback may cancel requests)."""
        while self._outbox:
            batch, self._outbox = self._outbox, []
            for request, event in batch:
                assert request.on_event is not None
                request.on_event(event)

    @property
    def has_work(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    # -- the loop -----------------------------------------------------------------------------------------------
    def _expire(self, now: float) -> list[Request]:
        """Requests past their deadline fail. A heap of deadlines: a step looks at the expired ones only, not at
        every queued request (5,000 waiting cost 3 ms a step when each was checked)."""
        expired = []
        while self._deadlines and self._deadlines[0][0] < now:
            deadline, _, request = heapq.heappop(self._deadlines)
            if not request.done:
                why = f"timed out after {deadline - request.arrival:g} s"
                self._retire(request, Status.FAILED, FinishReason.TIMEOUT, why)
                expired.append(request)
        if len(self._deadlines) > 2 * len(self.requests) + 64:  # ended requests' entries: drop, memory stays flat
            self._deadlines = [d for d in self._deadlines if not d[2].done]
            heapq.heapify(self._deadlines)
        return expired

    def step(self) -> list[Request]:
        """One engine call; returns the requests that ended in it."""
        now = self.clock()
        ended = self._expire(now)
        self._drafts = None
        scheduled = self.scheduler.schedule(self._propose_for if self.proposer is not None else None)
        if not scheduled:
            self._flush()
            return ended
        for s in scheduled:
            if s.request.first_scheduled is None:
                s.request.first_scheduled = now
                s.request.num_cached = s.context_len
                self.cached_tokens += s.context_len  # prompt tokens found in the prefix cache
        drafts = self._drafts  # speculation: the decodes' drafted tokens (they come first in `scheduled`)
        if drafts is not None:
            drafts = drafts + [None] * (len(scheduled) - len(drafts))
        every = (  # sequences whose chunk needs every position's logits: prompt logprobs
            [logprobs.wants_prompt_rows(s.request, s.context_len, len(s.tokens)) for s in scheduled]
            if self._prompt_logprobs_live
            else None
        )
        last: Sequence[int]  # one past each sequence's last output row
        if drafts is None and every is None:  # the common step: one output row per sequence, its last token's
            counts, last, many = None, range(1, len(scheduled) + 1), None
        else:  # ... or every row for the sequences with prompt logprob rows or drafts to verify
            every = every or [False] * len(scheduled)
            drafts = drafts or [None] * len(scheduled)
            many = [e or d is not None for e, d in zip(every, drafts, strict=True)]
            counts = [len(s.tokens) if m else 1 for s, m in zip(scheduled, many, strict=True)]
            last = list(itertools.accumulate(counts))
        batch = Batch.from_sequences(
            [s.tokens for s in scheduled],
            [s.context_len for s in scheduled],
            [s.request.blocks for s in scheduled],
            many if many is not None and any(many) else False,
        )
        sampled: list[int] = []  # output rows whose logits come to the host: only for requests that need them
        constrained: list[Request] = []
        constrained_drafts: list[list[int]] = []
        for i, s in enumerate(scheduled):
            p = s.request.params
            if not p.needs_host_logits and many is None:
                continue
            complete = s.context_len + len(s.tokens) >= len(s.request.tokens)
            if many is not None and (every[i] or (drafts[i] is not None and p.needs_host_logits)):  # type: ignore[index]
                sampled.extend(range(last[i] - counts[i], last[i]))  # type: ignore[index]
            elif p.needs_host_logits and complete:
                sampled.append(last[i] - 1)
            if p.grammar is not None and complete:
                constrained.append(s.request)
                drafted = drafts[i] if drafts is not None else None
                constrained_drafts.append(drafted.tokens if drafted is not None else [])
        if constrained:
            self.guide.begin(constrained, constrained_drafts)  # masks computed while the engine runs
        step = self.engine.forward_tokens(batch, self.pool, sampled)
        if constrained:
            self.guide.wait()
        greedy_ids = step.greedy.tolist()  # Python ints at once: indexing numpy per row costs ~10x more
        self.steps += 1
        tokens = 0
        for i, s in enumerate(scheduled):
            request = s.request
            if request.done:  # cancelled while this step ran
                continue
            if drafts is not None and (draft := drafts[i]) is not None:
                assert counts is not None
                tokens += self._verify(request, draft, last[i] - counts[i], step, greedy_ids, ended)
                continue
            self.blocks.advance(request, len(s.tokens))
            row = last[i] - 1
            if s.context_len < len(request.prompt):  # prompt tokens in this row (decode rows have none)
                tokens += min(len(request.prompt), s.context_len + len(s.tokens)) - s.context_len
            try:
                if every is not None and every[i]:
                    assert counts is not None
                    logprobs.collect_prompt(
                        request, s.context_len, [step.rows[r] for r in range(row - counts[i] + 1, row + 1)]
                    )
                if request.num_computed < len(request.tokens):  # a prefill chunk with more to come: no prediction yet
                    continue
                if request.params.needs_host_logits:
                    token, logprob = self._choose(request, step.rows[row])
                else:
                    token, logprob = greedy_ids[row], None
            except (RuntimeError, ValueError) as e:  # this request's logits or parameters: not the batch's problem
                self._retire(request, Status.FAILED, FinishReason.ERROR, f"sampling failed: {e}")
                ended.append(request)
                continue
            tokens += 1
            self._accept(request, token, ended, logprob)
        self.step_tokens = tokens
        used = self.blocks.num_used / self.blocks.num_blocks
        self.peak_utilization = max(self.peak_utilization, used)
        if self.record_utilization:
            self.utilization.append((self.clock(), used))
        self._flush()
        return ended

    def _propose_for(self, decodes: list[Scheduled]) -> int:
        """The scheduler's hook: draft into the decodes' reserved slots (kept for this step), and give back how many
        slots went unused."""
        self._drafts = self._propose(decodes)
        used = sum(len(d.tokens) for d in self._drafts or () if d is not None)
        return sum(s.spec for s in decodes) - used

    def _propose(self, scheduled: list[Scheduled]) -> list[Draft | None] | None:
        """The proposer's drafts for the decodes with reserved slots (None elsewhere), appended to their chunks;
        None when no sequence has slots."""
        if self.proposer is None or not any(s.spec for s in scheduled):
            return None
        drafts = self.proposer.propose(scheduled)
        for k, (s, d) in enumerate(zip(scheduled, drafts, strict=True)):
            if d is None or not d.tokens or not s.spec:
                drafts[k] = None
                continue
            if len(d.tokens) > s.spec:  # a proposer may not use more slots than the scheduler reserved
                raise RuntimeError(f"the proposer drafted {len(d.tokens)} tokens for {s.spec} slots")
            if s.request.params.grammar is not None:  # drafts the grammar refuses could only be rejected: cut
                n = self.guide.valid_prefix(s.request, d.tokens)
                if n < len(d.tokens) and d.probs is not None:  # its q row decides the draw there (Draft.refused)
                    d.refused = (d.tokens[n], d.probs[n])
                if n == 0 and d.refused is None:
                    drafts[k] = None
                    continue
                d.tokens, d.probs = d.tokens[:n], (d.probs[:n] if d.probs is not None else None)
            s.tokens = s.tokens + d.tokens
        return drafts if any(d is not None for d in drafts) else None

    def _verify(
        self,
        request: Request,
        draft: Draft,
        first_row: int,
        step: StepTokens,
        greedy_ids: list[int],
        ended: list[Request],
    ) -> int:
        """Keep the drafted tokens the target agrees with, left to right, and the target's own token after them;
        returns how many tokens were emitted. Plain greedy rows compare the draft with the engine's argmax; host
        rows process each position's raw row as `_choose` would (its pipeline in the state after the tokens before
        it: `_accept` updates it) and apply the acceptance rule (rejection.py); the bonus token is a plain
        `_choose`. Each emitted token goes through `_accept` as a plain step's (stops, min_tokens, logprobs from its
        own raw row). The KV of an accepted draft is the accepted token's (it was fed at that position), so the
        request advances over it; a rejected draft's is left past `num_computed`, to be overwritten."""
        self.blocks.advance(request, 1)  # the last token, fed first
        accepted = emitted = 0
        for j in range(len(draft.tokens) + 1):
            row = first_row + j
            proposed = draft.tokens[j] if j < len(draft.tokens) else None
            try:
                if not request.params.needs_host_logits:
                    token, logprob = greedy_ids[row], None
                    hit = token == proposed
                elif proposed is None and draft.refused is not None:  # the grammar's cut: the residual's draw
                    refused, q_row = draft.refused
                    token, hit = rejection.verify_position(
                        self._scores(request, step.rows[row]), refused, q_row, request.params, request.generator
                    )
                    logprob = self._logprob(request, step.rows[row], token)
                elif proposed is None:  # the bonus token: a plain step's
                    token, logprob = self._choose(request, step.rows[row])
                    hit = False
                else:  # the acceptance rule on the row as a plain step would process it (rejection.py)
                    q = draft.probs[j] if draft.probs is not None else None
                    token, hit = rejection.verify_position(
                        self._scores(request, step.rows[row]), proposed, q, request.params, request.generator
                    )
                    logprob = self._logprob(request, step.rows[row], token)
            except (RuntimeError, ValueError) as e:
                self._retire(request, Status.FAILED, FinishReason.ERROR, f"sampling failed: {e}")
                ended.append(request)
                break
            accepted += hit
            emitted += 1
            self._accept(request, token, ended, logprob)
            if request.done and hit and not request.params.needs_host_logits:
                # a stop inside an accepted run: vLLM counts what its rejection sampler accepted before the stop
                # check cuts the output, so the drafts after it that the target's argmax agrees with count too
                for rest in range(j + 1, len(draft.tokens)):
                    if greedy_ids[first_row + rest] != draft.tokens[rest]:
                        break
                    accepted += 1
            if request.done or not hit:
                break
            self.blocks.advance(request, 1)
        request.spec.observe(len(draft.tokens), accepted)
        self.spec_stats.observe(len(draft.tokens), accepted)
        return emitted

    def _choose(self, request: Request, row: np.ndarray) -> tuple[int, TokenLogprob | None]:
        """The next token of a host row, from the engine's raw logits `row`: the grammar mask, the request's
        pipeline, then sampling (or argmax); the logprob reported is the raw row's."""
        token = sample(self._scores(request, row), request.params, request.generator)
        return token, self._logprob(request, row, token)

    def _scores(self, request: Request, row: np.ndarray) -> torch.Tensor:
        """The float64 scores a host row's token is chosen from: the raw row, the grammar mask, then the request's
        pipeline (in the state after the tokens accepted so far)."""
        scores = torch.from_numpy(np.asarray(row, dtype=np.float64))
        if request.params.grammar is not None:
            self.guide.mask(request, scores)
        if request.pipeline is not None:
            scores = request.pipeline.apply(scores, request)
        return scores

    def _logprob(self, request: Request, row: np.ndarray, token: int) -> TokenLogprob | None:
        """`token`'s raw logprob in `row` when the request asks for logprobs (#29: before any processing)."""
        k = request.params.logprobs
        return logprobs.token_logprob(row, token, k) if k is not None else None

    def _accept(self, request: Request, token: int, ended: list[Request], logprob: TokenLogprob | None = None) -> None:
        """A sampled token: stream it, and retire the request if it stops here."""
        if request.pipeline is not None:
            request.pipeline.accepted(token)
        if request.params.grammar is not None:
            refused = self.guide.accept(request, token)
            if refused:
                self._retire(request, Status.FAILED, FinishReason.ERROR, f"structured output: {refused}")
                ended.append(request)
                return
        request.append(token)
        if request.first_token is None:
            request.first_token = self.clock()
        p, detok = request.params, request.detok
        # vLLM (v1/core/sched/utils.py `check_stop`): no stop token counts before min_tokens; a stop token's text is
        # left out unless include_stop_str_in_output (v1/engine/detokenizer.py `update`)
        stop_token = token in p.stop_token_ids and len(request.generated) >= p.min_tokens
        text = ""
        if detok is not None and (not stop_token or p.include_stop_str_in_output):
            text = detok.add(token)
        reason = None
        if stop_token:
            reason = FinishReason.STOP_TOKEN
        elif detok is not None and detok.stopped is not None:
            reason = FinishReason.STOP_STRING
        elif len(request.generated) >= p.max_new_tokens:
            reason = FinishReason.LENGTH
        if reason is None:
            self._emit(request, token, text, logprob=logprob)
            return
        if detok is not None:
            text += detok.flush()
        request.status, request.finish_reason, request.finished_at = Status.FINISHED, reason, self.clock()
        self.scheduler.free(request)
        self._release(request)
        self.requests.pop(request.id, None)
        self._emit(request, token, text, reason, logprob)
        ended.append(request)

    def run(self) -> None:
        while self.has_work:
            self.step()
