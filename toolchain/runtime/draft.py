"""Draft-target speculation (issue 30): a small draft engine (trtbuild-built, same tokenizer) runs ahead of the
target: each step it catches up on the sequence's accepted tokens and drafts k tokens one call at a time; its KV
lives in its own pool indexed by the target's block ids (no second block manager).

The draft pool mirrors the target's: block b of a request holds, in the draft pool, the draft model's K/V of the
same positions. Per request the proposer remembers how far the draft pool is right (`_State`): the tokens it fed
that are still the request's tokens. Positions it fed past them (drafts the target rejected) are simply
overwritten later, as the target's are. The state is void when the request's block table is replaced (preemption
frees it; admission on a shared prefix starts a new one): the draft then recomputes from position 0, the shared
prefix included, so acceptance never depends on what the prefix cache happened to hold (issue 30, Q5).

Per step, call 1 carries every drafting decode's catch-up (1 token, or 2 after a fully accepted draft: the last
drafted token was never fed to the draft) and yields d1 from its last row; with the token budget left it also
feeds the prefill chunks the target runs this step (same positions, same blocks), so a long prompt does not land
on the draft as one catch-up at the first decode (the runtime calls no proposer in a step without a drafting
decode: chunks run then are caught up later). Calls 2..k feed one token per still-drafting sequence. A
catch-up that does not fit the draft's `max_num_tokens` is fed in part and that sequence gets no draft this step.
Exactness never depends on the draft's KV (the target verifies every drafted token), only acceptance does.

A greedy request's draft is the draft model's argmax (reduced on the device, as the target's). A sampled request's
draft samples from the draft's own distribution q (temperature, top-k, top-p as `sampler.sample`, no penalties:
any q is valid as long as the draft drew from it, Leviathan et al. 2023 §2.3) with its own generator seeded from
the request's seed, and returns q's rows for the acceptance rule (runtime/rejection.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from toolchain.engine.contract import Batch
from toolchain.errors import UserError
from toolchain.runtime import sampler, speculative
from toolchain.runtime.request import SamplingParams
from toolchain.runtime.speculative import Draft, SpecConfig

if TYPE_CHECKING:
    from toolchain.engine.api import Engine
    from toolchain.runtime.request import Request
    from toolchain.runtime.scheduler import Scheduled

_DRAFT_SEED = 0x5D_2AF7  # mixed into the request's seed: the draft's draws are not the target's


def check_draft(target: Engine, draft: Engine) -> None:
    """Refuse a draft that cannot serve `target` (another tokenizer or vocabulary, another tokens_per_block,
    smaller limits), naming both engines and the first difference."""
    from toolchain.engine.api import load_tokenizer

    t_dir, d_dir = target.spec.engine_dir, draft.spec.engine_dir
    pair = f"draft engine {d_dir} cannot speculate for target {t_dir}"
    try:
        d_tok = load_tokenizer(d_dir)
    except UserError as e:
        raise UserError(f"{pair}: cannot check it shares the target's tokenizer ({e})") from e
    t_tok = load_tokenizer(t_dir)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        d_id, t_id = getattr(d_tok, name, None), getattr(t_tok, name, None)
        if d_id != t_id:
            raise UserError(f"{pair}: another tokenizer ({name} {d_id} vs the target's {t_id})")
    d_vocab, t_vocab = d_tok.get_vocab(), t_tok.get_vocab()
    if d_vocab != t_vocab:
        t_by_id = {i: s for s, i in t_vocab.items()}
        d_by_id = {i: s for s, i in d_vocab.items()}
        first = min(i for i in set(t_by_id) | set(d_by_id) if t_by_id.get(i) != d_by_id.get(i))
        raise UserError(
            f"{pair}: another tokenizer (token id {first} is {d_by_id.get(first)!r} in the draft, "
            f"{t_by_id.get(first)!r} in the target)"
        )
    if draft.vocab_size != target.vocab_size:
        raise UserError(f"{pair}: vocab_size {draft.vocab_size} vs the target's {target.vocab_size}")
    if draft.tokens_per_block != target.tokens_per_block:
        raise UserError(
            f"{pair}: tokens_per_block {draft.tokens_per_block} vs the target's {target.tokens_per_block} (its KV "
            f"pool is indexed by the target's blocks); rebuild the draft with --tokens-per-block "
            f"{target.tokens_per_block}"
        )
    d_lim, t_lim = draft.spec.limits, target.spec.limits
    for name in ("max_batch_size", "max_num_tokens", "max_seq_len", "num_blocks"):
        if getattr(d_lim, name) < getattr(t_lim, name):
            flag = "--" + name.replace("_", "-")
            fix = f"rebuild the draft with {flag} {getattr(t_lim, name)}"
            if name == "num_blocks":  # the pool a TensorRT plan takes: max_batch_size x blocks of max_seq_len
                fix = "rebuild the draft with the target's --max-batch-size and --max-seq-len"
            raise UserError(
                f"{pair}: limits.{name} {getattr(d_lim, name)} is below the target's {getattr(t_lim, name)}; {fix}"
            )


@dataclass
class _State:
    """What the draft pool holds for one request: K/V of `request.tokens[:base]`, then of `extra` (drafted tokens
    fed after them, right as far as they are still the request's tokens), in the block table `blocks` (the list
    object: the block manager replaces it when it frees or re-admits the request)."""

    blocks: list[int]
    preemptions: int
    base: int = 0
    extra: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None


@dataclass
class _Feed:
    index: int  # in `scheduled`
    tokens: list[int]
    start: int  # position of tokens[0]
    drafting: bool  # the last row's logits give this sequence's next drafted token


class DraftProposer:
    def __init__(self, config: SpecConfig, draft: Engine) -> None:
        self.config, self.draft = config, draft
        self.limits = draft.spec.limits
        self.pool = draft.new_kv_cache(self.limits.num_blocks)
        self.calls = 0  # draft engine calls, for tests and bench

    # -- the per-request state ----------------------------------------------------------------------------------
    def progress(self, request: Request) -> int:
        """How many of `request.tokens` the draft pool holds right, from position 0."""
        state = request.spec_state
        if not isinstance(state, _State) or state.blocks is not request.blocks:
            return 0
        if state.preemptions != request.preemptions:
            return 0
        n, tokens = state.base, request.tokens
        for t in state.extra:
            if n >= len(tokens) or tokens[n] != t:
                break
            n += 1
        return n

    def _state(self, request: Request, progress: int) -> _State:
        state = request.spec_state
        if not isinstance(state, _State) or state.blocks is not request.blocks:
            old = state.generator if isinstance(state, _State) else None
            state = _State(request.blocks, request.preemptions, generator=old)
            request.spec_state = state
        state.preemptions, state.base, state.extra = request.preemptions, progress, []
        return state

    def release(self, request: Request) -> None:
        request.spec_state = None

    # -- drafting -----------------------------------------------------------------------------------------------
    def propose(self, scheduled: Sequence[Scheduled]) -> list[Draft | None]:
        out: list[Draft | None] = [None] * len(scheduled)
        feeds = self._catch_up(scheduled)
        if not feeds:
            return out
        self._grow_pool(scheduled)
        drafts: dict[int, list[int]] = {}
        probs: dict[int, list[np.ndarray]] = {}
        states = {f.index: self._state(scheduled[f.index].request, f.start) for f in feeds}
        active = feeds
        while active:
            rows = self._run(scheduled, active)
            nxt: list[_Feed] = []
            for f, row in zip(active, rows, strict=True):
                state = states[f.index]
                state.extra += f.tokens
                if not f.drafting:
                    continue
                token, q = row
                drafts.setdefault(f.index, []).append(token)
                if q is not None:
                    probs.setdefault(f.index, []).append(q)
                if len(drafts[f.index]) < scheduled[f.index].spec:
                    nxt.append(_Feed(f.index, [token], f.start + len(f.tokens), True))
            active = nxt
        for i, tokens in drafts.items():
            rows_q = probs.get(i)
            out[i] = Draft(tokens, np.stack(rows_q) if rows_q else None)
        return out

    def _catch_up(self, scheduled: Sequence[Scheduled]) -> list[_Feed]:
        """Call 1's chunks: each drafting decode's catch-up first (they give drafts), then the prefill chunks the
        target runs this step, within the draft's token budget and batch size."""
        budget, room = self.limits.max_num_tokens, self.limits.max_batch_size
        order = sorted(range(len(scheduled)), key=lambda i: not scheduled[i].spec)
        feeds = []
        for i in order:
            s = scheduled[i]
            request = s.request
            end = min(len(request.tokens), s.context_len + len(s.tokens))  # what the target holds after this step
            if not s.spec and (len(s.tokens) < 2 or not speculative.may_speculate(request)):
                continue  # a decode without draft slots, or a request that never drafts: nothing to feed
            start = self.progress(request)
            if s.spec:
                start = min(start, end - 1)  # the last token's row gives d1: fed again if the pool had it
            n = min(end - start, budget)
            if n <= 0 or room == 0:
                continue
            feeds.append(_Feed(i, request.tokens[start : start + n], start, s.spec > 0 and start + n == end))
            budget, room = budget - n, room - 1
        return feeds

    def _run(self, scheduled: Sequence[Scheduled], feeds: list[_Feed]) -> list[tuple[int, np.ndarray | None]]:
        """One draft engine call; each feed's next token (and its q row when the request samples)."""
        batch = Batch.from_sequences(
            [f.tokens for f in feeds], [f.start for f in feeds], [scheduled[f.index].request.blocks for f in feeds]
        )
        host = [f.drafting and scheduled[f.index].request.params.temperature > 0 for f in feeds]
        step = self.draft.forward_tokens(batch, self.pool, [r for r, h in enumerate(host) if h])
        self.calls += 1
        greedy = step.greedy.tolist()
        out: list[tuple[int, np.ndarray | None]] = []
        for r, f in enumerate(feeds):
            if not host[r]:
                out.append((int(greedy[r]), None))
                continue
            request = scheduled[f.index].request
            state = request.spec_state
            assert isinstance(state, _State)
            if state.generator is None:
                state.generator = torch.Generator().manual_seed((request.seed ^ _DRAFT_SEED) & ((1 << 63) - 1))
            q = distribution(step.rows[r], request.params)
            out.append((int(torch.multinomial(torch.from_numpy(q), 1, generator=state.generator)), q))
        return out

    def _grow_pool(self, scheduled: Sequence[Scheduled]) -> None:
        """The runtime's pool may have more blocks than the draft engine's default (`Runtime(num_blocks=...)`):
        grow the draft pool to hold every block id (a TensorRT plan refuses past its profile, naming it)."""
        top = max((max(s.request.blocks, default=-1) for s in scheduled), default=-1) + 1
        have = self.pool.shape[1]
        if top > have:
            pool = self.draft.new_kv_cache(top)
            pool[:, :have] = self.pool
            self.pool = pool


def distribution(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The draft's q over the vocabulary: the sampler's own distribution (temperature, min-p, top-k, top-p) of the
    draft's raw row, the definition the target's p comes from too (float64, sums to 1)."""
    out: np.ndarray = sampler.distribution(logits, params).numpy()
    return out
