"""Quality cost of every quantization method x group size on stories260K, calibrated on WikiText-2 valid.txt and
evaluated on held-out text (WikiText-2 test: other articles; the stage refuses the calibration file as eval data).

python bench/quality.py              # prints a markdown table (or --json); figures go to docs/quality.md
python bench/quality.py --methods w4a16,w4a16_awq --eval-data ../shared/data/wikitext-2/wiki.test.raw \
    --eval-tokens 30000             # the int4 rows on raw text
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from toolchain.checkpoint.convert import convert  # noqa: E402
from toolchain.quantize.stage import QuantizeOptions, quantize_checkpoint  # noqa: E402

DATA = ROOT.parent / "shared" / "data"
CONFIGS = [
    ("w8a16", 128, "none"),
    ("w4a16", 32, "none"),
    ("w4a16", 64, "none"),
    ("w4a16", 128, "none"),
    ("w4a16_awq", 32, "none"),
    ("w4a16_awq", 64, "none"),
    ("w4a16_awq", 128, "none"),
    ("w8a8_sq", 128, "none"),
    ("fp8", 128, "none"),
    ("w8a16", 128, "int8"),
    ("w8a16", 128, "fp8"),
    ("fp8", 128, "fp8"),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DATA / "models" / "stories260K-hf")
    ap.add_argument("--eval-data", type=Path, default=DATA / "wikitext-2" / "test.txt")
    ap.add_argument("--calib-data", type=Path, default=DATA / "wikitext-2" / "valid.txt")
    ap.add_argument("--eval-tokens", type=int, default=60_000)
    ap.add_argument("--methods", help="comma-separated subset of the methods (default: all)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    configs = [c for c in CONFIGS if not args.methods or c[0] in args.methods.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as work:
        ckpt = Path(work) / "ckpt"
        convert(args.model, ckpt)
        for method, group, kv in configs:
            opts = QuantizeOptions(method, kv, group, calib_data=args.calib_data, calib_samples=64, calib_seq_len=256)
            start = time.perf_counter()
            out = Path(work) / f"{method}-{group}-{kv}"
            r = quantize_checkpoint(ckpt, out, opts, eval_data=args.eval_data, eval_tokens=args.eval_tokens)
            rows.append(
                {
                    "method": method,
                    "group": group if method.startswith("w4a16") else None,
                    "kv_cache": kv,
                    "seconds": time.perf_counter() - start,
                    **r["quality"],
                }
            )
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(
        f"stories260K, calibrated on 64 x 256 tokens of {args.calib_data.name}, evaluated on {rows[0]['tokens']:,} "
        f"tokens of {args.eval_data.name} in {rows[0]['windows']} windows of 256"
    )
    print("| method | group | KV cache | PPL ratio | mean KLD | KLD p99 | same top-1 | RMS Δp |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['method']} | {r['group'] or '-'} | {r['kv_cache']} | {r['ppl_ratio']:.4f} | {r['kld_mean']:.5f} "
            f"| {r['kld_p99']:.4f} | {100 * r['same_top1']:.2f} % | {100 * r['dp_rms']:.2f} % |"
        )
    print(f"PPL(reference) = {rows[0]['ppl_reference']:.3f}")


if __name__ == "__main__":
    main()
