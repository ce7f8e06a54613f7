"""plugins/gpu_check.py without a GPU: its CPU mode end to end (a subprocess under TRITON_INTERPRET=1, its JSON),
and its checking logic on stand-in kernels — the reference ops pass it, a planted stale-slot read and a write into
a slot no sequence owns fail it."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from toolchain.engine import ops

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "plugins" / "gpu_check.py"


def _gpu_check() -> Any:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_cpu_mode_reports_every_part(tmp_path: Path) -> None:
    """`gpu_check.py --cpu`: part (a) on the small vectors through the interpreted kernels, (b)-(d) skipped with the
    reason; the exit status is the verdict, and the verdict is every case's. ~3 s."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "--cpu", "--out", str(tmp_path)], capture_output=True, text=True, env=env,
        timeout=300,
    )  # fmt: skip
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    gc = _gpu_check()
    assert report["mode"] == "cpu" and sorted(report["native"]) == sorted(gc.CPU_CASES), res.stderr[-2000:]
    for name, r in report["native"].items():
        assert "error" not in r, (name, r.get("error"))
        within = max(r["q_err_over_tol"], r["pool_err_over_tol"], r["out_err_over_tol"]) <= 1.0
        assert r["pass"] == (within and r["unowned_slots_untouched"]), name
    assert report["passed"] == all(r["pass"] for r in report["native"].values())
    assert res.returncode == (0 if report["passed"] else 1), res.stderr[-2000:]
    for part in ("aot", "sanitizer", "timing"):
        assert report[part] == {"skipped": "needs a CUDA GPU (--cpu run)"}, part
    md = (tmp_path / "gpu-check.md").read_text()
    assert all(name in md for name in gc.CPU_CASES) and "aot: skipped — needs a CUDA GPU" in md


@pytest.fixture(scope="module")
def gc() -> Any:
    return _gpu_check()


def _with(gc: Any, monkeypatch: pytest.MonkeyPatch, write: Any, attend: Any, name: str) -> dict[str, Any]:
    monkeypatch.setattr(gc.kv_write, "kv_cache_write", write)
    monkeypatch.setattr(gc.attention, "paged_attention", attend)
    case = gc.load_case(next(p for p in gc.VECTORS if p.stem == name))
    result: dict[str, Any] = gc.check_native(case, gc.run_native(case, "cpu"))
    return result


def _reference_write(a: Any, qkv: Any, *rest: Any) -> Any:
    return ops.kv_cache_write(a, qkv, *rest).to(qkv.dtype)  # fp32 inside, as the kernels compute


def _reference_attention(a: Any, q: Any, *rest: Any) -> Any:
    return ops.paged_attention(a, q, *rest).to(q.dtype)


@pytest.mark.parametrize("name", ["f16-hd64-gqa4-mixed", "bf16-int8kv-hd64-mha-tpb64", "f16-fp8kv-hd128-gqa8"])
def test_the_reference_passes_the_check(gc: Any, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    r = _with(gc, monkeypatch, _reference_write, _reference_attention, name)
    assert r["pass"], r


def test_a_stale_slot_read_fails_the_check(gc: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Attention one position too far reads the poisoned slot after each sequence's last token."""

    def stale(a: Any, q: Any, pos: Any, *rest: Any) -> Any:
        return _reference_attention(a, q, pos + 1, *rest)

    r = _with(gc, monkeypatch, _reference_write, stale, "f16-hd64-gqa4-mixed")
    assert not r["pass"] and r["out_err_over_tol"] > 1, r


def test_a_write_outside_the_owned_slots_fails_the_check(gc: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    def spill(a: Any, qkv: Any, pos: Any, ctx: Any, new: Any, tables: Any, pool: Any) -> Any:
        q = _reference_write(a, qkv, pos, ctx, new, tables, pool)
        pool[a.layer, -1].zero_()  # the last block: a spare nobody owns in this vector
        return q

    r = _with(gc, monkeypatch, spill, _reference_attention, "f16-hd64-gqa4-mixed")
    assert not r["pass"] and not r["unowned_slots_untouched"], r
