"""The loop's host-row seam (issue 29): only requests that need more than the engine's argmax bring their logits
row to the host (a plain greedy request keeps `sampled` empty), a request whose params need the host gets the same
token as the device argmax when nothing changes the row, and a batch can ask every position's logits for some
sequences and the last position's for the others."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from conftest import save_random_llama
from fakes import Spy

from toolchain.checkpoint.convert import convert
from toolchain.engine.api import open_engine
from toolchain.engine.build import BuildOptions, build_engine
from toolchain.engine.contract import Batch
from toolchain.runtime.loop import Runtime
from toolchain.runtime.request import SamplingParams


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp("hostrows")
    convert(save_random_llama(tmp / "hf", num_attention_heads=8, num_key_value_heads=2), tmp / "ckpt")
    build_engine(tmp / "ckpt", tmp / "engine", BuildOptions(backend="onnxruntime", tokens_per_block=4))
    return open_engine(tmp / "engine")


PROMPTS = [[5, 9, 14, 3, 22, 8], [40, 41, 7], [11, 12, 13, 14, 15, 16, 17, 18, 19]]


def test_plain_greedy_rows_never_leave_the_device(engine: Any) -> None:
    spy = Spy(engine)
    rt = Runtime(spy, num_blocks=64)  # type: ignore[arg-type]
    for p in PROMPTS:
        rt.add_request(p, SamplingParams(max_new_tokens=5))
    rt.run()
    assert spy.calls and all(c == [] for c in spy.calls)


def test_a_host_row_with_neutral_params_picks_the_device_argmax(engine: Any) -> None:
    """logprobs change nothing for greedy, but make the row a host row: same tokens as the plain run."""
    plain, hosted = Runtime(engine, num_blocks=64), Runtime(Spy(engine), num_blocks=64)  # type: ignore[arg-type]
    neutral = SamplingParams(max_new_tokens=6, logprobs=0)
    assert neutral.needs_host_logits and not SamplingParams(max_new_tokens=6).needs_host_logits
    a = [plain.add_request(p, SamplingParams(max_new_tokens=6)) for p in PROMPTS]
    b = [hosted.add_request(p, neutral) for p in PROMPTS]
    plain.run()
    hosted.run()
    assert [r.generated for r in a] == [r.generated for r in b]
    assert any(c for c in hosted.engine.calls)  # type: ignore[attr-defined]


def test_every_position_for_some_sequences_the_last_for_others(engine: Any) -> None:
    pool = engine.new_kv_cache(16)
    tables = [[0, 1], [2], [3, 4, 5]]
    whole = engine.forward(Batch.from_sequences(PROMPTS, [0, 0, 0], tables, True), pool)
    pool = engine.new_kv_cache(16)
    mixed = engine.forward(Batch.from_sequences(PROMPTS, [0, 0, 0], tables, [True, False, True]), pool)
    ends = np.cumsum([len(p) for p in PROMPTS])
    expected = np.concatenate([whole[: ends[0]], whole[ends[1] - 1 : ends[1]], whole[ends[1] :]])
    np.testing.assert_array_equal(mixed, expected)
