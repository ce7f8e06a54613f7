"""The typed stage results: `to_json()` keeps the keys and order the CLI's `--json` and the report files always had,
and `lines()` is what the CLI prints."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from toolchain.checkpoint.convert import ConvertResult
from toolchain.engine.results import BuildResult
from toolchain.evaluate.diff import BaselineDiff, BaselineSettings, DiffQuality, DiffResult, SideInfo
from toolchain.evaluate.gates import GateResult
from toolchain.evaluate.results import EvalResult
from toolchain.pipeline import RunResult
from toolchain.quality import QualityReport
from toolchain.quantize.results import QuantizeResult

OUTPUTS = [{"path": "rank0.safetensors", "size": 2048, "sha256": "ab" * 32}]
QUALITY = QualityReport(510, 2, 10.0, 10.1, 1.01, 0.002, 0.001, 0.004, 0.009, 0.02, 0.98, -0.001, 0.01)
LIMITS = {"max_batch_size": 4, "max_num_tokens": 2048, "max_seq_len": 256, "tokens_per_block": 16, "num_blocks": 64}


def test_convert_result_json_and_lines() -> None:
    r = ConvertResult("/out/ckpt", "LlamaForCausalLM", "float32", 1, 1, 12, 1000, OUTPUTS, [], 0.5)
    keys = ["output_dir", "architecture", "dtype", "tp_size", "pp_size", "num_tensors", "num_parameters"]
    assert list(r.to_json()) == [*keys, "outputs", "warnings", "wall_time_s"]
    assert ConvertResult(**r.to_json()) == r
    assert r.lines() == [
        "converted LlamaForCausalLM -> /out/ckpt",
        "  dtype float32, tp=1 pp=1, 12 tensors, 1,000 parameters, 0.50 s",
        f"  rank0.safetensors  2,048 B  sha256 {'ab' * 8}",
    ]


def test_quantize_result_hands_back_a_quality_report() -> None:
    r = QuantizeResult("/out/q", "W8A16", None, 128, 7, None, QUALITY, OUTPUTS, 1.25)
    data = r.to_json()
    assert list(data) == [
        "output_dir", "quant_algo", "kv_cache_quant_algo", "group_size", "quantized_modules", "calibration",
        "quality", "outputs", "wall_time_s",
    ]  # fmt: skip
    assert data["quality"] == QUALITY.to_dict() and QualityReport(**data["quality"]) == r.quality
    assert r.lines()[:2] == ["quantized -> /out/q", "  W8A16 (group 128), kv cache unquantized, 7 modules, 1.25 s"]
    assert r.lines()[2:] == ["  " + line for line in QUALITY.lines()]
    assert replace(r, quality=None).to_json()["quality"] is None and len(replace(r, quality=None).lines()) == 2


def test_build_result_from_what_the_build_wrote() -> None:
    config = {"backend": "onnxruntime", "dtype": "float32", "limits": {**LIMITS, "max_blocks_per_seq": 16}}
    r = BuildResult.of(Path("/out/engine"), config, {"outputs": OUTPUTS, "wall_time_s": 2.0})
    assert list(r.to_json()) == ["engine_dir", "backend", "dtype", "limits", "outputs", "wall_time_s"]
    assert r.to_json()["limits"] == config["limits"]
    assert r.lines() == [
        "built -> /out/engine",
        "  backend onnxruntime, float32, batch <= 4, tokens/call <= 2048, seq <= 256, 16 tokens/block",
        "  1 files, 2,048 B, 2.00 s",
    ]


def _eval_result() -> EvalResult:
    gates = [GateResult("kld_mean_max", "kld_mean", 0.01, 0.002, True)]
    histogram = {"edges": [1e-6, 1.0], "counts": [3.0]}
    return EvalResult("/e", "/ref", "/d.txt", 256, QUALITY, None, 0, [], gates, True, histogram, [1.0, 0.5])


def test_eval_result_keys_before_and_after_the_report() -> None:
    r = _eval_result()
    head = ["engine_dir", "reference", "data", "window", "quality", "golden_exact", "golden_prompts", "golden"]
    assert list(r.to_json()) == [*head, "gates", "passed", "kld_histogram", "top1_by_position"]
    written = replace(r, built={"method": None}, evaluated_with={"backend": "onnxruntime"}, report_dir="/rep")
    written = replace(written, outputs=OUTPUTS)
    plots = ["kld_histogram", "top1_by_position"]
    tail = ["built", "evaluated_with", "report_dir", "outputs"]
    assert list(written.to_json()) == [*head, "gates", "passed", *plots, *tail]
    assert list(written.to_json(plots=False)) == [*head, "gates", "passed", *tail]
    assert written.to_json()["quality"] == QUALITY.to_dict()
    lines = written.lines()
    assert lines[0] == "report -> /rep (report.md, report.html, report.json)"
    assert lines[-1] == "  gate kld_mean_max      0.002 vs 0.01: pass"


def _side(label: str) -> SideInfo:
    return SideInfo(f"/{label}", "run", f"/{label}/engine", label * 64, ["build", "convert", "run"])


def test_diff_result_gates_appear_once_checked_and_plots_stay_in_the_report() -> None:
    row = {"section": "quantization", "key": "quant_algo", "old": None, "new": "W8A16", "changed": True}
    r = DiffResult(_side("a"), _side("b"), [row], 1, 0, False, True, None)
    keys = ["old", "new", "changes", "changed", "unknown", "same_build", "same_machine", "data", "quality"]
    keys += ["quality_refused", "golden", "golden_same", "speed"]
    assert list(r.to_json()) == keys  # the change table alone, as `on_changes` sees it
    assert r.to_json()["old"] == {
        "path": "/a", "kind": "run", "engine_dir": "/a/engine", "manifest_sha256": "a" * 64,
        "stages": ["build", "convert", "run"],
    }  # fmt: skip
    quality = DiffQuality(QUALITY, None, None, 256, {"edges": [], "counts": {}}, {"new_vs_old": [1.0]})
    done = replace(r, quality=quality, gates=[], passed=True, report_dir="/rep")
    assert list(done.to_json()) == [*keys, "gates", "passed", "report_dir"]
    assert list(done.to_json(plots=False)["quality"]) == ["new_vs_old", "window"]
    assert list(done.to_json()["quality"]) == ["new_vs_old", "window", "kld_histogram", "top1_by_position"]
    with_reference = replace(quality, old_vs_reference=QUALITY, new_vs_reference=QUALITY)
    assert list(with_reference.to_json(plots=False)) == ["new_vs_old", "old_vs_reference", "new_vs_reference", "window"]
    assert done.lines()[0] == "  quality on 510 tokens of None"
    assert done.change_lines(Path("a"), Path("b"))[0] == "diff a -> b"
    assert done.lines()[-1] == "  report -> /rep (report.md, report.html, report.json)"


def test_baseline_results_json() -> None:
    settings = BaselineSettings("c" * 64, 4096, (("kld_vs_old_max", 0.5),))
    assert settings.to_json() == {
        "baseline_manifest_sha256": "c" * 64,
        "max_tokens": 4096,
        "gates": (("kld_vs_old_max", 0.5),),
    }
    stage = BaselineDiff("/a", "c" * 64, 1, None, None, [], True)
    assert list(stage.to_json()) == [
        "baseline", "baseline_manifest_sha256", "changed", "quality", "golden_same", "gates", "passed",
    ]  # fmt: skip


def test_run_result_lines_name_reused_stages() -> None:
    stages: dict[str, dict[str, Any]] = {
        "convert": {"architecture": "LlamaForCausalLM", "dtype": "float32", "num_parameters": 1000, "cached": True},
        "build": {"backend": "onnxruntime", "dtype": "float32"},
    }
    r = RunResult("/run", "recipes/demo.yaml", "d" * 64, stages, ["build"], True, OUTPUTS, [], 3.0)
    assert RunResult(**r.to_json()) == r
    assert list(r.to_json()) == [
        "output_dir", "recipe", "recipe_sha256", "stages", "rerun", "passed", "outputs", "warnings", "wall_time_s",
    ]  # fmt: skip
    assert r.lines() == [
        "ran recipes/demo.yaml -> /run",
        f"  recipe sha256 {'d' * 64}",
        "  convert   (unchanged, reused) LlamaForCausalLM, float32, 1,000 parameters",
        "  build     backend onnxruntime, float32",
        "  1 files, 2,048 B, 3.00 s",
    ]
