"""Benchmark `trtbuild quantize`: wall time and peak RSS of every method on the conversion benchmark's random Llama.

One run: the bf16 model of bench/convert.py (default hidden 2048, 16 layers: about 1.7 GB) is converted once;
then, as separate processes under /usr/bin/time, the baseline — `trtbuild convert` of the same model, one pass
over its weights — and `trtbuild quantize` with each method. Calibration: the same seeded text for every method
(generated, the random model has no language), 4 windows x 128 tokens unless told otherwise. Prints a table (or
--json); figures go to docs/benchmarks.md.

    python bench/quantize.py                  # the default ~1.7 GB model, every method
    python bench/quantize.py --layers 2 --methods w8a16 fp8
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.convert import timed, write_model  # noqa: E402
from toolchain.checkpoint.tiny import byte_level_tokenizer  # noqa: E402
from toolchain.quantize.methods import METHOD_NAMES as METHODS  # noqa: E402


def calibration_text(path: Path, words: int = 40_000) -> None:
    rng = random.Random(0)
    vocab = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(3000)]
    path.write_text(" ".join(rng.choice(vocab) for _ in range(words)) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--calib-samples", type=int, default=4)
    ap.add_argument("--calib-seq-len", type=int, default=128)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    trtbuild = str(Path(sys.executable).with_name("trtbuild"))
    work = Path(tempfile.mkdtemp(prefix="trtbuild-bench-q-"))
    try:
        src = work / "hf"
        size = write_model(src, args)
        byte_level_tokenizer().save_pretrained(src)
        calib = work / "calib.txt"
        calibration_text(calib)
        ckpt = work / "ckpt"
        subprocess.run([trtbuild, "convert", str(src), "-o", str(ckpt)], check=True, capture_output=True)
        for f in ckpt.iterdir():  # warm the page cache, as for every run below
            f.read_bytes()
        runs = {"baseline: trtbuild convert": [trtbuild, "convert", str(src), "-o", str(work / "out")]}
        for method in args.methods:
            runs[f"quantize {method}"] = [
                *(trtbuild, "quantize", str(ckpt), "-o", str(work / "out"), "--method", method),
                *("--calib-data", str(calib), "--calib-samples", str(args.calib_samples)),
                *("--calib-seq-len", str(args.calib_seq_len), "--group-size", "128"),
            ]
        rows = []
        for name, cmd in runs.items():
            wall, rss = timed(cmd)
            out_bytes = sum(f.stat().st_size for f in (work / "out").iterdir())
            shutil.rmtree(work / "out")
            rows.append({"run": name, "wall_s": wall, "peak_rss_mib": rss / 2**20, "output_mib": out_bytes / 2**20})
    finally:
        shutil.rmtree(work, ignore_errors=True)

    result = {
        "model": {"bytes": size, "layers": args.layers, "hidden": args.hidden, "intermediate": args.intermediate},
        "calibration": {"samples": args.calib_samples, "seq_len": args.calib_seq_len},
        "rows": rows,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(
        f"model: {size / 1e9:.2f} GB bf16, {args.layers} layers, hidden {args.hidden}; "
        f"calibration {args.calib_samples} x {args.calib_seq_len} tokens"
    )
    print(f"| {'run':<28} | {'wall s':>7} | {'peak RSS MiB':>12} | {'RSS / model':>11} | {'output MiB':>10} |")
    print(f"|{'-' * 30}|{'-' * 8}:|{'-' * 13}:|{'-' * 12}:|{'-' * 11}:|")
    for r in rows:
        print(
            f"| {r['run']:<28} | {r['wall_s']:>7.1f} | {r['peak_rss_mib']:>12.0f} | "
            f"{r['peak_rss_mib'] * 2**20 / size:>10.2f}x | {r['output_mib']:>10.0f} |"
        )


if __name__ == "__main__":
    main()
