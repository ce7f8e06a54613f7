"""The Triton PagedAttention kernel, run by Triton's interpreter, against the reference op on the same inputs.

Every variant the plugin serves (activation fp32 / fp16 / bf16; pool of the activation's floats, int8, fp8; head
sizes 8 to 256; 16 / 32 / 64 tokens per block; GQA 1 to 20; a sliding window; q_scaling) on one batch that mixes a
prefill chunk after a cached prefix, a prefill from position 0 and decode steps, with shuffled block tables and
part-full last blocks. Every pool slot no sequence owns holds NaN (float pools, fp8's 0x7f) or an extreme int8
code, so a read past a mask shows; the truth is the reference op in float64. Every case runs again with attention
sinks (gpt-oss): moderate logits, one that dominates every score and one too negative to matter.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import pytest
import torch

from toolchain import seeded
from toolchain.engine.geometry import blocks_for
from toolchain.engine.ops import AttentionAttrs, kv_cache_write
from toolchain.engine.ops import paged_attention as reference
from toolchain.plugins.kernels import attention

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
POOLS = {**DTYPES, "int8": torch.int8, "fp8": torch.uint8}
SCALES = {"int8": 0.03, "fp8": 0.015}  # values (|x| < 3.47) to int8 codes within 116, fp8 within 231 (max 448)
UNIT = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}  # unit roundoff
LAYERS, LAYER = 2, 1  # layer 0 of the pool is all NaN / extreme codes: reading the wrong layer shows


class Case(NamedTuple):
    activation: str
    pool: str
    head_size: int
    tokens_per_block: int
    heads: int
    kv_heads: int
    window: bool
    q_scaling: float = 1.0


# Not the cross product: every value of every axis appears, each kernel path (float / int8 / fp8 decode, fp32 and
# activation-type products, GQA padding, a group split over programs, the window's first block) at least once.
CASES = [
    Case("float32", "float32", 8, 16, 2, 2, False),
    Case("float32", "int8", 24, 32, 4, 2, True),
    Case("float32", "fp8", 64, 64, 8, 2, False, q_scaling=1.5),
    Case("float16", "float16", 64, 16, 8, 1, True),
    Case("float16", "int8", 8, 64, 2, 2, False),
    Case("float16", "fp8", 24, 32, 8, 2, True),
    Case("float16", "float16", 128, 64, 6, 2, True),  # GQA 3: a group that is no power of two
    Case("bfloat16", "fp8", 256, 32, 4, 2, True),  # head size 256: two steps of 16 keys a block
    Case("bfloat16", "bfloat16", 24, 64, 4, 2, False, q_scaling=0.7),
    Case("bfloat16", "int8", 64, 16, 8, 1, True),
    Case("bfloat16", "fp8", 8, 32, 2, 2, True),
    Case("bfloat16", "bfloat16", 8, 16, 16, 1, False),  # GQA 16: the largest group one program takes
    Case("float16", "fp8", 8, 16, 20, 1, True),  # GQA 20: split over two programs, the second part-full
]


# (cached tokens, new tokens) per sequence, in tokens_per_block units where the block edges matter: a decode
# whose last block is exactly full, a prefill chunk after a cached prefix crossing into a part-full block, a
# decode in the first block, a prefill from position 0.
def mixed_batch(tpb: int) -> list[tuple[int, int]]:
    return [(2 * tpb - 1, 1), (tpb + 2, 3), (5, 1), (0, 4)]


class Inputs(NamedTuple):
    attrs: AttentionAttrs
    q: torch.Tensor
    position_ids: torch.Tensor
    context_lens: torch.Tensor
    new_lens: torch.Tensor
    block_tables: torch.Tensor
    kv_cache: torch.Tensor
    sinks: torch.Tensor | None = None


def stale(pool: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """What an unowned slot holds: NaN where the storage has one, else int8's extreme codes."""
    if pool == "int8":
        return torch.where(seeded.integers(0, 2, shape, gen) == 1, 127, -128).to(torch.int8)
    if pool == "fp8":
        return torch.full(shape, 0x7F, dtype=torch.uint8)
    return torch.full(shape, float("nan"), dtype=POOLS[pool])


# sink logits: one far above every score (|scores| here stay under ~15), one whose exp underflows to 0
DOMINANT, NEGLIGIBLE = 30.0, -1e4


