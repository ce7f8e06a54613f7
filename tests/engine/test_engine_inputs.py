"""Engine folders damaged past the integrity check (a fuzzer's): impossible or missing limits are refused when the
engine is opened, and engine files that are not files are refused, each in one line naming the file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from conftest import deadline, not_a_file, one_line_error, reseal


def engine_copy(engine: Path, dst: Path) -> Path:
    shutil.copytree(engine, dst)
    return dst


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("max_batch_size", 0),
        ("max_num_tokens", 0),
        ("max_num_tokens", -8),
        ("max_seq_len", 1),
        ("num_blocks", 0),
        ("tokens_per_block", 3),
        ("max_batch_size", 2.5),
        ("max_batch_size", "4"),
        ("max_batch_size", True),
        ("num_blocks", 1 << 40),
    ],
)
def test_engine_limits_are_checked_when_the_engine_is_opened(
    key: str, value: Any, cli: Any, tiny_engine: Path, tmp_path: Path
) -> None:
    config_path = tiny_engine / "build_config.json"
    config = json.loads(config_path.read_text())
    config["limits"][key] = value
    engine = engine_copy(tiny_engine, tmp_path / "engine")
    (engine / "build_config.json").write_text(json.dumps(config))
    reseal(engine)  # as if a build had written these limits: the spec's own checks, past the integrity check
    with deadline(60):
        line = one_line_error(cli("generate", engine, "--prompt", "Once upon", "--max-new-tokens", "2"))
    assert f"{engine / 'build_config.json'}: " in line and f"limits.{key} is {value!r}" in line
    assert "rebuild the engine" in line


def test_a_missing_engine_limit_is_named(cli: Any, tiny_engine: Path, tmp_path: Path) -> None:
    config = json.loads((tiny_engine / "build_config.json").read_text())
    del config["limits"]["max_num_tokens"]
    engine = engine_copy(tiny_engine, tmp_path / "engine")
    (engine / "build_config.json").write_text(json.dumps(config))
    reseal(engine)
    line = one_line_error(cli("bench", engine, "--trace", tmp_path / "t.jsonl"))
    assert "build_config.json: key 'max_num_tokens' is missing" in line


@pytest.mark.parametrize("kind", ["dev-zero", "fifo", "directory"])
def test_engine_files_that_are_not_files(kind: str, cli: Any, tiny_engine: Path, tmp_path: Path) -> None:
    # build_config.json: no engine dir to check (exit 1); the others: an engine not as recorded (exit 4, integrity)
    for name, code in (("build_config.json", 1), ("manifest.json", 4), ("tokenizer.json", 4)):
        engine = engine_copy(tiny_engine, tmp_path / f"{name}-engine")
        not_a_file(engine / name, kind)
        with deadline(60):
            result = cli("generate", engine, "--prompt", "Once upon", "--max-new-tokens", "2")
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert result.exit_code == code and len(errors) == 1, (name, result.exit_code, result.stderr)
        assert f"{engine / name}: not a regular file" in errors[0] or f"not a regular file: {name}" in errors[0]
