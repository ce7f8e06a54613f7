"""Draft-target speculation (issue 30): a small draft engine (trtbuild-built, same tokenizer) runs ahead of the
target: each step it catches up on the sequence's accepted tokens and drafts k tokens one call at a time; its KV
lives in its own pool indexed by the target's block ids (no second block manager).

FRAME STUB: `check_draft` checks nothing and `DraftProposer` proposes nothing. Slice B fills them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from toolchain.runtime.speculative import Draft, SpecConfig

if TYPE_CHECKING:
    from toolchain.engine.api import Engine
    from toolchain.runtime.request import Request
    from toolchain.runtime.scheduler import Scheduled


def check_draft(target: Engine, draft: Engine) -> None:
    """Refuse a draft that cannot serve `target` (another tokenizer or vocabulary, another tokens_per_block,
    smaller limits), naming both engines and the first difference."""


class DraftProposer:
    def __init__(self, config: SpecConfig, draft: Engine) -> None:
        self.config, self.draft = config, draft

    def propose(self, scheduled: Sequence[Scheduled]) -> list[Draft | None]:
        return [None for _ in scheduled]

    def release(self, request: Request) -> None:
        pass
