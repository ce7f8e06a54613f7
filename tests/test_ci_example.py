"""examples/ci/: the workflows run as written on the demo model.

build-artifact.yml (push to main) builds the released engine and uploads it as `released-engine`; release-gate.yml
(pull request) builds the candidate, fetches that artifact and diffs against it. Here the pull request is the one
that adds w8a16 quantization to examples/ci/engine.yaml: main's recipe is the same file without its `quantize:`
section (fp32). Every `.venv/bin/trtbuild` line of both workflows runs verbatim, in order, in a copy of the
repository's examples/ci and recipes/data; the artifact download is done by moving the directory the upload names.
"""

from __future__ import annotations

import re
import shlex
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
CI = REPO / "examples" / "ci"
KNOWN_ACTIONS = {"actions/checkout@v4", "actions/upload-artifact@v4"}  # published actions this example uses
TRTBUILD = ".venv/bin/trtbuild"


def workflow(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((CI / name).read_text())
    return doc


def steps(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [step for job in doc["jobs"].values() for step in job["steps"]]


def trtbuild_lines(doc: dict[str, Any]) -> list[str]:
    lines = [line.strip() for s in steps(doc) if "run" in s for line in s["run"].splitlines()]
    return [line for line in lines if line.startswith(TRTBUILD)]


def run_line(cli: Any, line: str) -> Any:
    """One workflow line through the CLI, with its `> FILE` redirection of stdout."""
    args = shlex.split(line)
    target = None
    if ">" in args:
        target = Path(args[args.index(">") + 1])
        args = args[: args.index(">")]
    result = cli(*args[1:])
    if target is not None:
        target.write_text(result.stdout)
    return result


@pytest.mark.parametrize("name", ["build-artifact.yml", "release-gate.yml"])
def test_workflow_fetches_nothing_that_does_not_exist(name: str) -> None:
    doc = workflow(name)
    for step in steps(doc):
        assert "uses" not in step or step["uses"] in KNOWN_ACTIONS, step
        for script in re.findall(r"(?<![\w/])\./[\w./-]+", step.get("run", "")):
            assert (REPO / script).exists(), f"{name}: {script} does not exist"
    for line in trtbuild_lines(doc):
        for arg in shlex.split(line):
            if arg.endswith((".yaml", ".jsonl", ".txt")):
                assert (REPO / arg).is_file(), f"{name}: {arg} does not exist"


def test_released_engine_is_what_the_gate_downloads() -> None:
    upload = next(s for s in steps(workflow("build-artifact.yml")) if s.get("uses") == "actions/upload-artifact@v4")
    fetch = next(s for s in steps(workflow("release-gate.yml")) if "gh run download" in s.get("run", ""))
    assert upload["with"]["name"] == "released-engine" and upload["with"]["path"].rstrip("/") == "artifact"
    assert "--name released-engine --dir released" in fetch["run"] and "build-artifact.yml" in fetch["run"]
    recipe = yaml.safe_load((CI / "engine.yaml").read_text())
    assert recipe["quantize"] and recipe["build"] is not None and recipe["eval"]["gates"]


@pytest.mark.slow
def test_workflows_run_on_the_demo_model(cli: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shutil.copytree(CI, tmp_path / "examples" / "ci")
    shutil.copytree(REPO / "recipes" / "data", tmp_path / "recipes" / "data")
    monkeypatch.chdir(tmp_path)
    recipe = tmp_path / "examples" / "ci" / "engine.yaml"
    pull_request = recipe.read_text()
    main = re.sub(r"^quantize:\n(?:  .*\n)+", "", pull_request, flags=re.M)
    assert "quantize" not in yaml.safe_load(main) and main != pull_request

    recipe.write_text(main)  # main before the pull request: fp32
    for line in trtbuild_lines(workflow("build-artifact.yml")):
        assert run_line(cli, line).exit_code == 0, line
    Path("artifact").rename("released")  # what `gh run download ... --name released-engine --dir released` does
    shutil.rmtree("demo")  # the pull request's job runs on a fresh runner

    recipe.write_text(pull_request)  # the pull request: w8a16
    gate_lines = trtbuild_lines(workflow("release-gate.yml"))
    results = {line: run_line(cli, line) for line in gate_lines}
    assert all(r.exit_code == 0 for r in results.values()), {k: r.stderr for k, r in results.items()}
    diff_line = next(line for line in gate_lines if " diff " in line)
    assert "quantization method" in results[diff_line].stdout and "none -> w8a16" in results[diff_line].stdout
    assert Path("diff-report/report.md").read_text().startswith("# Release diff: PASS")

    strict = diff_line.replace("kld_vs_old_max=0.05", "kld_vs_old_max=1e-12").replace("-o diff-report", "")
    assert strict != diff_line
    failing = run_line(cli, strict)
    assert failing.exit_code == 3, failing.stderr
    assert "a diff gate failed" in failing.stderr
