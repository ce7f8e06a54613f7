"""Benchmark `trtbuild convert` (TP=1, TP=2) against a byte copy (the floor) and a transformers round trip.

One run, same model, same warm page cache: a random Llama written as several bf16 safetensors shards
(default hidden 2048, 16 layers: about 1.7 GB). Each method runs as its own process under /usr/bin/time, which
reports wall time and peak RSS. Prints a table (or --json); figures go to docs/benchmarks.md.

    python bench/convert.py                 # the default ~1.7 GB model
    python bench/convert.py --layers 4      # quicker
    python bench/convert.py --moe           # a ~1 GB Qwen3-MoE-shaped model (issue 26: peak RSS < 25 % of it)

--moe writes a random Qwen3-MoE (per-expert tensors, as transformers saves them; default hidden 1024, 8 layers of
32 experts 512 wide, about 1.0 GB in 6 shards), tensor by tensor, so the generator holds one tensor at a time. Its
table adds the floor: the RSS of a process that only imports what convert imports (Python, numpy, ml_dtypes, the
converter: about 47 MiB; convert does not import torch), and each row's RSS above that floor as a share of the model.
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


def attention_tensors(p: str, hidden: int, heads: int, kv_heads: int) -> dict[str, tuple[int, ...]]:
    """A layer's norms and attention projections, as both bench models (Llama, Qwen3-MoE) name them."""
    head = hidden // heads
    return {
        p + "input_layernorm.weight": (hidden,),
        p + "post_attention_layernorm.weight": (hidden,),
        p + "self_attn.q_proj.weight": (heads * head, hidden),
        p + "self_attn.k_proj.weight": (kv_heads * head, hidden),
        p + "self_attn.v_proj.weight": (kv_heads * head, hidden),
        p + "self_attn.o_proj.weight": (hidden, heads * head),
    }


def llama_tensors(hidden: int, layers: int, inter: int, vocab: int, heads: int, kv_heads: int) -> list[TensorInfo]:
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    shapes["lm_head.weight"] = (vocab, hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                **attention_tensors(p, hidden, heads, kv_heads),
                p + "mlp.gate_proj.weight": (inter, hidden),
                p + "mlp.up_proj.weight": (inter, hidden),
                p + "mlp.down_proj.weight": (hidden, inter),
            }
        )
    return [TensorInfo(n, torch.bfloat16, s) for n, s in shapes.items()]


def qwen3_moe_tensors(args: argparse.Namespace) -> list[TensorInfo]:
    """A Qwen3-MoE's tensors as transformers 5.x saves them: experts one by one, q/k norms, no dense layer."""
    hidden, heads, kv_heads, head = args.hidden, args.heads, args.kv_heads, args.hidden // args.heads
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (args.vocab, hidden)}
    for i in range(args.layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                **attention_tensors(p, hidden, heads, kv_heads),
                p + "self_attn.q_norm.weight": (head,),
                p + "self_attn.k_norm.weight": (head,),
                p + "mlp.gate.weight": (args.experts, hidden),
            }
        )
        for e in range(args.experts):
            q = f"{p}mlp.experts.{e}."
            inter = args.moe_intermediate
            shapes.update(
                {
                    q + "gate_proj.weight": (inter, hidden),
                    q + "up_proj.weight": (inter, hidden),
                    q + "down_proj.weight": (hidden, inter),
                }
            )
    shapes.update({"model.norm.weight": (hidden,), "lm_head.weight": (args.vocab, hidden)})
    return [TensorInfo(n, torch.bfloat16, s) for n, s in shapes.items()]


def model_config(args: argparse.Namespace) -> dict[str, object]:
    config: dict[str, object] = {
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
    if getattr(args, "moe", False):
        config.update(
            architectures=["Qwen3MoeForCausalLM"],
            model_type="qwen3_moe",
            head_dim=args.hidden // args.heads,
            num_experts=args.experts,
            num_experts_per_tok=args.top_k,
            moe_intermediate_size=args.moe_intermediate,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    return config


def write_model(out: Path, args: argparse.Namespace) -> int:
    """Write an HF dir in `args.shards` shards, tensor by tensor; returns the weight bytes."""
    out.mkdir(parents=True)
    if getattr(args, "moe", False):  # tests/checkpoint/test_memory.py passes the Llama's fields only
        infos = qwen3_moe_tensors(args)
    else:
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
    config = model_config(args)
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


FLOOR = "imports only (RSS floor)"
IMPORTS_ONLY = "import toolchain.cli, toolchain.checkpoint.convert, toolchain.checkpoint.qwen3_moe"


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
    ap.add_argument("--moe", action="store_true", help="a Qwen3-MoE-shaped model (defaults below apply)")
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--moe-intermediate", type=int, default=512)
    args = ap.parse_args()
    if args.moe:  # the MoE model's own defaults where the Llama's were left as they are
        for name, llama, moe in (("hidden", 2048, 1024), ("layers", 16, 8), ("shards", 4, 6)):
            if getattr(args, name) == llama:
                setattr(args, name, moe)
        args.skip_transformers = True  # transformers has no streaming load: its row measures something else

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
        if args.moe:  # MoE layers are not split over ranks yet (refused); the process's own floor instead
            del methods["trtbuild convert tp=2"]
            methods[FLOOR] = lambda d: [python, "-c", IMPORTS_ONLY]
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

    floor = next((r["peak_rss_mib"] for r in rows if r["method"] == FLOOR), None)
    for row in rows:
        if floor is not None and row["method"].startswith("trtbuild"):
            row["rss_above_floor_pct"] = 100 * (row["peak_rss_mib"] - floor) * 2**20 / size
    # the largest tensor convert holds: the embedding, or (MoE) a layer's stacked [E, 2I, H] fc
    largest = max(args.vocab * args.hidden * 2, args.experts * 2 * args.moe_intermediate * args.hidden * 2 * args.moe)
    result = {
        "model": {
            "bytes": size,
            "params": size // 2,
            "layers": args.layers,
            "hidden": args.hidden,
            "shards": args.shards,
            "largest_tensor_bytes": largest,
            "architecture": "Qwen3MoeForCausalLM" if args.moe else "LlamaForCausalLM",
        },
        "repeat": args.repeat,
        "rows": rows,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(
        f"model: {size / 1e9:.2f} GB bf16 {result['model']['architecture']}, {args.layers} layers, hidden "
        f"{args.hidden}, {args.shards} shards"
        + (f", {args.experts} experts x {args.moe_intermediate}" if args.moe else "")
        + f"; largest tensor {largest / 2**20:.0f} MiB; median of {args.repeat}"
    )
    extra = floor is not None
    print(
        f"| {'method':<24} | {'wall s':>7} | {'GB/s':>6} | {'peak RSS MiB':>12} | {'RSS % model':>11} |"
        + (f" {'above floor % model':>19} |" if extra else "")
    )
    print(f"|{'-' * 26}|{'-' * 9}:|{'-' * 8}:|{'-' * 14}:|{'-' * 13}:|" + (f"{'-' * 21}:|" if extra else ""))
    for row in rows:
        print(
            f"| {row['method']:<24} | {row['wall_s']:>7.2f} | {row['gb_per_s']:>6.2f} | "
            f"{row['peak_rss_mib']:>12.0f} | {row['rss_pct_of_model']:>11.1f} |"
            + (f" {row.get('rss_above_floor_pct', math.nan):>19.1f} |" if extra else "")
        )
    assert math.isfinite(sum(r["wall_s"] for r in rows))


if __name__ == "__main__":
    main()
