"""Logprobs in OpenAI's response shapes (issue 29, item 1): completions' `{text_offset, token_logprobs, tokens,
top_logprobs}` (with echo, prompt positions first) and chat's `{content: [{token, logprob, bytes, top_logprobs}]}`,
for whole responses and for streamed chunks; and the checks of the logprob fields of a request.

FRAME STUB: slice A fills these; until then requests asking for logprobs are refused (protocol.refuse_unsupported).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from toolchain.runtime.request import TokenLogprob
from toolchain.serve.protocol import ChatCompletionRequest, CompletionRequest


def response_logprobs(
    tokenizer: Any,
    body: CompletionRequest | ChatCompletionRequest,
    generated: Sequence[TokenLogprob],
    prompt: Sequence[TokenLogprob | None] | None,
    offset: int = 0,
) -> dict[str, Any] | None:
    """The choice's `logprobs` object for `generated` tokens' logprobs (and with echo the `prompt`'s first), or None
    when the request did not ask. `offset`: characters of text before the first token (text_offset, streaming)."""
    return None
