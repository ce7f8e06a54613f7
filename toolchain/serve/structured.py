"""Structured output requests (issue 29, item 3): OpenAI's `response_format` (json_object, json_schema), vLLM's
`structured_outputs` and its older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` fields, turned
into one `GrammarSpec` for the runtime's guide (runtime/guided.py). More than one constraint is refused by name.

FRAME STUB: slice C fills this; until then any constraint is refused by name.
"""

from __future__ import annotations

from toolchain.runtime.request import GrammarSpec
from toolchain.serve.protocol import ApiError, ChatCompletionRequest, CompletionRequest


def grammar_spec(body: CompletionRequest | ChatCompletionRequest) -> GrammarSpec | None:
    """The request's constraint, or None."""
    for name in (
        "response_format",
        "structured_outputs",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
    ):
        value = getattr(body, name)
        if value is not None and not (name == "response_format" and value.get("type") == "text"):
            raise ApiError(400, f"{name}: structured output is not available yet", param=name)
    return None
