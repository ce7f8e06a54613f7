"""Quality cost of quantizing a mixture of experts' weights (w8a16, w4a16 per expert: quantize/experts.py) on a
random Qwen3-MoE-shaped model, against its float checkpoint: PPL ratio, KLD and top-1 agreement on random token
windows. No real MoE is in ../shared/data, so the model is random (transformers' own init at a wider
initializer_range, so that its next-token distributions are not flat) and the tokens random ids; the variant is
the fake-quant reference, which the CPU engine equals to 1e-4 (tests/quantize/test_moe_quant.py).

    python bench/moe_quant.py             # prints a markdown table (or --json); figures go to docs/quantization.md
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402

from toolchain.checkpoint.convert import convert  # noqa: E402
from toolchain.quality import compare  # noqa: E402
from toolchain.quantize.fake import load_quantized  # noqa: E402
from toolchain.quantize.stage import QuantizeOptions, quantize_checkpoint  # noqa: E402
from toolchain.reference.model import ReferenceModel  # noqa: E402

CONFIGS = [("w8a16", 128), ("w4a16", 32), ("w4a16", 64), ("w4a16", 128)]
SHAPE = {  # 4 layers, all sparse: 16 experts of width 128, top 4 (renormalised), hidden 256
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "norm_topk_prob": True,
    "vocab_size": 512,
    "max_position_embeddings": 512,
    "initializer_range": 0.1,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**SHAPE)).eval()
    tokens = torch.randint(
        0, SHAPE["vocab_size"], (args.windows * args.window,), generator=torch.Generator().manual_seed(1)
    )
    rows = []
    with tempfile.TemporaryDirectory() as work, torch.no_grad():
        hf, ckpt = Path(work) / "hf", Path(work) / "ckpt"
        model.save_pretrained(hf, safe_serialization=True)
        convert(hf, ckpt)
        full = ReferenceModel.from_checkpoint(ckpt)
        for method, group in CONFIGS:
            start = time.perf_counter()
            out = Path(work) / f"{method}-{group}"
            quantize_checkpoint(ckpt, out, QuantizeOptions(method, group_size=group))
            seconds = time.perf_counter() - start
            r = compare(full.forward, load_quantized(out).forward, tokens, args.window)
            rows.append({"method": method, "group": group if method == "w4a16" else None, "quantize_s": seconds,
                         **r.to_dict()})  # fmt: skip
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(
        f"random Qwen3-MoE ({SHAPE['num_hidden_layers']} sparse layers, {SHAPE['num_experts']} experts top "
        f"{SHAPE['num_experts_per_tok']}, hidden {SHAPE['hidden_size']}, expert width "
        f"{SHAPE['moe_intermediate_size']}), {rows[0]['tokens']:,} scored tokens of random ids in "
        f"{rows[0]['windows']} windows of {args.window}"
    )
    print("| method | group | PPL ratio | mean KLD | KLD p99 | same top-1 | RMS Δp |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['method']} | {r['group'] or '-'} | {r['ppl_ratio']:.4f} | {r['kld_mean']:.5f} | {r['kld_p99']:.4f} "
            f"| {100 * r['same_top1']:.2f} % | {100 * r['dp_rms']:.2f} % |"
        )
    print(f"PPL(reference) = {rows[0]['ppl_reference']:.3f}")


if __name__ == "__main__":
    main()
