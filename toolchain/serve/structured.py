"""Structured output requests (issue 29, item 3): OpenAI's `response_format` (json_object, json_schema), vLLM's
`structured_outputs` and its older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` fields, and a
chat request's `tool_choice` (`required` or a named function: serve/tools.py), turned into one `GrammarSpec` for the
runtime's guide (runtime/guided.py). More than one constraint is refused naming both; a constraint that does not
compile is refused with llguidance's message, before the request is admitted.

Sources: OpenAI's API reference (`response_format`: `{"type": "text" | "json_object" | "json_schema",
"json_schema": {"name", "schema", "strict"}}`); vLLM's `StructuredOutputsParams` (vllm/sampling_params.py: json,
regex, choice, grammar, json_object) and the `guided_*` request fields it still accepts
(vllm/entrypoints/openai/protocol.py).
"""

from __future__ import annotations

import json
from typing import Any

from toolchain.runtime.guided import GrammarError, Guide, compile_grammar
from toolchain.runtime.request import GrammarSpec
from toolchain.serve import tools
from toolchain.serve.protocol import ApiError, ChatCompletionRequest, CompletionRequest

RESPONSE_FORMATS = ("text", "json_object", "json_schema")
STRUCTURED_OUTPUTS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}


def grammar_spec(body: CompletionRequest | ChatCompletionRequest, guide: Guide | None = None) -> GrammarSpec | None:
    """The request's constraint, checked (it compiles, and with `guide`, for this engine's tokenizer), or None;
    ApiError(400) naming the field otherwise."""
    found: list[tuple[str, GrammarSpec]] = []
    if body.response_format is not None:
        spec = _response_format(body.response_format)
        if spec is not None:
            found.append(("response_format", spec))
    if body.structured_outputs is not None:
        found.append(_structured_outputs(body.structured_outputs))
    if body.guided_json is not None:
        found.append(("guided_json", _schema(body.guided_json, "guided_json")))
    if body.guided_regex is not None:
        found.append(("guided_regex", GrammarSpec("regex", body.guided_regex)))
    if body.guided_choice is not None:
        found.append(("guided_choice", _choice(body.guided_choice, "guided_choice")))
    if body.guided_grammar is not None:
        found.append(("guided_grammar", GrammarSpec("grammar", body.guided_grammar)))
    if isinstance(body, ChatCompletionRequest):
        spec = tools.tool_grammar(body)
        if spec is not None:
            found.append(("tool_choice", spec))
    if not found:
        return None
    if len(found) > 1:
        a, b = found[0][0], found[1][0]
        raise ApiError(400, f"{a} and {b} both constrain the output: send one of them", param=b)
    field, spec = found[0]
    try:
        compile_grammar(spec)
    except GrammarError as e:
        raise ApiError(400, f"{field}: the {spec.kind} constraint does not compile: {e}", param=field) from e
    problem = guide.check(spec) if guide is not None else None
    if problem:
        raise ApiError(400, f"{field}: the {spec.kind} constraint cannot run on this engine: {problem}", param=field)
    return spec


def _response_format(value: dict[str, Any]) -> GrammarSpec | None:
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object", "")
    if kind == "json_schema":
        inner = value.get("json_schema")
        if not isinstance(inner, dict) or "schema" not in inner:
            raise ApiError(
                400,
                'response_format: json_schema needs {"type": "json_schema", "json_schema": {"name": ..., "schema": '
                "{...}}}",
                param="response_format",
            )
        return _schema(inner["schema"], "response_format")
    raise ApiError(
        400, f"response_format: type {kind!r} is not one of {', '.join(RESPONSE_FORMATS)}", param="response_format"
    )


def _structured_outputs(value: dict[str, Any]) -> tuple[str, GrammarSpec]:
    field = "structured_outputs"
    keys = [k for k, v in value.items() if v is not None and v is not False]
    unknown = [k for k in keys if k not in STRUCTURED_OUTPUTS and k != "json_object"]
    if unknown:
        allowed = ", ".join([*STRUCTURED_OUTPUTS, "json_object"])
        raise ApiError(400, f"{field}: {unknown[0]!r} is not supported here; one of {allowed}", param=field)
    if len(keys) != 1:
        raise ApiError(400, f"{field}: exactly one of {', '.join(STRUCTURED_OUTPUTS)}, json_object", param=field)
    key = keys[0]
    name = f"{field}.{key}"
    if key == "json_object":
        return name, GrammarSpec("json_object", "")
    if key == "json":
        return name, _schema(value[key], name)
    if key == "choice":
        return name, _choice(value[key], name)
    if not isinstance(value[key], str):
        raise ApiError(400, f"{name}: a string", param=name)
    return name, GrammarSpec(STRUCTURED_OUTPUTS[key], value[key])


def _schema(schema: Any, field: str) -> GrammarSpec:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise ApiError(400, f"{field}: the schema is not valid JSON ({e})", param=field) from e
    if not isinstance(schema, dict):
        raise ApiError(400, f"{field}: a JSON schema is an object", param=field)
    return GrammarSpec("json_schema", json.dumps(schema))  # key order kept: the answer follows the properties


def _choice(choices: Any, field: str) -> GrammarSpec:
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise ApiError(400, f"{field}: a non-empty list of non-empty strings", param=field)
    return GrammarSpec("choice", json.dumps(choices))
