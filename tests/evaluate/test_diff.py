"""`trtbuild diff OLD NEW`: the change table from manifests, quality NEW vs OLD (and vs the reference), golden
prompts, interleaved trace replay, gates (exit 3), reports, bad input, both directions, and `run` with a baseline."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from conftest import one_line_error, reseal, save_random_llama

from toolchain.checkpoint.tiny import make_tiny_llama
from toolchain.evaluate.diff import check_gates
from toolchain.evaluate.diff_report import SERIES, markdown
from toolchain.pipeline import run_recipe
from toolchain.recipe import load_recipe

REPO = Path(__file__).resolve().parents[2]
DEMO_TEXT = REPO / "recipes" / "data" / "demo.txt"
GOLDEN = REPO / "recipes" / "data" / "demo-golden.jsonl"
QUICK = ("--data", str(DEMO_TEXT), "--max-tokens", "520")  # two windows of 256


def recipe_text(model: Path, quantize: str = "", extra: str = "") -> str:
    q = f"quantize: {{method: {quantize}}}\n" if quantize else ""
    return f"version: 1\nmodel: {{path: {model}}}\n{q}build: {{max_batch_size: 4, max_seq_len: 256}}\n{extra}"


def run(path: Path, text: str, out: Path) -> Path:
    path.write_text(text)
    run_recipe(load_recipe(path), out)
    return out


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The demo model built twice as fp32 (two run dirs: a reproducible build) and once as w8a16."""
    root = tmp_path_factory.mktemp("diff")
    make_tiny_llama(root / "tiny")
    return {
        "root": root,
        "tiny": root / "tiny",
        "fp32": run(root / "fp32.yaml", recipe_text(root / "tiny"), root / "fp32"),
        "fp32_again": run(root / "fp32.yaml", recipe_text(root / "tiny"), root / "fp32-again"),
        "w8a16": run(root / "w8a16.yaml", recipe_text(root / "tiny", "w8a16"), root / "w8a16"),
    }


def changed(result: dict[str, Any]) -> dict[tuple[str, str], tuple[Any, Any]]:
    return {(r["section"], r["key"]): (r["old"], r["new"]) for r in result["changes"] if r["changed"]}


def test_change_table_names_the_quantization_and_nothing_else(cli: Any, builds: dict[str, Path]) -> None:
    result = cli("diff", builds["fp32"], builds["w8a16"], "--changes-only", "--json")
    assert result.exit_code == 0, result.stderr
    r = json.loads(result.stdout)
    rows = changed(r)
    assert rows[("quantization", "method")] == ("none", "w8a16")
    assert rows[("quantization", "quant_algo")] == ("none", "W8A16")
    assert rows[("recipe", "quantize.method")] == (None, "w8a16")
    assert ("engine files", "model.onnx") in rows
    assert not r["same_build"] and r["quality"] is None and r["speed"] is None
    # fields that apply to neither side's method are absent on both, not config.json's defaults (group_size 128)
    facts = {row["key"]: (row["old"], row["new"]) for row in r["changes"] if row["section"] == "quantization"}
    assert facts["group_size"] == (None, None) and facts["smoothquant_alpha"] == (None, None)
    assert facts["pre_quant_scale"] == (None, False) and facts["exclude_modules"][0] is None
    # same source weights (found through the run's checkpoint manifest), same limits, same software
    weights = [row for row in r["changes"] if row["section"] == "weights"]
    assert {row["key"] for row in weights} >= {"model.safetensors", "config.json"}
    assert not any(row["changed"] for row in weights)
    assert not [key for key in rows if key[0] in ("weights", "build", "versions")]
    text = cli("diff", builds["fp32"], builds["w8a16"], "--changes-only")
    assert text.exit_code == 0 and "quantization method" in text.stdout and "none -> w8a16" in text.stdout


