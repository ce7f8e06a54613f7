"""Logprobs in OpenAI's response shapes (issue 29, item 1): completions' `{text_offset, token_logprobs, tokens,
top_logprobs}` (with echo, prompt positions first) and chat's `{content: [{token, logprob, bytes, top_logprobs}]}`,
for whole responses and for streamed chunks; vLLM's `prompt_logprobs` extension; echo; and the checks of the
logprob fields of a request.

Sources (vLLM, read): completions -- vllm/entrypoints/openai/serving_completion.py `_create_completion_logprobs`
(a position without logprobs: the token with None and None; `top_logprobs` a dict of the chosen token then the top
N, keyed by token string; logprobs floored at -9999.0; `text_offset` from the text before the first token, then
cumulative token-string lengths) and `request_output_to_completion_response` (echo: the prompt's text and positions
first; `echo` with `max_tokens` 0 generates one token and returns only the prompt); its protocol.py
`to_sampling_params` (echo: `prompt_logprobs` defaults to `logprobs`) and `validate_prompt_and_prompt_logprobs` /
`check_logprobs` (prompt_logprobs refused with stream). Chat -- serving_chat.py `_create_chat_logprobs`
(`bytes` = the token string's UTF-8, errors replaced) and protocol.py `check_logprobs` (top_logprobs needs logprobs
true, except 0). Token strings -- vllm/tokenizers/detokenizer_utils.py `convert_ids_list_to_tokens`: each token
decoded alone, the leading spaces a SentencePiece Metaspace piece's marker stands for put back. Limits: 0..20,
vLLM's default `max_logprobs`; -1 (vLLM's "the whole vocabulary") refused by name.

One difference from vLLM, by choice: chat's `top_logprobs` lists the N most likely tokens (OpenAI's meaning);
vLLM lists the sampled token first, then the most likely ones, which differs only when a sampled token is not the
most likely.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from typing import Any

from toolchain.runtime.logprobs import MAX_LOGPROBS
from toolchain.runtime.request import TokenLogprob
from toolchain.serve.protocol import ApiError, ChatCompletionRequest, CompletionRequest

FLOOR = -9999.0  # vLLM's floor for -inf logprobs (JSON has no -inf)
_MARKER = "_trtbuild_space_marker"


def check_logprobs(body: CompletionRequest | ChatCompletionRequest) -> None:
    """Refuse logprob fields this server cannot honour, naming the field, the value and the allowed range."""
    fields: list[tuple[str, int | None]] = []
    if isinstance(body, ChatCompletionRequest):
        fields.append(("top_logprobs", body.top_logprobs))
        if body.echo:
            raise ApiError(400, "echo is served on /v1/completions only: send the prompt there", param="echo")
    else:
        fields += [("logprobs", body.logprobs), ("prompt_logprobs", body.prompt_logprobs)]
    for name, value in fields:
        if value is None:
            continue
        if value == -1:
            raise ApiError(
                400,
                f"{name} -1 (every token of the vocabulary) is not supported: ask for 0 to {MAX_LOGPROBS} alternatives",
                param=name,
            )
        if not 0 <= value <= MAX_LOGPROBS:
            raise ApiError(
                400, f"{name} {value}: must be between 0 and {MAX_LOGPROBS} (vLLM's max_logprobs)", param=name
            )
    if isinstance(body, ChatCompletionRequest):
        if body.top_logprobs and not body.logprobs:
            raise ApiError(400, f"top_logprobs {body.top_logprobs} needs logprobs: true as well", param="top_logprobs")
    elif body.prompt_logprobs is not None and body.stream:
        raise ApiError(
            400, "prompt_logprobs cannot be streamed: send stream false, or echo with logprobs", param="prompt_logprobs"
        )


def logprob_counts(body: CompletionRequest | ChatCompletionRequest) -> tuple[int | None, int | None]:
    """(logprobs, prompt_logprobs) for the runtime: alternatives per generated token and per prompt position."""
    if isinstance(body, ChatCompletionRequest):
        return (body.top_logprobs or 0 if body.logprobs else None), None
    prompt = body.prompt_logprobs if body.prompt_logprobs is not None else (body.logprobs if body.echo else None)
    return body.logprobs, prompt


def echo_only(body: CompletionRequest | ChatCompletionRequest) -> bool:
    """echo with max_tokens 0: the one token generated (the engine must run once) is not returned."""
    return isinstance(body, CompletionRequest) and body.echo and body.max_tokens == 0


def echo_text(
    tokenizer: Any, body: CompletionRequest | ChatCompletionRequest, prompt_ids: Sequence[int], index: int = 0
) -> str:
    """The text echo puts before the completion of prompt `index`: the prompt as sent, or the token ids' text; ""
    without echo."""
    if not isinstance(body, CompletionRequest) or not body.echo:
        return ""
    prompt = body.prompts()[index]
    if isinstance(prompt, str):
        return prompt
    return "" if tokenizer is None else str(tokenizer.decode(list(prompt_ids)))


def token_strings(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    """Each token's text decoded alone, as vLLM's `convert_ids_list_to_tokens` (token ids as text without a
    tokenizer)."""
    if tokenizer is None:
        return [str(t) for t in ids]
    marker = _space_marker(tokenizer)
    texts = [str(tokenizer.decode([t]) or "") for t in ids]
    if marker is None:
        return texts
    out = []
    for raw, text in zip(tokenizer.convert_ids_to_tokens(list(ids)), texts, strict=True):
        markers = len(raw or "") - len((raw or "").lstrip(marker))
        missing = markers - (len(text) - len(text.lstrip(" ")))
        out.append(" " * missing + text if missing > 0 else text)
    return out


def _space_marker(tokenizer: Any) -> str | None:
    """The Metaspace pre-tokenizer's replacement character (SentencePiece's "▁"), whose leading instance decode()
    drops from a token alone; None for other tokenizers. Cached on the tokenizer, as vLLM does."""
    cached = getattr(tokenizer, _MARKER, "")
    if cached != "":
        return cached
    marker = None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        try:
            pre = json.loads(backend.to_str()).get("pre_tokenizer") or {}
        except (ValueError, AttributeError):
            pre = {}
        for p in [pre, *pre.get("pretokenizers", [])]:
            if p.get("type") == "Metaspace":
                marker = p.get("replacement", "▁")
                break
    with contextlib.suppress(AttributeError):  # a tokenizer that takes no attributes: computed again next time
        setattr(tokenizer, _MARKER, marker)
    return marker


def _names(tokenizer: Any, ids: Sequence[int]) -> dict[int, str]:
    """Each distinct token's string, decoded once."""
    unique = list(dict.fromkeys(ids))
    return dict(zip(unique, token_strings(tokenizer, unique), strict=True))


