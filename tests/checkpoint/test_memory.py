"""Conversion memory does not grow with the model: it is bounded by the tensors in flight."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
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


@pytest.mark.slow
def test_peak_rss_is_bounded_by_tensors_not_model(tmp_path: Path) -> None:
    small = _model(tmp_path / "small", layers=1)
    big = _model(tmp_path / "big", layers=24)  # ~180 MB; largest tensor: the 8 MB embedding
    rss_small = _peak_rss_of_convert(tmp_path / "small", tmp_path / "o1")
    rss_big = _peak_rss_of_convert(tmp_path / "big", tmp_path / "o2")
    growth = max(rss_big - rss_small, 0)
    # Holding the model would add ~180 MB; streaming adds a few tensors at most.
    assert growth < 0.25 * (big - small), (growth, big - small)


_FAULTS = """
import resource, sys, torch
from pathlib import Path
from toolchain.checkpoint.convert import convert, freed_memory_returned

x, idx = torch.randn(1 << 20), torch.randint(0, 1 << 20, (5 << 18,))

def faults():  # minor page faults of 50 gathers with 5 MiB results (a batch-32 decode layer's K/V is ~5 MiB)
    for _ in range(3):
        x.index_select(0, idx)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(50):
        x.index_select(0, idx)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

with freed_memory_returned():
    inside = faults()
convert(Path(sys.argv[1]), Path(sys.argv[2]))
print(inside, faults())
"""


@pytest.mark.slow
def test_conversion_leaves_later_large_temporaries_off_mmap(tmp_path: Path) -> None:
    """convert (and quantize) have glibc return freed tensors at once (mmap for 4 MiB and more) while they run; the
    process that goes on to run an engine (a `trtbuild run` recipe) must not keep paying a page fault per page of
    every large temporary afterwards: that halved batch-32 decode (docs/performance.md). Counted in a fresh process,
    since glibc's setting is process-wide."""
    _model(tmp_path / "m", layers=1)
    cmd = [sys.executable, "-c", _FAULTS, str(tmp_path / "m"), str(tmp_path / "out")]
    inside, after = map(int, subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.split())
    assert inside > 50 * 1000  # every 5 MiB result mmapped and faulted in page by page (1280 pages)
    assert after < inside / 5, (inside, after)
