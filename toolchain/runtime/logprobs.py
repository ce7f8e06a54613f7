"""Logprobs (issue 29, item 1): the raw log-softmax of the engine's logits (vLLM's default `raw_logprobs`), for the
generated tokens of requests that ask (`SamplingParams.logprobs`) and for the prompt positions of requests that ask
`prompt_logprobs` (the engine then returns every position's logits for that sequence's prefill chunks). Computed
only for the rows that ask: a request without them costs nothing here.

FRAME STUB: slice A fills these.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from toolchain.runtime.request import Request, TokenLogprob


def token_logprob(row: np.ndarray, token: int, top: int) -> TokenLogprob:
    """`token`'s raw logprob in the logits `row` [vocab], with the `top` best alternatives (best first)."""
    raise NotImplementedError("logprobs: slice A")


def wants_prompt_rows(request: Request, context_len: int, new_tokens: int) -> bool:
    """Whether this step's chunk of `request` (`new_tokens` tokens after `context_len` cached ones) needs every
    position's logits: it asked for prompt logprobs and the chunk covers prompt positions not collected yet."""
    return False


def collect_prompt(request: Request, context_len: int, rows: Sequence[np.ndarray]) -> None:
    """Store the prompt logprobs this chunk's `rows` (one per new token, the logits after it) give into
    `request.prompt_lps` (position 0 has none: None)."""
    raise NotImplementedError("prompt logprobs: slice A")
