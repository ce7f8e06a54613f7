"""The HTTP application: OpenAI's completions and chat completions over the Generation API, with API keys,
per-key rate limits, a bounded queue, timeouts, health and readiness, Prometheus metrics and one JSON log line
per request.

Admission runs in this order, each step refusing with OpenAI's error JSON: draining or not warmed up (503),
API key (401), body (400 naming the field), engine limits (400), rate limits (429 + Retry-After), queue (429 +
Retry-After). Load never produces a 5xx: beyond the queue a request is told when to retry. A request that was
admitted ends with a response, a timeout (408), or an abort when its client goes away — the runtime frees its KV
blocks before the next step.

A multi-rank engine whose rank failed (its `health()` gives the reason, or the step loop stopped on a
`CollectiveError`) cannot serve again: /health and /ready answer 503 with the reason, requests in flight end with
an error (an SSE error event once a stream has begun), new ones get 503, and `serve` exits (server.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from toolchain import __version__
from toolchain.engine.api import Engine
from toolchain.runtime.llm_engine import EngineFailed, LLMEngine, RequestStream, engine_health
from toolchain.runtime.request import FinishReason, SamplingParams, TokenEvent, TokenLogprob
from toolchain.runtime.speculative import SpecConfig
from toolchain.serve import (
    DEFAULT_DRAIN_TIMEOUT_S,
    DEFAULT_HOST,
    DEFAULT_MAX_QUEUE,
    DEFAULT_PORT,
    DEFAULT_REQUEST_TIMEOUT_S,
    ENGINE_HEADER,
    HEALTH_GENERATE_PATH,
    HEALTH_PATH,
    METRICS_PATH,
    READY_PATH,
    shapes,
    structured,
    tools,
)
from toolchain.serve.auth import ApiKey, KeyRing, RateLimiter
from toolchain.serve.metrics import Metrics
from toolchain.serve.params import sampling_params
from toolchain.serve.protocol import (
    ApiError,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    completion_body,
    new_id,
    tokenizer_config,
    usage,
)

log = logging.getLogger("trtbuild.serve")
_Body = TypeVar("_Body", bound=BaseModel)
ANONYMOUS = "anonymous"  # the key id of requests to a server without --api-keys
# apply_chat_template's own arguments: a request's chat_template_kwargs may not override them
RESERVED_TEMPLATE_KWARGS = {
    "conversation",
    "tools",
    "documents",
    "chat_template",
    "add_generation_prompt",
    "continue_final_message",
    "tokenize",
    "padding",
    "truncation",
    "max_length",
    "return_tensors",
    "return_dict",
    "return_assistant_tokens_mask",
    "tokenizer_kwargs",
}


@dataclass(frozen=True)
class ServeOptions:
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    api_keys: Path | None = None
    max_queue: int = DEFAULT_MAX_QUEUE
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT_S
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_S
    served_model_name: str | None = None
    log_requests: bool = False
    heartbeat_timeout: float = 60.0  # /health fails when a step has run longer than this
    tool_call_parser: str | None = None  # --tool-call-parser; None: detected from the chat template (serve/tools.py)
    speculation: SpecConfig | None = None  # issue 30: n-gram or draft-target speculative decoding
    draft: Path | None = None  # the draft engine's dir (speculation.method == "draft"), opened by server.prepare


@dataclass
class _Admitted:
    """One admitted request's bookkeeping, for metrics, rate-limit settlement and the log line."""

    id: str
    key_id: str
    prompt_ids: list[int]
    reserved: int
    arrived: float
    stream: RequestStream
    token_times: list[float] = field(default_factory=list)
    token_steps: list[int] = field(default_factory=list)  # the runtime step that emitted each token
    text: list[str] = field(default_factory=list)
    final: TokenEvent | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # the generated tokens', when asked
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None  # when asked (echo, prompt_logprobs)

    @property
    def finish_reason(self) -> FinishReason:
        """How it ended; a handler that stopped before the final event (its client went away) counts as
        cancelled."""
        reason = self.final.finish_reason if self.final is not None else None
        return reason or FinishReason.CANCELLED


