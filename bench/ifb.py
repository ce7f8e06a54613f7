"""In-flight batching benchmark: one model, one trace, four ways of serving it, in one run.

1. trtbuild runtime, in-flight batching (requests join the running batch at every step, chunked prefill);
2. trtbuild runtime, static batching on the same engine: batches of --batch requests, each run to completion before
   the next is admitted (request-level batching, no padding: toolchain/runtime/replay.py says exactly what);
3. transformers continuous batching (`init_continuous_batching` manager, paged attention; requests added at
   their arrival times, per-request max_new_tokens, per-token timestamps);
4. transformers `generate` with static batches (wait for a full batch, left-padded, greedy).

Workload: the first --requests requests of a trace (default: Azure conv), lengths scaled to the engine's context
(toolchain/runtime/traces.py says how), arrival times divided by --rate-scale. Greedy decoding everywhere.
Prints a table (or --json); figures go to docs/benchmarks.md. Requests that did not complete are counted in the
table, and the script exits 1 if any did, unless --allow-failures.

    python bench/ifb.py                                  # stories260K (../shared/data) and a random 54 M Llama
    python bench/ifb.py --models random --requests 32
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from toolchain.checkpoint.convert import convert  # noqa: E402
from toolchain.engine.api import open_engine  # noqa: E402
from toolchain.engine.build import BuildOptions, build_engine  # noqa: E402
from toolchain.runtime.replay import replay  # noqa: E402
from toolchain.runtime.traces import TraceRequest, load_trace  # noqa: E402

DATA = ROOT.parent / "shared" / "data"


def pct(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    return {f"p{p}": float(np.percentile(values, p)) for p in (50, 90, 99)}


def result(
    requests: int, completed: int, tokens: int, wall: float, ttft: list[float], tpot: list[float]
) -> dict[str, Any]:
    return {
        "completed": completed,
        "not_completed": requests - completed,
        "output_tokens": tokens,
        "wall_s": wall,
        "output_tok_s": tokens / wall,
        "ttft_s": pct(ttft),
        "tpot_s": pct(tpot),
        "preemptions": None,
    }


def hf_continuous(model: Any, trace: list[TraceRequest]) -> dict[str, Any]:
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=max(r.output_tokens for r in trace), eos_token_id=None)
    manager = model.init_continuous_batching(generation_config=config)
    manager.start()
    manager.add_request(trace[0].prompt, request_id="warmup", max_new_tokens=2)  # its start-up stays out of the
    manager.get_result(request_id="warmup", timeout=600)  # figures (about 17 s on this machine)
    start = time.monotonic()
    ids = []
    arrivals: dict[str, float] = {}
    for i, r in enumerate(trace):
        delay = r.arrival - (time.monotonic() - start)
        if delay > 0:
            time.sleep(delay)
        rid = f"r{i}"
        arrivals[rid] = time.perf_counter()  # the clock of the manager's token timestamps
        manager.add_request(r.prompt, request_id=rid, max_new_tokens=r.output_tokens, record_timestamps=True)
        ids.append(rid)
    results: dict[str, Any] = {}
    while len(results) < len(ids):  # results come in completion order; asking by id loses the others
        o = manager.get_result(timeout=600)
        if o is None:
            break
        results[o.request_id] = o
    outputs = [results.get(rid) for rid in ids]
    wall = time.monotonic() - start
    manager.stop(block=True)
    missing = [rid for rid, o in zip(ids, outputs, strict=True) if o is None or not o.generated_tokens]
    if missing:
        print(f"transformers continuous batching: no result for {missing[:5]}", file=sys.stderr)
    done = [o for o in outputs if o is not None and o.generated_tokens]
    tokens = sum(len(o.generated_tokens) for o in done)
    ttft = [o.timestamps[0] - arrivals[o.request_id] for o in done if o.timestamps]
    tpot = [(o.timestamps[-1] - o.timestamps[0]) / (len(o.timestamps) - 1) for o in done if len(o.timestamps or []) > 1]
    return result(len(trace), len(done), tokens, wall, ttft, tpot)


def hf_static(model: Any, trace: list[TraceRequest], batch: int) -> dict[str, Any]:
    start = time.monotonic()
    tokens, ttft, tpot, completed = 0, [], [], 0
    for first in range(0, len(trace), batch):
        group = trace[first : first + batch]
        delay = group[-1].arrival - (time.monotonic() - start)  # wait for the batch to fill
        if delay > 0:
            time.sleep(delay)
        width = max(len(r.prompt) for r in group)
        ids = torch.tensor([[0] * (width - len(r.prompt)) + r.prompt for r in group])
        mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in group])
        steps: list[float] = []

        def mark(input_ids: torch.Tensor, scores: torch.Tensor, steps: list[float] = steps) -> torch.Tensor:
            steps.append(time.monotonic() - start)
            return scores

        new = max(r.output_tokens for r in group)
        with torch.no_grad():
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                logits_processor=[mark],
                pad_token_id=0,
            )
        for r in group:  # each request's own tokens; the batch runs to its longest
            tokens += r.output_tokens
            ttft.append(steps[0] - r.arrival)
            if r.output_tokens > 1:
                tpot.append((steps[r.output_tokens - 1] - steps[0]) / (r.output_tokens - 1))
            completed += 1
    wall = time.monotonic() - start
    return result(len(trace), completed, tokens, wall, ttft, tpot)


def random_llama(path: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=512,
        intermediate_size=1344,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=32000,
        max_position_embeddings=1024,
    )
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    return path


def run_model(name: str, hf: Path, work: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    from transformers import AutoModelForCausalLM

    convert(hf, work / f"{name}-ckpt", dtype="float32")
    opts = BuildOptions(
        backend="onnxruntime",
        max_batch_size=args.batch,
        max_num_tokens=args.max_num_tokens,
        max_seq_len=args.max_seq_len,
        tokens_per_block=16,
    )
    build_engine(work / f"{name}-ckpt", work / f"{name}-engine", opts)
    engine = open_engine(work / f"{name}-engine")
    trace, scale = load_trace(args.trace, args.max_seq_len, engine.vocab_size, args.requests, args.rate_scale)
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    rows = []
    for label, fn in (
        ("trtbuild in-flight", lambda: replay(engine, trace)),
        ("trtbuild static (batches run to completion)", lambda: replay(engine, trace, static=True)),
        ("transformers continuous", lambda: hf_continuous(model, trace)),
        ("transformers static", lambda: hf_static(model, trace, args.batch)),
    ):
        print(f"{name}: {label} ...", file=sys.stderr, flush=True)
        r = fn()
        rows.append(
            {
                "model": name,
                "runtime": label,
                "length_scale": scale,
                "engine_manifest_sha256": engine.spec.manifest_sha256,
                **{
                    k: r[k]
                    for k in (
                        "completed",
                        "not_completed",
                        "output_tokens",
                        "wall_s",
                        "output_tok_s",
                        "ttft_s",
                        "tpot_s",
                        "preemptions",
                    )
                },
                "failure_reasons": r.get("failure_reasons", {}),
                "prefix_cache_hit_rate": r["prefix_cache"]["hit_rate"] if "prefix_cache" in r else None,
                "settings": r.get("settings"),
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["stories260K", "random"], choices=["stories260K", "random"])
    ap.add_argument("--trace", type=Path, default=DATA / "traces" / "AzureLLMInferenceTrace_conv.csv")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--rate-scale", type=float, default=20.0, help="arrivals this many times faster than the trace")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-num-tokens", type=int, default=256)
    ap.add_argument("--max-seq-len", type=int, default=256)
    ap.add_argument("--allow-failures", action="store_true", help="exit 0 even if requests did not complete")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for name in args.models:
            hf = DATA / "models" / "stories260K-hf" if name == "stories260K" else random_llama(work / "random-hf")
            if not (hf / "config.json").is_file():
                print(f"skipping {name}: {hf} not found", file=sys.stderr)
                continue
            rows += run_model(name, hf, work, args)
    if args.json:
        print(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=2))
    else:
        table(args, rows)
    failed = [r for r in rows if r["not_completed"]]
    if failed and not args.allow_failures:
        what = "; ".join(
            f"{r['model']} {r['runtime']}: {r['not_completed']} {r['failure_reasons'] or ''}" for r in failed
        )
        print(f"error: requests did not complete ({what}); pass --allow-failures to accept", file=sys.stderr)
        sys.exit(1)


def table(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    print(
        f"trace {args.trace.name}: first {args.requests} requests, rate x {args.rate_scale}; batch {args.batch}; greedy"
    )
    print(
        "| model | runtime | done | not done | output tok/s | TTFT p50 / p90 ms | TPOT p50 / p90 ms | preemptions "
        "| prefix-cache hits |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")

    def ms(d: dict[str, float | None]) -> str:
        return " / ".join("-" if d[k] is None else f"{1e3 * d[k]:.0f}" for k in ("p50", "p90"))  # type: ignore[operator]

    for r in rows:
        hits = "-" if r["prefix_cache_hit_rate"] is None else f"{100 * r['prefix_cache_hit_rate']:.1f} %"
        print(
            f"| {r['model']} | {r['runtime']} | {r['completed']} | {r['not_completed']} | {r['output_tok_s']:.1f} | "
            f"{ms(r['ttft_s'])} | {ms(r['tpot_s'])} | {'-' if r['preemptions'] is None else r['preemptions']} | "
            f"{hits} |"
        )


if __name__ == "__main__":
    main()
