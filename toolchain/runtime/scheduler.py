"""Which requests run in the next engine call, and with how many tokens.

Per step: a token budget (`max_num_tokens`) and a sequence budget (`max_batch_size`). Decode steps go first (one
token each: they protect the latency of requests already streaming); prefill chunks fill the rest of the budget,
continuing prefills before new admissions (first come, first served). Policies:
- guaranteed_no_evict: admit a request only when the blocks for its whole prompt and max_new_tokens are free, and
  take them at once; nothing is ever preempted.
- max_utilization: admit while the prompt's next chunk fits; take blocks as tokens arrive; when a decode finds no
  free block, preempt the most recently admitted running request (its blocks are freed and it is recomputed later,
  prompt and generated tokens together).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from toolchain.runtime import speculative
from toolchain.runtime.blocks import BlockManager
from toolchain.runtime.request import Request, Status

POLICIES = ("guaranteed_no_evict", "max_utilization")


@dataclass
class Scheduled:
    request: Request
    tokens: list[int]  # fed this step (a decode's drafts are appended by the loop)
    context_len: int  # already in the cache
    spec: int = 0  # draft slots reserved for a decode (blocks and budget): the proposer may fill up to this many


class Scheduler:
    def __init__(
        self,
        blocks: BlockManager,
        max_batch_size: int,
        max_num_tokens: int,
        policy: str = "max_utilization",
        spec_tokens: int = 0,
        max_seq_len: int | None = None,
    ):
        """`spec_tokens`: draft slots to reserve per decode when speculating (issue 30), within `max_seq_len`."""
        if policy not in POLICIES:
            raise ValueError(f"policy {policy!r}; choose one of {', '.join(POLICIES)}")
        self.blocks, self.policy = blocks, policy
        self.max_batch_size, self.max_num_tokens = max_batch_size, max_num_tokens  # sequence length: check_request
        self.spec_tokens, self.max_seq_len = spec_tokens, max_seq_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.preempted = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def free(self, request: Request) -> None:
        """The request ended: its blocks go back and it leaves the running batch."""
        self.blocks.free(request)
        if request in self.running:
            self.running.remove(request)

    def _preempt(self, victim: Request) -> None:
        self.free(victim)
        victim.status = Status.WAITING
        victim.preemptions += 1
        self.preempted += 1
        self.waiting.appendleft(victim)

    def _draft_slots(self, request: Request, room: int) -> int:
        """How many drafted tokens a decode may carry this step: at most `spec_tokens`, the `room` left in the token
        budget, what max_new_tokens and max_seq_len still allow, and the blocks it holds or can take above the
        watermark — after every decode has its own token, so drafts never make anyone preempted."""
        if not speculative.may_speculate(request):
            return 0
        k = min(self.spec_tokens, room, request.params.max_new_tokens - len(request.generated) - 1)
        if self.max_seq_len is not None:
            k = min(k, self.max_seq_len - len(request.tokens))
        if k <= 0:
            return 0
        tokens = request.num_computed + 1 + k
        if not self.blocks.can_allocate_for(request, tokens) or not self.blocks.allocate_for(request, tokens):
            k = min(k, len(request.blocks) * self.blocks.tokens_per_block - request.num_computed - 1)
        return max(k, 0)

    def schedule(self, propose: Callable[[list[Scheduled]], int] | None = None) -> list[Scheduled]:
        """The next step's sequences: decodes first (with draft slots when speculating), then prefill chunks.
        `propose(decodes)` fills the decodes' draft slots and returns how many it left unused: they go back to the
        prefills' budget (an n-gram proposer often has nothing to propose)."""
        out: list[Scheduled] = []
        budget = self.max_num_tokens
        # 1. decodes, oldest first
        decodes = sorted((r for r in self.running if r.pending == 1), key=lambda r: r.arrival)
        for request in decodes:
            if request.status is not Status.RUNNING or budget == 0:  # preempted by an earlier decode this step
                continue
            while not self.blocks.allocate_for(request, request.num_computed + 1):
                scheduled = {id(s.request) for s in out}
                victim = next(r for r in reversed(self.running) if id(r) not in scheduled)  # most recently admitted
                self._preempt(victim)
                if victim is request:
                    break
            if request.status is Status.RUNNING:
                out.append(Scheduled(request, request.tokens[request.num_computed :], request.num_computed))
                budget -= 1
        # 1b. draft slots, from the budget and blocks every decode's own token left
        if self.spec_tokens and out:
            for s in out:
                s.spec = self._draft_slots(s.request, budget)
                budget -= s.spec
            if propose is not None:
                budget += propose(out)
        # 2. prefills in progress, then 3. admissions, while budget and batch room remain
        starved = False
        for request in [r for r in self.running if r.pending > 1]:
            if budget == 0 or len(out) >= self.max_batch_size:
                break
            chunk = min(request.pending, budget)
            if not self.blocks.allocate_for(request, request.num_computed + chunk):
                # shrink the chunk to the blocks there are; with none, admit nobody new this step, so that the
                # blocks finishing requests free go to this prefill instead of to newcomers
                chunk = min(chunk, self.blocks.max_tokens_for(request) - request.num_computed)
                if chunk <= 0 or not self.blocks.allocate_for(request, request.num_computed + chunk):
                    starved = True
                    continue
            out.append(
                Scheduled(
                    request, request.tokens[request.num_computed : request.num_computed + chunk], request.num_computed
                )
            )
            budget -= chunk
        if starved:
            if not out:  # partial prefills hold every block and none can go on: free the newest, or none ever would
                self._preempt(self.running[-1])
            return out
        while (
            self.waiting and budget > 0 and len(self.running) < self.max_batch_size and len(out) < self.max_batch_size
        ):
            request = self.waiting[0]
            total = len(request.tokens) + request.params.max_new_tokens - len(request.generated)
            if self.policy == "guaranteed_no_evict" and not self.blocks.can_allocate_for(request, total):
                break
            if request.params.prompt_logprobs is None:  # a cached block has no logits to report (as vLLM)
                self.blocks.share_prefix(request)
            chunk = min(request.pending, budget)
            target = total if self.policy == "guaranteed_no_evict" else request.num_computed + chunk
            if not self.blocks.can_allocate_for(request, target) or not self.blocks.allocate_for(request, target):
                self.blocks.free(request)  # the shared prefix goes back too
                break
            self.waiting.popleft()
            request.status = Status.RUNNING
            self.running.append(request)
            out.append(
                Scheduled(
                    request, request.tokens[request.num_computed : request.num_computed + chunk], request.num_computed
                )
            )
            budget -= chunk
        return out
