"""Which per-layer KV cache scale costs the least, measured offline on stories260K: the float model with only its
KV cache fake-quantized (INT8 or FP8), one scale per layer for k and v together (the layout TensorRT-LLM's engine
reads) or one each, from several calibration statistics. Calibrated on WikiText-2 valid.txt (64 x 256 tokens, seed
0), scored on held-out raw test text. Figures: docs/quality.md, "KV cache calibration".

python bench/kv_calibration.py --eval-tokens 30000
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from toolchain.checkpoint.convert import convert  # noqa: E402
from toolchain.checkpoint.trtllm import load_rank, read_config  # noqa: E402
from toolchain.quality import compare  # noqa: E402
from toolchain.quantize.calibrate import KV_CLIP, sample_windows  # noqa: E402
from toolchain.quantize.core import fake_quant  # noqa: E402
from toolchain.quantize.methods.registry import kv_by_algo  # noqa: E402
from toolchain.reference.model import Hooks, ReferenceModel  # noqa: E402
from toolchain.reference.rope import apply_rotary  # noqa: E402
from toolchain.text import tokenize  # noqa: E402

DATA = ROOT.parent / "shared" / "data"
SEARCH_WINDOWS = 16  # calibration windows the attention-output search runs on


class Recorder(Hooks):
    def __init__(self) -> None:
        self.k: dict[str, list[torch.Tensor]] = {}
        self.v: dict[str, list[torch.Tensor]] = {}

    def kv_cache(self, layer: str, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k.setdefault(layer, []).append(k.clone())
        self.v.setdefault(layer, []).append(v.clone())
        return k, v


class KvQuant(Hooks):
    def __init__(self, k_scales: dict[str, float], v_scales: dict[str, float], kind: str) -> None:
        self.k_scales, self.v_scales, self.kind = k_scales, v_scales, kind

    def kv_cache(self, layer: str, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return fake_quant(k, self.k_scales[layer], self.kind), fake_quant(v, self.v_scales[layer], self.kind)


def record(model: ReferenceModel, windows: torch.Tensor) -> tuple[dict, dict, dict]:
    """k, v (as the cache stores them) and q (after rotary) per layer; q by recomputing it from qkv's weight."""
    rec, queries = Recorder(), {}
    original = model._attention
    c = model.config

    def attention(x: torch.Tensor, layer: str, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        b, t, _ = x.shape
        q = (x @ model.w[f"{layer}.attention.qkv.weight"].T)[..., : c.num_attention_heads * c.head_size]
        q = q.view(b, t, c.num_attention_heads, c.head_size).transpose(1, 2)
        queries.setdefault(layer, []).append(apply_rotary(q, *rope) if rope else q)
        return original(x, layer, rope)

    model.hooks, model._attention = rec, attention  # type: ignore[method-assign]
    for start in range(0, windows.shape[0], 8):
        model.forward(windows[start : start + 8])
    model.hooks, model._attention = Hooks(), original  # type: ignore[method-assign]
    cat = lambda d: {n: torch.cat(ts) for n, ts in d.items()}  # noqa: E731
    return cat(queries), cat(rec.k), cat(rec.v)


def maxbound(kind: str) -> float:
    """The KV cache quantization's largest code (INT8: 127, FP8: 448), from the registry."""
    kv = kv_by_algo(kind)
    assert kv is not None, kind
    return kv.maxbound


def attention_error(c, q, k, v, ks, vs, kind) -> float:  # type: ignore[no-untyped-def]
    group = c.num_attention_heads // c.num_key_value_heads
    mask = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).tril()

    def attend(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = (q @ k.transpose(-1, -2)) / c.head_size**0.5
        return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v

    return (attend(fake_quant(k, ks, kind), fake_quant(v, vs, kind)) - attend(k, v)).pow(2).sum().item()


def statistics(c, q, k, v, kind) -> dict[str, Callable[[str], tuple[float, float]]]:  # type: ignore[no-untyped-def]
    """name -> layer -> (k amax, v amax) the scales are made of (amax / maxbound)."""
    top = maxbound(kind)
    amax = lambda t: t.abs().max().item()  # noqa: E731
    pct = lambda t, p: torch.quantile(t.abs().flatten()[::4], p).item()  # noqa: E731

    def mse(t: torch.Tensor, peak: float) -> float:
        errors = {r: (fake_quant(t, peak * r / top, kind) - t).pow(2).sum().item() for r in KV_CLIP}
        return peak * min(errors, key=lambda r: errors[r])

    ratios = [1 - i * 0.05 for i in range(10)] + [1.1, 1.25]

    def attention_search(layer: str, separate: bool) -> tuple[float, float]:
        w = slice(0, SEARCH_WINDOWS)
        lq, lk, lv = q[layer][w], k[layer][w], v[layer][w]
        ak, av = amax(lk), amax(lv)
        pairs = (
            [(a * ak, b * av) for a in ratios for b in ratios]
            if separate
            else [(r * max(ak, av), r * max(ak, av)) for r in ratios]
        )
        return min(pairs, key=lambda p: attention_error(c, lq, lk, lv, p[0] / top, p[1] / top, kind))

    joint = lambda f: lambda n: (max(f(k[n]), f(v[n])),) * 2  # noqa: E731
    return {
        "max, one scale (trtbuild before; TensorRT-LLM's layout)": joint(amax),
        "max, k and v apart": lambda n: (amax(k[n]), amax(v[n])),
        "p99.9 of abs k, abs v, one scale": joint(lambda t: pct(t, 0.999)),
        "p99.99 of abs k, abs v, one scale": joint(lambda t: pct(t, 0.9999)),
        "clip search on k, v values, one scale": lambda n: (
            (mse(torch.cat([k[n].flatten(), v[n].flatten()]), max(amax(k[n]), amax(v[n]))),) * 2
        ),
        "clip search on k, v values, apart": lambda n: (mse(k[n], amax(k[n])), mse(v[n], amax(v[n]))),
        "attention-output search, one scale": lambda n: attention_search(n, False),
        "attention-output search, apart": lambda n: attention_search(n, True),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DATA / "models" / "stories260K-hf")
    ap.add_argument("--calib-data", type=Path, default=DATA / "wikitext-2" / "valid.txt")
    ap.add_argument("--eval-data", type=Path, default=DATA / "wikitext-2" / "wiki.test.raw")
    ap.add_argument("--eval-tokens", type=int, default=30_000)
    ap.add_argument("--calib-samples", type=int, default=64)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as work:
        ckpt = Path(work) / "ckpt"
        convert(args.model, ckpt)
        cfg, weights = read_config(ckpt), load_rank(ckpt, 0)
        model = ReferenceModel(cfg, weights)
        windows = sample_windows(tokenize(args.calib_data, ckpt), args.calib_samples, 256, 0)
        q, k, v = record(model, windows)
        tokens = tokenize(args.eval_data, ckpt, max_tokens=args.eval_tokens)
    print("| KV cache | statistic | PPL ratio | mean KLD | same top-1 |\n|---|---|---:|---:|---:|")
    for kind in ("INT8", "FP8"):
        for name, stat in statistics(cfg, q, k, v, kind).items():
            peaks = {layer: stat(layer) for layer in k}
            top = maxbound(kind)
            quantized = ReferenceModel(cfg, weights)
            quantized.hooks = KvQuant(
                {n: p[0] / top for n, p in peaks.items()}, {n: p[1] / top for n, p in peaks.items()}, kind
            )
            r = compare(model.forward, quantized.forward, tokens, 256)
            print(f"| {kind} | {name} | {r.ppl_ratio:.4f} | {r.kld_mean:.5f} | {100 * r.same_top1:.2f} % |", flush=True)


if __name__ == "__main__":
    main()
