"""What the speculative-decoding tests share (issue 30): a scripted proposer that drafts the true greedy continuation
with chosen positions corrupted (so acceptance is known in advance), and a block-manager invariant check that a
rejected draft can break if rollback is wrong."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from toolchain.runtime.blocks import BlockManager
from toolchain.runtime.loop import Runtime
from toolchain.runtime.request import Request
from toolchain.runtime.scheduler import Scheduled
from toolchain.runtime.speculative import Draft


class ScriptedProposer:
    """Drafts `truth(request.tokens)`'s continuation, k tokens, with draft position j replaced by a wrong token when
    `wrong(step, j)` says so. `proposed` counts the drafted tokens."""

    def __init__(
        self,
        truth: Callable[[list[int]], int],
        wrong: Callable[[int, int], bool] = lambda step, j: False,
        vocab: int = 320,
    ) -> None:
        self.truth, self.wrong, self.vocab = truth, wrong, vocab
        self.calls = self.proposed = 0

    def propose(self, scheduled: Sequence[Scheduled]) -> list[Draft | None]:
        self.calls += 1
        out: list[Draft | None] = []
        for s in scheduled:
            if not s.spec:
                out.append(None)
                continue
            context, tokens = list(s.request.tokens), []
            for j in range(s.spec):
                t = self.truth(context)
                if self.wrong(self.calls, j):
                    t = (t + 1 + j) % self.vocab
                tokens.append(t)
                context.append(t)
            self.proposed += len(tokens)
            out.append(Draft(tokens))
        return out

    def release(self, request: Request) -> None:
        pass


def check_blocks(rt: Runtime) -> None:
    """The block manager's books balance, and every block the prefix cache can hand out holds the tokens its owner
    really has at that place (a rejected draft registered as a cached block would break this)."""
    blocks: BlockManager = rt.blocks
    live = list(rt.requests.values())
    held = [b for r in live for b in r.blocks]
    for b in set(held):
        assert blocks.refcount[b] >= held.count(b), (
            f"block {b} referenced {held.count(b)}x, refcount {blocks.refcount[b]}"
        )
    t = blocks.tokens_per_block
    for r in live:
        assert r.num_computed <= len(r.tokens), (r.id, r.num_computed, len(r.tokens))
        for i in range(min(r.registered, r.num_computed // t)):
            entry = blocks.cached.get(r.blocks[i])
            if entry is not None and blocks.block_of.get(entry.hash) == r.blocks[i]:
                assert entry.tokens == tuple(r.tokens[i * t : (i + 1) * t]), f"{r.id} block {i} caches other tokens"
