"""What the runtime itself costs per step: scheduler, KV blocks, batch packing, sampling, bookkeeping — measured
with a null engine (an `Engine` whose forward returns fixed logits at once), so that the figure is what a GPU
engine, whose decode step of an 8B model takes ~10–20 ms, would pay on top of its own time.

    python bench/step_overhead.py                 # batch 8 and 256, greedy, vocab 32000
    python bench/step_overhead.py --batches 1 8 64 256 --sampling top_p

Steady decode: every request prefilled first (not timed), then --steps decode steps timed one by one; the table
shows the median and p90 per step and the share of the step in each phase (cProfile-free: perf_counter splits
in a copy of Runtime.step would change what is measured, so the phases come from a separate --profile run).
Goals (issue 15): <= 0.3 ms per step at batch 8, <= 1 ms at batch 256.

Greedy tokens come from `Engine.forward_tokens`: a GPU engine reduces the logits on the device and sends the host
one id per row (TensorRT's backend does), so by default the null engine answers with the argmax of its fixed logits
known in advance, and the table shows what the host reduction alone would cost beside it. `--host-argmax` puts that
reduction back into the step, as the CPU engine pays it.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from toolchain.engine.api import EngineSpec, KVCacheSpec, Limits, StepTokens  # noqa: E402
from toolchain.engine.contract import Batch  # noqa: E402
from toolchain.runtime.loop import Runtime  # noqa: E402
from toolchain.runtime.request import SamplingParams  # noqa: E402


class NullEngine:
    """Fixed logits, no work: the runtime's own cost is all that is left."""

    def __init__(self, batch: int, vocab: int, max_seq_len: int, host_argmax: bool, tokens_per_block: int = 16):
        blocks = batch * -(-max_seq_len // tokens_per_block)
        limits = Limits(batch, max(8192, batch), max_seq_len, tokens_per_block, blocks)
        self.spec = EngineSpec(
            Path("null"), "null", "float32", "float32", "Null", vocab, limits, KVCacheSpec("float32", 1, 1, 16, 1)
        )
        self.vocab_size, self.tokens_per_block = vocab, tokens_per_block
        rng = np.random.default_rng(0)
        self.logits = rng.standard_normal((limits.max_num_tokens, vocab), dtype=np.float32)
        self.greedy = self.logits.argmax(axis=1)
        self.host_argmax = host_argmax

    def new_kv_cache(self, num_blocks: int) -> torch.Tensor:
        return torch.zeros(self.spec.kv_cache.pool_shape(num_blocks))

    def forward(self, batch: Batch, kv_cache: torch.Tensor) -> np.ndarray:
        return self.logits[: batch.logits_index.shape[0]]

    def forward_tokens(self, batch: Batch, kv_cache: torch.Tensor, sampled: Sequence[int]) -> StepTokens:
        """As a GPU engine answers: the greedy reduction ran on the device (its result is known: the logits are
        fixed), the sampled rows' logits come to the host. `--host-argmax` makes it reduce on the host instead,
        as the CPU engine does."""
        n = batch.logits_index.shape[0]
        greedy = self.logits[:n].argmax(axis=1) if self.host_argmax else self.greedy[:n]
        return StepTokens(greedy, {i: self.logits[i] for i in sampled})


def steady_steps(batch: int, args: argparse.Namespace, profile: cProfile.Profile | None = None) -> list[float]:
    engine = NullEngine(batch, args.vocab, args.prompt + args.steps + 8, args.host_argmax)
    rt = Runtime(engine)
    params = {
        "greedy": SamplingParams(max_new_tokens=args.steps + 4),
        "top_p": SamplingParams(max_new_tokens=args.steps + 4, temperature=0.8, top_p=0.9, seed=0),
    }[args.sampling]
    rng = np.random.default_rng(1)
    for _ in range(batch):
        rt.add_request(rng.integers(3, args.vocab, args.prompt).tolist(), params)
    while rt.num_waiting or any(r.pending > 1 for r in rt.scheduler.running):  # prefill, not timed
        rt.step()
    times = []
    if profile is not None:
        profile.enable()
    for _ in range(args.steps):
        start = time.perf_counter()
        rt.step()
        times.append(time.perf_counter() - start)
    if profile is not None:
        profile.disable()
    return times


def argmax_ms(batch: int, vocab: int, repeat: int = 50) -> float:
    """The part of a greedy step that reads every logit (batch x vocab floats from memory): on a GPU engine it
    would run on the device; here it is host memory bandwidth."""
    logits = np.random.default_rng(2).standard_normal((batch, vocab), dtype=np.float32)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        for row in logits:
            row.argmax()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 256])
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--sampling", choices=["greedy", "top_p"], default="greedy")
    ap.add_argument("--profile", action="store_true", help="print where the time goes (cProfile), per batch")
    ap.add_argument(
        "--host-argmax",
        action="store_true",
        help="greedy reduction over the logits on the host, inside the step (the CPU engine's case)",
    )
    args = ap.parse_args()
    where = "on the host, in the step" if args.host_argmax else "by the engine (on the device, for a GPU engine)"
    print(f"null engine, vocab {args.vocab}, prompt {args.prompt}, {args.steps} decode steps, {args.sampling}")
    print(f"greedy reduction over the logits: {where}")
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    print("| batch | median ms/step | p90 ms/step | host argmax over the logits alone, ms | goal |")
    print("|---:|---:|---:|---:|---|")
    for b in args.batches:
        times = sorted(steady_steps(b, args))
        goal = {8: "<= 0.3", 256: "<= 1.0"}.get(b, "")
        p90 = times[int(0.9 * (len(times) - 1))]
        argmax = argmax_ms(b, args.vocab)
        print(f"| {b} | {1e3 * statistics.median(times):.3f} | {1e3 * p90:.3f} | {argmax:.3f} | {goal} |")
    if args.profile:
        for b in args.batches:
            prof = cProfile.Profile()
            steady_steps(b, args, prof)
            print(f"\n## batch {b}: cumulative time by function (top 18)")
            pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
