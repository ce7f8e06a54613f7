"""`trtbuild bench` says what it measured (issue 13, item 5): failed requests exit 1 with the reason unless
--allow-failures; the JSON names the engine and every setting; the prefix-cache hit rate is reported on every
trace; --static is what its label says (batches run to completion, nobody admitted mid-batch)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from conftest import SHARED, mooncake, one_line_error

SMALL = {"timestamp": 0, "input_length": 1, "output_length": 1}
LARGE = {"timestamp": 10, "input_length": 2000, "output_length": 100}  # scaled to the whole 128-token context


def test_failed_requests_exit_1_with_the_reason_unless_allowed(
    cli: Any,
    tiny_engine: Path,
    tmp_path: Path,
) -> None:
    trace = mooncake(tmp_path / "t.jsonl", SMALL, LARGE)
    args = ("bench", tiny_engine, "--trace", trace, "--kv-blocks", "2")
    result = cli(*args)
    line = one_line_error(result)
    assert "1 of 2 requests did not complete" in line and "needs more KV blocks than the whole pool (2)" in line
    assert "--allow-failures" in line
    assert "not completed 1 x needs more KV blocks" in result.stdout  # the table still shows what ran
    allowed = cli(*args, "--allow-failures", "--json")
    assert allowed.exit_code == 0, allowed.stderr
    report = json.loads(allowed.stdout)
    assert report["completed"] == 1 and report["failed"] == 1 and report["not_completed"] == 1
    assert list(report["failure_reasons"].values()) == [1]


def test_json_names_the_engine_and_every_setting(cli: Any, tiny_engine: Path, tmp_path: Path) -> None:
    trace = mooncake(tmp_path / "t.jsonl", SMALL, {**SMALL, "timestamp": 5})
    result = cli("bench", tiny_engine, "--trace", trace, "--kv-blocks", "40", "--rate-scale", "4", "--json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    engine = report["engine"]
    assert engine["path"] == str(tiny_engine.resolve())
    assert engine["manifest_sha256"] == hashlib.sha256((tiny_engine / "manifest.json").read_bytes()).hexdigest()
    assert engine["backend"] == "onnxruntime" and engine["limits"]["max_batch_size"] == 4
    settings = report["settings"]
    assert settings == {
        "batching": "in-flight: requests join the running batch at every step",
        "static": False,
        "policy": "max_utilization",
        "kv_blocks": 40,
        "kv_blocks_used": 40,
        "tokens_per_block": 16,
        "prefix_sharing": True,
        "max_requests": 100,
        "rate_scale": 4.0,
        "max_gap_s": 60.0,
        "seed": 0,
    }
    default = json.loads(cli("bench", tiny_engine, "--trace", trace, "--json").stdout)["settings"]
    assert default["kv_blocks"] is None and default["kv_blocks_used"] > 0  # the build's pool, said so


def test_prefix_cache_hit_rate_on_every_trace(cli: Any, tiny_engine: Path, tmp_path: Path) -> None:
    shared = {"input_length": 1536, "output_length": 4, "hash_ids": [0, 1, 2]}  # 3 Mooncake blocks of 512
    trace = mooncake(tmp_path / "t.jsonl", {**shared, "timestamp": 0}, {**shared, "timestamp": 2000})
    args = ("bench", tiny_engine, "--trace", trace, "--rate-scale", "10", "--json")
    cache = json.loads(cli(*args).stdout)["prefix_cache"]
    # the second prompt repeats the first's 126 hashed tokens: its 7 full 16-token blocks come from the cache
    assert cache == {"enabled": True, "cached_prompt_tokens": 112, "prompt_tokens": 254, "hit_rate": 112 / 254}
    off = json.loads(cli(*args, "--no-prefix-sharing").stdout)["prefix_cache"]
    assert off["enabled"] is False and off["cached_prompt_tokens"] == 0 and off["hit_rate"] == 0
    table = cli("bench", tiny_engine, "--trace", trace, "--rate-scale", "10").stdout
    assert "prefix cache  44.1 % of prompt tokens (112/254)" in table


def test_prefix_cache_hit_rate_is_reported_on_an_azure_trace(cli: Any, tiny_engine: Path) -> None:
    """No shared prefixes in an Azure trace: the rate is there, and it is 0."""
    azure = SHARED / "traces" / "AzureLLMInferenceTrace_conv.csv"
    if not azure.is_file():
        pytest.skip(f"shared data absent: {azure} (present in CI; a fresh clone has no ../shared)")
    r = json.loads(
        cli("bench", tiny_engine, "--trace", azure, "--max-requests", "3", "--rate-scale", "50", "--json").stdout
    )
    assert r["prefix_cache"]["hit_rate"] == 0 and r["prefix_cache"]["prompt_tokens"] > 0


def test_static_is_what_its_label_says(
    cli: Any,
    tiny_engine: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from toolchain.engine.api import open_engine
    from toolchain.runtime import replay as replay_module
    from toolchain.runtime.traces import TraceRequest

    seen: list[Any] = []
    summarize = replay_module.summarize
    monkeypatch.setattr(replay_module, "summarize", lambda reqs, *a: seen.append(reqs) or summarize(reqs, *a))
    engine = open_engine(tiny_engine)
    # five at once, batch 4; the first ends after one token, the next three run on
    trace = [TraceRequest(0.0, [5 + i, 6, 7], n) for i, n in enumerate((1, 12, 12, 12, 6))]
    static = replay_module.replay(engine, trace, static=True)
    first, fifth = seen[0][:4], seen[0][4]
    assert fifth.first_scheduled >= max(r.finished_at for r in first)  # admitted only once the batch ended
    assert static["settings"]["batching"].startswith("static: batches of 4 requests, each run to completion")
    replay_module.replay(engine, trace)  # in-flight: the fifth takes the first's slot while the others run
    assert seen[1][4].first_scheduled < max(r.finished_at for r in seen[1][:4])
    table = cli("bench", tiny_engine, "--trace", mooncake(tmp_path / "t.jsonl", SMALL), "--static").stdout
    assert "batching      static: batches of 4 requests, each run to completion before the next is admitted" in table
