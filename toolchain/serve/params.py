"""A request body's sampling parameters: every field the server honours becomes a `SamplingParams` field, and every
value it cannot honour is refused by name (HTTP 400 naming the field). Issue 29, item 2.

FRAME: `sampling_params` is the former app._sampling, moved; slice B adds the penalties, logit_bias, min_tokens,
ignore_eos, stop_token_ids, min_p and the refusals; slice A the logprobs fields; slice C calls
structured.grammar_spec.
"""

from __future__ import annotations

from typing import Any

from toolchain.runtime.request import SamplingParams
from toolchain.serve import shapes
from toolchain.serve.protocol import ApiError, ChatCompletionRequest, CompletionRequest

# below this a temperature is greedy, as in vLLM: logits / 1e-300 overflow to inf, and the NaN that softmax makes
# of them would fail the step, and with it every request in the batch
GREEDY_BELOW = 1e-5


def sampling_params(
    body: CompletionRequest | ChatCompletionRequest,
    ids: list[int],
    max_seq_len: int,
    eos_ids: tuple[int, ...],
    tokenizer: Any,
) -> SamplingParams:
    """`body`'s parameters for a prompt of `ids` on an engine of `max_seq_len`; `eos_ids`: the tokenizer's end
    tokens (stop tokens unless the body says otherwise)."""
    limit = max_seq_len
    if len(ids) >= limit:
        field_name = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
        raise ApiError(400, f"the prompt has {len(ids)} tokens; this engine's max_seq_len is {limit}", param=field_name)
    asked = body.max_completion_tokens if isinstance(body, ChatCompletionRequest) else None
    asked = asked if asked is not None else body.max_tokens
    default = limit - len(ids) if isinstance(body, ChatCompletionRequest) else min(16, limit - len(ids))
    max_tokens = default if asked is None else asked
    if shapes.echo_only(body):  # vLLM: echo with max_tokens 0 runs the engine once, then returns the prompt only
        max_tokens = 1
    if max_tokens < 1 or len(ids) + max_tokens > limit:
        raise ApiError(
            400,
            f"max_tokens {max_tokens}: must be >= 1 and prompt ({len(ids)}) + max_tokens <= max_seq_len {limit}",
            param="max_tokens",
        )
    logprobs, prompt_logprobs = shapes.logprob_counts(body)
    return SamplingParams(
        max_new_tokens=max_tokens,
        temperature=body.temperature if body.temperature >= GREEDY_BELOW else 0.0,
        top_k=max(body.top_k, 0),
        top_p=body.top_p,
        seed=body.seed,
        stop_token_ids=eos_ids,
        stop_strings=body.stops(),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )
