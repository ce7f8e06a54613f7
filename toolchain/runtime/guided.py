"""Structured output (issue 29, item 3): one grammar matcher per constrained request; each step the allowed-token
masks of the constrained rows are computed on a worker thread while the engine runs (`begin` before the engine
call, `wait` after it), then applied to the host rows (`mask`), and the chosen token advances the matcher
(`accept`).

FRAME STUB: `Guide` does nothing (no request has a grammar until slice C fills this module).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from toolchain.runtime.request import Request

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


class Guide:
    """The runtime's grammar engine, built once per runtime from its tokenizer (None: no structured output)."""

    def __init__(self, tokenizer: object | None, vocab: int) -> None:
        self.tokenizer, self.vocab = tokenizer, vocab

    def add(self, request: Request) -> str | None:
        """Start `request`'s matcher (its params.grammar); why it cannot be constrained, or None."""
        if request.params.grammar is not None:
            return "structured output is not available in this runtime"
        return None

    def begin(self, requests: Sequence[Request]) -> None:
        """Start computing the next-token masks of `requests` (off the caller's thread)."""

    def wait(self) -> None:
        """Wait for the masks `begin` started."""

    def mask(self, request: Request, scores: torch.Tensor) -> None:
        """Set the scores of the tokens `request`'s grammar forbids to -inf, in place."""

    def accept(self, request: Request, token: int) -> str | None:
        """Advance `request`'s matcher by `token`; why the grammar refuses it, or None."""
        return None

    def release(self, request: Request) -> None:
        """`request` ended: drop its matcher."""
