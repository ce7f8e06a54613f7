"""The conversion benchmark script runs end to end on a tiny model (its figures are not asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_convert_benchmark_smoke() -> None:
    args = ["--hidden", "64", "--layers", "2", "--intermediate", "96", "--vocab", "128", "--heads", "4"]
    args += ["--kv-heads", "2", "--shards", "2", "--skip-transformers", "--json"]
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "convert.py"), *args], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    table = json.loads(result.stdout)
    methods = ["byte copy (floor)", "trtbuild convert tp=1", "trtbuild convert tp=2"]
    assert [r["method"] for r in table["rows"]] == methods
    assert all(r["wall_s"] >= 0 and r["peak_rss_mib"] > 0 for r in table["rows"])


def test_ifb_benchmark_exits_1_when_requests_did_not_complete(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """bench/ifb.py's table counts requests that did not complete, and the script fails on them unless allowed
    (the runs themselves are replaced: they take minutes, `test_bench_report.py` covers the replay)."""
    sys.path.insert(0, str(ROOT / "bench"))
    import ifb

    def rows(name: str, hf: Path, work: Path, args: Any) -> list[dict[str, Any]]:
        pct = {"p50": 0.01, "p90": 0.02, "p99": 0.03}
        row = dict(model=name, completed=3, output_tokens=9, wall_s=1.0, output_tok_s=9.0, ttft_s=pct, tpot_s=pct)
        reasons = {"needs more KV blocks than the whole pool (2) holds": 1}
        ours = {"runtime": "trtbuild in-flight", "not_completed": 1, "preemptions": 0, "failure_reasons": reasons}
        theirs = {"runtime": "transformers static", "not_completed": 0, "preemptions": None, "failure_reasons": {}}
        return [{**row, **ours, "prefix_cache_hit_rate": 0.25}, {**row, **theirs, "prefix_cache_hit_rate": None}]

    def random_llama(path: Path) -> Path:
        path.mkdir()
        (path / "config.json").write_text("{}")
        return path

    monkeypatch.setattr(ifb, "run_model", rows)
    monkeypatch.setattr(ifb, "random_llama", random_llama)
    monkeypatch.setattr(sys, "argv", ["ifb.py", "--models", "random"])
    with pytest.raises(SystemExit) as e:
        ifb.main()
    assert e.value.code == 1
    out, err = capsys.readouterr()
    assert "| random | trtbuild in-flight | 3 | 1 | 9.0 | 10 / 20 | 10 / 20 | 0 | 25.0 % |" in out
    assert "error: requests did not complete (random trtbuild in-flight: 1 " in err and "needs more KV blocks" in err
    monkeypatch.setattr(sys, "argv", ["ifb.py", "--models", "random", "--allow-failures"])
    ifb.main()  # returns: accepted