class ServerState:
    """Everything the routes share: the engine loop, keys and limits, metrics, readiness and drain."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: Any,
        options: ServeOptions,
        keys: list[ApiKey] | None,
        draft_engine: Engine | None = None,
    ):
        self.engine, self.spec, self.tokenizer, self.options = engine, engine.spec, tokenizer, options
        self.draft_engine = draft_engine  # closed with the engine
        self.model_name = options.served_model_name or engine.spec.engine_dir.resolve().name
        self.manifest = _read_manifest(engine.spec.engine_dir)
        self.llm = LLMEngine(engine, tokenizer, speculation=options.speculation, draft_engine=draft_engine)
        self.metrics = Metrics(engine.spec, self.model_name, self.llm.runtime)
        self.llm.on_step = self.metrics.observe_step
        self.keyring = KeyRing(keys) if keys else None
        self.limiter = RateLimiter(keys or [])
        self.ready = self.draining = False
        self.warmup_error: str | None = None
        self.inflight = 0
        self._close_lock = threading.Lock()
        self._engine_closed = False
        eos = getattr(tokenizer, "eos_token_id", None)
        self.stop_ids: tuple[int, ...] = (int(eos),) if isinstance(eos, int) else ()
        self.tool_parser, self.tool_parser_note = tools.choose_parser(options.tool_call_parser, tokenizer)
        self.format_stops = tools.stop_tokens(self.tool_parser, tokenizer)  # stay stops under ignore_eos

    def warm_up(self) -> None:
        """One real token through the engine before /ready says yes; the grammar tokenizer built (structured
        output's first request must not stall the step loop for it)."""
        if self.tokenizer is not None:
            unusable = self.llm.runtime.guide.prepare()
            if unusable:
                log.warning(json.dumps({"event": "structured_output_unavailable", "reason": unusable}))
        result = self.llm.submit([self._probe_token()], SamplingParams(max_new_tokens=1, temperature=0)).result()
        if result.error:
            self.warmup_error = result.error
            log.error(json.dumps({"event": "warmup_failed", "error": result.error}))
        else:
            self.ready = True

    def close(self) -> None:
        """Stop the step loop, then the engine."""
        try:
            self.llm.close()
        finally:
            self.close_engine()

    def close_engine(self) -> None:
        """Once, from whichever thread comes first: a multi-rank engine's `close()` stops its ranks (workers
        joined, killed after a grace; ports freed). Single-rank engines have nothing to close."""
        with self._close_lock:
            if self._engine_closed:
                return
            self._engine_closed = True
            for engine in (self.engine, self.draft_engine):
                close = getattr(engine, "close", None)
                if callable(close):
                    close()

    def _probe_token(self) -> int:
        bos = getattr(self.tokenizer, "bos_token_id", None)
        return int(bos) if isinstance(bos, int) else 0

    def engine_failure(self) -> str | None:
        """Why the engine can never serve again (a rank failed), or None."""
        return self.llm.fatal or engine_health(self.engine)

    def health(self) -> tuple[bool, str]:
        failed = self.engine_failure()
        if failed:
            return False, f"engine failed: {failed}"
        if self.warmup_error:
            return False, f"warm-up failed: {self.warmup_error}"
        if not self.llm.alive and not self.draining:
            return False, f"the engine loop has stopped ({self.llm.failure or 'closed'})"
        stalled = time.monotonic() - self.llm.heartbeat
        if self.llm.runtime.has_work and stalled > self.options.heartbeat_timeout:
            return False, f"the engine loop has not completed a step for {stalled:.0f} s"
        return True, "ok"


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="trtbuild serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.trtbuild = state
    app.add_middleware(EngineHeader, value=(state.spec.manifest_sha256 or "unknown").encode())
    _install_handlers(app, state)
    _install_probes(app, state)
    _install_openai(app, state)
    return app


class EngineHeader:
    """Every response names the engine (its manifest's sha256). Pure ASGI, so that streams pass untouched."""

    def __init__(self, app: ASGIApp, value: bytes):
        self.app, self.value = app, value

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (ENGINE_HEADER.encode(), self.value)]
            await send(message)

        await self.app(scope, receive, send_with_header)


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _log_refusal(request: Request, e: ApiError) -> None:
    """The one log line of a request answered with an error before (or instead of) generating: admitted requests
    log theirs when they end (`_finish`)."""
    if e.logged:
        return
    line = {
        "event": "request",
        "path": request.url.path,
        "key_id": getattr(request.state, "key_id", None),
        "status": e.status,
        "error": e.type,
        "param": e.param,
        "message": e.message,
    }
    log.info(json.dumps(line, ensure_ascii=False))


def _install_handlers(app: FastAPI, state: ServerState) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        _log_refusal(request, e)
        return _error(e)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:  # 404, 405: OpenAI's shape
        error = ApiError(e.status_code, str(e.detail), "invalid_request_error")
        _log_refusal(request, error)
        return _error(error)

    @app.exception_handler(Exception)
    async def unexpected(_: Request, e: Exception) -> JSONResponse:
        log.exception("unexpected error")  # a bug: keep the traceback in the log, not in the response
        return _error(ApiError(500, f"internal error ({type(e).__name__}); see the server log", "server_error"))