def test_two_checkouts_of_one_recipe_are_the_same_build(cli: Any, builds: dict[str, Path], tmp_path: Path) -> None:
    """The recipe is compared as written (model.path relative to the recipe), not as resolved to absolute paths."""
    outs = []
    for checkout in ("a", "b"):
        shutil.copytree(builds["tiny"], tmp_path / checkout / "tiny")
        outs.append(run(tmp_path / checkout / "r.yaml", recipe_text(Path("tiny")), tmp_path / checkout / "out"))
    result = cli("diff", *outs, "--changes-only", "--json")
    assert result.exit_code == 0, result.stderr
    r = json.loads(result.stdout)
    assert r["same_build"] and r["changed"] == 0, changed(r)
    assert any(
        row["section"] == "recipe" and row["key"] == "model.path" and row["old"] == "tiny" for row in r["changes"]
    )


def test_identical_builds_say_so(cli: Any, builds: dict[str, Path]) -> None:
    result = cli("diff", builds["fp32"], builds["fp32_again"] / "engine", "--changes-only", "--json")
    assert result.exit_code == 0, result.stderr
    r = json.loads(result.stdout)
    assert r["same_build"] and r["changed"] == 0
    assert r["old"]["kind"] == "run" and r["new"]["kind"] == "engine"
    text = cli("diff", builds["fp32"], builds["fp32_again"], "--changes-only")
    assert "identical builds" in text.stdout


def test_an_engine_kept_alone_leaves_unknowns_not_changes(cli: Any, builds: dict[str, Path], tmp_path: Path) -> None:
    """A released engine copied out of its run dir has no convert or quantize manifest beside it: its source weights
    and calibration are unknown, which is neither a change nor an identical build."""
    alone = tmp_path / "released"
    shutil.copytree(builds["w8a16"] / "engine", alone)
    result = cli("diff", alone, builds["w8a16"], "--changes-only", "--json")
    assert result.exit_code == 0, result.stderr
    r = json.loads(result.stdout)
    assert r["changed"] == 0 and not r["same_build"] and r["unknown"] > 0
    unknown = {(row["section"], row["key"]) for row in r["changes"] if row.get("unknown") == ["OLD"]}
    assert ("weights", "model.safetensors") in unknown and ("quantization", "method") in unknown
    assert ("quantization", "quant_algo") not in unknown  # the engine's build config still says that
    text = cli("diff", alone, builds["w8a16"], "--changes-only").stdout
    assert "0 of" in text and "not compared" in text and "weights (OLD)" in text and "identical" not in text
    forward = json.loads(cli("diff", alone, builds["fp32"], "--changes-only", "--json").stdout)
    assert changed(forward)[("quantization", "quant_algo")] == ("W8A16", "none")
    assert not [key for key in changed(forward) if key[0] == "weights"]


def test_gate_limits_are_inclusive_and_a_missing_value_fails() -> None:
    gates = {"kld_vs_old_max": 0.5, "top1_vs_old_min": 0.5, "ttft_p90_ratio_max": 1.0, "throughput_ratio_min": 1.0}
    at_limit = {"kld_mean": 0.5, "same_top1": 0.5, "ttft_p90_ratio": 1.0, "throughput_ratio": 1.0}
    assert all(g.passed for g in check_gates(gates, at_limit))
    past = {"kld_mean": 0.5000001, "same_top1": 0.4999999, "ttft_p90_ratio": 1.0000001, "throughput_ratio": 0.9999}
    assert not any(g.passed for g in check_gates(gates, past))
    missing = check_gates({"throughput_ratio_min": 0.0}, {"throughput_ratio": None})
    assert [g.to_json() for g in missing] == [
        {"gate": "throughput_ratio_min", "metric": "throughput_ratio", "limit": 0.0, "value": None, "pass": False}
    ]


def test_report_markdown_keeps_its_tables_whatever_the_text(cli: Any, builds: dict[str, Path]) -> None:
    r = json.loads(cli("diff", builds["fp32"], builds["w8a16"], "--changes-only", "--json").stdout)
    r["changes"].append({"section": "recipe", "key": "description", "old": "a | b", "new": "x`y\nz", "changed": True})
    r["golden"] = [
        {"prompt": "say `hi`", "same": False, "first_divergence": 0, "old": "a`b", "new": "c", "old_tokens": [1],
         "new_tokens": [2]}
    ]  # fmt: skip
    md = markdown(r)
    row = next(line for line in md.splitlines() if "description" in line)
    assert len(row.replace("\\|", "").split("|")) == 6, row  # 4 cells: the `|` of the value is escaped
    assert row.endswith("| `a \\| b` | ``x`y\\nz`` |"), row  # one line: the newline shown as \n
    assert "- `` say `hi` `` — first divergence at token 0" in md and "OLD: ``a`b`` [1]" in md


