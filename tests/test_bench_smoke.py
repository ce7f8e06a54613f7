"""The conversion benchmark script runs end to end on a tiny model (its figures are not asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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
