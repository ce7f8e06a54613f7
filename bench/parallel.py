"""Tensor parallelism on the CPU engine, measured and projected (issue 27).

    python bench/parallel.py                  # bench/engine.py's random Llama (hidden 512, 8 layers), float32
    python bench/parallel.py --json

Measured: the same model built at TP=1 and TP=2; a prefill of --batch sequences of --prompt tokens, then --steps
decode steps, --repeat times (medians). TP=2 runs twice: as real processes (open_engine: rank 1 spawned, gloo
over loopback TCP; rank 0's GlooComm stats, the step broadcast included), and with its ranks as threads of this
process with ThreadComm
(toolchain/engine/collectives.py), each rank's ONNX Runtime on one thread: a rank's collective time is what its
Communicator.stats() recorded, which includes waiting at the barrier for the slower rank (the skew a real
all-reduce waits for too) but no network. Compute = step - collectives. Bytes: what each collective's input
held on one rank per token (recorded) against the formula (analytic): AllReduce hidden * 4 B per token per call,
2 L + 1 calls (the embedding, attention.dense and mlp.proj of every layer); AllGather vocab / tp * 4 B per output
row (the logits).

Projected: per-step collective time of Llama-3-8B and -70B in bf16 at TP 2 / 4 / 8, ring algorithms (all-reduce
moves 2 (n-1)/n of the tensor per rank, all-gather (n-1)/n of the gathered tensor), over NVLink 4 (450 GB/s per
direction) and PCIe 5 x16 (64 GB/s per direction), plus --latency-us per collective (a stated assumption: NCCL's
small-message all-reduce inside a node takes several microseconds; at decode sizes this term dominates).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from engine import random_llama  # noqa: E402  bench/engine.py: the model is defined once

from toolchain.checkpoint.convert import convert  # noqa: E402
from toolchain.engine.api import Engine, EngineSpec, open_engine  # noqa: E402
from toolchain.engine.build import BuildOptions, build_engine  # noqa: E402
from toolchain.engine.collectives import Communicator, ThreadWorld  # noqa: E402
from toolchain.engine.contract import Batch  # noqa: E402
from toolchain.engine.ort_backend import OrtEngine  # noqa: E402
from toolchain.parallel.engine import DistributedEngine  # noqa: E402

LINKS = {"NVLink 4": 450e9, "PCIe 5 x16": 64e9}  # bytes/s per direction
MODELS = {"Llama-3-8B": (4096, 32, 128256), "Llama-3-70B": (8192, 80, 128256)}  # hidden, layers, vocab
BF16 = 2


def _seconds(comm: Communicator | None) -> float:
    return sum(s.seconds for s in comm.stats().values()) if comm is not None else 0.0


def _bytes(comm: Communicator | None) -> dict[str, int]:
    return {op: s.bytes for op, s in comm.stats().items()} if comm is not None else {}


def run(engine: Engine, comm: Communicator | None, args: argparse.Namespace) -> dict[str, Any]:
    """One rank's repeats: prefill seconds, per decode step seconds and its collectives' share, bytes per op."""
    b, per_seq = args.batch, -(-(args.prompt + args.steps) // engine.tokens_per_block)
    tables = [list(range(s * per_seq, (s + 1) * per_seq)) for s in range(b)]
    ids = torch.randint(0, engine.vocab_size, (b, args.prompt), generator=torch.Generator().manual_seed(0)).tolist()
    prefill, steps, colls = [], [], []
    decode_bytes: dict[str, int] = {}
    for _ in range(args.repeat):
        pool = engine.new_kv_cache(b * per_seq)
        start = time.perf_counter()
        engine.forward(Batch.from_sequences(ids, [0] * b, tables), pool)
        prefill.append(time.perf_counter() - start)
        before = _bytes(comm)
        for step in range(args.steps):
            c0, t0 = _seconds(comm), time.perf_counter()
            engine.forward(Batch.from_sequences([[1]] * b, [args.prompt + step] * b, tables), pool)
            steps.append(time.perf_counter() - t0)
            colls.append(_seconds(comm) - c0)
        decode_bytes = {op: n - before.get(op, 0) for op, n in _bytes(comm).items()}
    calls = {op: s.calls for op, s in comm.stats().items()} if comm is not None else {}
    return {
        "prefill_s": statistics.median(prefill),
        "step_s": statistics.median(steps),
        "collective_s": statistics.median(colls),
        "decode_bytes_per_token": {op: n / (args.steps * b) for op, n in decode_bytes.items()},
        "calls": calls,
    }


def measure(work: Path, args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    hf = random_llama(work / "hf", args.hidden, args.layers)
    opts = BuildOptions(backend="onnxruntime", max_batch_size=64)
    specs = {}
    for tp in (1, 2):
        convert(hf, work / f"ckpt{tp}", dtype="float32", tp=tp)
        build_engine(work / f"ckpt{tp}", work / f"engine{tp}", opts)
        specs[tp] = EngineSpec.from_dir(work / f"engine{tp}")
    rows = []
    for threads in (1, 2):
        r = run(OrtEngine(specs[1], threads=threads), None, args)
        rows.append({"config": f"TP=1, {threads} ORT thread(s)", **r})
    world = ThreadWorld(2, timeout_s=60)
    results: list[Any] = [None, None]

    def rank(r: int) -> None:
        comm = world.comm(r)
        results[r] = run(OrtEngine(specs[2].for_rank(r), threads=1, comm=comm), comm, args)

    threads_ = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads_:
        t.start()
    for t in threads_:
        t.join()
    for i, res in enumerate(results):
        rows.append({"config": f"TP=2 rank {i} (thread, 1 ORT thread)", **res})
    # the same engine as `trtbuild generate` runs it: rank 1 a spawned process, collectives over gloo (loopback TCP);
    # rank 0's GlooComm records its collectives, the step broadcast to rank 1 included
    os.environ.setdefault("TRTBUILD_ORT_THREADS", "1")
    engine = open_engine(work / "engine2")
    assert isinstance(engine, DistributedEngine)
    try:
        rows.append({"config": "TP=2 rank 0 (processes, gloo, 1 ORT thread each)", **run(engine, engine.comm, args)})
    finally:
        engine.close()
    cfg = specs[1]
    shape = {"hidden": args.hidden, "layers": args.layers, "vocab": cfg.vocab_size}
    return rows, shape


def analytic_bytes(hidden: int, layers: int, vocab: int, tp: int, dtype_bytes: int) -> dict[str, float]:
    """Per token, one rank's collective inputs: 2 L + 1 all-reduces of hidden, one all-gather of vocab / tp."""
    return {"AllReduce": (2 * layers + 1) * hidden * dtype_bytes, "AllGather": -(-vocab // tp) * dtype_bytes}


def projection(phase: str, tokens: int, outputs: int, latency_s: float) -> list[dict[str, Any]]:
    """Per-step collective time of a forward over `tokens` tokens with `outputs` logits rows (decode: both the
    batch; prefill of one sequence: its prompt and one row, as the engine picks the last token's)."""
    rows = []
    for name, (hidden, layers, vocab) in MODELS.items():
        for tp in (2, 4, 8):
            reduce_bytes = tokens * hidden * BF16  # one all-reduce's tensor
            gather_bytes = outputs * vocab * BF16  # the gathered logits
            n_reduce = 2 * layers + 1
            for link, bw in LINKS.items():
                wire = n_reduce * 2 * (tp - 1) / tp * reduce_bytes + (tp - 1) / tp * gather_bytes
                rows.append({
                    "model": name, "phase": phase, "tp": tp, "link": link, "collectives": n_reduce + 1,
                    "bytes_per_rank": wire, "bandwidth_s": wire / bw, "latency_s": (n_reduce + 1) * latency_s,
                })  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--latency-us", type=float, default=10.0, help="assumed fixed cost of one collective")
    ap.add_argument("--prefill-tokens", type=int, default=2048)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as work:
        rows, shape = measure(Path(work), args)
    load_after = os.getloadavg()
    analytic = analytic_bytes(shape["hidden"], shape["layers"], shape["vocab"], 2, 4)
    latency = args.latency_us * 1e-6
    proj = projection("decode, batch 1", 1, 1, latency) + projection("decode, batch 64", 64, 64, latency)
    proj += projection(f"prefill, {args.prefill_tokens} tokens", args.prefill_tokens, 1, latency)
    result: dict[str, Any] = {"shape": shape, "args": vars(args), "load": [load_before, load_after]}
    result["cores"] = os.cpu_count()
    result |= {"rows": rows, "analytic_bytes_per_token": analytic, "projection": proj}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(
        f"measured: random Llama hidden {shape['hidden']}, {shape['layers']} layers, vocab {shape['vocab']}, float32; "
        f"batch {args.batch}, prompt {args.prompt}, {args.steps} decode steps, median of {args.repeat}; TP=2 as "
        "processes (gloo over loopback) and as threads of one process (ThreadComm, no network); "
        f"load average {load_before[0]:.2f} before, "
        f"{load_after[0]:.2f} after, on {os.cpu_count()} cores"
    )
    print("| config | prefill ms | decode step ms | of which collectives ms | compute ms |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        step, coll = r["step_s"] * 1e3, r["collective_s"] * 1e3
        print(f"| {r['config']} | {r['prefill_s'] * 1e3:.1f} | {step:.2f} | {coll:.2f} | {step - coll:.2f} |")
    print("\nbytes one rank's collectives take in per decoded token (TP=2, float32):")
    print("| op | recorded B/token | analytic B/token | calls per step |")
    print("|---|---:|---:|---:|")
    rank0 = rows[2]
    for op, want in analytic.items():
        got = rank0["decode_bytes_per_token"].get(op, 0.0)
        per_step = rank0["calls"].get(op, 0) / (args.repeat * (args.steps + 1))
        print(f"| {op} | {got:,.0f} | {want:,.0f} | {per_step:g} |")
    print(
        f"\nprojected per-step collective time, bf16, ring all-reduce 2(n-1)/n and all-gather (n-1)/n of the bytes "
        f"per rank, link bandwidth per direction, {args.latency_us:g} us per collective (assumed):"
    )
    print("| model | step | TP | link | collectives | MB per rank | bandwidth us | latency us | total us |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|")
    for p in proj:
        bw_us, lat_us = p["bandwidth_s"] * 1e6, p["latency_s"] * 1e6
        print(
            f"| {p['model']} | {p['phase']} | {p['tp']} | {p['link']} | {p['collectives']} | "
            f"{p['bytes_per_rank'] / 1e6:.2f} | {bw_us:,.1f} | {lat_us:,.0f} | {bw_us + lat_us:,.0f} |"
        )


if __name__ == "__main__":
    main()
