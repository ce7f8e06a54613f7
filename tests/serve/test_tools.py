"""Tool calling (serve/tools.py): the parsers on recorded model texts (Hermes/Qwen3, Llama 3.x JSON), the same
calls whether streamed in pieces or read whole, the parser chosen from the template, and the official OpenAI
client end to end against the tiny engine with a Hermes-style template: tool_choice required and named give a
`get_weather` call whose arguments validate against its schema, streamed or not, and the tool's answer sent back
gets a completion."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from tests.serve.helpers import MODEL, Running, error_of, post, running
from toolchain.checkpoint.tiny import CHAT_TEMPLATE
from toolchain.engine.build import BuildOptions, build_engine
from toolchain.serve import tools
from toolchain.serve.protocol import ChatCompletionRequest

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
GET_WEATHER: Any = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}
# Qwen3's tool format (its tokenizer_config.json chat_template) cut to what the tests need: the tools in a system
# turn, assistant calls as <tool_call> blocks with their arguments as JSON, tool answers in their own turn
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t.function | tojson }}{% endfor %}</tools>"
    "<|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
    '{% for c in m.tool_calls %}<tool_call>{"name": {{ c.function.name | tojson }}, "arguments": '
    "{{ c.function.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


# -- parsers on recorded texts ----------------------------------------------------------------------------------
QWEN3 = (
    "I'll check both.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>\n<tool_call>\n'
    '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>'
)
LLAMA3_TAGGED = (
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}; '
    '{"name": "get_time", "parameters": {"tz": "Europe/Paris"}}'
)
# gpt-oss answers (harmony), decoded with their special tokens: reasoning then a call (recipient after the channel,
# then before it), and reasoning then a final answer
GPT_OSS_CALL = (
    "<|channel|>analysis<|message|>The user wants the weather. Call get_weather.<|end|>"
    '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", '
    '"unit": "c"}<|call|>'
)
GPT_OSS_CALL_BEFORE = (
    '<|start|>assistant to=functions.get_time<|channel|>commentary<|constrain|>json<|message|>{"tz": "Europe/Paris"}'
    "<|call|>"
)
GPT_OSS_FINAL = (
    "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>It is 18 C in Paris."
    "<|return|>"
)
LLAMA3_PLAIN = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}'
CALLS = [("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {"tz": "Europe/Paris"})]


def _calls(calls: list[tools.ToolCall]) -> list[tuple[str, Any]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def test_hermes_parser_reads_qwen3_calls_and_the_text_before() -> None:
    content, calls = tools.parse_hermes(QWEN3)
    assert content == "I'll check both.\n" and _calls(calls) == CALLS
    assert tools.parse_hermes("no call here") == ("no call here", [])
    broken = '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    assert tools.parse_hermes(broken) == (broken, [])  # unreadable: the text stays content
    content, calls = tools.parse_hermes('<tool_call>\n{"name": "f", "arguments": {}}')  # cut before its end tag
    assert content is None and _calls(calls) == [("f", {})]


def test_llama3_json_parser_with_and_without_the_python_tag() -> None:
    assert tools.parse_llama3_json(LLAMA3_TAGGED)[0] is None
    assert _calls(tools.parse_llama3_json(LLAMA3_TAGGED)[1]) == CALLS
    assert _calls(tools.parse_llama3_json(LLAMA3_PLAIN)[1]) == CALLS[:1]
    assert tools.parse_llama3_json("The weather is fine.") == ("The weather is fine.", [])
    assert tools.parse_llama3_json('{"city": "Paris"}') == ('{"city": "Paris"}', [])  # JSON, but no call


def test_gpt_oss_parser_reads_harmony_calls_and_the_final_channel() -> None:
    assert tools.parse_gpt_oss(GPT_OSS_CALL)[0] is None
    assert _calls(tools.parse_gpt_oss(GPT_OSS_CALL)[1]) == CALLS[:1]
    assert _calls(tools.parse_gpt_oss(GPT_OSS_CALL_BEFORE)[1]) == CALLS[1:]
    assert tools.parse_gpt_oss(GPT_OSS_FINAL) == ("It is 18 C in Paris.", [])  # the analysis is not content
    assert tools.parse_gpt_oss("plain words") == ("plain words", [])


def test_gpt_oss_streams_read_the_answer_with_its_special_tokens() -> None:
    stream = tools.ToolStream(tools.ToolMode("auto", "gpt_oss", ("get_weather",), True))
    assert stream.needs_special_tokens
    visible = (
        "analysisThe user wants the weather.assistantcommentary to=functions.get_weather json{}"  # specials dropped
    )
    assert stream.feed(visible) == []  # held: the channels are only known from the special tokens
    deltas = stream.finish(GPT_OSS_CALL)
    assert [
        (d["tool_calls"][0]["function"]["name"], json.loads(d["tool_calls"][0]["function"]["arguments"]))
        for d in deltas
    ] == CALLS[:1]
    final = tools.ToolStream(tools.ToolMode("auto", "gpt_oss", ("get_weather",), True))
    assert final.finish(GPT_OSS_FINAL) == [{"content": "It is 18 C in Paris."}] and not final.called


@pytest.mark.parametrize(("parser", "text"), [("hermes", QWEN3), ("llama3_json", LLAMA3_TAGGED)])
def test_streamed_pieces_give_the_whole_answers_calls(parser: str, text: str) -> None:
    mode = tools.ToolMode("auto", parser, ("get_weather", "get_time"), True)
    stream = tools.ToolStream(mode)
    deltas = [d for i in range(0, len(text), 3) for d in stream.feed(text[i : i + 3])] + stream.finish()
    content = "".join(d.get("content", "") for d in deltas)
    pieces = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    whole_content, whole = tools.parse(mode, text)
    assert content == (whole_content or "") and stream.called
    assert _assembled(pieces) == {i: (c.name, c.arguments) for i, c in enumerate(whole)}
    firsts = [p for p in pieces if "id" in p]  # each call's first delta: id, type and name, once
    assert [p["index"] for p in firsts] == list(range(len(whole)))
    assert all(p["type"] == "function" and p["id"].startswith("call_") and p["function"]["name"] for p in firsts)
    assert len(pieces) > 2 * len(whole)  # the arguments came in fragments


def _assembled(pieces: list[dict[str, Any]]) -> dict[int, tuple[str, str]]:
    """Streamed tool-call deltas put together as a client does: name from the first, arguments concatenated."""
    calls: dict[int, tuple[str, str]] = {}
    for p in pieces:
        name, arguments = calls.get(p["index"], ("", ""))
        function = p.get("function", {})
        calls[p["index"]] = (name + (function.get("name") or ""), arguments + (function.get("arguments") or ""))
    return calls


def test_plain_text_streams_as_content_with_markers_held_back() -> None:
    stream = tools.ToolStream(tools.ToolMode("auto", "hermes", ("f",), True))
    assert stream.feed("Hello <tool") == [{"content": "Hello "}]  # "<tool" may begin a call: held
    assert stream.feed("s are fine") == [{"content": "<tools are fine"}]
    assert stream.finish() == [] and not stream.called


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    mode = tools.ToolMode("auto", "hermes", ("get_weather", "get_time"), parallel=False)
    assert _calls(tools.parse(mode, QWEN3)[1]) == CALLS[:1]


def test_the_parser_comes_from_the_flag_or_the_template() -> None:
    class Tok:
        def __init__(self, template: str) -> None:
            self.chat_template = template

    assert tools.choose_parser(None, Tok(HERMES_TEMPLATE))[0] == "hermes"
    assert tools.choose_parser(None, Tok("{{ '<|python_tag|>' }}"))[0] == "llama3_json"
    assert tools.choose_parser(None, Tok(CHAT_TEMPLATE))[0] is None
    assert tools.choose_parser("llama3_json", Tok(HERMES_TEMPLATE))[0] == "llama3_json"  # the flag wins
    assert tools.choose_parser(None, Tok("{{ '<|start|>assistant<|channel|>final<|message|>' }}"))[0] == "gpt_oss"
    with pytest.raises(ValueError, match="not one of hermes, llama3_json, gpt_oss"):
        tools.choose_parser("mistral", None)


def test_required_is_vllms_array_schema() -> None:
    body = ChatCompletionRequest(model=MODEL, messages=[], tools=[GET_WEATHER], tool_choice="required")
    spec = tools.tool_grammar(body)
    assert spec is not None and json.loads(spec.text) == {
        "type": "array",
        "minItems": 1,
        "items": {
            "type": "object",
            "anyOf": [
                {
                    "properties": {"name": {"type": "string", "enum": ["get_weather"]}, "parameters": WEATHER},
                    "required": ["name", "parameters"],
                }
            ],
        },
    }


# -- end to end with the OpenAI client --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tool_server(checkpoint: Path) -> Iterator[Running]:
    """The tiny engine with room for a tools prompt (max_seq_len 512: one byte a token), served with a
    Hermes-style template put on its tokenizer here (the parser detected from it, as at start-up)."""
    opts = BuildOptions(backend="onnxruntime", max_seq_len=512, max_batch_size=4, max_num_tokens=512)
    build_engine(checkpoint, checkpoint.parent / "engine-tools", opts)
    with running(checkpoint.parent / "engine-tools") as r:
        r.state.tokenizer.chat_template = HERMES_TEMPLATE
        r.state.tool_parser, _ = tools.choose_parser(None, r.state.tokenizer)
        yield r


MESSAGES: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("choice", ["required", "named"])
def test_client_gets_a_valid_call_whole_and_streamed(tool_server: Running, choice: str) -> None:
    client = tool_server.client()
    args: dict[str, Any] = {
        "model": MODEL,
        "messages": MESSAGES,
        "tools": [GET_WEATHER],
        "tool_choice": "required" if choice == "required" else NAMED,
        "parallel_tool_calls": False,
        "temperature": 1.0,
        "seed": 7,
        "max_tokens": 160,  # the prompt is ~300 tokens of 512
    }
    answer = client.chat.completions.create(**args)
    assert answer.choices[0].finish_reason == "tool_calls"
    calls = answer.choices[0].message.tool_calls or []
    assert len(calls) == 1 and calls[0].type == "function" and calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER)

    assembled: dict[int, dict[str, str]] = {}
    finish, pieces = None, 0
    for chunk in client.chat.completions.create(**args, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        assert not delta.content  # a call, not text
        for call in delta.tool_calls or []:
            pieces += 1
            if call.function and call.function.name:  # the first delta of a call names it
                assert call.id and call.id.startswith("call_") and call.type == "function"
            entry = assembled.setdefault(call.index, {"name": "", "arguments": ""})
            entry["name"] += (call.function.name if call.function else None) or ""
            entry["arguments"] += (call.function.arguments if call.function else None) or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert assembled == {0: {"name": "get_weather", "arguments": calls[0].function.arguments}}
    assert pieces > len(calls[0].function.arguments) // 2  # the arguments streamed as they were generated


def test_the_tool_answer_goes_back_and_gets_a_completion(tool_server: Running) -> None:
    client = tool_server.client()
    call: Any = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    answer = client.chat.completions.create(
        model=MODEL,
        messages=[
            *MESSAGES,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
        ],
        tools=[GET_WEATHER],
        max_tokens=4,
    )
    assert answer.choices[0].finish_reason == "length" and answer.choices[0].message.content
    prompt = post(
        tool_server.url,
        {"model": MODEL, "messages": [*MESSAGES, {"role": "assistant", "tool_calls": [call]}]},
        path="/tokenize",
    ).json()["tokens"]
    text = tool_server.state.tokenizer.decode(prompt)
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text


def test_tool_requests_refused_by_name(tool_server: Running) -> None:
    base = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4}
    path = "/v1/chat/completions"
    missing = {**base, "tools": [GET_WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}
    assert "'nope'" in error_of(post(tool_server.url, missing, path=path), 400)["message"]
    bare = {**base, "tool_choice": "required"}
    assert error_of(post(tool_server.url, bare, path=path), 400)["param"] == "tool_choice"
    both = {**base, "tools": [GET_WEATHER], "tool_choice": "required", "guided_regex": "a"}
    assert "tool_choice" in error_of(post(tool_server.url, both, path=path), 400)["message"]
    state = tool_server.state
    state.tokenizer.chat_template = CHAT_TEMPLATE  # a template that never mentions tools
    try:
        ignored = error_of(post(tool_server.url, {**base, "tools": [GET_WEATHER]}, path=path), 400)
        assert ignored["param"] == "tools" and "ignores tools" in ignored["message"]
        state.tool_parser = None
        auto = error_of(post(tool_server.url, {**base, "tools": [GET_WEATHER]}, path=path), 400)
        assert auto["param"] == "tool_choice" and "--tool-call-parser" in auto["message"]
        plain = post(tool_server.url, {**base, "tools": [GET_WEATHER], "tool_choice": "none"}, path=path)
        assert plain.status_code == 200, plain.text
    finally:
        state.tokenizer.chat_template = HERMES_TEMPLATE
        state.tool_parser = "hermes"


def test_streamed_calls_carry_their_logprobs_and_the_clients_message_goes_back(tool_server: Running) -> None:
    """logprobs with tools: every generated token's entry arrives, whole or streamed (chunks whose text the parser
    holds back carry them on an empty delta); the openai client's own assistant message (model_dump: refusal,
    annotations, audio, function_call all null) is accepted back in the history."""
    client = tool_server.client()
    args: dict[str, Any] = {
        "model": MODEL,
        "messages": MESSAGES,
        "tools": [GET_WEATHER],
        "tool_choice": NAMED,
        "temperature": 1.0,
        "seed": 11,
        "max_tokens": 160,
        "logprobs": True,
        "top_logprobs": 2,
    }
    whole = client.chat.completions.create(**args)
    entries = whole.choices[0].logprobs.content if whole.choices[0].logprobs else None
    assert whole.usage is not None and entries is not None and len(entries) == whole.usage.completion_tokens
    streamed = []
    for chunk in client.chat.completions.create(**args, stream=True):
        if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
            streamed += chunk.choices[0].logprobs.content
    assert [e.token for e in streamed] == [e.token for e in entries]  # same seed: the same tokens, all of them
    message = whole.choices[0].message.model_dump()
    assert {"refusal", "audio", "function_call"} <= set(message)
    calls = message["tool_calls"]
    history = [*MESSAGES, message, {"role": "tool", "tool_call_id": calls[0]["id"], "content": "18 C"}]
    again = client.chat.completions.create(model=MODEL, messages=history, tools=[GET_WEATHER], max_tokens=2)
    assert again.choices[0].message.content is not None


def test_gpt_oss_answers_also_end_at_its_call_token() -> None:
    from toolchain.checkpoint.tiny import byte_level_tokenizer

    tok = byte_level_tokenizer()
    assert tools.stop_tokens("gpt_oss", tok) == ()  # no such token: nothing added
    tok.add_special_tokens({"additional_special_tokens": ["<|call|>"]})
    assert tools.stop_tokens("gpt_oss", tok) == (tok.convert_tokens_to_ids("<|call|>"),)
    assert tools.stop_tokens("hermes", tok) == ()


def test_chat_template_kwargs_reach_the_template(tool_server: Running) -> None:
    """vLLM's chat_template_kwargs: Qwen3's enable_thinking=false adds an empty think block to the prompt."""
    base = {"model": MODEL, "messages": MESSAGES, "max_tokens": 1}
    path = "/v1/chat/completions"
    plain = post(tool_server.url, base, path=path).json()["usage"]["prompt_tokens"]
    off = {**base, "chat_template_kwargs": {"enable_thinking": False}}
    assert post(tool_server.url, off, path=path).json()["usage"]["prompt_tokens"] == plain + len(
        "<think>\n\n</think>\n\n"
    )
    clash = {**base, "chat_template_kwargs": {"tools": []}}
    assert error_of(post(tool_server.url, clash, path=path), 400)["param"] == "chat_template_kwargs"


def test_auto_reads_a_hermes_call_from_free_text(tool_server: Running) -> None:
    """tool_choice auto: the answer is free text read by the hermes parser. A regex constraint (the noise model
    never writes a call by itself) makes it write text, then a <tool_call> block: the whole answer and the stream
    give the same content and call."""
    regex = (
        r'Sure\.<tool_call>\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,6}", "unit": "[cf]"\}\}</tool_call>'
    )
    client = tool_server.client()
    args: dict[str, Any] = {
        "model": MODEL,
        "messages": MESSAGES,
        "tools": [GET_WEATHER],
        "max_tokens": 120,
        "seed": 5,
        "extra_body": {"guided_regex": regex},
    }
    answer = client.chat.completions.create(**args)
    message = answer.choices[0].message
    assert answer.choices[0].finish_reason == "tool_calls" and message.content == "Sure."
    calls = message.tool_calls or []
    assert [c.function.name for c in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER)
    content, finish = "", None
    streamed: list[Any] = []
    for chunk in client.chat.completions.create(**args, stream=True):
        if chunk.choices:
            content += chunk.choices[0].delta.content or ""
            streamed += chunk.choices[0].delta.tool_calls or []
            finish = chunk.choices[0].finish_reason or finish
    assert content == "Sure." and finish == "tool_calls"
    pieces = [c.model_dump(exclude_none=True) for c in streamed]
    assert _assembled(pieces) == {0: ("get_weather", calls[0].function.arguments)}


@pytest.mark.parametrize(
    ("text", "level", "expected"),
    [
        ('{"name": "f", "arguments": {"a": {"b": [1, "}"]}}}', 0, [("f", '{"a": {"b": [1, "}"]}}')]),
        ('{"arguments": {"x": 1}, "name": "g"}', 0, [("g", '{"x": 1}')]),  # arguments before the name
        ('{"name": "h", "parameters": 42 , "x": 1}', 0, [("h", "42")]),  # a primitive, blanks not included
        (
            '[{"name":"f","parameters":{"q":"a\\"b"}},{"name":"g","parameters":{}}]',
            1,
            [("f", '{"q":"a\\"b"}'), ("g", "{}")],
        ),
        (
            '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>\n<tool_call>{"name": "g", "argu',
            0,
            [("f", '{"a": 1}'), ("g", None)],
        ),
    ],
    ids=["nested", "name-last", "primitive", "required-array", "cut-short"],
)
def test_call_spans_while_the_json_is_written(text: str, level: int, expected: list[tuple[str, str | None]]) -> None:
    spans = tools.scan_calls(text, level, ("arguments", "parameters"))
    found = [
        (s.name, text[s.args_start : s.args_end] if s.args_end is not None and s.args_start is not None else None)
        for s in spans
    ]
    assert found == expected
    for cut in range(len(text)):  # never wrong while cut short: a name is whole, a finished span is the same
        for early, final in zip(tools.scan_calls(text[:cut], level, ("arguments", "parameters")), spans, strict=False):
            assert early.name in (None, final.name) and early.args_end in (None, final.args_end)
