"""Conversion memory does not grow with the model: it is bounded by the tensors in flight."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from convert import write_model  # noqa: E402  (bench/convert.py: streams a random sharded Llama to disk)


def _model(path: Path, layers: int) -> int:
    args = argparse.Namespace(hidden=512, layers=layers, intermediate=1376, vocab=8000, heads=8, kv_heads=2, shards=3)
    return write_model(path, args)


_MEASURE = """
import resource, subprocess, sys
subprocess.run(sys.argv[1:], check=True, capture_output=True)
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
"""


def _peak_rss_of_convert(src: Path, out: Path) -> int:
    """Peak RSS of one `trtbuild convert` process, measured from a fresh parent (RUSAGE_CHILDREN is a max over
    every child a process ever waited for, so it must not be read in the test process itself)."""
    trtbuild = str(Path(sys.executable).with_name("trtbuild"))
    cmd = [sys.executable, "-c", _MEASURE, trtbuild, "convert", str(src), "-o", str(out), "--tp", "2"]
    return int(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)


def test_peak_rss_is_bounded_by_tensors_not_model(tmp_path: Path) -> None:
    small = _model(tmp_path / "small", layers=1)
    big = _model(tmp_path / "big", layers=24)  # ~180 MB; largest tensor: the 8 MB embedding
    rss_small = _peak_rss_of_convert(tmp_path / "small", tmp_path / "o1")
    rss_big = _peak_rss_of_convert(tmp_path / "big", tmp_path / "o2")
    growth = max(rss_big - rss_small, 0)
    # Holding the model would add ~180 MB; streaming adds a few tensors at most.
    assert growth < 0.25 * (big - small), (growth, big - small)
