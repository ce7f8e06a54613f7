"""The conversion benchmark script runs end to end on a tiny model (its figures are not asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
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


@pytest.mark.slow
def test_quality_modelopt_column_skips_with_the_reason(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """bench/quality.py's ModelOpt column: no ModelOpt means one printed reason and no figures; a ModelOpt run that
    fails (here: no model, or no modelopt, in the worker's python) is a reason in both cells, not a crash."""
    sys.path.insert(0, str(ROOT / "bench"))
    import quality_modelopt as qm
    import torch

    monkeypatch.delenv("TRTBUILD_MODELOPT_PYTHON", raising=False)
    monkeypatch.setattr(qm, "PEER_VENV", tmp_path / "no-venv" / "bin" / "python")
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-python"))
    peer = qm.Peer(tmp_path, tmp_path, tmp_path, tmp_path / "valid.txt", tmp_path / "test.txt", 100)
    assert peer.python is None and peer.row("fp8", 128, "none") is None
    err = capsys.readouterr().err
    assert "ModelOpt column skipped: nvidia-modelopt not importable (set TRTBUILD_MODELOPT_PYTHON" in err
    monkeypatch.undo()

    known = "w8a16, w4a16, w4a16_awq, w8a8_sq, fp8, w4a8_awq"
    assert qm.skip_reason(qm.Spec("w4a8")) == f"no ModelOpt config for w4a8 (known: {known})"
    assert qm.skip_reason(qm.Spec("w4a8_awq")) is None
    windows = torch.arange(64, dtype=torch.int64)
    inputs = qm.Inputs(tmp_path / "missing-hf", windows.view(2, 32), windows, 32, reference=None)
    got = qm.measure(qm.Spec("w4a16_awq", 32), inputs, sys.executable, tmp_path / "work")
    assert isinstance(got["engine"], str) and got["engine"] == got["fake_quant"] and "Error" in got["engine"]
    row = {"method": "w4a16_awq", "group": 32, "kv_cache": "none", "ppl_ratio": 1.1, "kld_mean": 0.2}
    line = qm.markdown([{**row, "modelopt": got}])[2]
    assert line.startswith("| w4a16_awq | 32 | none | 1.1000 / 0.20000 | ") and line.count("|") == 7


def test_step_profile_times_every_part_of_a_decode_step(make_llama: Any, tmp_path: Path) -> None:
    """bench/step_profile.py's instruments reach the engine's segments and plugin ops (a renamed internal would
    leave a part at zero), and the parts it reports fit inside the step it times."""
    import argparse

    from toolchain.checkpoint.convert import convert
    from toolchain.engine.api import open_engine
    from toolchain.engine.build import BuildOptions, build_engine

    sys.path.insert(0, str(ROOT / "bench"))
    import step_profile

    convert(make_llama(num_attention_heads=4, num_key_value_heads=2), tmp_path / "ckpt")
    build_engine(tmp_path / "ckpt", tmp_path / "engine", BuildOptions(backend="onnxruntime", max_batch_size=4))
    engine = open_engine(tmp_path / "engine")
    saved = dict(step_profile.ort_backend.OPS)
    try:
        spent = step_profile.instrument(engine)  # type: ignore[arg-type]
        args = argparse.Namespace(prompt=20, steps=6)
        for b in (1, 4):
            row = step_profile.profile(engine, spent, b, args)  # type: ignore[arg-type]
            assert all(row[k] > 0 for k in step_profile.PARTS), row
            assert sum(row[k] for k in step_profile.PARTS) < row["step"], row
    finally:
        step_profile.ort_backend.OPS.update(saved)  # the instrumented ops must not outlive the test
