"""`trtbuild eval` and the recipe's build/eval stages: metrics on the engine's logits, golden replay, gates and
exit 3, the three reports, and stage caching."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import one_line_error, save_random_llama

ROOT = Path(__file__).resolve().parents[2]
DEMO_TEXT = ROOT / "recipes" / "data" / "demo.txt"
DEMO_GOLDEN = ROOT / "recipes" / "data" / "demo-golden.jsonl"


@pytest.fixture(scope="module")
def fp32_engine(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from toolchain.checkpoint.convert import convert
    from toolchain.engine.build import BuildOptions, build_engine

    tmp = tmp_path_factory.mktemp("engine")
    convert(tiny, tmp / "ckpt")
    build_engine(tmp / "ckpt", tmp / "engine", BuildOptions(backend="onnxruntime", max_seq_len=256))
    return tmp / "engine"


def test_eval_of_an_exact_engine_passes_its_gates(cli: Any, tiny: Path, fp32_engine: Path, tmp_path: Path) -> None:
    args = ["eval", fp32_engine, "--reference", tiny, "--data", DEMO_TEXT, "--golden", DEMO_GOLDEN, "--json"]
    args += ["-o", tmp_path / "report", "--gate", "kld_mean_max=1e-8", "--gate", "golden_exact_min=1.0"]
    result = cli(*args)
    assert result.exit_code == 0, result.stderr
    r = json.loads(result.stdout)
    assert r["quality"]["kld_mean"] < 1e-8 and r["quality"]["same_top1"] == 1.0  # float32 engine = transformers
    assert r["golden_exact"] == 1.0 and len(r["golden"]) == 3 and r["passed"]
    assert {p.name for p in (tmp_path / "report").iterdir()} == {
        "report.json",
        "report.md",
        "report.html",
        "manifest.json",
    }
    html = (tmp_path / "report" / "report.html").read_text()
    assert "<svg" in html and "PASS" in html and "<script" not in html and "http" not in html.split("</style>")[0]
    assert "| kld_mean_max |" in (tmp_path / "report" / "report.md").read_text()


def test_a_failed_gate_exits_3_with_the_report_written(cli: Any, tiny: Path, fp32_engine: Path, tmp_path: Path) -> None:
    args = ["eval", fp32_engine, "--reference", tiny, "--data", DEMO_TEXT, "-o", tmp_path / "r"]
    result = cli(*args, "--gate", "ppl_ratio_max=0.5")
    assert result.exit_code == 3
    assert "gate failed" in result.stderr
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert report["passed"] is False and report["gates"][0]["gate"] == "ppl_ratio_max"
    assert "REGRESSION" in (tmp_path / "r" / "report.html").read_text()


def test_eval_bad_input(cli: Any, tiny: Path, fp32_engine: Path, tmp_path: Path) -> None:
    base = ["eval", fp32_engine, "--reference", tiny, "--data", DEMO_TEXT, "-o", tmp_path / "r"]
    line = one_line_error(cli(*base, "--gate", "speed_min=3"))
    assert "unknown gate 'speed_min'" in line
    line = one_line_error(cli(*base, "--gate", "kld_mean_max"))
    assert "NAME=NUMBER" in line
    line = one_line_error(cli(*base, "--gate", "golden_exact_min=1"))
    assert "--golden" in line
    line = one_line_error(cli(*base, "--gate", "top1_min=5"))
    assert "top1_min=5" in line
    (tmp_path / "empty.jsonl").write_text('{"prompt": ""}\n')
    assert "tokenizes to nothing" in one_line_error(cli(*base, "--golden", tmp_path / "empty.jsonl"))
    (tmp_path / "r").mkdir()
    line = one_line_error(cli(*base, "--gate", "kld_mean_max=1"))
    assert "already exists" in line
    (tmp_path / "r").rmdir()
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{"text": 3}\n')
    line = one_line_error(cli(*base, "--golden", tmp_path / "bad.jsonl"))
    assert "bad.jsonl:2" in line
    line = one_line_error(cli("eval", tmp_path, "--reference", tiny, "--data", DEMO_TEXT))
    assert "not an engine directory" in line
    line = one_line_error(cli(*base[:-2], "--data", tmp_path / "none.txt"))
    assert "none.txt" in line
    other = save_random_llama(tmp_path / "other", vocab_size=97)
    line = one_line_error(cli(*base[:2], "--reference", other, *base[4:]))
    assert "a vocabulary of 97, the engine's is" in line and "converted from" in line
    assert not (tmp_path / "r").exists()


def test_recipe_runs_every_stage_and_caches_them(cli: Any, tiny: Path, tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"model:\n  path: {tiny}\nquantize:\n  method: w8a16\nbuild:\n  max_seq_len: 256\n"
        f"eval:\n  data: {DEMO_TEXT}\n  gates:\n    kld_mean_max: 0.01\n"
    )
    first = cli("run", recipe, "-o", tmp_path / "o", "--json")
    assert first.exit_code == 0, first.stderr
    r = json.loads(first.stdout)
    assert list(r["stages"]) == ["convert", "quantize", "build", "eval"] and r["passed"]
    assert r["rerun"] == ["convert", "quantize", "build", "eval"]
    engine_bytes = (tmp_path / "o" / "engine" / "model.onnx").stat().st_ino
    again = cli("run", recipe, "-o", tmp_path / "o", "--json")
    assert json.loads(again.stdout)["rerun"] == [] and "nothing to do" in again.stderr
    assert (tmp_path / "o" / "engine" / "model.onnx").stat().st_ino == engine_bytes  # linked, not rebuilt
    gated = cli("run", recipe, "-o", tmp_path / "o", "--json", "--set", "eval.gates.top1_min=1.01")
    assert gated.exit_code == 2 or gated.exit_code == 1  # out of range [0, 1]: a recipe error
    strict = cli("run", recipe, "-o", tmp_path / "o", "--json", "--set", "eval.gates.kld_mean_max=0.0")
    assert strict.exit_code == 3
    assert json.loads(strict.stdout)["rerun"] == ["eval"]
    assert cli("verify", tmp_path / "o").exit_code == 0
    report = json.loads((tmp_path / "o" / "report" / "report.json").read_text())
    assert report["engine_dir"] == str((tmp_path / "o" / "engine").resolve())


@pytest.mark.slow
def test_quantize_benchmark_smoke() -> None:
    import subprocess
    import sys

    args = ["--hidden", "64", "--layers", "1", "--intermediate", "128", "--vocab", "320", "--heads", "4"]
    args += ["--kv-heads", "2", "--shards", "1", "--methods", "w8a8_sq", "--json"]
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "quantize.py"), *args], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)["rows"]
    assert [r["run"] for r in rows] == ["baseline: trtbuild convert", "quantize w8a8_sq"]
    assert all(r["wall_s"] > 0 and r["peak_rss_mib"] > 0 for r in rows)


@pytest.mark.slow
def test_eval_and_generate_on_a_tp2_engine_run_it_and_close_it(cli: Any, tiny: Path, tmp_path: Path) -> None:
    # a multi-rank engine has no top-level model.onnx: eval opens its ranks (processes) and hashes their graphs
    from toolchain.checkpoint.convert import convert
    from toolchain.engine.build import BuildOptions, build_engine

    convert(tiny, tmp_path / "ckpt", tp=2)
    build_engine(tmp_path / "ckpt", tmp_path / "engine", BuildOptions(backend="onnxruntime", max_seq_len=256))
    args = ["eval", tmp_path / "engine", "--reference", tiny, "--data", DEMO_TEXT, "--json", "-o", tmp_path / "r"]
    result = cli(*args, "--gate", "kld_mean_max=1e-8")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["quality"]["same_top1"] == 1.0  # float32 TP=2 = transformers
    inputs = {i["path"] for i in json.loads((tmp_path / "r" / "manifest.json").read_text())["inputs"]}
    assert {"rank0/model.onnx", "rank1/model.onnx"} <= inputs
    import torch.distributed as dist

    assert not dist.is_initialized()  # eval closed the engine: its ranks are stopped, its world gone
    done = cli("generate", tmp_path / "engine", "--prompt", "Once upon a time", "--max-new-tokens", "4", "--json")
    assert done.exit_code == 0, done.stderr
    assert len(json.loads(done.stdout)["tokens"]) == 4 and not dist.is_initialized()  # generate closes it too
