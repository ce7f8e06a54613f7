"""Tool calling (issue 29, item 4): `tools` rendered through the chat template, `tool_choice` turned into a grammar
(`required`, a named function) or left free (`auto`), and the model's text parsed into OpenAI `tool_calls` by the
parser of its chat format (Llama 3.x JSON, Hermes/Qwen3), whole or as streamed deltas.

What each piece follows:
- `tool_choice` (vLLM vllm/entrypoints/openai/protocol.py `ChatCompletionRequest._get_json_schema_from_tool` and
  tool_parsers/utils.py `_get_json_schema_from_tools`): `none` renders no tools and parses nothing (as vLLM with
  `--exclude-tools-when-tool-choice-none`); `auto` generates freely and parses the model's format; `required`
  constrains the answer to a JSON array `[{"name": <one of the tools>, "parameters": <its schema>}, ...]` with
  `minItems: 1` (`maxItems: 1` when `parallel_tool_calls` is false); a named function constrains the answer to
  that function's `parameters` schema, the answer being its arguments.
- `hermes` (vLLM tool_parsers/hermes_tool_parser.py `Hermes2ProToolParser.extract_tool_calls`; Qwen2.5/Qwen3 and
  Hermes templates): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, any number, the text before
  the first block being the message content.
- `llama3_json` (vLLM tool_parsers/llama_tool_parser.py `Llama3JsonToolParser`; Llama 3.1-3.3 JSON templates): an
  answer that starts with `<|python_tag|>` or `{` is one or more `{"name": ..., "parameters"|"arguments": {...}}`
  objects separated by `;`. (vLLM's non-streaming path also finds such objects after other text; we take its
  streaming rule, the same for both, so a streamed answer and a whole one always agree.)
- `gpt_oss` (harmony; the openai-harmony library vLLM uses cannot load offline, so the text is read here): the
  answer decoded with its special tokens kept is split into messages; one addressed `to=functions.NAME` is a call
  with its body as arguments, the `final` channel is the content (the `analysis` reasoning is not shown). Its
  answer is read at its end (streamed: content and calls arrive then).
- Streaming: OpenAI's `delta.tool_calls[{index, id, type, function: {name, arguments}}]`: a call's first delta
  carries its id, type and name (once the name is complete), the next ones its arguments as they are generated;
  the fragments add up to the arguments of the whole answer, which are the model's text of them (not re-encoded).
  Text before a call streams as content as it comes; text that might begin a call marker is held back until
  decided.
- `parallel_tool_calls: false`: at most the first call is returned.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from toolchain.runtime.request import GrammarSpec
from toolchain.serve.protocol import ApiError, ChatCompletionRequest, ChatMessage, CompletionRequest

PARSERS = ("hermes", "llama3_json", "gpt_oss")
HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
# harmony's markers (gpt-oss): special tokens, so its answers are read from the ids decoded with them kept
HARMONY_START, HARMONY_CHANNEL, HARMONY_MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
HARMONY_ENDS = ("<|end|>", "<|call|>", "<|return|>")


def choose_parser(flag: str | None, tokenizer: Any) -> tuple[str | None, str]:
    """The tool-call parser (`serve --tool-call-parser` wins, else detected from the chat template's text) and a
    line saying how it was chosen, for the start-up log. ValueError for a parser this server does not have."""
    if flag:
        if flag not in PARSERS:
            raise ValueError(f"--tool-call-parser {flag}: not one of {', '.join(PARSERS)}")
        return flag, f"tool-call parser {flag} (--tool-call-parser)"
    template = str(getattr(tokenizer, "chat_template", None) or "")
    if HERMES_START in template:
        return "hermes", "tool-call parser hermes (the chat template writes <tool_call>)"
    if PYTHON_TAG in template:
        return "llama3_json", "tool-call parser llama3_json (the chat template writes <|python_tag|>)"
    if HARMONY_CHANNEL in template:
        return "gpt_oss", "tool-call parser gpt_oss (the chat template writes harmony's <|channel|>)"
    return None, "no tool-call parser (the chat template shows no tool-call format; --tool-call-parser sets one)"


def stop_tokens(parser: str | None, tokenizer: Any) -> tuple[int, ...]:
    """Token ids that end an answer for this parser beside EOS: gpt-oss ends a tool call with `<|call|>` (its
    generation_config.json lists it among the EOS ids; the tokenizer's eos_token is `<|return|>`)."""
    if parser != "gpt_oss" or tokenizer is None:
        return ()
    ids = tokenizer.convert_tokens_to_ids(["<|call|>"])
    unk = getattr(tokenizer, "unk_token_id", None)
    return tuple(int(i) for i in ids if isinstance(i, int) and i != unk)


@dataclass(frozen=True)
class ToolMode:
    """How a chat request's answer is read: `choice` is "auto", "required" or the named function."""

    choice: str
    parser: str | None
    names: tuple[str, ...]
    parallel: bool

    @property
    def named(self) -> bool:
        return self.choice not in ("auto", "required")


def _tool_names(body: ChatCompletionRequest) -> list[str]:
    names = []
    for i, tool in enumerate(body.tools or []):
        function = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise ApiError(400, f"tools[{i}]: only {{'type': 'function', 'function': {{...}}}} tools", param="tools")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ApiError(400, f"tools[{i}].function.name: a non-empty string", param="tools")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise ApiError(400, f"tools[{i}].function.parameters: a JSON schema object", param="tools")
        names.append(name)
    return names


def _choice(body: ChatCompletionRequest) -> str:
    """tool_choice as "none", "auto", "required" or a function name (OpenAI's default: auto with tools)."""
    choice = body.tool_choice
    if choice is None:
        return "auto" if body.tools else "none"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise ApiError(
                400,
                f"tool_choice {choice!r}: one of none, auto, required or "
                '{"type": "function", "function": {"name": ...}}',
                param="tool_choice",
            )
        return choice
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if choice.get("type") != "function" or not isinstance(name, str):
        raise ApiError(400, 'tool_choice: {"type": "function", "function": {"name": ...}}', param="tool_choice")
    return name


def check_tools(body: ChatCompletionRequest, parser: str | None = None) -> ToolMode | None:
    """Refuse what this server cannot do with the request's tools; how its answer is read (None: plain text)."""
    names = _tool_names(body)
    choice = _choice(body)
    if choice == "none":
        return None
    if not names:
        raise ApiError(400, f"tool_choice {choice!r} needs tools", param="tool_choice")
    if choice not in ("auto", "required") and choice not in names:
        raise ApiError(
            400, f"tool_choice names {choice!r}, which is not among the tools ({', '.join(names)})", param="tool_choice"
        )
    if choice == "auto" and parser is None:
        raise ApiError(
            400,
            "tool_choice auto needs a tool-call parser and this server has none (its chat template shows no "
            f"tool-call format): start serve with --tool-call-parser ({', '.join(PARSERS)}), or send tool_choice "
            "required or a named function",
            param="tool_choice",
        )
    return ToolMode(choice, parser, tuple(names), body.parallel_tool_calls is not False)


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    parameters = function.get("parameters")
    return parameters if isinstance(parameters, dict) else {"type": "object", "properties": {}}


def tool_grammar(body: ChatCompletionRequest) -> GrammarSpec | None:
    """The constraint `tool_choice` puts on the answer (required, named), or None (auto, none)."""
    choice = _choice(body)
    if choice in ("none", "auto") or not body.tools:
        return None
    functions = [t["function"] for t in body.tools]
    if choice != "required":
        function = next((f for f in functions if f.get("name") == choice), None)
        if function is None:
            return None  # check_tools refuses it by name
        return GrammarSpec("json_schema", json.dumps(_parameters(function)))
    items = [
        {
            "properties": {"name": {"type": "string", "enum": [f["name"]]}, "parameters": _parameters(f)},
            "required": ["name", "parameters"],
        }
        for f in functions
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if body.parallel_tool_calls is False:
        schema["maxItems"] = 1
    return GrammarSpec("json_schema", json.dumps(schema))


# -- the chat template -----------------------------------------------------------------------------------------
def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as the chat template reads them: assistant `tool_calls` with their arguments as objects (the
    templates write them with `tojson`, as vLLM's chat_utils passes them), `tool` turns with their call id."""
    turns: list[dict[str, Any]] = []
    for m in messages:
        turn: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name is not None:
            turn["name"] = m.name
        if m.tool_call_id is not None:
            turn["tool_call_id"] = m.tool_call_id
        if m.reasoning_content is not None:
            turn["reasoning_content"] = m.reasoning_content
        if m.tool_calls:
            calls = []
            for call in m.tool_calls:
                call = dict(call)
                function = dict(call.get("function") or {})
                arguments = function.get("arguments")
                if isinstance(arguments, str):
                    with contextlib.suppress(ValueError):  # not JSON: the template gets the text
                        function["arguments"] = json.loads(arguments)
                call["function"] = function
                calls.append(call)
            turn["tool_calls"] = calls
        turns.append(turn)
    return turns


def template_tools(
    body: CompletionRequest | ChatCompletionRequest, mode: ToolMode | None
) -> list[dict[str, Any]] | None:
    """The `tools` the template renders: none when tool_choice is none (and for completions)."""
    return list(body.tools or []) if isinstance(body, ChatCompletionRequest) and mode is not None else None


# -- reading the answer ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def message(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def delta(self, index: int) -> dict[str, Any]:
        return {"index": index, **self.message()}


@dataclass
class CallSpan:
    """Where one call object stands in a text being generated: its name once complete, and the span of its
    arguments' value as the model wrote it (end None while it is still open)."""

    start: int
    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None
    end: int | None = None


def scan_calls(text: str, level: int, arguments_keys: tuple[str, ...]) -> list[CallSpan]:
    """The call objects of `text`, a JSON text that may be cut short: the objects opened at nesting `level` (0:
    one object after another, as Hermes and Llama 3 write them; 1: the items of `required`'s array). Characters
    outside the objects (markers, separators) are skipped. One pass, no JSON parsing but the name's string."""
    calls: list[CallSpan] = []
    depth, in_string, escape, string_start = 0, False, False, 0
    key: str | None = None
    expecting: str | None = None  # the key whose value comes next, at the call's member depth
    primitive = False  # the arguments' value is a number, true, false or null (ends at "," or "}")
    call: CallSpan | None = None
    member = level + 1
    for i, ch in enumerate(text):
        if in_string:
            if escape:
                escape = False
            elif ch == "\\":
                escape = True
            elif ch == '"':
                in_string = False
                if call is not None and depth == member:
                    literal = text[string_start : i + 1]
                    if expecting is not None:
                        if expecting == "name":
                            call.name = str(json.loads(literal))
                        elif expecting in arguments_keys and call.args_start == string_start:
                            call.args_end = i + 1
                        expecting = None
                    else:
                        key = str(json.loads(literal))
            continue
        if ch.isspace():
            continue
        if call is not None and depth == member and expecting is not None and ch not in ",}":
            if expecting in arguments_keys and call.args_start is None:
                call.args_start, primitive = i, ch not in '"{['
            if ch not in '"{[':
                continue  # inside a primitive value
        if ch == '"':
            in_string, string_start = True, i
        elif ch in "{[":
            if ch == "{" and depth == level and call is None:
                call = CallSpan(i)
                calls.append(call)
            depth += 1
            if call is not None and depth == member + 1 and expecting is not None:
                expecting = expecting if expecting in arguments_keys else None
        elif ch in "}]":
            depth -= 1
            if call is not None and depth == member and expecting in arguments_keys and call.args_end is None:
                call.args_end, expecting = i + 1, None
            if call is not None and depth == level:
                if primitive and call.args_end is None and call.args_start is not None:
                    call.args_end = len(text[:i].rstrip())
                call.end, call, expecting, primitive = i + 1, None, None, False
        elif ch == ":" and call is not None and depth == member:
            expecting = key
        elif ch == "," and call is not None and depth == member:
            if primitive and call.args_end is None and call.args_start is not None:
                call.args_end = len(text[:i].rstrip())
            expecting, primitive = None, False
    return calls


def _call(obj: Any, arguments_keys: tuple[str, ...], raw: str, level: int = 0) -> ToolCall | None:
    """The call in `obj` (parsed from `raw`), its arguments as the model wrote them (a streamed answer's
    fragments add up to the same text)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    for key in arguments_keys:
        if key in obj:
            value = obj[key]
            if isinstance(value, str):  # arguments sent as a JSON string: its text is the arguments
                return ToolCall(obj["name"], value)
            spans = scan_calls(raw, level, arguments_keys)
            if len(spans) == 1 and spans[0].args_start is not None and spans[0].args_end is not None:
                return ToolCall(obj["name"], raw[spans[0].args_start : spans[0].args_end])
            return ToolCall(obj["name"], json.dumps(value, ensure_ascii=False))
    return None


def parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    """Hermes/Qwen3: the content before the first `<tool_call>` and the calls (an unclosed last block is read to
    the end, as vLLM's regex `<tool_call>(.*?)</tool_call>|<tool_call>(.*)`); unreadable JSON: all content."""
    start = text.find(HERMES_START)
    if start < 0:
        return text, []
    calls: list[ToolCall] = []
    rest = text[start:]
    while rest.startswith(HERMES_START):
        end = rest.find(HERMES_END)
        if end >= 0:
            block, rest = rest[len(HERMES_START) : end], rest[end + len(HERMES_END) :].lstrip()
        else:
            block, rest = rest[len(HERMES_START) :], ""
        try:
            call = _call(json.loads(block), ("arguments",), block)
        except ValueError:
            call = None
        if call is None:
            return text, []
        calls.append(call)
    content = text[:start]
    return (content if content.strip() else None), calls


def parse_llama3_json(text: str) -> tuple[str | None, list[ToolCall]]:
    """Llama 3.x: `<|python_tag|>`? then `{...}` objects separated by `;`; anything else: all content."""
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG) :].lstrip()
    if not body.startswith("{"):
        return text, []
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(body):
        start = at
        try:
            obj, at = decoder.raw_decode(body, at)
        except ValueError:
            return text, []
        call = _call(obj, ("arguments", "parameters"), body[start:at])
        if call is None:
            return text, []
        calls.append(call)
        rest = body[at:].lstrip()
        if not rest:
            break
        if not rest.startswith(";"):
            return text, []
        at = len(body) - len(rest[1:].lstrip())
    return None, calls


def parse_gpt_oss(text: str) -> tuple[str | None, list[ToolCall]]:
    """gpt-oss (harmony; text decoded with its special tokens): messages `[<|start|>assistant]<|channel|>C
    [to=functions.NAME] [<|constrain|>json]<|message|>BODY<|end|>|<|call|>|<|return|>` (the recipient may also
    stand before `<|channel|>`). A message to `functions.NAME` is a call whose arguments are its body; the content
    is the `final` channel's text (the `analysis` channel is the model's reasoning: not shown). Text without
    harmony markers is all content."""
    if HARMONY_MESSAGE not in text:
        return text, []
    calls: list[ToolCall] = []
    final: list[str] = []
    for message in text.split(HARMONY_START):
        header, sep, body = message.partition(HARMONY_MESSAGE)
        if not sep:
            continue
        for end in HARMONY_ENDS:
            body = body.split(end, 1)[0]
        words = header.replace(HARMONY_CHANNEL, " <|channel|>").replace("<|constrain|>", " <|constrain|>").split()
        recipient = next((w[len("to=") :] for w in words if w.startswith("to=")), None)
        channel = next((w[len(HARMONY_CHANNEL) :] for w in words if w.startswith(HARMONY_CHANNEL)), "")
        if recipient is not None and recipient.startswith("functions."):
            calls.append(ToolCall(recipient[len("functions.") :], body.strip()))
        elif channel == "final":
            final.append(body)
    return ("".join(final) or None), calls


def parse(mode: ToolMode, text: str) -> tuple[str | None, list[ToolCall]]:
    """The message content and the tool calls in a whole answer."""
    if mode.named:
        calls = [ToolCall(mode.choice, text)]
        content = None
    elif mode.choice == "required":
        try:
            items = json.loads(text)
        except ValueError:  # cut short (max_tokens): the grammar's text is not complete
            return text, []
        if not isinstance(items, list):
            return text, []
        spans = scan_calls(text, 1, ("parameters",))
        raws = [text[s.start : s.end] for s in spans] if len(spans) == len(items) else [json.dumps(i) for i in items]
        calls = [c for c in (_call(i, ("parameters",), raw) for i, raw in zip(items, raws, strict=True)) if c]
        content = None
    elif mode.parser == "hermes":
        content, calls = parse_hermes(text)
    elif mode.parser == "gpt_oss":
        content, calls = parse_gpt_oss(text)
    else:
        content, calls = parse_llama3_json(text)
    return content, calls if mode.parallel else calls[:1]


def apply(choice: dict[str, Any], mode: ToolMode, text: str, finish_reason: str) -> None:
    """A whole chat answer's choice with its `tool_calls` (finish_reason `tool_calls` when there are some)."""
    content, calls = parse(mode, text)
    if mode.parser == "gpt_oss" and mode.choice == "auto":
        choice["message"]["content"] = content  # the final channel's text, without the markers and the reasoning
    if calls:
        choice["message"]["content"] = content
        choice["message"]["tool_calls"] = [c.message() for c in calls]
        if finish_reason == "stop":
            choice["finish_reason"] = "tool_calls"


class ToolStream:
    """A streamed chat answer read for tool calls: `feed` each text delta, get the deltas to send; `finish` at the
    end. Content streams until a call may begin; then each call's name once complete and its arguments as they
    are written (gpt-oss: all at the end)."""

    def __init__(self, mode: ToolMode) -> None:
        self.mode, self.text, self.sent = mode, "", 0  # sent: characters of `text` streamed as content
        # required/named: everything is a call; gpt-oss: channels decided by special tokens, read at the end
        self.holding = mode.choice != "auto" or self.needs_special_tokens
        self.called = False
        self.call: ToolCall | None = None  # the named function's call, once its first delta is out
        self.streamed: list[tuple[ToolCall, int]] = []  # calls announced so far, and their argument characters sent

    def _marker_at(self) -> int | None:
        """Where a call begins in the text not yet sent, or None; and how much is safe to send meanwhile."""
        if self.mode.parser == "hermes":
            at = self.text.find(HERMES_START, self.sent)
            return at if at >= 0 else None
        stripped = self.text.lstrip()
        if stripped.startswith("{") or stripped.startswith(PYTHON_TAG):
            return 0
        return None

    def _safe_end(self) -> int:
        """Characters that cannot be the start of a call marker: sent as content."""
        if self.mode.parser == "hermes":
            for keep in range(min(len(HERMES_START) - 1, len(self.text) - self.sent), 0, -1):
                if HERMES_START.startswith(self.text[-keep:]):
                    return len(self.text) - keep
            return len(self.text)
        stripped = self.text.lstrip()  # llama3_json: decided by the first non-blank characters
        if not stripped or PYTHON_TAG.startswith(stripped):
            return self.sent
        return len(self.text)

    @property
    def needs_special_tokens(self) -> bool:
        """Whether `finish` reads the answer decoded with its special tokens (harmony's markers are ones)."""
        return self.mode.parser == "gpt_oss" and self.mode.choice == "auto"

    def feed(self, delta: str) -> list[dict[str, Any]]:
        self.text += delta
        if self.mode.named:  # the answer is the named function's arguments: stream them as they come
            first = not self.called
            self.called, self.sent = True, len(self.text)
            if first:
                self.call = ToolCall(self.mode.choice, "")
                return [
                    {"tool_calls": [{**self.call.delta(0), "function": {"name": self.mode.choice, "arguments": delta}}]}
                ]
            return [{"tool_calls": [{"index": 0, "function": {"arguments": delta}}]}] if delta else []
        if self.holding:
            return self._call_deltas() if not self.needs_special_tokens else []
        marker = self._marker_at()
        if marker is not None:
            self.holding = True
            end = marker
        else:
            end = self._safe_end()
        out: list[dict[str, Any]] = []
        if end > self.sent:
            out.append({"content": self.text[self.sent : end]})
            self.sent = end
        return out + (self._call_deltas() if self.holding else [])

    def _region(self) -> tuple[int, int, tuple[str, ...]] | None:
        """Where the calls begin in the text, the nesting level of their objects, and their arguments' keys."""
        if self.mode.choice == "required":
            return 0, 1, ("parameters",)
        if self.mode.parser == "hermes":
            at = self.text.find(HERMES_START)
            return (at, 0, ("arguments",)) if at >= 0 else None
        at = self.text.find("{")
        return (at, 0, ("arguments", "parameters")) if at >= 0 else None

    def _call_deltas(self) -> list[dict[str, Any]]:
        """The deltas of the calls as far as they are written: a call's first delta once its name is complete
        (id, type, name), then its arguments as they come (held back: trailing blanks, which may end up outside
        them, and arguments written as a JSON string, sent whole at the end)."""
        region = self._region()
        if region is None:
            return []
        offset, level, keys = region
        text = self.text[offset:]
        out: list[dict[str, Any]] = []
        for i, span in enumerate(scan_calls(text, level, keys)):
            if (i > 0 and not self.mode.parallel) or span.name is None:
                break  # in order: a later call waits for this one's name
            if i == len(self.streamed):
                call = ToolCall(span.name, "")
                self.streamed.append((call, 0))
                out.append({"tool_calls": [{**call.delta(i), "function": {"name": span.name, "arguments": ""}}]})
            if span.args_start is None or text[span.args_start] == '"':
                continue
            end = span.args_end if span.args_end is not None else len(text.rstrip())
            call, sent = self.streamed[i]
            piece = text[span.args_start + sent : end]
            if piece:
                self.streamed[i] = (call, sent + len(piece))
                out.append({"tool_calls": [{"index": i, "function": {"arguments": piece}}]})
        self.called = bool(self.streamed)
        return out

    def finish(self, raw: str | None = None) -> list[dict[str, Any]]:
        """The deltas that end the answer: held-back content, or the tool calls. `raw`: the whole answer decoded
        with its special tokens, for gpt-oss."""
        if self.mode.named:
            return []
        if self.needs_special_tokens:
            content, calls = parse(self.mode, raw if raw is not None else self.text)
            self.called = bool(calls)
            return ([{"content": content}] if content else []) + [
                {"tool_calls": [call.delta(i)]} for i, call in enumerate(calls)
            ]
        rest = self.text[self.sent :]
        out = self._call_deltas() if self.holding else []
        _, calls = parse(self.mode, self.text if self.mode.choice == "auto" else rest)
        if not calls:
            return out if self.streamed else ([{"content": rest}] if rest else [])
        self.called = True
        for i, call in enumerate(calls):  # what the whole answer holds beyond what was streamed
            if i < len(self.streamed):
                piece = call.arguments[self.streamed[i][1] :]
                if piece:
                    out.append({"tool_calls": [{"index": i, "function": {"arguments": piece}}]})
            else:
                out.append({"tool_calls": [call.delta(i)]})
        return out
