"""OpenAI's request and response shapes for /v1/completions and /v1/chat/completions (the subset we serve), and
its error JSON. Fields we do not support are refused by name rather than ignored: a client that asks for n=2 or
logprobs and silently gets one plain answer has been misled.

Reference for the shapes: OpenAI's API reference (Completions, Chat Completions, streaming chunks with
stream_options.include_usage) as vLLM and trtllm-serve implement them.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field


class ApiError(Exception):
    """An error the client caused or must handle: HTTP status, OpenAI error type, message, offending field."""

    def __init__(
        self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param
        self.headers: dict[str, str] = {}
        self.logged = False  # its request's log line is written already (an admitted request that failed)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


# Fields OpenAI or vLLM define that clients send (apps: user, metadata) and that this server accepts without acting
# on them. Every other field is either honoured or refused by name; an unknown field is refused too: a misspelt
# `max_token` must not silently fall back to the default. (Issue 29 frame: the slices move the entries below the
# first four out as they honour them.)
ACCEPTED_UNUSED = (
    "user",
    "metadata",
    "store",
    "service_tier",
)


MAX_STOPS = 16  # stop strings per request


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid")  # every accepted field is declared below

    model: str
    max_tokens: int | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # vLLM's extension; 0 (or vLLM's -1) = no limit
    min_p: float = Field(0.0, ge=0.0, le=1.0)  # vLLM's extension
    seed: int | None = Field(None, ge=0, lt=2**64)  # what torch.Generator.manual_seed accepts
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM's extension
    include_stop_str_in_output: bool = False  # vLLM's extension
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    best_of: int | None = None
    # penalties and bias (OpenAI; repetition_penalty, min_tokens, ignore_eos are vLLM's extensions)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    logit_bias: dict[str, float] | None = None
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # structured output (OpenAI's response_format; vLLM's structured_outputs and its older guided_* fields)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # accepted, not acted on (ACCEPTED_UNUSED)
    user: Any = None
    metadata: Any = None
    store: Any = None
    service_tier: Any = None

    def refuse_unsupported(self) -> None:
        if self.stream_options is not None and not self.stream:  # as vLLM: they describe a stream
            raise ApiError(400, "stream_options needs stream: true", param="stream_options")
        # vLLM answers any suffix, even "", with 400 "suffix is not currently supported" (no fill-in-the-middle)
        if getattr(self, "suffix", None) is not None:
            raise ApiError(400, "suffix is not supported (no fill-in-the-middle): leave it out", param="suffix")
        if self.n != 1 or (self.best_of is not None and self.best_of != 1):
            field = "n" if self.n != 1 else "best_of"
            raise ApiError(400, f"{field} must be 1: one choice per request (send several requests)", param=field)

    def stops(self) -> tuple[str, ...]:
        """The stop strings: at most MAX_STOPS (OpenAI allows 4, vLLM any number; lm-eval sends ~5), each
        non-empty. Each costs a search over the new text and holds back its length - 1 characters of the stream."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOPS or any(not s for s in stops):
            raise ApiError(
                400, f"stop: {len(stops)} strings; up to {MAX_STOPS} non-empty strings are accepted", param="stop"
            )
        return tuple(stops)


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None  # top alternatives per generated token (OpenAI's completions)
    echo: bool = False  # the prompt before the completion (with its logprobs when logprobs is set)
    prompt_logprobs: int | None = None  # vLLM's extension
    suffix: str | None = None  # refused when set (as vLLM: no fill-in-the-middle here)

    def prompts(self) -> list[str | list[int]]:
        """The prompts, in order: one (a string or a list of ids) or several (a list of strings or of id lists),
        each answered by its own choice, as vLLM's completions (vllm/entrypoints/openai/completion/serving.py)."""
        p = self.prompt
        many = isinstance(p, list) and bool(p) and isinstance(p[0], (str, list))
        prompts = cast(list[str | list[int]], list(p) if many else [p])
        for i, one in enumerate(prompts):
            if not one:
                where = f"prompt {i} of {len(prompts)}" if many else "prompt"
                raise ApiError(400, f"{where} is empty", param="prompt")
        return prompts


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn's calls, sent back by tool-calling clients
    tool_call_id: str | None = None  # a tool turn's answer to one call
    # what an OpenAI client's own assistant message carries when a tool-calling loop sends it back (message.model_dump)
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: dict[str, Any] | None = None  # refused when set: text only here
    function_call: dict[str, Any] | None = None  # OpenAI's deprecated single call: refused when set (use tool_calls)
    reasoning_content: str | None = None  # vLLM passes reasoning back to the template

    def text(self) -> str:
        for name in ("audio", "function_call"):
            if getattr(self, name) is not None:
                fix = "send tool_calls" if name == "function_call" else "send text"
                raise ApiError(400, f"messages: {name} is not supported here; {fix}", param=f"messages.{name}")
        if isinstance(self.content, list):  # content parts: text only
            if any(part.get("type") != "text" for part in self.content):
                raise ApiError(400, "only text content parts are supported", param="messages")
            return "".join(str(part.get("text", "")) for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False  # chat: the chosen tokens' logprobs ...
    top_logprobs: int | None = None  # ... with this many alternatives each
    echo: bool = False  # vLLM's extension (the last message's content before the answer)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extension: passed to the template


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a completion prompt, or chat messages through the chat template."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # vLLM's defaults: True for a prompt, False for messages
    add_generation_prompt: bool = True  # messages only
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    """vLLM's /detokenize."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion_body(
    rid: str, model: str, text: str, finish: str | None, use: dict[str, int] | None, chat: bool, chunk: bool
) -> dict[str, Any]:
    """A response, or one streaming chunk, in OpenAI's shape for completions or chat."""
    if chat:
        key, value = ("delta", {"content": text}) if chunk else ("message", {"role": "assistant", "content": text})
        choice: dict[str, Any] = {"index": 0, key: value, "logprobs": None, "finish_reason": finish}
        kind = "chat.completion.chunk" if chunk else "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        kind = "text_completion"
    body: dict[str, Any] = {"id": rid, "object": kind, "created": int(time.time()), "model": model}
    body["choices"] = [choice]
    if use is not None or not chunk:
        body["usage"] = use
    return body


# /tokenizer_info leaves these out: file paths on the server (vLLM drops vocab_file and merges_file; name_or_path is
# the engine directory's path, which a client has no use for)
_TOKENIZER_PATHS = ("vocab_file", "merges_file", "name_or_path")


def tokenizer_config(tokenizer: Any) -> dict[str, Any]:
    """vLLM's GET /tokenizer_info (vllm/entrypoints/serve/tokenize/serving.py `TokenizerInfo._get_tokenizer_config`):
    the tokenizer's `init_kwargs` (its tokenizer_config.json) made JSON-safe (an AddedToken becomes its text), less
    file paths, plus `tokenizer_class` and `chat_template`. lm-eval's `tokenizer_backend=remote` (lm_eval/utils.py
    `RemoteTokenizer`, 0.4.13) reads eos_token, bos_token, pad_token and chat_template from it: each is filled from
    the tokenizer itself where init_kwargs lacks it and the tokenizer has one."""
    config = {k: _json_safe(v) for k, v in dict(getattr(tokenizer, "init_kwargs", None) or {}).items()}
    for key in _TOKENIZER_PATHS:
        config.pop(key, None)
    for key in ("bos_token", "eos_token", "pad_token", "chat_template"):
        value = getattr(tokenizer, key, None)
        if config.get(key) is None and isinstance(value, str):
            config[key] = value
    config["tokenizer_class"] = type(tokenizer).__name__
    return config


def _json_safe(value: Any) -> Any:
    if hasattr(value, "content"):  # tokenizers.AddedToken
        return str(value.content)
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)  # anything else a tokenizer keeps (a path, an enum): its text
