"""Quality cost of quantizing a mixture of experts' weights (w8a16, w4a16, fp8, w4a16_awq, w8a8_sq per expert:
quantize/experts.py) on a random Qwen3-MoE-shaped model, against its float checkpoint: PPL ratio, KLD and top-1
agreement on random token windows, and KLD and top-1 on held-out text (WikiText-2 test.txt through the demo
byte-level tokenizer). fp8, AWQ and SmoothQuant calibrate routed (each expert's statistics, and for the searches a
sample of its rows, from the tokens routed to it: calibrate.RoutedStats) on WikiText-2 valid.txt through that
tokenizer (ids < 320 of the model's 512: in a random model every id's embedding is alike), held out from both
evaluation sets; the ablation rows "(layer statistics)" make every expert fall back to its layer's statistics (and,
for the searches, its layer's routed rows), as an unrouted calibration would. SmoothQuant at --sq-alpha auto. No
real MoE is in ../shared/data, so the model is random (transformers' own init at a wider initializer_range, so that
its next-token distributions are not flat); the variant is the fake-quant reference, which the CPU engine equals to
1e-4 (tests/quantize/test_moe_quant.py; for w8a8_sq up to an int8 code flipped by summation order).

    python bench/moe_quant.py             # prints a markdown table (or --json); figures go to docs/quantization.md
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402

from toolchain.checkpoint.convert import convert  # noqa: E402
from toolchain.checkpoint.tiny import make_tiny_llama  # noqa: E402
from toolchain.quality import compare  # noqa: E402
from toolchain.quantize import calibrate  # noqa: E402
from toolchain.quantize.fake import load_quantized  # noqa: E402
from toolchain.quantize.stage import QuantizeOptions, quantize_checkpoint  # noqa: E402
from toolchain.reference.model import ReferenceModel  # noqa: E402
from toolchain.text import tokenize  # noqa: E402

CONFIGS = [
    ("w8a16", 128),
    ("w4a16", 32),
    ("w4a16", 64),
    ("w4a16", 128),
    ("fp8 (routed)", 128),
    ("fp8 (layer statistics)", 128),
    ("w4a16_awq (routed)", 128),
    ("w4a16_awq (layer statistics)", 128),
    ("w8a8_sq (routed)", 128),
    ("w8a8_sq (layer statistics)", 128),
]
GROUPED = ("w4a16", "w4a16_awq")  # the methods whose group size the table shows
CALIB = ROOT.parent / "shared" / "data" / "wikitext-2" / "valid.txt"
TEXT = ROOT.parent / "shared" / "data" / "wikitext-2" / "test.txt"  # held-out text to score on
CALIB_SAMPLES, CALIB_SEQ_LEN = 64, 128
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
        make_tiny_llama(Path(work) / "demo")  # its byte-level tokenizer, for the calibration text
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(Path(work) / "demo" / name, hf / name)
        convert(hf, ckpt)
        full = ReferenceModel.from_checkpoint(ckpt)
        text = tokenize(TEXT, hf, max_tokens=tokens.numel())
        for label, group in CONFIGS:
            method, layer_scales = label.split()[0], label.endswith("(layer statistics)")
            start = time.perf_counter()
            out = Path(work) / f"{method}-{group}-{layer_scales}"
            calib = {"calib_data": CALIB, "calib_samples": CALIB_SAMPLES, "calib_seq_len": CALIB_SEQ_LEN}
            kept = calibrate.MIN_EXPERT_TOKENS
            calibrate.MIN_EXPERT_TOKENS = 1 << 62 if layer_scales else kept  # the ablation: every expert falls back
            try:
                alpha = {"sq_alpha": "auto"} if method == "w8a8_sq" else {}
                q = quantize_checkpoint(ckpt, out, QuantizeOptions(method, group_size=group, **calib, **alpha))
            finally:
                calibrate.MIN_EXPERT_TOKENS = kept
            seconds = time.perf_counter() - start
            variant = load_quantized(out).forward
            r = compare(full.forward, variant, tokens, args.window)
            on_text = compare(full.forward, variant, text, args.window)
            routed = q.routed_calibration["linears"] if q.routed_calibration else {}
            counts = [n for info in routed.values() for n in info["tokens"]]
            rows.append({"method": label, "group": group if method in GROUPED else None, "quantize_s": seconds,
                         "expert_tokens": [min(counts), max(counts)] if counts else None,
                         "fell_back": sum(len(i["fell_back"]) for i in routed.values()) if routed else None,
                         "text_kld_mean": on_text.kld_mean, "text_same_top1": on_text.same_top1,
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
    print("| method | group | PPL ratio | mean KLD | KLD p99 | same top-1 | RMS Δp | text: mean KLD | text: same top-1 "
          "| quantize s |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['method']} | {r['group'] or '-'} | {r['ppl_ratio']:.4f} | {r['kld_mean']:.5f} | {r['kld_p99']:.4f} "
            f"| {100 * r['same_top1']:.2f} % | {100 * r['dp_rms']:.2f} % | {r['text_kld_mean']:.5f} "
            f"| {100 * r['text_same_top1']:.2f} % | {r['quantize_s']:.1f} |"
        )
    print(f"PPL(reference) = {rows[0]['ppl_reference']:.3f}")
    for r in rows:
        if r["expert_tokens"]:
            low, high = r["expert_tokens"]
            print(f"{r['method']}: routed tokens per expert {low}..{high}, {r['fell_back']} expert inputs fell back")


if __name__ == "__main__":
    main()
