"""Benchmark the CPU engine (engine graph in ONNX Runtime + reference plugin op) against transformers eager on the
same model and tokens: prefill and decode throughput at each --batches size, in one run.

    python bench/engine.py                 # random Llama, hidden 512, 8 layers (~50 M parameters), float32
    python bench/engine.py --model ../shared/data/models/stories260K-hf

Prefill: B sequences of --prompt tokens in one call (transformers: one forward of [B, prompt]). Decode: then
--steps single-token steps for all B sequences (transformers: with its KV cache), timed on their own. The two
runtimes alternate --repeat times; medians; tok/s = tokens processed / wall time. Prints a table (or --json);
figures go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from toolchain.checkpoint.convert import convert  # noqa: E402
from toolchain.engine.api import open_engine  # noqa: E402
from toolchain.engine.build import BuildOptions, build_engine  # noqa: E402
from toolchain.engine.contract import Batch  # noqa: E402


def random_llama(path: Path, hidden: int, layers: int) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 256),
        vocab_size=32000,
        max_position_embeddings=2048,
    )
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    return path


def measure(engine: Any, model: Any, b: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Prefill and decode throughput of both runtimes at batch b."""
    ids = torch.randint(0, engine.vocab_size, (b, args.prompt), generator=torch.Generator().manual_seed(b))
    per_seq = -(-(args.prompt + args.steps) // engine.tokens_per_block)
    tables = [list(range(s * per_seq, (s + 1) * per_seq)) for s in range(b)]

    def engine_run() -> tuple[float, float]:
        pool = engine.new_kv_cache(b * per_seq)
        start = time.perf_counter()
        engine.forward(Batch.from_sequences(ids.tolist(), [0] * b, tables), pool)
        prefilled = time.perf_counter()
        for step in range(args.steps):
            engine.forward(Batch.from_sequences([[1]] * b, [args.prompt + step] * b, tables), pool)
        return prefilled - start, time.perf_counter() - prefilled

    @torch.no_grad()
    def hf_run() -> tuple[float, float]:
        start = time.perf_counter()
        out = model(ids, use_cache=True)
        prefilled = time.perf_counter()
        key = "cache" if "cache" in out else "past_key_values"  # transformers 5 renamed it
        for _ in range(args.steps):
            out = model(torch.ones(b, 1, dtype=torch.long), use_cache=True, **{key: out[key]})
        return prefilled - start, time.perf_counter() - prefilled

    rows = []
    for _ in range(args.repeat):  # the two runtimes alternate, so that a change in the machine's load hits both
        for name, run in (("trtbuild CPU engine", engine_run), ("transformers eager", hf_run)):
            rows.append({"runtime": name, "times": run()})
    out = []
    for name in ("trtbuild CPU engine", "transformers eager"):
        times = [r["times"] for r in rows if r["runtime"] == name]
        prefill_s = statistics.median(t[0] for t in times)
        decode_s = statistics.median(t[1] for t in times)  # the decode steps themselves, timed on their own
        out.append(
            {
                "runtime": name,
                "batch": b,
                "prefill_tok_s": b * args.prompt / prefill_s,
                "decode_tok_s": b * args.steps / decode_s,
            }
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="a Hugging Face Llama dir; default: a random one")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(torch.get_num_threads())
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as work:
        hf = args.model or random_llama(Path(work) / "hf", args.hidden, args.layers)
        convert(hf, Path(work) / "ckpt", dtype="float32")
        build_engine(Path(work) / "ckpt", Path(work) / "engine", BuildOptions(backend="onnxruntime", max_batch_size=64))
        engine = open_engine(Path(work) / "engine")
        model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
        params = sum(p.numel() for p in model.parameters())
        for b in args.batches:
            rows += measure(engine, model, b, args)
    result = {
        "params": params,
        "prompt": args.prompt,
        "steps": args.steps,
        "threads": torch.get_num_threads(),
        "rows": rows,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(
        f"model: {params / 1e6:.1f} M parameters, float32; prompt {args.prompt} tokens, {args.steps} decode steps; "
        f"{result['threads']} threads; median of {args.repeat}"
    )
    print(f"| {'runtime':<20} | {'batch':>5} | {'prefill tok/s':>13} | {'decode tok/s':>12} |")
    print(f"|{'-' * 22}|{'-' * 6}:|{'-' * 14}:|{'-' * 13}:|")
    for r in rows:
        print(f"| {r['runtime']:<20} | {r['batch']:>5} | {r['prefill_tok_s']:>13.0f} | {r['decode_tok_s']:>12.1f} |")


if __name__ == "__main__":
    main()
