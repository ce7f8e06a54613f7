"""Where a CPU-engine decode step goes, per component: ONNX Runtime's graph segments, the KVCacheWrite and
PagedAttention reference ops, and the rest (Python between them, batch checks, packing), at each batch size.

    python bench/step_profile.py                  # bench/engine.py's random Llama (54.5 M, float32), B = 1 and 16
    python bench/step_profile.py --batches 1 4 16 --steps 64
    python bench/step_profile.py --engine DIR     # an engine already built

Method: B prompts of --prompt tokens are prefilled, 4 decode steps warm up, then --steps decode steps are timed as
a whole while every segment's `run` and every plugin op is timed on its own (perf_counter around each call: ~1 us
of the step each). Rounds alternate the batch sizes; medians of --rounds. A profile, not a benchmark against a
baseline: bench/engine.py and bench/peers.py compare runtimes; this says which part of a step a change must move.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from toolchain.engine import ort_backend  # noqa: E402
from toolchain.engine.api import open_engine  # noqa: E402
from toolchain.engine.contract import Batch  # noqa: E402

PARTS = ("onnxruntime", "KVCacheWrite", "PagedAttention")


class _TimedSession:
    def __init__(self, session: Any, spent: dict[str, float]):
        self.session, self.spent = session, spent

    def run(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return self.session.run(*args, **kwargs)
        finally:
            self.spent["onnxruntime"] += time.perf_counter() - start


def _timed_op(name: str, op: Callable[..., Any], spent: dict[str, float]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return op(*args, **kwargs)
        finally:
            spent[name] += time.perf_counter() - start

    return run


def instrument(engine: ort_backend.OrtEngine) -> dict[str, float]:
    """Time every segment run and plugin op of `engine` into the returned dict (seconds, accumulated)."""
    spent = dict.fromkeys(PARTS, 0.0)
    for step in engine.steps:
        if isinstance(step, ort_backend._Segment):
            step.session = _TimedSession(step.session, spent)
    for name, op in list(ort_backend.OPS.items()):
        ort_backend.OPS[name] = _timed_op(name, op, spent)
    return spent


def profile(
    engine: ort_backend.OrtEngine, spent: dict[str, float], b: int, args: argparse.Namespace
) -> dict[str, float]:
    """ms per decode step: the whole step and each part."""
    ids = torch.randint(0, engine.vocab_size, (b, args.prompt), generator=torch.Generator().manual_seed(b)).tolist()
    per = -(-(args.prompt + args.steps + 4) // engine.tokens_per_block)
    tables = [list(range(s * per, (s + 1) * per)) for s in range(b)]
    pool = engine.new_kv_cache(b * per)
    engine.forward(Batch.from_sequences(ids, [0] * b, tables), pool)
    for s in range(4):
        engine.forward(Batch.from_sequences([[1]] * b, [args.prompt + s] * b, tables), pool)
    for key in spent:
        spent[key] = 0.0
    start = time.perf_counter()
    for s in range(args.steps):
        engine.forward(Batch.from_sequences([[1]] * b, [args.prompt + 4 + s] * b, tables), pool)
    step = (time.perf_counter() - start) / args.steps * 1e3
    parts = {k: v / args.steps * 1e3 for k, v in spent.items()}
    return {"step": step, **parts, "rest": step - sum(parts.values())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", type=Path, help="an engine directory (onnxruntime backend); default: build one")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as work:
        engine_dir = args.engine
        if engine_dir is None:
            from engine import random_llama  # bench/engine.py: the model is defined once

            from toolchain.checkpoint.convert import convert
            from toolchain.engine.build import BuildOptions, build_engine

            hf = random_llama(Path(work) / "hf", 512, 8)
            convert(hf, Path(work) / "ckpt", dtype="float32")
            engine_dir = Path(work) / "engine"
            options = BuildOptions(backend="onnxruntime", max_batch_size=max(args.batches))
            build_engine(Path(work) / "ckpt", engine_dir, options)
        engine = open_engine(engine_dir, backend="onnxruntime")
        assert isinstance(engine, ort_backend.OrtEngine)
        spent = instrument(engine)
        samples: dict[int, list[dict[str, float]]] = {b: [] for b in args.batches}
        for _ in range(args.rounds):
            for b in args.batches:
                samples[b].append(profile(engine, spent, b, args))
    print(f"ms per decode step, median of {args.rounds} rounds of {args.steps} steps after {args.prompt} prompt tokens")
    cols = ("step", *PARTS, "rest")
    print("| batch | " + " | ".join(cols) + " | tok/s |")
    print("|---:|" + "---:|" * (len(cols) + 1))
    for b, rows in samples.items():
        med = {k: statistics.median(r[k] for r in rows) for k in cols}
        cells = " | ".join(f"{med[k]:.2f}" for k in cols)
        print(f"| {b} | {cells} | {b * 1e3 / med['step']:.0f} |")


if __name__ == "__main__":
    main()
