"""Quality cost of every quantization method x group size on stories260K, calibrated on WikiText-2 valid.txt and
evaluated on held-out text (WikiText-2 test: other articles; the stage refuses the calibration file as eval data).

python bench/quality.py              # prints a markdown table (or --json); figures go to docs/quality.md
python bench/quality.py --methods w4a16,w4a16_awq --eval-data ../shared/data/wikitext-2/wiki.test.raw \
    --eval-tokens 30000             # the int4 rows on raw text
python bench/quality.py --methods w8a8_sq,fp8 --eval-data ../shared/data/wikitext-2/wiki.test.raw --eval-tokens 30000
                                    # SmoothQuant at α 0.5 and α searched per layer; FP8
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

import quality_modelopt  # noqa: E402  bench/: ModelOpt's column

from toolchain.checkpoint.convert import convert  # noqa: E402
from toolchain.quantize.stage import QuantizeOptions, quantize_checkpoint  # noqa: E402

DATA = ROOT.parent / "shared" / "data"
CONFIGS: list[tuple[str, int, str, float | str]] = [  # method, group size, KV cache, SmoothQuant α
    ("w8a16", 128, "none", 0.5),
    ("w4a16", 32, "none", 0.5),
    ("w4a16", 64, "none", 0.5),
    ("w4a16", 128, "none", 0.5),
    ("w4a16_awq", 32, "none", 0.5),
    ("w4a16_awq", 64, "none", 0.5),
    ("w4a16_awq", 128, "none", 0.5),
    ("w8a8_sq", 128, "none", 0.5),
    ("w8a8_sq", 128, "none", "auto"),
    ("fp8", 128, "none", 0.5),
    ("w8a16", 128, "int8", 0.5),
    ("w8a16", 128, "fp8", 0.5),
    ("fp8", 128, "fp8", 0.5),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DATA / "models" / "stories260K-hf")
    ap.add_argument("--eval-data", type=Path, default=DATA / "wikitext-2" / "test.txt")
    ap.add_argument("--calib-data", type=Path, default=DATA / "wikitext-2" / "valid.txt")
    ap.add_argument("--eval-tokens", type=int, default=60_000)
    ap.add_argument("--methods", help="comma-separated subset of the methods (default: all)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--modelopt",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ModelOpt's figures on the same calibration windows and tokens (skipped, saying why, without ModelOpt)",
    )
    args = ap.parse_args()
    configs = [c for c in CONFIGS if not args.methods or c[0] in args.methods.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as work:
        ckpt = Path(work) / "ckpt"
        convert(args.model, ckpt)
        peer = None
        if args.modelopt:  # ModelOpt on the same calibration windows (64 x 256, seed 0) and scored tokens
            peer = quality_modelopt.Peer(
                args.model, ckpt, Path(work), args.calib_data, args.eval_data, args.eval_tokens
            )
        for method, group, kv, alpha in configs:
            opts = QuantizeOptions(
                method, kv, group, calib_data=args.calib_data, calib_samples=64, calib_seq_len=256, sq_alpha=alpha
            )
            start = time.perf_counter()
            out = Path(work) / f"{method}-{group}-{kv}-{alpha}"
            r = quantize_checkpoint(ckpt, out, opts, eval_data=args.eval_data, eval_tokens=args.eval_tokens)
            rows.append(
                {
                    "method": f"{method} (α {alpha})" if opts.quant_method.uses_sq_alpha else method,
                    "group": group if opts.quant_method.grouped else None,
                    "kv_cache": kv,
                    "seconds": time.perf_counter() - start,
                    **r.to_json()["quality"],
                }
            )
        for r in rows if peer else []:  # ModelOpt's run on each row's spec, same windows and tokens
            r["modelopt"] = peer.row(r["method"], r["group"], r["kv_cache"])
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
    if peer and peer.python:
        print("\nPPL ratio / mean KLD, same calibration windows and scored tokens:")
        print("\n".join(quality_modelopt.markdown(rows)))


if __name__ == "__main__":
    main()