def test_quality_golden_gates_and_reports(cli: Any, builds: dict[str, Path], tmp_path: Path) -> None:
    gates = ("--gate", "kld_vs_old_max=0.05", "--gate", "top1_vs_old_min=0.9", "--gate", "golden_same_min=0")
    out = tmp_path / "report"
    args = (builds["fp32"], builds["w8a16"], *QUICK, "--golden", GOLDEN, "--reference", builds["tiny"], *gates)
    result = cli("diff", *args, "-o", out, "--json")
    assert result.exit_code == 0, result.stderr
    r = json.loads(result.stdout)
    q = r["quality"]
    assert q["new_vs_old"]["tokens"] == 2 * 255
    assert 0 < q["new_vs_old"]["kld_mean"] < 0.05 and 0.9 <= q["new_vs_old"]["same_top1"] <= 1
    # the fp32 engine is the reference model, to float rounding; int8 weights move further from it
    assert q["old_vs_reference"]["kld_mean"] < 1e-6 < q["new_vs_reference"]["kld_mean"]
    assert len(r["golden"]) == 3 and r["golden_same"] == sum(g["same"] for g in r["golden"]) / 3
    for g in r["golden"]:
        k = g["first_divergence"]
        assert (k is None) == g["same"] and (g["same"] or g["old_tokens"][k] != g["new_tokens"][k])
        assert g["same"] or g["old_tokens"][:k] == g["new_tokens"][:k]
    assert [g["pass"] for g in r["gates"]] == [True, True, True]
    md = (out / "report.md").read_text()
    assert md.index("## What changed") < md.index("## Quality") < md.index("## Gates")
    assert "<svg" in (out / "report.html").read_text()
    saved = json.loads((out / "report.json").read_text())["quality"]
    assert saved["new_vs_old"] == q["new_vs_old"] and set(saved["kld_histogram"]["counts"]) == set(SERIES)
    assert cli("verify", out).exit_code == 0
    failing = cli("diff", builds["fp32"], builds["w8a16"], *QUICK, "--gate", "kld_vs_old_max=1e-12")
    assert failing.exit_code == 3, failing.stderr
    assert "gate kld_vs_old_max" in failing.stdout and "FAIL" in failing.stdout


def test_rollback_both_directions_agree(cli: Any, builds: dict[str, Path]) -> None:
    forward = json.loads(cli("diff", builds["fp32"], builds["w8a16"], *QUICK, "--json").stdout)
    back = cli("diff", builds["w8a16"], builds["fp32"], *QUICK, "--json")
    assert back.exit_code == 0, back.stderr
    backward = json.loads(back.stdout)
    a, b = forward["quality"]["new_vs_old"], backward["quality"]["new_vs_old"]
    assert a["same_top1"] == b["same_top1"]  # agreement of the argmax is symmetric
    assert a["ppl_ratio"] * b["ppl_ratio"] == pytest.approx(1, rel=1e-9)
    assert changed(forward) == {key: (new, old) for key, (old, new) in changed(backward).items()}


def trace_file(path: Path, requests: int = 6) -> Path:
    rows = [f"2023-11-16 18:15:{10 + k:02d}.0000000,{40 + 7 * k},{6 + k % 3}" for k in range(requests)]
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(rows) + "\n")
    return path


