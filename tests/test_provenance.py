"""Provenance inside run directories: every stage of a `trtbuild run` verifies with its inputs, by their final
paths; the recipe's sha256 and the stage cache keys do not depend on where the checkout lives; `eval` without -o
leaves a run dir verifiable. On the demo tiny model (recipes/demo.yaml), so the whole file takes seconds."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from toolchain.cli import app
from toolchain.pipeline import _stage_keys, default_report_dir
from toolchain.recipe import STAGE_DIRS, load_recipe

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
DEMO_STAGES = {"convert": "checkpoint", "quantize": "quantized", "build": "engine", "eval": "report"}


def invoke(*args: Any) -> Any:
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkout's worth of the demo: recipes/demo.yaml with its data, and demo/tiny-llama beside it."""
    root = tmp_path_factory.mktemp("checkout")
    shutil.copytree(RECIPES / "data", root / "recipes" / "data")
    shutil.copy(RECIPES / "demo.yaml", root / "recipes" / "demo.yaml")
    result = invoke("tiny-model", root / "demo" / "tiny-llama")
    assert result.exit_code == 0, result.stderr
    return root


@pytest.fixture(scope="module")
def demo_run(tree: Path) -> tuple[Path, dict[str, Any], str]:
    out = tree / "out"
    result = invoke("run", tree / "recipes" / "demo.yaml", "-o", out, "--json")
    assert result.exit_code == 0, result.stderr
    return out, json.loads(result.stdout), result.stdout


@pytest.fixture
def run_copy(demo_run: tuple[Path, dict[str, Any], str], tmp_path: Path) -> Path:
    """The run dir copied elsewhere, for a test that changes it or writes beside it."""
    return Path(shutil.copytree(demo_run[0], tmp_path / "run"))


def test_every_stage_of_a_run_verifies_with_its_inputs(demo_run: tuple[Path, dict[str, Any], str]) -> None:
    out, summary, _ = demo_run
    assert {s: STAGE_DIRS[s] for s in summary["stages"]} == DEMO_STAGES
    for directory in [out, *(out / s for s in DEMO_STAGES.values())]:
        result = invoke("verify", directory, "--inputs")
        assert result.exit_code == 0, (directory, result.stderr)
    upstream = {"quantized": "checkpoint", "engine": "quantized", "report": "engine"}
    for stage, source in upstream.items():
        inputs = json.loads((out / stage / "manifest.json").read_text())["inputs"]
        inside = [e for e in inputs if not Path(e["root"]).is_absolute()]
        assert inside and all(e["root"] == ".." and e["path"].startswith(f"{source}/") for e in inside), inputs


def test_no_manifest_or_json_names_the_temporary_dir(demo_run: tuple[Path, dict[str, Any], str]) -> None:
    out, summary, stdout = demo_run
    assert ".tmp-" not in stdout
    assert summary["output_dir"] == str(out.resolve())
    assert summary["stages"]["build"]["engine_dir"] == str(out.resolve() / "engine")
    assert summary["stages"]["eval"]["engine_dir"] == str(out.resolve() / "engine")
    for manifest in out.rglob("manifest.json"):
        data = json.loads(manifest.read_text())
        data.pop("command")
        assert ".tmp-" not in json.dumps(data), manifest


def test_a_moved_run_dir_still_verifies_and_names_a_changed_input(run_copy: Path) -> None:
    assert invoke("verify", run_copy, "--inputs").exit_code == 0
    config = run_copy / "quantized" / "config.json"
    config.write_text(config.read_text() + " ")
    assert invoke("verify", run_copy / "engine").exit_code == 0  # the engine's own files are untouched
    result = invoke("verify", run_copy / "engine", "--inputs")
    assert result.exit_code == 1
    assert f"input changed: {config}" in result.stderr
    result = invoke("verify", run_copy, "--inputs")  # the run's own hashes and the engine's input both catch it
    assert "changed: quantized/config.json" in result.stderr and f"input changed: {config}" in result.stderr


def test_recipe_sha_and_cache_keys_do_not_depend_on_the_checkout_location(
    demo_run: tuple[Path, dict[str, Any], str], tree: Path, tmp_path: Path
) -> None:
    out, summary, _ = demo_run
    elsewhere = Path(shutil.copytree(tree, tmp_path / "another" / "place", ignore=shutil.ignore_patterns("out")))
    here, there = load_recipe(tree / "recipes" / "demo.yaml"), load_recipe(elsewhere / "recipes" / "demo.yaml")
    assert here.recipe.model.path != there.recipe.model.path
    assert here.sha256 == there.sha256 == summary["recipe_sha256"]
    recorded = {stage: json.loads((out / d / "manifest.json").read_text()) for stage, d in DEMO_STAGES.items()}
    keys = _stage_keys(there.recipe)
    assert keys == {stage: m["details"]["cache_key"] for stage, m in recorded.items()}
    assert {m["recipe_sha256"] for m in recorded.values()} == {summary["recipe_sha256"]}

    # inputs count by content: the same text elsewhere keeps the key, other text changes it (and what follows)
    (elsewhere / "recipes" / "data" / "demo.txt").write_text("Other evaluation text.\n" * 40)
    changed = _stage_keys(there.recipe)
    assert changed["build"] == keys["build"] and changed["eval"] != keys["eval"]
    # the recipe's own content still counts: another seed is another recipe
    assert load_recipe(elsewhere / "recipes" / "demo.yaml", ["seed=1"]).sha256 != here.sha256


def test_eval_without_output_keeps_the_run_dir_verifiable(run_copy: Path, tree: Path) -> None:
    data, model = tree / "recipes" / "data" / "demo.txt", tree / "demo" / "tiny-llama"
    before = sorted(p.name for p in run_copy.iterdir())
    result = invoke("eval", run_copy / "engine", "--reference", model, "--data", data, "--max-tokens", "300")
    assert result.exit_code == 0, result.stderr
    report = run_copy.with_name("run-engine-report")
    assert (report / "report.json").is_file() and invoke("verify", report, "--inputs").exit_code == 0
    assert sorted(p.name for p in run_copy.iterdir()) == before
    assert invoke("verify", run_copy, "--inputs").exit_code == 0


def test_default_report_dir_outside_a_run_is_beside_the_engine(tmp_path: Path) -> None:
    engine = tmp_path / "builds" / "engine"
    engine.mkdir(parents=True)
    assert default_report_dir(engine) == tmp_path / "builds" / "engine-report"