def _install_probes(app: FastAPI, state: ServerState) -> None:
    probe_lock = asyncio.Lock()

    @app.get(HEALTH_PATH)
    async def health() -> JSONResponse:
        ok, why = state.health()
        return JSONResponse({"status": why}, status_code=200 if ok else 503)

    @app.get(READY_PATH)
    async def ready() -> JSONResponse:
        failed = state.engine_failure()
        if failed:
            return JSONResponse({"status": f"engine failed: {failed}"}, status_code=503)
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not state.ready:
            return JSONResponse({"status": state.warmup_error or "warming up"}, status_code=503)
        return JSONResponse({"status": "ready"})

    @app.get(HEALTH_GENERATE_PATH)
    async def health_generate() -> JSONResponse:
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        async with probe_lock:  # one probe in the engine at a time: unauthenticated callers cannot queue work
            return await _probe()

    async def _probe() -> JSONResponse:
        started = time.monotonic()
        try:
            stream = state.llm.submit(
                [state._probe_token()], SamplingParams(max_new_tokens=1, temperature=0), loop=asyncio.get_running_loop()
            )
        except RuntimeError as e:  # the loop stopped: a rank failed, or the server is shutting down
            return JSONResponse({"status": str(e)}, status_code=503)
        try:
            event = await stream.get(timeout=state.options.heartbeat_timeout)
            while not event.finished:
                event = await stream.get(timeout=state.options.heartbeat_timeout)
        except asyncio.TimeoutError:
            state.llm.abort(stream.request_id)
            return JSONResponse({"status": "no token within the heartbeat timeout"}, status_code=503)
        if event.finish_reason is FinishReason.ERROR:
            return JSONResponse({"status": f"engine error: {event.error}"}, status_code=503)
        return JSONResponse({"status": "ok", "token": event.token, "latency_s": time.monotonic() - started})

    @app.get(METRICS_PATH)
    async def metrics() -> Response:
        state.metrics.observe_gauges(state.llm.runtime)
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def _install_openai(app: FastAPI, state: ServerState) -> None:
    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        _authorize(state, request)
        spec = state.spec
        card: dict[str, Any] = {
            "id": state.model_name,
            "object": "model",
            "created": _created(state.manifest),
            "owned_by": "trtbuild",
            "max_model_len": spec.limits.max_seq_len,
            "engine_sha256": spec.manifest_sha256,
            "recipe_sha256": _recipe_sha256(state.manifest),
            "backend": spec.backend,
        }
        if _quantized(spec.quantization):  # TensorRT-LLM's block lists defaults (group_size...) even when unquantized
            card["quantization"] = dict(spec.quantization)
        return JSONResponse({"object": "list", "data": [card]})

    @app.get("/version")
    async def version(request: Request) -> JSONResponse:
        _authorize(state, request)
        built_by = state.manifest.get("toolchain")
        engine = {
            "sha256": state.spec.manifest_sha256,
            "recipe_sha256": _recipe_sha256(state.manifest),
            "created_utc": state.manifest.get("created_utc"),
            "built_by": built_by if isinstance(built_by, dict) else None,
            "backend": state.spec.backend,
        }
        return JSONResponse({"version": __version__, "engine": engine})

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        _authorize(state, request)
        body = await _parse(state, request, TokenizeRequest)
        try:
            _check_model(state, body.model)
            ids = _tokenize(state, body)
        except ApiError as e:
            raise _reject(state, "bad_request", e) from e
        out: dict[str, Any] = {"count": len(ids), "max_model_len": state.spec.limits.max_seq_len, "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = state.tokenizer.convert_ids_to_tokens(ids)
        return JSONResponse(out)

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request) -> JSONResponse:
        _authorize(state, request)
        if state.tokenizer is None:
            raise ApiError(
                404, "this engine has no tokenizer, so no tokenizer_info: send token ids", "not_found_error", None
            )
        return JSONResponse(tokenizer_config(state.tokenizer))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        _authorize(state, request)
        body = await _parse(state, request, DetokenizeRequest)
        try:
            _check_model(state, body.model)
            tok = _need_tokenizer(state, "tokens")
            bad = [t for t in body.tokens if not 0 <= t < state.spec.vocab_size]
            if bad:
                raise ApiError(
                    400,
                    f"token ids {bad[:5]} are outside this engine's vocabulary [0, {state.spec.vocab_size})",
                    param="tokens",
                )
            text = tok.decode(body.tokens, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        except ApiError as e:
            raise _reject(state, "bad_request", e) from e
        return JSONResponse({"prompt": str(text)})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _generate(state, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _generate(state, request, chat=True)


def _read_manifest(engine_dir: Path) -> dict[str, Any]:
    """The engine dir's manifest.json (serve verified it before loading), or {} where an engine has none."""
    try:
        value = json.loads((engine_dir / "manifest.json").read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _recipe_sha256(manifest: dict[str, Any]) -> str | None:
    value = manifest.get("recipe_sha256")
    return str(value) if value else None


def _created(manifest: dict[str, Any]) -> int:
    """The engine's build time (its manifest's created_utc) in Unix seconds, as OpenAI's `created`; 0 if unknown."""
    try:
        return int(datetime.fromisoformat(str(manifest["created_utc"])).timestamp())
    except (KeyError, ValueError):
        return 0


def _quantized(quantization: Any) -> bool:
    return bool(quantization.get("quant_algo") or quantization.get("kv_cache_quant_algo"))


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise ApiError(
            400, f"model {model!r} is not served here; this server serves {state.model_name!r}", param="model"
        )


def _need_tokenizer(state: ServerState, param: str) -> Any:
    if state.tokenizer is None:
        raise ApiError(400, "this engine has no tokenizer: send token ids", param=param)
    return state.tokenizer


def _tokenize(state: ServerState, body: TokenizeRequest) -> list[int]:
    if (body.prompt is None) == (body.messages is None):
        raise ApiError(400, "send exactly one of prompt and messages", param="prompt")
    if body.messages is not None:
        ids = _chat_ids(state, body.messages, body.add_generation_prompt, bool(body.add_special_tokens))
        return ids
    tok = _need_tokenizer(state, "prompt")
    add = True if body.add_special_tokens is None else body.add_special_tokens
    return [int(t) for t in tok.encode(body.prompt, add_special_tokens=add)]


def _reject(state: ServerState, reason: str, error: ApiError) -> ApiError:
    state.metrics.rejections.labels(reason).inc()
    return error


def _authorize(state: ServerState, request: Request) -> str:
    """The key id of the request's API key (ANONYMOUS without --api-keys)."""
    if state.keyring is None:
        request.state.key_id = ANONYMOUS
        return ANONYMOUS
    key = state.keyring.identify(request.headers.get("authorization"))
    if key is not None:
        request.state.key_id = key.id
    if key is None:
        raise _reject(
            state,
            "auth",
            ApiError(401, "a valid API key is required: Authorization: Bearer KEY", "authentication_error"),
        )
    return key.id


async def _parse(state: ServerState, request: Request, model: type[_Body]) -> _Body:
    try:
        raw = await request.json()
    except ClientDisconnect as e:  # gone before its body arrived: nobody to answer
        raise ApiError(499, "the client disconnected", "client_closed") from e
    except (ValueError, UnicodeDecodeError) as e:
        raise _reject(state, "bad_request", ApiError(400, f"the body is not valid JSON ({e})")) from e
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        message = f"{where}: {first['msg']}"
        if first["type"] == "extra_forbidden":
            known = ", ".join(model.model_fields)
            message = f"unknown field {where!r}: this endpoint accepts {known} (docs/serving.md)"
        raise _reject(state, "bad_request", ApiError(400, message, param=where)) from e


def _prompt_ids(
    state: ServerState, body: CompletionRequest | ChatCompletionRequest, tool_list: list[dict[str, Any]] | None = None
) -> list[list[int]]:
    """Each prompt's token ids (chat messages, with `tool_list` rendered by the template, make one prompt)."""
    tok = state.tokenizer
    if isinstance(body, ChatCompletionRequest):
        return [_chat_ids(state, body.messages, True, False, tool_list, body.chat_template_kwargs)]
    out = []
    for prompt in body.prompts():
        if isinstance(prompt, str):
            if tok is None:
                raise ApiError(400, "this engine has no tokenizer: send the prompt as token ids", param="prompt")
            out.append(list(tok.encode(prompt)))
        else:
            out.append([int(t) for t in prompt])
    return out


def _chat_ids(
    state: ServerState,
    messages: list[ChatMessage],
    add_generation_prompt: bool,
    add_special_tokens: bool,
    tool_list: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """The messages (and `tool_list`, the request's tools; `template_kwargs`, vLLM's chat_template_kwargs such as
    Qwen3's enable_thinking) through the tokenizer's chat template (whose text carries the BOS where the model
    wants one)."""
    tok = state.tokenizer
    if not messages:
        raise ApiError(400, "messages is empty", param="messages")
    if tok is None or not getattr(tok, "chat_template", None):
        raise ApiError(400, "this engine's tokenizer has no chat template; use /v1/completions", param="messages")
    turns = tools.template_messages(messages)
    extra = dict(template_kwargs or {})
    reserved = sorted(set(extra) & RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise ApiError(
            400,
            f"chat_template_kwargs: {reserved[0]!r} is set by the server (use the request's own field)",
            param="chat_template_kwargs",
        )
    try:
        text = tok.apply_chat_template(turns, add_generation_prompt=add_generation_prompt, tokenize=False, **extra)
        if tool_list:
            bare = text
            text = tok.apply_chat_template(
                turns, tools=tool_list, add_generation_prompt=add_generation_prompt, tokenize=False, **extra
            )
            if text == bare:
                raise ApiError(
                    400,
                    "tools: this engine's chat template ignores tools (it renders the same prompt with and without "
                    "them); send tool_choice none, or serve a template that renders tools",
                    param="tools",
                )
    except (TemplateError, TypeError, ValueError) as e:  # e.g. "roles must alternate": the messages' fault
        raise ApiError(400, f"the chat template refused these messages: {e}", param="messages") from e
    return [int(t) for t in tok.encode(str(text), add_special_tokens=add_special_tokens)]


async def _generate(state: ServerState, request: Request, chat: bool) -> Response:
    arrived = time.monotonic()
    _check_open(state)
    key_id = _authorize(state, request)
    body: CompletionRequest | ChatCompletionRequest = await _parse(
        state, request, ChatCompletionRequest if chat else CompletionRequest
    )
    try:
        _check_model(state, body.model)
        body.refuse_unsupported()
        shapes.check_logprobs(body)
        mode = tools.check_tools(body, state.tool_parser) if isinstance(body, ChatCompletionRequest) else None
        prompts = _prompt_ids(state, body, tools.template_tools(body, mode))
        grammar = structured.grammar_spec(body, state.llm.runtime.guide if state.tokenizer is not None else None)
        if grammar is not None and state.tokenizer is None:
            raise ApiError(400, f"{grammar.kind}: structured output needs the engine's tokenizer (it has none)")
        if grammar is not None and (body.ignore_eos or body.min_tokens):
            # a complete grammar allows only the end token: ignore_eos would repeat it to max_tokens, min_tokens
            # would mask it and leave no token at all
            name = "ignore_eos" if body.ignore_eos else "min_tokens"
            raise ApiError(
                400, f"{name} cannot be combined with structured output (the grammar decides the end)", param=name
            )
        every_params = []
        for i, ids in enumerate(prompts):
            try:
                params = sampling_params(
                    body,
                    ids,
                    state.spec.limits.max_seq_len,
                    state.stop_ids,
                    state.tokenizer,
                    state.spec.vocab_size,
                    state.format_stops,
                )
                if grammar is not None:
                    params = dataclasses.replace(params, grammar=grammar)
                problem = state.llm.runtime.check_request(ids, params)  # vocabulary, pool size: immutable facts
                if problem:
                    raise ApiError(400, problem, param="prompt")
            except ApiError as e:
                if len(prompts) > 1:  # say which prompt
                    e.message = f"prompt {i} of {len(prompts)}: {e.message}"
                raise
            every_params.append(params)
    except ApiError as e:
        raise _reject(state, "bad_request", e) from e
    if len(prompts) > 1:
        assert isinstance(body, CompletionRequest)
        if body.stream and (body.echo or body.logprobs is not None):
            error = ApiError(
                400, "echo and logprobs with several prompts are served unstreamed: set stream false", param="stream"
            )
            raise _reject(state, "bad_request", error)
        return await _generate_many(state, request, body, key_id, prompts, every_params, arrived)
    loop = asyncio.get_running_loop()
    admitted = _admit(state, key_id, prompts[0], every_params[0], arrived, loop, "chatcmpl" if chat else "cmpl")
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(
            _sse(state, admitted, body, chat, include_usage, request),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )
    return await _respond(state, admitted, body, chat, request)


async def _generate_many(
    state: ServerState,
    request: Request,
    body: CompletionRequest,
    key_id: str,
    prompts: list[list[int]],
    every_params: list[SamplingParams],
    arrived: float,
) -> Response:
    """Several prompts in one completions request, as vLLM's: one runtime request per prompt (they batch like
    separate requests, each with its own rate-limit share, metrics and log line), one choice per prompt indexed in
    prompt order, usage summed; streamed chunks name their choice's index. Admitted all or none."""
    loop = asyncio.get_running_loop()
    admitted: list[_Admitted] = []
    try:
        for ids, params in zip(prompts, every_params, strict=True):
            admitted.append(_admit(state, key_id, ids, params, arrived, loop, "cmpl"))
    except ApiError:
        for a in admitted:  # the ones queued already go again
            state.llm.abort(a.id)
            _finish(state, a)
        raise
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(
            _sse_many(state, admitted, body.model, include_usage, request),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )

    async def drain(a: _Admitted) -> None:
        try:
            async for _ in _events(state, a, request):
                pass
        finally:
            if a.final is None:  # cancelled: do not leave the request holding its blocks
                state.llm.abort(a.id)
            _finish(state, a)

    await asyncio.gather(*(drain(a) for a in admitted))
    for a in admitted:
        assert a.final is not None
        error = _finish_error(state, a.final)
        if error is not None:
            error.logged = True  # _finish wrote its line
            raise error
    use = usage(sum(len(a.prompt_ids) for a in admitted), sum(a.final.generated_tokens for a in admitted if a.final))
    out = completion_body(admitted[0].id, body.model, "", None, use, chat=False, chunk=False)
    out["choices"] = [_final_choice(state, body, a, False, i) for i, a in enumerate(admitted)]
    return JSONResponse(out)


def _choice(rid: str, model: str, text: str, finish: str | None, index: int, chunk: bool) -> dict[str, Any]:
    choice: dict[str, Any] = completion_body(rid, model, text, finish, None, chat=False, chunk=chunk)["choices"][0]
    choice["index"] = index
    return choice


async def _sse_many(
    state: ServerState, admitted: list[_Admitted], model: str, include_usage: bool, request: Request
) -> AsyncIterator[str]:
    """The prompts' events interleaved as they come, each chunk naming its choice's index (vLLM's)."""
    rid = admitted[0].id
    events: asyncio.Queue[tuple[int, TokenEvent]] = asyncio.Queue()

    async def pump(i: int, a: _Admitted) -> None:
        async for event in _events(state, a, request):
            await events.put((i, event))

    def chunk(choices: list[dict[str, Any]], use: dict[str, int] | None = None) -> str:
        body = completion_body(rid, model, "", None, use, chat=False, chunk=True)
        body["choices"] = choices
        return _sse_data(body)

    tasks = [asyncio.create_task(pump(i, a)) for i, a in enumerate(admitted)]
    try:
        left = len(admitted)
        while left:
            i, event = await events.get()
            if event.text:
                yield chunk([_choice(rid, model, event.text, None, i, chunk=True)])
            if not event.finished:
                continue
            left -= 1
            error = _finish_error(state, event)
            if error is not None:  # headers are sent: the error travels as an event, and ends the stream
                yield _sse_data(error.body())
                break
            yield chunk([_choice(rid, model, "", admitted[i].finish_reason.openai, i, chunk=True)])
        else:
            if include_usage:
                prompt = sum(len(a.prompt_ids) for a in admitted)
                yield chunk([], usage(prompt, sum(a.final.generated_tokens for a in admitted if a.final)))
        yield "data: [DONE]\n\n"
    finally:
        for task in tasks:
            task.cancel()
        for a in admitted:
            if a.final is None:  # the client went away mid-stream, or another prompt failed: free its blocks
                state.llm.abort(a.id)
            _finish(state, a)


def _unavailable(why: str) -> ApiError:
    error = ApiError(503, f"{why}; retry on another replica", "unavailable")
    error.headers["Retry-After"] = "1"
    return error


def _check_open(state: ServerState) -> None:
    failed = state.engine_failure()
    if failed:
        raise _unavailable(f"the engine failed ({failed}); this server is exiting")
    if state.draining:
        raise _reject(state, "draining", _unavailable("the server is draining"))
    if not state.ready:
        raise _unavailable("the engine is warming up")


def _admit(
    state: ServerState,
    key_id: str,
    ids: list[int],
    params: SamplingParams,
    arrived: float,
    loop: asyncio.AbstractEventLoop,
    id_prefix: str,
) -> _Admitted:
    _check_open(state)  # again: a drain may have begun while the body was read
    reserved = len(ids) + params.max_new_tokens
    wait = state.limiter.admit(key_id, reserved)
    if wait:
        if math.isinf(wait):
            raise _reject(
                state,
                "bad_request",
                ApiError(
                    400,
                    f"prompt + max_tokens ({reserved}) exceed this key's tokens-per-minute limit",
                    param="max_tokens",
                ),
            )
        error = ApiError(429, f"rate limit of key {key_id!r} reached; retry in {math.ceil(wait)} s", "rate_limit_error")
        error.headers["Retry-After"] = str(math.ceil(wait))
        raise _reject(state, "rate", error)
    if state.llm.num_pending >= state.options.max_queue:
        state.limiter.refund(key_id, reserved)
        error = ApiError(429, f"the server's queue is full ({state.options.max_queue} waiting); retry", "overloaded")
        error.headers["Retry-After"] = "1"
        raise _reject(state, "queue", error)
    rid = new_id(id_prefix)
    try:
        stream = state.llm.submit(ids, params, rid, state.options.request_timeout, loop)
    except EngineFailed as e:  # a rank failed between the checks and here
        state.limiter.refund(key_id, reserved)
        raise _unavailable(f"{e}; this server is exiting") from e
    except RuntimeError as e:  # the engine loop closed (end of a drain) between the checks and here
        state.limiter.refund(key_id, reserved)
        raise _unavailable("the server is shutting down") from e
    state.inflight += 1
    state.metrics.key_requests.labels(key_id).inc()
    return _Admitted(rid, key_id, ids, reserved, arrived, stream)


async def _events(state: ServerState, a: _Admitted, request: Request) -> AsyncIterator[TokenEvent]:
    """The request's events; a client that disconnects (looked for about once a second, whether tokens flow or not)
    aborts it."""
    checked = time.monotonic()
    while True:
        try:
            event = await a.stream.get(timeout=1.0)
        except asyncio.TimeoutError:
            event = None
        if time.monotonic() - checked >= 1.0 or event is None:
            checked = time.monotonic()
            if await request.is_disconnected():
                state.llm.abort(a.id)
        if event is None:
            continue
        if event.token is not None:
            a.token_times.append(time.monotonic())
            a.token_steps.append(event.step)
        if event.logprob is not None:
            a.logprobs.append(event.logprob)
        if event.prompt_logprobs is not None:
            a.prompt_logprobs = event.prompt_logprobs
        a.text.append(event.text)
        if event.finished:
            a.final = event
        yield event
        if event.finished:
            return


async def _respond(
    state: ServerState, a: _Admitted, body: CompletionRequest | ChatCompletionRequest, chat: bool, request: Request
) -> Response:
    try:
        async for _ in _events(state, a, request):
            pass
    finally:
        if a.final is None:  # this handler was cancelled: do not leave the request holding its blocks
            state.llm.abort(a.id)
        _finish(state, a)
    assert a.final is not None
    error = _finish_error(state, a.final)
    if error is not None:
        error.logged = True  # _finish wrote its line
        raise error
    use = usage(len(a.prompt_ids), a.final.generated_tokens)
    out = completion_body(a.id, body.model, "", None, use, chat, chunk=False)
    out["choices"] = [_final_choice(state, body, a, chat, 0)]
    mode = _tool_mode(state, body)
    if mode is not None:
        tools.apply(out["choices"][0], mode, _answer_text(state, a, mode), a.finish_reason.openai)
    return JSONResponse(out)


def _final_choice(
    state: ServerState, body: CompletionRequest | ChatCompletionRequest, a: _Admitted, chat: bool, index: int
) -> dict[str, Any]:
    """A finished request's choice: its text (after the echoed prompt), logprobs and prompt logprobs as asked."""
    text, generated = ("", []) if shapes.echo_only(body) else ("".join(a.text), a.logprobs)
    text = shapes.echo_text(state.tokenizer, body, a.prompt_ids, index) + text
    choice: dict[str, Any] = completion_body(a.id, body.model, text, a.finish_reason.openai, None, chat, chunk=False)[
        "choices"
    ][0]
    choice["index"] = index
    choice["logprobs"] = shapes.response_logprobs(
        state.tokenizer, body, generated, a.prompt_logprobs, prompt_ids=a.prompt_ids
    )
    if (prompt_lps := shapes.prompt_logprobs(state.tokenizer, body, a.prompt_logprobs)) is not None:
        choice["prompt_logprobs"] = prompt_lps
    return choice


def _answer_text(state: ServerState, a: _Admitted, mode: tools.ToolMode) -> str:
    """The answer as the tool-call parser reads it: gpt-oss's with its special tokens (harmony's markers)."""
    if tools.ToolStream(mode).needs_special_tokens and a.stream.request is not None:
        return str(state.tokenizer.decode(a.stream.request.generated, skip_special_tokens=False))
    return "".join(a.text)


def _tool_mode(state: ServerState, body: CompletionRequest | ChatCompletionRequest) -> tools.ToolMode | None:
    """How a chat answer is read for tool calls (checked at admission already), or None."""
    return tools.check_tools(body, state.tool_parser) if isinstance(body, ChatCompletionRequest) else None


def _finish_error(state: ServerState, final: TokenEvent) -> ApiError | None:
    """The error a request that ended so is answered with (a JSON response, or an SSE event once a stream has
    begun), or None when it is answered with a completion."""
    reason = final.finish_reason
    if reason is None or not reason.is_error:
        return None
    if reason is FinishReason.SHUTDOWN:
        return _unavailable("the server shut down before the request finished")
    if reason is FinishReason.TIMEOUT:
        return _reject(state, "timeout", ApiError(reason.http_status, f"request timed out: {final.error}", "timeout"))
    return ApiError(reason.http_status, f"the engine failed: {final.error}", "server_error")


def _sse_data(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


async def _sse(
    state: ServerState,
    a: _Admitted,
    body: CompletionRequest | ChatCompletionRequest,
    chat: bool,
    include_usage: bool,
    request: Request,
) -> AsyncIterator[str]:
    model = body.model
    sent_chars = 0  # text streamed so far (completions' text_offset)
    mode = _tool_mode(state, body)
    calls = tools.ToolStream(mode) if mode is not None else None  # the answer read for tool calls
    try:
        if chat:
            first = completion_body(a.id, model, "", None, None, chat, chunk=True)
            first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
            yield _sse_data(first)
        echo, echo_only = shapes.echo_text(state.tokenizer, body, a.prompt_ids), shapes.echo_only(body)
        async for event in _events(state, a, request):
            lps = [event.logprob] if event.logprob is not None and not echo_only else []
            text = "" if echo_only else event.text
            prompt_lps = None
            if echo and event.token is not None:  # vLLM: the prompt goes out with the first token
                text, prompt_lps, echo = echo + text, a.prompt_logprobs, ""
            chunk_lps = None
            if lps or prompt_lps is not None:
                chunk_lps = shapes.response_logprobs(state.tokenizer, body, lps, prompt_lps, sent_chars, a.prompt_ids)
            if calls is not None:  # tool calls: content while it is content, then each call whole
                deltas = calls.feed(event.text)
                if event.finished:
                    deltas += calls.finish(_answer_text(state, a, calls.mode) if calls.needs_special_tokens else None)
                if chunk_lps is not None and not deltas:  # text held back for the parser: its logprobs go now
                    deltas = [{}]
                for n, delta in enumerate(deltas):
                    chunk = completion_body(a.id, model, "", None, None, chat, chunk=True)
                    chunk["choices"][0]["delta"] = delta
                    chunk["choices"][0]["logprobs"] = chunk_lps if n == 0 else None
                    yield _sse_data(chunk)
            elif text or chunk_lps is not None:
                chunk = completion_body(a.id, model, text, None, None, chat, chunk=True)
                chunk["choices"][0]["logprobs"] = chunk_lps
                yield _sse_data(chunk)
                sent_chars += len(text)
            if not event.finished:
                continue
            error = _finish_error(state, event)
            if error is not None:  # headers are sent: the error travels as an event, as OpenAI's does
                yield _sse_data(error.body())
            else:
                finish = a.finish_reason.openai
                if calls is not None and calls.called and finish == "stop":
                    finish = "tool_calls"
                yield _sse_data(completion_body(a.id, model, "", finish, None, chat, chunk=True))
            if include_usage:
                tail = completion_body(
                    a.id, model, "", None, usage(len(a.prompt_ids), event.generated_tokens), chat, chunk=True
                )
                tail["choices"] = []
                yield _sse_data(tail)
            yield "data: [DONE]\n\n"
    finally:
        if a.final is None:  # the client went away mid-stream: free its blocks before the next step
            state.llm.abort(a.id)
        _finish(state, a)


def _finish(state: ServerState, a: _Admitted) -> None:
    """Once per admitted request: metrics, token accounting, rate-limit settlement, the log line."""
    state.inflight -= 1
    reason = a.finish_reason
    generated = a.final.generated_tokens if a.final is not None else len(a.token_times)
    state.limiter.settle(a.key_id, a.reserved, len(a.prompt_ids) + generated)
    state.metrics.key_tokens.labels(a.key_id, "prompt").inc(len(a.prompt_ids))
    state.metrics.key_tokens.labels(a.key_id, "generation").inc(generated)
    if a.stream.request is not None:
        state.metrics.observe_request(a.stream.request, reason.openai, a.arrived, a.token_times, a.token_steps)
    line: dict[str, Any] = {
        "event": "request",
        "id": a.id,
        "key_id": a.key_id,
        "status": reason.http_status,
        "finish_reason": reason.value,
        "prompt_tokens": len(a.prompt_ids),
        "completion_tokens": generated,
        "ttft_s": round(a.token_times[0] - a.arrived, 6) if a.token_times else None,
        "e2e_s": round(time.monotonic() - a.arrived, 6),
    }
    if state.options.speculation is not None and a.stream.request is not None:
        spec = a.stream.request.spec  # vLLM's counting (runtime/speculative.py SpecStats)
        line.update(spec_drafts=spec.drafts, spec_draft_tokens=spec.draft_tokens, spec_accepted_tokens=spec.accepted)
    if state.options.log_requests:  # text only when asked: prompts are the users' data
        line["prompt"] = state.tokenizer.decode(a.prompt_ids) if state.tokenizer is not None else a.prompt_ids
        line["output"] = "".join(a.text)
    log.info(json.dumps(line, ensure_ascii=False))


def start_warm_up(state: ServerState) -> threading.Thread:
    thread = threading.Thread(target=state.warm_up, name="trtbuild-warmup", daemon=True)
    thread.start()
    return thread
