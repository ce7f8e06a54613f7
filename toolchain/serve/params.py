"""A request body's sampling parameters: every field the server honours becomes a `SamplingParams` field, and every
value it cannot honour is refused by name (HTTP 400 naming the field). Issue 29, item 2.

The vLLM facts followed here (vllm/entrypoints/openai/completion/protocol.py `to_sampling_params`,
vllm/sampling_params.py `SamplingParams._verify_args`, vllm/v1/core/sched/utils.py `check_stop`):
`ignore_eos` drops the tokenizer's end token from the stop tokens (it is neither a stop nor masked by min_tokens)
while `stop_token_ids` still stop; `min_tokens` must not exceed `max_tokens`; `top_k` -1 (or 0) means no limit;
`logit_bias` keys are token ids of the model's vocabulary (vllm/v1/engine/processor.py `_validate_logit_bias`) —
vLLM clamps the values to [-100, 100], OpenAI documents that range: a value outside it is refused here.
`suffix` is refused in protocol.py (`_Sampling.refuse_unsupported`), as vLLM does.
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
    vocab_size: int | None = None,
    format_stops: tuple[int, ...] = (),
) -> SamplingParams:
    """`body`'s parameters for a prompt of `ids` on an engine of `max_seq_len` and `vocab_size` (logit_bias keys);
    `eos_ids`: the tokenizer's end tokens (stop tokens unless the body says `ignore_eos`); `format_stops`: tokens
    that end an answer in the chat format (gpt-oss's <|call|>), kept under `ignore_eos`."""
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
    if body.min_tokens > max_tokens:
        raise ApiError(
            400,
            f"min_tokens {body.min_tokens}: must be <= max_tokens ({max_tokens}); lower min_tokens or raise max_tokens",
            param="min_tokens",
        )
    stop_ids = list(() if body.ignore_eos else eos_ids)
    stop_ids += [t for t in format_stops if t not in stop_ids]
    stop_ids += [t for t in body.stop_token_ids or () if t not in stop_ids]
    if vocab_size is not None and any(not 0 <= t < vocab_size for t in stop_ids):
        bad = [t for t in stop_ids if not 0 <= t < vocab_size]
        raise ApiError(
            400, f"stop_token_ids {bad}: outside this engine's vocabulary [0, {vocab_size})", param="stop_token_ids"
        )
    logprobs, prompt_logprobs = shapes.logprob_counts(body)
    return SamplingParams(
        max_new_tokens=max_tokens,
        temperature=body.temperature if body.temperature >= GREEDY_BELOW else 0.0,
        top_k=max(body.top_k, 0),
        top_p=body.top_p,
        seed=body.seed,
        stop_token_ids=tuple(stop_ids),
        stop_strings=body.stops(),
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=body.repetition_penalty if body.repetition_penalty is not None else 1.0,
        logit_bias=logit_bias(body.logit_bias, vocab_size),
        min_tokens=body.min_tokens,
        min_p=body.min_p,
        include_stop_str_in_output=body.include_stop_str_in_output,
        skip_special_tokens=body.skip_special_tokens,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )


def logit_bias(bias: dict[str, float] | None, vocab_size: int | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's `logit_bias` ({"token id": bias}) as (id, bias) pairs; zero biases dropped (they change nothing and
    would make a plain request a host row). A key that is not a token id of the vocabulary, or a bias outside
    [-100, 100], is refused naming the key."""
    pairs = []
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            token = -1
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            span = f"[0, {vocab_size})" if vocab_size is not None else "the vocabulary"
            raise ApiError(
                400, f"logit_bias key {key!r}: must be a token id in {span} (send ids, not text)", param="logit_bias"
            )
        if not -100 <= value <= 100:
            raise ApiError(
                400, f"logit_bias[{key!r}] = {value}: must be in [-100, 100] (OpenAI's range)", param="logit_bias"
            )
        if value:
            pairs.append((token, float(value)))
    return tuple(pairs)