def test_speed_replays_both_engines_interleaved(cli: Any, builds: dict[str, Path], tmp_path: Path) -> None:
    trace = trace_file(tmp_path / "t.csv")
    speed = ("--trace", trace, "--rate-scale", "100", "--rounds", "2", "--changes-only")
    assert one_line_error(cli("diff", builds["fp32"], builds["w8a16"], *speed, "--gate", "throughput_ratio_min=0.5"))
    args = ("--trace", trace, "--rate-scale", "100", "--rounds", "2", "--max-tokens", "300", "--data", DEMO_TEXT)
    gates = ("--gate", "throughput_ratio_min=1e6", "--gate", "ttft_p90_ratio_max=1e6")
    result = cli("diff", builds["fp32"], builds["w8a16"], *args, *gates, "--json")
    assert result.exit_code == 3, result.stderr  # nothing runs a million times faster
    s = json.loads(result.stdout)["speed"]
    assert s["requests"] == 6 and len(s["per_round"]["old"]) == len(s["per_round"]["new"]) == 2
    for side in ("old", "new"):
        assert s[side]["output_tokens"] == sum(6 + k % 3 for k in range(6)) and s[side]["output_tok_s"] > 0
    assert s["ratios"]["throughput_ratio"] == pytest.approx(s["new"]["output_tok_s"] / s["old"]["output_tok_s"])
    assert s["ratios"]["ttft_p90_ratio"] == pytest.approx(s["new"]["ttft_s"]["p90"] / s["old"]["ttft_s"]["p90"])
    assert s["ratios"]["tpot_p50_ratio"] == pytest.approx(s["new"]["tpot_s"]["p50"] / s["old"]["tpot_s"]["p50"])
    gates_result = {g["gate"]: g["pass"] for g in json.loads(result.stdout)["gates"]}
    assert gates_result == {"throughput_ratio_min": False, "ttft_p90_ratio_max": True}


def test_different_models_refuse_quality_but_print_changes(cli: Any, builds: dict[str, Path], tmp_path: Path) -> None:
    hf = save_random_llama(tmp_path / "other", vocab_size=97)
    assert cli("convert", hf, "-o", tmp_path / "ckpt").exit_code == 0
    assert cli("build", tmp_path / "ckpt", "-o", tmp_path / "engine", "--max-seq-len", "128").exit_code == 0
    result = cli("diff", builds["fp32"], tmp_path / "engine", *QUICK)
    line = one_line_error(result)
    assert "quality comparison refused" in line and "vocabulary of 320" in line and "97" in line
    assert "build        vocab_size" in result.stdout and "320 -> 97" in result.stdout
    # the standalone engine's source weights were found by following its inputs to the convert stage
    rows = json.loads(cli("diff", builds["fp32"], tmp_path / "engine", "--changes-only", "--json").stdout)
    weights = {r["key"]: r for r in rows["changes"] if r["section"] == "weights"}
    assert weights["model.safetensors"]["changed"] and weights["model.safetensors"]["new"] is not None
    # not asked for quality (fp32's recipe names eval data, not used for another model): their speed compares
    speed = cli("diff", builds["fp32"], tmp_path / "engine", "--trace", trace_file(tmp_path / "t.csv", 2),
                "--rate-scale", "100", "--rounds", "1", "--json")  # fmt: skip
    assert speed.exit_code == 0, speed.stderr
    r = json.loads(speed.stdout)
    assert r["quality_refused"] is None and r["quality"] is None and r["speed"]["requests"] == 2
    golden = one_line_error(cli("diff", builds["fp32"], tmp_path / "engine", "--golden", GOLDEN))
    assert "quality comparison refused" in golden
    wrong_reference = one_line_error(cli("diff", builds["fp32"], builds["w8a16"], *QUICK, "--reference", hf))
    assert "--reference" in wrong_reference and "vocabulary of 97" in wrong_reference