def make_inputs(c: Case, batch: list[tuple[int, int]], seed: int, sinks: bool = False) -> Inputs:
    """A pool written by the reference KVCacheWrite with every sequence's tokens 0..total-1 (the cached prefix and
    this step's tokens: the write precedes attention in a layer), on shuffled blocks; the step's queries. With
    `sinks`, float32 sink logits per head: 2 N(0, 1) (of the scores' order), head 0's DOMINANT, the last one's
    NEGLIGIBLE."""
    gen = seeded.generator(seed)
    dtype, tpb, d = DTYPES[c.activation], c.tokens_per_block, c.head_size
    a = AttentionAttrs(
        layer=LAYER, num_heads=c.heads, num_kv_heads=c.kv_heads, head_size=d, tokens_per_block=tpb,
        rotary_style="none", sliding_window=tpb // 2 + 3 if c.window else 0, kv_cache_dtype=c.pool,
        kv_scale=SCALES.get(c.pool, 1.0), q_scaling=c.q_scaling, sinks=int(sinks),
    )  # fmt: skip
    owned = [blocks_for(ctx + n, tpb) for ctx, n in batch]
    num_blocks, max_blocks = sum(owned) + 3, max(owned) + 1
    order = torch.randperm(num_blocks, generator=gen)
    spare = order[sum(owned) :]
    tables = spare[seeded.integers(0, len(spare), (len(batch), max_blocks), gen)]  # unused entries: unowned blocks
    at = 0
    for s, k in enumerate(owned):
        tables[s, :k] = order[at : at + k]
        at += k
    tables = tables.int()
    shape = (LAYERS, num_blocks, 2, c.kv_heads, tpb, d)
    kv_cache = stale(c.pool, shape, gen)
    totals = torch.tensor([ctx + n for ctx, n in batch], dtype=torch.int32)
    every = torch.cat([torch.arange(int(n), dtype=torch.int32) for n in totals])
    qkv = seeded.normal((len(every), (c.heads + 2 * c.kv_heads) * d), gen, dtype=dtype)
    kv_cache_write(a, qkv, every, torch.zeros_like(totals), totals, tables, kv_cache)
    positions = torch.cat([torch.arange(ctx, ctx + n, dtype=torch.int32) for ctx, n in batch])
    q = seeded.normal((len(positions), c.heads * d), gen, dtype=dtype)
    contexts = torch.tensor([ctx for ctx, _ in batch], dtype=torch.int32)
    news = torch.tensor([n for _, n in batch], dtype=torch.int32)
    logits = None
    if sinks:
        logits = 2 * seeded.normal((c.heads,), gen, dtype=torch.float32)
        logits[0], logits[-1] = DOMINANT, NEGLIGIBLE
    return Inputs(a, q, positions, contexts, news, tables, kv_cache, logits)


def truth(x: Inputs) -> torch.Tensor:
    """The reference op in float64: float pools upcast (NaN stays NaN), int8 / fp8 codes as they are."""
    pool = x.kv_cache.double() if x.attrs.kv_cache_dtype in DTYPES else x.kv_cache
    return reference(x.attrs, x.q.double(), x.position_ids, x.context_lens, x.new_lens, x.block_tables, pool, x.sinks)


def tolerance(x: Inputs) -> float:
    """The kernel's error bound against the float64 truth. The output is a weighted mean of V rows: relative
    errors e in its weights move it by at most 2 e max|V|. Weight errors: a score q.k (fp32 products of exact
    operands, |q.k| * scale <= A = max|q| max|k| * scale by Cauchy-Schwarz) is off by at most (d + 8) u32 (A + 1);
    the accumulation over n keys and the exp2 / rescaling add (n + 8) u32; on a GPU p is rounded to the
    activation's type before the PV product (u_p: its unit roundoff; with fp32 products, attention.dot_fp32:
    u_p = u32). With sinks, a sink logit s is one more score, exact but for its fp32 product with log2(e) (its
    weight off by u32 (|s| + 1)); the sink takes at most the share exp(s + A) of the weights (every score >= -A),
    so a logit far below the scores (NEGLIGIBLE) costs nothing.
    Then one rounding of the output to the activation's type: u_act max|V| (|out| <= max|V|)."""
    a, dtype = x.attrs, x.q.dtype
    u32, u_act = UNIT[torch.float32], UNIT[dtype]
    u_p = u32 if attention.dot_fp32(str(dtype).removeprefix("torch.")) else u_act
    rows = pool_values(x).reshape(-1, a.head_size)
    rows = rows[~rows.isnan().any(1)]  # the slots some sequence owns (stale ones are NaN or extreme codes)
    k_norm = rows.norm(dim=1).max().item()
    q_norm = x.q.double().reshape(-1, a.head_size).norm(dim=1).max().item()
    big = q_norm * k_norm / (a.head_size**0.5 * a.q_scaling)
    n = int(x.position_ids.max()) + 1
    weights = (a.head_size + 8) * u32 * (big + 1) + (n + 8) * u32 + u_p
    if x.sinks is not None:
        weights += max(u32 * (abs(s) + 1) * min(1.0, math.exp(min(s + big, 0.0))) for s in x.sinks.tolist())
    v_max = rows.abs().max().item()
    return float(2 * weights * v_max + u_act * v_max)


def pool_values(x: Inputs) -> torch.Tensor:
    """The layer's pool decoded in float64 (int8 / fp8 codes times the scale), NaN in the stale slots: int8's
    extreme codes there are no written value's (seeded.normal's values are within 2 sqrt(3), codes within 116)."""
    a = x.attrs
    codes = x.kv_cache[a.layer]
    if a.kv_cache_dtype == "fp8":
        return codes.view(torch.float8_e4m3fn).double() * a.kv_scale
    if a.kv_cache_dtype == "int8":
        return torch.where((codes == 127) | (codes == -128), float("nan"), codes.double() * a.kv_scale)
    return codes.double()


