"""Same input => same bytes; an interrupted run leaves nothing that looks complete and loses nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import edit_weights, one_line_error

import toolchain.checkpoint.convert as convert_mod
from toolchain.checkpoint.convert import convert
from toolchain.manifest import verify

HASHED = ("config.json", "rank0.safetensors")


@pytest.mark.slow
def test_same_model_twice_gives_identical_bytes(make_llama: Any, tmp_path: Path) -> None:
    hf = make_llama(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    convert(hf, tmp_path / "a")
    convert(hf, tmp_path / "b")
    for name in HASHED:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_rank_file_is_valid_safetensors_with_sorted_names(make_llama: Any, tmp_path: Path) -> None:
    from toolchain.checkpoint.safetensors_io import read_header

    convert(make_llama(), tmp_path / "out")
    infos, metadata = read_header(tmp_path / "out" / "rank0.safetensors")
    assert list(infos) == sorted(infos)
    assert metadata == {"format": "pt"}


def _fail_after(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    real = convert_mod._materialize
    calls = iter(range(10**6))

    def flaky(*args: Any) -> Any:
        if next(calls) == n:
            raise RuntimeError("injected failure mid-write")
        return real(*args)

    monkeypatch.setattr(convert_mod, "_materialize", flaky)


def leftovers(parent: Path, name: str) -> list[Path]:
    return [p for p in parent.iterdir() if p.name.startswith(f".{name}.")]


def test_injected_failure_leaves_nothing(make_llama: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hf = make_llama()
    _fail_after(monkeypatch, 5)
    with pytest.raises(RuntimeError, match="injected"):
        convert(hf, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert leftovers(tmp_path, "out") == []


def test_failed_force_keeps_the_previous_output(
    make_llama: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hf = make_llama()
    convert(hf, tmp_path / "out")
    before = (tmp_path / "out" / "rank0.safetensors").read_bytes()
    _fail_after(monkeypatch, 3)
    with pytest.raises(RuntimeError):
        convert(hf, tmp_path / "out", force=True)
    assert (tmp_path / "out" / "rank0.safetensors").read_bytes() == before
    assert verify(tmp_path / "out") == []
    assert leftovers(tmp_path, "out") == []


_SLOW_CONVERT = """
import sys, time
import toolchain.checkpoint.convert as c
real = c._materialize
def slow(*a):
    time.sleep(0.3)
    return real(*a)
c._materialize = slow
from toolchain.cli import app
app(sys.argv[1:])
"""


@pytest.mark.slow
def test_sigterm_mid_write_leaves_nothing(make_llama: Any, tmp_path: Path) -> None:
    hf = make_llama()
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-c", _SLOW_CONVERT, "convert", str(hf), "-o", str(out)],
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not leftovers(tmp_path, "out") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert leftovers(tmp_path, "out"), "conversion never started writing"
    time.sleep(0.5)  # a few tensors into the rank file
    os.kill(proc.pid, signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert "interrupted" in stderr
    assert not out.exists()
    assert leftovers(tmp_path, "out") == []


def test_force_refuses_a_folder_with_a_foreign_manifest(cli: Any, make_llama: Any, tmp_path: Path) -> None:
    webapp = tmp_path / "webapp"
    webapp.mkdir()
    (webapp / "manifest.json").write_text('{"name": "app"}')
    (webapp / "index.html").write_text("<html>")
    line = one_line_error(cli("convert", make_llama(), "-o", webapp, "--force"))
    assert "not a trtbuild artifact" in line
    assert (webapp / "index.html").read_text() == "<html>"


def test_output_under_a_file_and_parents_cleaned(cli: Any, make_llama: Any, tmp_path: Path) -> None:
    hf = make_llama()
    (tmp_path / "afile").write_text("x")
    line = one_line_error(cli("convert", hf, "-o", tmp_path / "afile" / "out"))
    assert "cannot create output dir" in line
    edit_weights(hf, lambda t: t["model.norm.weight"].fill_(float("nan")))
    assert "NaN/Inf" in one_line_error(cli("convert", hf, "-o", tmp_path / "deep" / "a" / "b" / "out"))
    assert not (tmp_path / "deep").exists()
