"""Usage errors: at most three plain lines on stderr (what is wrong, the usage, where to read more), exit 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

CASES = [
    (["quantize", "ckpt", "-o", "out", "--method", "bogus"], "'bogus' is not one of"),
    (["nosuch"], "No such command 'nosuch'"),
    (["quantize"], "Missing argument"),
    (["recipe", "nope"], "No such command 'nope'"),
    (["plugins", "compile", "--bogus"], "No such option: --bogus"),
    (["build", "ckpt", "-o", "e", "--max-batch-size", "many"], "'many'"),
]


@pytest.mark.parametrize(("args", "needle"), CASES, ids=[" ".join(a) for a, _ in CASES])
def test_usage_error_is_three_plain_lines(args: list[str], needle: str) -> None:
    p = subprocess.run(
        [sys.executable, "-m", "toolchain.cli", *args], capture_output=True, text=True, timeout=60, check=False
    )
    assert p.returncode == 2, p.stderr
    lines = p.stderr.splitlines()
    assert 1 <= len(lines) <= 3, p.stderr
    assert lines[0].startswith("error: ") and needle in lines[0], p.stderr
    assert "Value error" not in p.stderr  # pydantic's prefix, from typer's enum parsing
    assert not any(ch in p.stderr for ch in "╭│╰─"), "a rich box, not plain lines"
    assert lines[-1].startswith("see: ") and lines[-1].endswith(" --help")
    assert p.stdout == ""


def test_help_and_version_still_exit_zero() -> None:
    for args in (["--help"], ["quantize", "--help"], ["--version"]):
        p = subprocess.run(
            [sys.executable, "-m", "toolchain.cli", *args], capture_output=True, text=True, timeout=60, check=False
        )
        assert p.returncode == 0, (args, p.stderr)
        assert p.stdout.strip()


def test_tiny_model_seed_out_of_range_is_a_usage_error(cli: Any, tmp_path: Path) -> None:
    assert cli("tiny-model", tmp_path / "x", "--seed", str(10**23)).exit_code == 2
    assert not (tmp_path / "x").exists()
