"""Benchmark `trtbuild convert` (TP=1, TP=2) against a byte copy (the floor) and a transformers round trip.

One run, same model, same warm page cache: a random Llama written as several bf16 safetensors shards
(default hidden 2048, 16 layers: about 1.7 GB). Each method runs as its own process under /usr/bin/time, which
reports wall time and peak RSS. Prints a table (or --json); figures go to docs/benchmarks.md.

    python bench/convert.py                 # the default ~1.7 GB model
    python bench/convert.py --layers 4      # quicker
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from toolchain.checkpoint.safetensors_io import SafetensorsWriter, TensorInfo  # noqa: E402


def llama_tensors(hidden: int, layers: int, inter: int, vocab: int, heads: int, kv_heads: int) -> list[TensorInfo]:
    head = hidden // heads
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    shapes["lm_head.weight"] = (vocab, hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (hidden,),
                p + "post_attention_layernorm.weight": (hidden,),
                p + "self_attn.q_proj.weight": (heads * head, hidden),
                p + "self_attn.k_proj.weight": (kv_heads * head, hidden),
                p + "self_attn.v_proj.weight": (kv_heads * head, hidden),
                p + "self_attn.o_proj.weight": (hidden, heads * head),
                p + "mlp.gate_proj.weight": (inter, hidden),
                p + "mlp.up_proj.weight": (inter, hidden),
                p + "mlp.down_proj.weight": (hidden, inter),
            }
        )
    return [TensorInfo(n, torch.bfloat16, s) for n, s in shapes.items()]


def write_model(out: Path, args: argparse.Namespace) -> int:
    """Write an HF Llama dir in `args.shards` shards, tensor by tensor; returns the weight bytes."""
    out.mkdir(parents=True)
    infos = llama_tensors(args.hidden, args.layers, args.intermediate, args.vocab, args.heads, args.kv_heads)
    total = sum(i.nbytes for i in infos)
    shards: list[list[TensorInfo]] = [[] for _ in range(args.shards)]
    acc = 0
    for info in infos:  # contiguous split by bytes
        shards[min(args.shards - 1, acc * args.shards // total)].append(info)
        acc += info.nbytes
    gen = torch.Generator().manual_seed(0)
    weight_map = {}
    for k, shard in enumerate(shards):
        name = f"model-{k + 1:05d}-of-{args.shards:05d}.safetensors"
        with SafetensorsWriter(out / name, shard, {"format": "pt"}) as w:
            for info in shard:
                w.write(info.name, (torch.randn(info.shape, generator=gen) * 0.02).to(torch.bfloat16))
                weight_map[info.name] = name
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.hidden,
        "intermediate_size": args.intermediate,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "vocab_size": args.vocab,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return total


def timed(cmd: list[str]) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of one process, from GNU time."""
    res = subprocess.run(["/usr/bin/time", "-f", "%e %M", *cmd], capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{res.stderr[-2000:]}")
    wall, rss_kb = res.stderr.strip().splitlines()[-1].split()
    return float(wall), int(rss_kb) * 1024


HF_ROUND_TRIP = (
    "import sys, torch; from transformers import AutoModelForCausalLM; "
    "m = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16); "
    "m.save_pretrained(sys.argv[2], safe_serialization=True)"
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=1, help="runs per method; the median is reported")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    python = sys.executable
    trtbuild = str(Path(python).with_name("trtbuild"))
    work = Path(tempfile.mkdtemp(prefix="trtbuild-bench-"))
    try:
        src = work / "hf"
        size = write_model(src, args)
        for f in src.iterdir():  # warm the page cache so every method reads from memory
            f.read_bytes()
        methods = {
            "byte copy (floor)": lambda d: ["cp", "-r", str(src), str(d)],
            "trtbuild convert tp=1": lambda d: [trtbuild, "convert", str(src), "-o", str(d)],
            "trtbuild convert tp=2": lambda d: [trtbuild, "convert", str(src), "-o", str(d), "--tp", "2"],
        }
        if not args.skip_transformers:
            methods["transformers load+save"] = lambda d: [python, "-c", HF_ROUND_TRIP, str(src), str(d)]
        rows = []
        for name, make_cmd in methods.items():
            walls, rsss = [], []
            for r in range(args.repeat):
                dst = work / f"out-{len(rows)}-{r}"
                wall, rss = timed(make_cmd(dst))
                walls.append(wall)
                rsss.append(rss)
                shutil.rmtree(dst, ignore_errors=True)
            wall = statistics.median(walls)
            rows.append(
                {
                    "method": name,
                    "wall_s": wall,
                    "gb_per_s": size / 1e9 / max(wall, 1e-9),
                    "peak_rss_mib": max(rsss) / 2**20,
                    "rss_pct_of_model": 100 * max(rsss) / size,
                }
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)

    result = {
        "model": {
            "bytes": size,
            "params": size // 2,
            "layers": args.layers,
            "hidden": args.hidden,
            "shards": args.shards,
            "largest_tensor_bytes": args.vocab * args.hidden * 2,
        },
        "repeat": args.repeat,
        "rows": rows,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(
        f"model: {size / 1e9:.2f} GB bf16, {args.layers} layers, hidden {args.hidden}, {args.shards} shards; "
        f"largest tensor {args.vocab * args.hidden * 2 / 2**20:.0f} MiB; median of {args.repeat}"
    )
    print(f"| {'method':<24} | {'wall s':>7} | {'GB/s':>6} | {'peak RSS MiB':>12} | {'RSS % model':>11} |")
    print(f"|{'-' * 26}|{'-' * 9}:|{'-' * 8}:|{'-' * 14}:|{'-' * 13}:|")
    for row in rows:
        print(
            f"| {row['method']:<24} | {row['wall_s']:>7.2f} | {row['gb_per_s']:>6.2f} | "
            f"{row['peak_rss_mib']:>12.0f} | {row['rss_pct_of_model']:>11.1f} |"
        )
    assert math.isfinite(sum(r["wall_s"] for r in rows))


if __name__ == "__main__":
    main()