def _floor(value: float) -> float:
    return max(value, FLOOR)


def response_logprobs(
    tokenizer: Any,
    body: CompletionRequest | ChatCompletionRequest,
    generated: Sequence[TokenLogprob],
    prompt: Sequence[TokenLogprob | None] | None,
    offset: int = 0,
    prompt_ids: Sequence[int] = (),
) -> dict[str, Any] | None:
    """The choice's `logprobs` object for `generated` tokens' logprobs (and with echo the `prompt`'s first), or None
    when the request did not ask. `offset`: characters of text before the first token (text_offset, streaming);
    `prompt_ids`: the prompt's tokens (echo names position 0's, which has no logprob)."""
    if isinstance(body, ChatCompletionRequest):
        return _chat(tokenizer, body.top_logprobs or 0, generated) if body.logprobs else None
    if body.logprobs is None:
        return None
    positions: list[tuple[int, TokenLogprob | None]] = []
    if body.echo and prompt is not None:
        positions += [(t, lp) for t, lp in zip(prompt_ids, prompt, strict=True)]
    positions += [(lp.token, lp) for lp in generated]
    return _completion(tokenizer, body.logprobs, positions, offset)


def _completion(
    tokenizer: Any, top: int, positions: Sequence[tuple[int, TokenLogprob | None]], offset: int
) -> dict[str, Any]:
    ids = [t for t, _ in positions]
    names = _names(tokenizer, [*ids, *(a for _, lp in positions if lp is not None for a, _ in lp.top[:top])])
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []
    for token, lp in positions:
        text = names[token]
        text_offset.append(offset if not text_offset else text_offset[-1] + len(tokens[-1]))
        tokens.append(text)
        if lp is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(_floor(lp.logprob))
        best = {text: _floor(lp.logprob)}  # the chosen token first, then the top N (a repeated string: the last)
        for t, value in lp.top[:top]:
            best[names[t]] = _floor(value)
        top_logprobs.append(best)
    return {
        "text_offset": text_offset,
        "token_logprobs": token_logprobs,
        "tokens": tokens,
        "top_logprobs": top_logprobs,
    }


def _chat(tokenizer: Any, top: int, generated: Sequence[TokenLogprob]) -> dict[str, Any]:
    names = _names(tokenizer, [*(lp.token for lp in generated), *(a for lp in generated for a, _ in lp.top[:top])])

    def entry(token: int, value: float) -> dict[str, Any]:
        text = names[token]
        return {"token": text, "logprob": _floor(value), "bytes": list(text.encode("utf-8", errors="replace"))}

    content = [
        {**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top[:top]]} for lp in generated
    ]
    return {"content": content}


def prompt_logprobs(
    tokenizer: Any, body: CompletionRequest | ChatCompletionRequest, prompt: Sequence[TokenLogprob | None] | None
) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's `prompt_logprobs` choice field, when the request asked for it: per prompt position (None for the
    first) the prompt token and the top N, keyed by token id, each `{logprob, rank, decoded_token}`."""
    if not isinstance(body, CompletionRequest) or body.prompt_logprobs is None or prompt is None:
        return None
    top = body.prompt_logprobs
    names = _names(tokenizer, [i for lp in prompt if lp is not None for i in (lp.token, *(t for t, _ in lp.top[:top]))])
    out: list[dict[str, dict[str, Any]] | None] = []
    for lp in prompt:
        if lp is None:
            out.append(None)
            continue
        entries = {str(lp.token): {"logprob": _floor(lp.logprob), "rank": lp.rank, "decoded_token": names[lp.token]}}
        for rank, (t, value) in enumerate(lp.top[:top], start=1):
            entries.setdefault(str(t), {"logprob": _floor(value), "rank": rank, "decoded_token": names[t]})
        out.append(entries)
    return out
