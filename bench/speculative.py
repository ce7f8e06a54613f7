"""Speculative decoding on stories260K (issue 30): each proposer replays a trace without and with speculation
(runtime/replay.py `compare_speculation`: interleaved rounds, medians) with text prompts on the trace's arrivals,
and the table gives acceptance, mean accepted length, the CPU-measured throughput and step ratios, and the GPU
speedup projected from weight and KV bytes (a projection, not a measurement: c and v beside it).

    python bench/speculative.py                                   # n-gram [2, 4], k 2 and 4
    python bench/speculative.py --draft d4=/path/to/draft-engine  # plus a draft engine (same tokenizer)

Drafts here are CPU stand-ins (a few of the target's own layers, `trtbuild convert --layers`): on a CPU a draft step
costs nearly what a target step does (per-call overhead dominates), so the measured ratio understates a GPU's; the
projection assumes memory-bound decode (a step costs the bytes it reads).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from toolchain.engine.api import close_engine, load_tokenizer, open_engine  # noqa: E402
from toolchain.runtime.replay import compare_speculation, with_prompts  # noqa: E402
from toolchain.runtime.speculative import SpecConfig  # noqa: E402
from toolchain.runtime.traces import load_trace  # noqa: E402
from toolchain.speculation_cli import open_draft  # noqa: E402

SHARED = ROOT.parent / "shared" / "data"
PROMPTS = [  # TinyStories-style openings, the text stories260K was trained on
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the sun.",
    "One day, a big dog named Max went to the park. He saw a red ball under a tree.",
    "Tom and Sam were best friends. They liked to play with their toys in the garden.",
    "There was a small cat who lived in a house. The cat was very happy because",
    "Once upon a time, there was a boy named Tim. Tim had a big, red car.",
    "Lucy went to the store with her mom. She wanted to buy a new doll.",
    "A little bird sat on a branch. It sang a happy song every morning.",
    "Ben found a shiny rock in the sand. He showed it to his dad and said,",
]


def build_target(model: Path, work: Path) -> Path:
    from toolchain.checkpoint.convert import convert
    from toolchain.engine.build import BuildOptions, build_engine

    engine = work / "target-engine"
    if not (engine / "manifest.json").is_file():
        convert(model, work / "target-ckpt")
        opts = BuildOptions(backend="onnxruntime", max_seq_len=256, max_batch_size=8, tokens_per_block=4)
        build_engine(work / "target-ckpt", engine, opts)
    return engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=SHARED / "models" / "stories260K-hf")
    ap.add_argument("--engine", type=Path, help="a built target engine (default: built from --model in --work)")
    ap.add_argument("--trace", type=Path, default=SHARED / "traces" / "AzureLLMInferenceTrace_conv.csv")
    ap.add_argument("--max-requests", type=int, default=32)
    ap.add_argument("--rate-scale", type=float, default=1000.0, help="default: all queued at once (compute-bound)")
    ap.add_argument(
        "--output-tokens",
        type=int,
        default=96,
        help="every request's output length (0: the trace's, which scaled to a 256-token window are a few tokens)",
    )
    ap.add_argument("--k", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--ngram", type=int, nargs=2, default=[2, 4], metavar=("MIN", "MAX"))
    ap.add_argument("--draft", action="append", default=[], help="NAME=ENGINE_DIR: a draft engine row (repeatable)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--work", type=Path, default=Path("/tmp/trtbuild-bench-speculative"))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    args.work.mkdir(parents=True, exist_ok=True)
    engine_dir = args.engine or build_target(args.model, args.work)
    engine = open_engine(engine_dir)
    tok = load_tokenizer(engine_dir)
    limits = engine.spec.limits
    trace, scale = load_trace(args.trace, limits.max_seq_len, engine.vocab_size, args.max_requests, args.rate_scale)
    if args.output_tokens:
        trace = [dataclasses.replace(r, output_tokens=args.output_tokens) for r in trace]
    requests = with_prompts(trace, [list(tok.encode(p)) for p in PROMPTS], limits.max_seq_len)
    rows: list[dict[str, Any]] = []
    proposers: list[tuple[str, Path | None]] = [(f"n-gram [{args.ngram[0]}, {args.ngram[1]}]", None)]
    for item in args.draft:
        name, _, path = item.partition("=")
        proposers.append((f"draft {name}", Path(path)))
    try:
        for label, draft_dir in proposers:
            draft = open_draft(engine, draft_dir) if draft_dir is not None else None
            try:
                for k in args.k:
                    if draft is None:
                        config = SpecConfig("ngram", k, args.ngram[0], args.ngram[1])
                    else:
                        config = SpecConfig("draft", k)
                    r = compare_speculation(engine, requests, config, draft, args.rounds)
                    s, p = r["speculation"], r["projection"]
                    rows.append(
                        {
                            "proposer": label,
                            "k": k,
                            "acceptance_rate": s["acceptance_rate"],
                            "mean_accepted_length": s["mean_accepted_length"],
                            "plain_tok_s": r["plain"]["output_tok_s"],
                            "spec_tok_s": r["speculative"]["output_tok_s"],
                            "throughput_ratio": r["ratios"]["throughput"],
                            "steps_ratio": r["ratios"]["steps"],
                            "projected_gpu_speedup": p["speedup"],
                            "c": p["c"],
                            "v": p["v"],
                            "completed": (r["plain"]["completed"], r["speculative"]["completed"]),
                        }
                    )
                    print(f"{label} k={k}: done", file=sys.stderr)
            finally:
                if draft is not None:
                    close_engine(draft)
    finally:
        close_engine(engine)
    setup = {
        "engine": str(engine_dir),
        "trace": str(args.trace),
        "requests": len(requests),
        "length_scale": scale,
        "rate_scale": args.rate_scale,
        "rounds": args.rounds,
        "prompts": f"{len(PROMPTS)} TinyStories openings, cycled",
        "output_tokens": args.output_tokens or "the trace's",
    }
    if args.json:
        print(json.dumps({"setup": setup, "rows": rows}, indent=2))
        return
    outputs = f"{args.output_tokens} output tokens each" if args.output_tokens else f"lengths x {scale:.3f}"
    print(
        f"stories260K, {len(requests)} requests of {args.trace.name} (rate x {args.rate_scale:g}, {outputs}), "
        f"{len(PROMPTS)} text prompts cycled, {args.rounds} interleaved rounds (medians), CPU"
    )
    print(
        "| proposer | k | acceptance | MAL | plain tok/s | spec tok/s | ratio (CPU) | steps ratio | "
        "projected GPU speedup (c, v) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")

    def f(v: float | None, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    for row in rows:
        print(
            f"| {row['proposer']} | {row['k']} | {f(row['acceptance_rate'], '.3f')} | "
            f"{f(row['mean_accepted_length'], '.2f')} | {row['plain_tok_s']:.0f} | {row['spec_tok_s']:.0f} | "
            f"{f(row['throughput_ratio'], '.2f')} | {f(row['steps_ratio'], '.2f')} | "
            f"{f(row['projected_gpu_speedup'], '.2f')}x ({row['c']:.2f}, {row['v']:.3f}) |"
        )  # fmt: skip


if __name__ == "__main__":
    main()