def run_and_compare(x: Inputs) -> tuple[float, float]:
    want = truth(x)
    got = attention.paged_attention(*x)
    assert got.dtype == x.q.dtype and got.shape == want.shape
    assert not want.isnan().any(), "the reference read a stale slot: the test's inputs are wrong"
    assert not got.isnan().any(), f"NaN in the kernel's output at rows {got.isnan().any(1).nonzero()[:, 0].tolist()}"
    err = (got.double() - want).abs()
    tol = tolerance(x)
    worst = divmod(int(err.argmax()), want.shape[1])
    assert err.max() <= tol, (
        f"max abs error {err.max():.3g} > tolerance {tol:.3g} at token {worst[0]} column {worst[1]} "
        f"(got {got[worst].item():.6g}, want {want[worst].item():.6g}); tokens over it: "
        f"{(err > tol).any(1).nonzero()[:, 0].tolist()}"
    )
    # the relative error where the output is not near 0 (|want| >= 1/4 of its largest): the bound is in max|V|
    big = want.abs() >= want.abs().max() / 4
    return err.max().item(), (err[big] / want.abs()[big]).max().item()


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_kernel_matches_reference_on_a_mixed_batch(case: Case) -> None:
    x = make_inputs(case, mixed_batch(case.tokens_per_block), seed=CASES.index(case))
    abs_err, rel_err = run_and_compare(x)
    print(f"{case}: max abs error {abs_err:.3g}, max rel error {rel_err:.3g}, tolerance {tolerance(x):.3g}")


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_kernel_with_sinks_matches_reference_on_a_mixed_batch(case: Case) -> None:
    """Every case again with a sink logit per head (gpt-oss): within the bound; head 0's DOMINANT sink takes all
    the weight (its output ~0: the sink's zero value), the last head's NEGLIGIBLE one changes nothing, bit for bit
    the kernel's output without sinks (the running max starts below the first block's and is rescaled away)."""
    x = make_inputs(case, mixed_batch(case.tokens_per_block), seed=CASES.index(case), sinks=True)
    abs_err, rel_err = run_and_compare(x)
    print(f"{case} with sinks: max abs error {abs_err:.3g}, max rel error {rel_err:.3g}, tolerance {tolerance(x):.3g}")
    d = case.head_size
    got = attention.paged_attention(*x).reshape(-1, case.heads, d).double()
    plain = x._replace(attrs=dataclasses.replace(x.attrs, sinks=0), sinks=None)
    without = attention.paged_attention(*plain).reshape(-1, case.heads, d)
    v_max = pool_values(x).nan_to_num().abs().max().item()
    assert got[:, 0].abs().max() <= 1e-6 * v_max, "the dominant sink did not take head 0's weight"
    assert torch.equal(got[:, -1].to(without.dtype), without[:, -1]), "the negligible sink changed the last head"
    if case.heads > 2:  # moderate sinks move the output: the comparison above is not of two sink-free results
        assert (got[:, 1:-1] - without[:, 1:-1].double()).abs().max() > 10 * tolerance(x)


@pytest.mark.parametrize(
    "batch",
    [[(16, 1), (40, 1), (3, 1)], [(0, 5)], [(7, 2), (0, 1)]],
    ids=["decode-only", "one-prefill", "short-chunk-and-first-token"],
)
def test_kernel_matches_reference_on_other_batches(batch: list[tuple[int, int]]) -> None:
    """The reference's other plans (one decode group, one chunk) and tiny sequences."""
    run_and_compare(make_inputs(Case("float16", "fp8", 24, 16, 4, 2, True), batch, seed=len(batch)))


def test_unservable_attributes_are_refused() -> None:
    a = AttentionAttrs(layer=0, num_heads=6, num_kv_heads=4, head_size=8, tokens_per_block=16)
    with pytest.raises(ValueError, match="multiple of the KV heads"):
        attention.check(a, "float32")
    with pytest.raises(ValueError, match="head_size 7"):
        attention.check(dataclasses.replace(a, num_kv_heads=2, head_size=7), "float32")
    with pytest.raises(ValueError, match="sinks 2: expected 0"):
        attention.check(dataclasses.replace(a, num_kv_heads=2, sinks=2), "float32")


def test_a_sinks_input_must_match_the_attribute() -> None:
    """The sinks input exactly when sinks=1: float32, one logit per head (what export.py writes)."""
    x = make_inputs(CASES[0], [(0, 2)], seed=0, sinks=True)
    for attrs, sinks, message in [
        (x.attrs, None, "sinks=1 with a sinks input of none: expected float32 \\(2,\\)"),
        (x.attrs, torch.zeros(3), "sinks=1 with a sinks input of torch.float32 \\(3,\\)"),
        (x.attrs, torch.zeros(2, dtype=torch.float16), "torch.float16 \\(2,\\): expected float32"),
        (dataclasses.replace(x.attrs, sinks=0), x.sinks, "sinks=0 with a sinks input of .*: expected none"),
    ]:
        with pytest.raises(ValueError, match=message):
            attention.paged_attention(*x._replace(attrs=attrs, sinks=sinks))
