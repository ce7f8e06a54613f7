"""Tool calling (issue 29, item 4): `tools` rendered through the chat template, `tool_choice` turned into a grammar
(`required`, a named function) or left free (`auto`), and the model's text parsed into OpenAI `tool_calls` by the
parser of its chat format (Llama 3.x JSON, Hermes/Qwen3, gpt-oss), whole or as streamed deltas.

FRAME STUB: slice C fills this; until then `tools` other than empty are refused by name.
"""

from __future__ import annotations

from toolchain.serve.protocol import ApiError, ChatCompletionRequest


def check_tools(body: ChatCompletionRequest) -> None:
    """Refuse what this server cannot do with the request's tools."""
    if body.tools:
        raise ApiError(400, "tools: tool calling is not available yet", param="tools")
