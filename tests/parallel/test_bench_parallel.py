"""bench/parallel.py (issue 27): its TP=2 run records what each collective moved, which must be what the formula
says, and its projection follows the ring formulas it prints."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _bench() -> Any:
    sys.path.insert(0, str(ROOT / "bench"))
    import parallel

    return parallel


def test_projection_follows_the_ring_formulas() -> None:
    bench = _bench()
    rows = bench.projection("decode", 1, 1, 10e-6)
    row = next(r for r in rows if r["model"] == "Llama-3-8B" and r["tp"] == 8 and r["link"] == "NVLink 4")
    # 65 all-reduces of 4096 bf16 moving 2 * 7/8 each, one all-gather of 128256 bf16 logits moving 7/8
    assert row["bytes_per_rank"] == 65 * 2 * 7 / 8 * 4096 * 2 + 7 / 8 * 128256 * 2
    assert row["bandwidth_s"] == row["bytes_per_rank"] / 450e9 and row["latency_s"] == 66 * 10e-6
    assert {(r["model"], r["tp"], r["link"]) for r in rows} == {
        (m, tp, link) for m in ("Llama-3-8B", "Llama-3-70B") for tp in (2, 4, 8) for link in ("NVLink 4", "PCIe 5 x16")
    }


@pytest.mark.slow
def test_recorded_collective_bytes_are_the_analytic_ones() -> None:
    args = ["--hidden", "128", "--layers", "2", "--prompt", "8", "--steps", "2", "--repeat", "1", "--json"]
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "parallel.py"), *args], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    assert [row["config"].split(" (")[1][:7] for row in result["rows"][2:]] == ["thread,", "thread,", "process"]
    for row in result["rows"][2:]:  # the two TP=2 ranks as threads, then rank 0 of TP=2 as processes
        model = {op: row["decode_bytes_per_token"][op] for op in ("AllReduce", "AllGather")}
        assert model == result["analytic_bytes_per_token"]
        calls = {op: row["calls"][op] for op in ("AllReduce", "AllGather")}
        assert calls == {"AllReduce": 5 * 3, "AllGather": 3}  # 2 L + 1 and 1 per forward, 3 forwards
    assert result["rows"][4]["calls"]["Broadcast"] >= 2 * 3  # the processes' steps reached rank 1: header, payload
    assert all(row["step_s"] > 0 for row in result["rows"])
