"""Speculative decoding (issue 30): a proposer drafts up to k tokens for a decoding sequence, the engine verifies them
in the same call as the rest of the batch (the sequence's chunk is `[last, d1..dk]`, with a logits row per token),
and the runtime keeps the longest run the target agrees with plus one token of its own. Rejected drafts' KV needs no
undo: the request's `num_computed` advances only over accepted tokens, so their slots are overwritten by the next
step and never reach a registered (prefix-cache) or shared block.

Proposers: n-gram prompt lookup (runtime/ngram.py: vLLM's `prompt_lookup_min/max` semantics, no model) and
draft-target (runtime/draft.py: a smaller engine built by trtbuild with the target's tokenizer). Acceptance under
greedy decoding is the argmax rule (output identical to greedy without speculation); under sampling, the rule of
Leviathan et al. 2023 / Chen et al. 2023 (runtime/rejection.py), which keeps the target's distribution.

Counting follows vLLM (vllm/v1/spec_decode/metrics.py): a draft is one request-step with at least one drafted
token; acceptance rate = accepted / drafted tokens; mean accepted length = 1 + accepted / drafts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from toolchain.engine.api import Engine
    from toolchain.runtime.request import Request
    from toolchain.runtime.scheduler import Scheduled

METHODS = ("ngram", "draft")


@dataclass(frozen=True)
class SpecConfig:
    """How a runtime speculates: `method` (ngram or draft), up to `num_speculative_tokens` drafted per step, and the
    n-gram proposer's match lengths (vLLM's prompt_lookup_min / prompt_lookup_max)."""

    method: str
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method {self.method!r}: choose one of {', '.join(METHODS)}")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens {self.num_speculative_tokens}: must be at least 1")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min {self.prompt_lookup_min}, prompt_lookup_max {self.prompt_lookup_max}: need "
                "1 <= min <= max"
            )


@dataclass
class Draft:
    """A proposal for one sequence: `tokens` (at most its `Scheduled.spec`), and `probs` [len(tokens), vocab], the
    distributions the draft sampled them from, or None when each is a point mass (n-gram; a draft's argmax)."""

    tokens: list[int]
    probs: np.ndarray | None = None
    # a sampled draft cut by a grammar (loop._propose): the refused token after `tokens` and the q row it was drawn
    # from. The rule would reject it (its p is 0) and draw from the residual, so the position after the kept tokens
    # must draw from normalize(max(p - q, 0)), not from p: a plain draw there would skew the distribution.
    refused: tuple[int, np.ndarray] | None = None


class Proposer(Protocol):
    def propose(self, scheduled: Sequence[Scheduled]) -> list[Draft | None]:
        """One entry per scheduled sequence: a draft of at most `s.spec` tokens following `s.request.tokens` for the
        sequences with `s.spec > 0`, None for the others (and where it has nothing to propose)."""
        ...

    def release(self, request: Request) -> None:
        """`request` ended: drop what the proposer keeps for it."""
        ...


@dataclass
class SpecStats:
    """Speculation counters (vLLM's): `drafts` request-steps with drafted tokens, `draft_tokens` drafted,
    `accepted` accepted, `per_pos[i]` drafts whose position i was accepted."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    per_pos: list[int] = field(default_factory=list)

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        self.drafts += 1
        self.draft_tokens += drafted
        self.accepted += accepted
        if len(self.per_pos) < drafted:
            self.per_pos += [0] * (drafted - len(self.per_pos))
        for i in range(accepted):
            self.per_pos[i] += 1

    def add(self, other: SpecStats) -> None:
        self.drafts += other.drafts
        self.draft_tokens += other.draft_tokens
        self.accepted += other.accepted
        if len(self.per_pos) < len(other.per_pos):
            self.per_pos += [0] * (len(other.per_pos) - len(self.per_pos))
        for i, n in enumerate(other.per_pos):
            self.per_pos[i] += n

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.draft_tokens if self.draft_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        return 1 + self.accepted / self.drafts if self.drafts else None

    def to_json(self) -> dict[str, Any]:
        return {
            "drafts": self.drafts,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted,
            "accepted_per_position": list(self.per_pos),
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
        }


def may_speculate(request: Request) -> bool:
    """Whether the scheduler reserves draft slots for `request`: every request does. Plain greedy requests verify on
    the engine's argmax per row; host rows (sampling, penalties, logit_bias, logprobs, grammars) through the
    acceptance rule of runtime/rejection.py, each position processed as a plain step would (a grammar's masks for
    the drafted positions: runtime/guided.py)."""
    return True


def make_proposer(config: SpecConfig, target: Engine, draft: Engine | None = None) -> Proposer:
    """The proposer `config` names; draft-target needs the `draft` engine (checked against the target)."""
    if config.method == "ngram":
        from toolchain.runtime.ngram import NgramProposer

        return NgramProposer(config)
    from toolchain.runtime.draft import DraftProposer, check_draft

    if draft is None:
        raise ValueError("speculative method 'draft' needs a draft engine (--draft DIR)")
    check_draft(target, draft)
    return DraftProposer(config, draft)
