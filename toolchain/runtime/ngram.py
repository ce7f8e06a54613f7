"""N-gram prompt lookup (issue 30): drafts are the tokens that followed the latest n-gram's earlier occurrence in the
request's own tokens (prompt and output), as vLLM's ngram proposer (vllm/v1/spec_decode/ngram_proposer.py): the
longest n in [prompt_lookup_min, prompt_lookup_max] whose suffix occurs earlier, the earliest such occurrence, at
most k tokens after it. No model, no KV.

FRAME STUB: proposes nothing. Slice A fills it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from toolchain.runtime.speculative import Draft, SpecConfig

if TYPE_CHECKING:
    from toolchain.runtime.request import Request
    from toolchain.runtime.scheduler import Scheduled


class NgramProposer:
    def __init__(self, config: SpecConfig) -> None:
        self.config = config

    def propose(self, scheduled: Sequence[Scheduled]) -> list[Draft | None]:
        return [None for _ in scheduled]

    def release(self, request: Request) -> None:
        pass
