"""The runtime's vocabulary: `FinishReason` (runtime name, OpenAI name, HTTP status) from the runtime to the server,
and the block manager's request verbs, which are the only writers of a request's KV state."""

from __future__ import annotations

import ast
import json
import types
from pathlib import Path

import pytest
from fakes import FakeEngine, expected_output

from toolchain.runtime.blocks import BlockManager
from toolchain.runtime.loop import Runtime
from toolchain.runtime.request import FinishReason, Request, SamplingParams
from toolchain.serve.app import _finish_error
from toolchain.serve.metrics import FINISH_REASONS
from toolchain.serve.protocol import ApiError

RUNTIME = Path(__file__).resolve().parents[2] / "toolchain" / "runtime"

# what the server sent and logged before the enum (serve/app.py's FINISH and _STATUS tables), kept byte for byte
WIRE = {
    "length": ("length", 200),
    "stop_token": ("stop", 200),
    "stop_string": ("stop", 200),
    "cancelled": ("abort", 499),
    "timeout": ("abort", 408),
    "shutdown": ("abort", 503),
    "error": ("error", 500),
}


def test_every_finish_reason_keeps_its_names_and_status() -> None:
    assert {r.value: (r.openai, r.http_status) for r in FinishReason} == WIRE
    assert {r.openai for r in FinishReason} <= set(FINISH_REASONS)  # every metric label is present from the start
    # ... as vLLM's are: its FINISH_REASON_STRINGS (vllm/v1/engine/__init__.py, 0.34.0), repetition included
    assert FINISH_REASONS == ("stop", "length", "abort", "error", "repetition")
    assert {r for r in FinishReason if r.is_error} == {FinishReason.TIMEOUT, FinishReason.SHUTDOWN, FinishReason.ERROR}


@pytest.mark.parametrize("reason", list(FinishReason))
def test_a_finish_reason_is_its_string_wherever_it_is_written(reason: FinishReason) -> None:
    name = reason.value
    assert reason == name and str(reason) == f"{reason}" == f"{reason:>0}" == name
    assert json.dumps({reason: [reason]}) == json.dumps({name: [name]})
    assert {name: 1}[reason] == 1 and FinishReason(name) is reason


@pytest.mark.parametrize("reason", list(FinishReason))
def test_the_server_answers_a_finish_reason_with_one_error_or_a_completion(reason: FinishReason) -> None:
    rejections: list[str] = []
    counter = types.SimpleNamespace(labels=lambda r: types.SimpleNamespace(inc=lambda: rejections.append(r)))
    state = types.SimpleNamespace(metrics=types.SimpleNamespace(rejections=counter))
    event = types.SimpleNamespace(finish_reason=reason, error="why")
    error = _finish_error(state, event)  # type: ignore[arg-type]
    if not reason.is_error:
        assert error is None and not rejections
        return
    assert isinstance(error, ApiError) and error.status == reason.http_status
    assert error.body()["error"]["code"] == reason.http_status
    assert rejections == (["timeout"] if reason is FinishReason.TIMEOUT else [])


def test_the_runtime_ends_requests_with_finish_reasons() -> None:
    rt = Runtime(FakeEngine())
    done = rt.add_request([3, 4, 5], SamplingParams(max_new_tokens=3))
    stopped = rt.add_request(
        [3, 4, 5], SamplingParams(max_new_tokens=9, stop_token_ids=(expected_output([3, 4, 5], 2)[1],))
    )
    refused = rt.add_request([], SamplingParams(max_new_tokens=3))
    rt.run()
    assert done.finish_reason is FinishReason.LENGTH and stopped.finish_reason is FinishReason.STOP_TOKEN
    assert refused.finish_reason is FinishReason.ERROR


# -- the block manager's request verbs --------------------------------------------------------------------------
def test_request_verbs_allocate_share_advance_and_free() -> None:
    bm = BlockManager(6, 4)
    assert [bm.blocks_for(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    first = Request(list(range(10, 23)))  # 13 tokens: 3 full blocks + 1
    assert bm.can_allocate_for(first, 13) and bm.allocate_for(first, 13) and first.blocks == [0, 1, 2, 3]
    assert bm.allocate_for(first, 16) and first.blocks == [0, 1, 2, 3]  # already holds them: nothing taken
    bm.advance(first, 8)
    assert (first.num_computed, first.registered) == (8, 2)
    bm.advance(first, 5)
    assert (first.num_computed, first.registered) == (13, 3)
    second = Request([*first.tokens[:12], 99])
    assert bm.share_prefix(second) == 12 and second.blocks == [0, 1, 2] and second.registered == 3
    assert not bm.can_allocate_for(second, 13 + 3 * 4) and not bm.allocate_for(second, 13 + 3 * 4)
    assert second.blocks == [0, 1, 2]  # a refusal takes nothing
    assert bm.max_tokens_for(second) == (3 + 2) * 4  # its own blocks and the 2 free ones
    bm.free(second)
    bm.free(first)
    assert (first.blocks, first.num_computed, first.registered) == ([], 0, 0)
    assert bm.num_free == 6 and all(c == 0 for c in bm.refcount)


def _written_attributes(source: str) -> list[tuple[int, str]]:
    """(line, name) of every attribute assigned on an object other than `self`."""
    written = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        else:
            continue
        for leaf in (n for t in targets for n in ast.walk(t)):
            if isinstance(leaf, ast.Attribute) and not (isinstance(leaf.value, ast.Name) and leaf.value.id == "self"):
                written.append((leaf.lineno, leaf.attr))
    return written


def test_only_the_block_manager_writes_a_requests_kv_state() -> None:
    """The scheduler and the step loop ask the block manager; they never assign a request's block table or
    counts themselves (nano-vllm's and vLLM's split)."""
    owned = {"blocks", "num_computed", "registered"}
    writers = [
        f"{path.name}:{line} .{name}"
        for path in sorted(RUNTIME.glob("*.py"))
        if path.name not in ("blocks.py", "request.py")
        for line, name in _written_attributes(path.read_text())
        if name in owned
    ]
    assert writers == []
