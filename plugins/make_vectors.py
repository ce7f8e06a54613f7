"""Write the plugin test vectors (tests/vectors/*.npz) from the reference ops (toolchain/engine/ops.py).

Each case: a pool already holding some sequences' cached tokens, then one mixed call (prefill chunks and decode
steps, shuffled non-contiguous blocks, partial last blocks) through KVCacheWrite and PagedAttention. Inputs are
stored in the kernels' own formats (fp16 / bf16 as uint16 bits, the pool in its storage type), the expected
outputs in float32 (q, attention output) and storage bits (the pool after the write). The reference runs in
float32 on inputs that are exactly representable in the activation dtype.

    python plugins/make_vectors.py          # rewrites tests/vectors/
    python plugins/make_vectors.py NAME...  # rewrites only those cases (npz files carry their write time)
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from toolchain.engine.ops import OMITTED_AT, AttentionAttrs, kv_cache_write, paged_attention  # noqa: E402

OUT = ROOT / "tests" / "vectors"
ACT = {"f16": torch.float16, "bf16": torch.bfloat16}
POOL = {"f16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.uint8, "int8": torch.int8}

# name: (activation, kv cache, heads, kv_heads, head_size, tokens_per_block, new_lens, context_lens, extra attrs)
CASES: dict[str, tuple[str, str, int, int, int, int, list[int], list[int], dict[str, Any]]] = {
    "f16-hd64-gqa4-mixed": ("f16", "f16", 8, 2, 64, 16, [5, 1, 1, 7], [0, 20, 33, 9], {}),
    "bf16-hd128-gqa4-tpb32": ("bf16", "bf16", 8, 2, 128, 32, [9, 1, 1], [0, 40, 70], {}),
    "f16-fp8kv-hd128-gqa8": ("f16", "fp8", 8, 1, 128, 16, [3, 1, 1], [5, 30, 17], {}),
    "bf16-int8kv-hd64-mha-tpb64": ("bf16", "int8", 4, 4, 64, 64, [6, 1], [0, 100], {}),
    "f16-hd8-generic-stories": ("f16", "f16", 8, 4, 8, 16, [12, 1, 1], [0, 15, 3], {}),
    "bf16-hd24-generic-window": ("bf16", "bf16", 4, 2, 24, 16, [8, 1, 2], [3, 25, 12], {"sliding_window": 6}),
    "f16-hd128-gqa16-llama3": (
        "f16",
        "f16",
        16,
        1,
        128,
        16,
        [4, 1],
        [0, 50],
        {
            "rotary_base": 500000.0,
            "rotary_scaling_type": "llama3",
            "rotary_scaling_factor": 8.0,
            "rotary_original_max_positions": 16,
        },
    ),
    "f16-int8kv-hd64-linear-window": (
        "f16",
        "int8",
        8,
        2,
        64,
        16,
        [6, 1, 1],
        [0, 33, 21],
        {"rotary_scaling_type": "linear", "rotary_scaling_factor": 4.0, "sliding_window": 10},
    ),
    "f16-hd64-no-rotary": ("f16", "f16", 4, 4, 64, 16, [7, 1], [0, 12], {"rotary_style": "none"}),
    "bf16-hd128-gqa4-qscaling": ("bf16", "bf16", 8, 2, 128, 16, [6, 1, 1], [0, 27, 40], {"q_scaling": 1.7}),
}


def bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint16 if t.dtype in (torch.float16, torch.bfloat16) else t.dtype).numpy()


def make_case(name: str, seed: int) -> dict[str, np.ndarray]:
    act, kv, heads, kv_heads, head_size, tpb, new_lens, ctx, extra = CASES[name]
    gen = torch.Generator().manual_seed(seed)
    width = (heads + 2 * kv_heads) * head_size
    kv_dtype = {"f16": "float16", "bf16": "bfloat16"}.get(kv, kv)
    attrs = AttentionAttrs(
        layer=1,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_size=head_size,
        tokens_per_block=tpb,
        kv_cache_dtype=kv_dtype,
        **extra,
    )
    totals = [c + n for c, n in zip(ctx, new_lens, strict=True)]
    per_seq = [-(-t // tpb) for t in totals]
    num_blocks = sum(per_seq) + 3  # a few blocks no sequence owns: must stay untouched
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = np.zeros((len(totals), max(per_seq) + 1), dtype=np.int32)  # one spare column, never read
    at = 0
    for s, n in enumerate(per_seq):
        tables[s, :n] = order[at : at + n]
        at += n

    def rand_qkv(n: int) -> torch.Tensor:
        return (torch.randn(n, width, generator=gen) * 1.5).to(ACT[act]).float()

    history = [rand_qkv(c) for c in ctx]
    new = rand_qkv(sum(new_lens))
    if kv in ("fp8", "int8"):  # one scale per layer from the largest |k|, |v| (k before rotary: close enough)
        amax = max(float(torch.cat([*history, new]).abs().max()), 1e-6)
        attrs = replace(attrs, kv_scale=amax / (448.0 if kv == "fp8" else 127.0))
    pool = torch.zeros((2, num_blocks, 2, kv_heads, tpb, head_size), dtype=POOL[kv])
    for s, (c, h) in enumerate(zip(ctx, history, strict=True)):  # fill each sequence's cached prefix
        if c:
            one = torch.tensor([c], dtype=torch.int32)
            kv_cache_write(
                attrs,
                h,
                torch.arange(c, dtype=torch.int32),
                torch.zeros(1, dtype=torch.int32),
                one,
                torch.from_numpy(tables[s : s + 1]),
                pool,
            )
    kv_in = pool.clone()
    positions = torch.cat([torch.arange(c, c + n, dtype=torch.int32) for c, n in zip(ctx, new_lens, strict=True)])
    args = (
        positions,
        torch.tensor(ctx, dtype=torch.int32),
        torch.tensor(new_lens, dtype=torch.int32),
        torch.from_numpy(tables),
    )
    q = kv_cache_write(attrs, new, *args, pool)
    out = paged_attention(attrs, q, *args, pool)
    # fields at their OMITTED_AT value stay out, as in graphs: the vectors made before those fields keep their bytes
    meta = {k: v for k, v in asdict(attrs).items() if not (k in OMITTED_AT and v == OMITTED_AT[k])}
    return {
        "attrs": np.array(json.dumps({**meta, "activation": act, "kv": kv})),
        "qkv": bits(new.to(ACT[act])),
        "position_ids": positions.numpy(),
        "context_lens": np.array(ctx, dtype=np.int32),
        "new_lens": np.array(new_lens, dtype=np.int32),
        "block_tables": tables,
        "kv_in": bits(kv_in),
        "q_ref": q.numpy(),
        "kv_ref": bits(pool),
        "out_ref": out.numpy(),
    }


def main(names: list[str]) -> None:
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        sys.exit(f"make_vectors.py: unknown case(s) {', '.join(unknown)}; choose from {', '.join(CASES)}")
    OUT.mkdir(parents=True, exist_ok=True)
    for seed, name in enumerate(CASES):  # a case's seed is its place in CASES: add new cases at the end
        if names and name not in names:
            continue
        np.savez_compressed(OUT / f"{name}.npz", **make_case(name, seed))
        print(f"wrote {OUT / name}.npz")


if __name__ == "__main__":
    main(sys.argv[1:])