def test_bad_input(cli: Any, builds: dict[str, Path], tmp_path: Path) -> None:
    same = one_line_error(cli("diff", builds["fp32"], builds["fp32"]))
    assert "same directory" in same
    same_engine = one_line_error(cli("diff", builds["fp32"], builds["fp32"] / "engine"))
    assert "same engine" in same_engine
    no_manifest = tmp_path / "copy"
    shutil.copytree(builds["w8a16"] / "engine", no_manifest)
    (no_manifest / "manifest.json").unlink()
    unproven = cli("diff", builds["fp32"], no_manifest)  # nothing proves what it is: integrity's exit 4
    assert unproven.exit_code == 4 and "no manifest.json, so nothing proves" in unproven.stderr
    assert "neither an engine dir" in one_line_error(cli("diff", builds["fp32"], tmp_path))
    assert "unknown gate" in one_line_error(cli("diff", builds["fp32"], builds["w8a16"], "--gate", "kld_max=1"))
    assert "pass --golden" in one_line_error(
        cli("diff", builds["fp32"], builds["w8a16"], "--gate", "golden_same_min=1", *QUICK)
    )
    assert "--data" in one_line_error(cli("diff", builds["fp32"], builds["w8a16"], "--data", tmp_path / "none.txt"))
    ignored = one_line_error(cli("diff", builds["fp32"], builds["w8a16"], "--changes-only", "--golden", GOLDEN))
    assert "--golden would be ignored" in ignored
    assert "pass --data" in one_line_error(cli("diff", builds["fp32"], builds["w8a16"], "--reference", builds["tiny"]))


def test_different_tokenizers_refuse_quality(cli: Any, builds: dict[str, Path], tmp_path: Path) -> None:
    """Same architecture and vocabulary size, token ids shuffled: the same text is other tokens, so refused."""
    other = tmp_path / "engine"
    shutil.copytree(builds["fp32"] / "engine", other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    names = sorted((k for k in vocab if vocab[k] > 2), key=vocab.__getitem__)
    vocab.update(zip(names, sorted((vocab[k] for k in names), reverse=True), strict=True))
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    reseal(other)  # as a build with that tokenizer would have recorded it
    golden = one_line_error(cli("diff", builds["fp32"], other, "--golden", GOLDEN))
    assert "tokenize the prompts of" in golden and "tokenizers differ" in golden
    data = one_line_error(cli("diff", builds["fp32"], other, *QUICK))
    assert "tokenize the evaluation text differently" in data


def test_run_with_baseline_diffs_and_gates(cli: Any, builds: dict[str, Path]) -> None:
    root = builds["root"]
    baseline = builds["fp32"]
    ok = recipe_text(
        builds["tiny"],
        "w8a16",
        f"eval: {{data: {DEMO_TEXT}, max_tokens: 520, baseline: {baseline}, "
        "gates: {kld_mean_max: 0.01, kld_vs_old_max: 0.05, top1_vs_old_min: 0.9}}\n",
    )
    (root / "baseline.yaml").write_text(ok)
    result = cli("run", root / "baseline.yaml", "-o", root / "with-baseline", "--json")
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    diff = summary["stages"]["diff"]
    assert diff["passed"] and {g["gate"] for g in diff["gates"]} == {"kld_vs_old_max", "top1_vs_old_min"}
    sha = hashlib.sha256((baseline / "engine" / "manifest.json").read_bytes()).hexdigest()
    run_manifest = json.loads((root / "with-baseline" / "manifest.json").read_text())
    assert run_manifest["details"]["baseline_manifest_sha256"] == sha
    assert cli("verify", root / "with-baseline").exit_code == 0
    strict = ok.replace("kld_vs_old_max: 0.05", "kld_vs_old_max: 1.0e-12")
    (root / "baseline.yaml").write_text(strict)
    failing = cli("run", root / "baseline.yaml", "-o", root / "with-baseline")
    assert failing.exit_code == 3, failing.stderr
    assert "REGRESSION (kld_vs_old_max)" in failing.stdout
    eval_line = next(line for line in failing.stdout.splitlines() if line.strip().startswith("eval"))
    assert "PASS" in eval_line  # the engine is as good as the original model; only the diff gate failed
    no_baseline = ok.replace(f", baseline: {baseline}", "")
    (root / "baseline.yaml").write_text(no_baseline)
    assert "add `baseline: PATH`" in one_line_error(cli("run", root / "baseline.yaml", "-o", root / "x"))
    no_golden = ok.replace("top1_vs_old_min: 0.9", "golden_same_min: 0.5")
    (root / "baseline.yaml").write_text(no_golden)
    assert "add `golden:" in one_line_error(cli("run", root / "baseline.yaml", "-o", root / "x"))
    assert not (root / "x").exists()  # refused before any stage ran
