"""What the integrity check costs when a command opens an engine (toolchain/integrity.py), against its floor.

An engine-like directory (one large weights file plus small files, with a manifest written by the stage code) is
checked three ways in one run: the floor (sha256 of the same bytes with hashlib, no manifest), `check_engine` with
an empty hash cache (the first open), and `check_engine` again (a repeated open: a stat per file). The page cache is
warm for all three (the file was just written), so the figures are the hashing's, not the disk's. Prints a table;
figures go to docs/engine.md.

    python bench/verify.py            # a 2 GiB weights file
    python bench/verify.py --gib 0.5  # quicker
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from toolchain.integrity import check_engine  # noqa: E402
from toolchain.manifest import StageRecord  # noqa: E402


def make_engine(root: Path, gib: float) -> Path:
    engine = root / "engine"
    engine.mkdir()
    chunk = os.urandom(64 << 20)
    with (engine / "model.onnx.data").open("wb") as f:
        for _ in range(max(1, round(gib * 16))):
            f.write(chunk)
    (engine / "model.onnx").write_bytes(os.urandom(1 << 20))
    (engine / "build_config.json").write_text("{}\n")
    StageRecord("build").write(engine)
    return engine


def timed(fn: object, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        out.append(time.perf_counter() - start)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=2.0, help="size of the weights file")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["XDG_CACHE_HOME"] = str(Path(tmp) / "cache")
        engine = make_engine(Path(tmp), args.gib)
        size = sum(p.stat().st_size for p in engine.iterdir())

        def floor() -> None:
            for p in sorted(engine.iterdir()):
                digest = hashlib.sha256()
                with p.open("rb") as f:
                    while chunk := f.read(8 << 20):
                        digest.update(chunk)
                digest.hexdigest()

        def cold() -> None:
            cache = Path(tmp) / "cache" / "trtbuild" / "sha256-cache.json"
            cache.unlink(missing_ok=True)
            check_engine(engine)

        rows = [
            ("sha256 of every file (hashlib, floor)", timed(floor, args.repeats)),
            ("check_engine, first open (empty cache)", timed(cold, args.repeats)),
            ("check_engine, repeated open (cached)", timed(lambda: check_engine(engine), args.repeats)),
        ]
    print(f"engine of {size / 2**30:.2f} GiB, {args.repeats} repeats, warm page cache")
    print(f"| {'what':<42} | median s | min s | GB/s |")
    print(f"|{'-' * 44}|---------:|------:|-----:|")
    for name, times in rows:
        median = statistics.median(times)
        print(f"| {name:<42} | {median:8.3f} | {min(times):5.3f} | {size / median / 1e9:4.1f} |")


if __name__ == "__main__":
    main()
