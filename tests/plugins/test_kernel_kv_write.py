"""The KVCacheWrite Triton kernel, run by Triton's interpreter on CPU (tests/conftest.py sets TRITON_INTERPRET),
against the reference op `toolchain.engine.ops.kv_cache_write` on the same inputs: every activation dtype, pool
storage, rotary variant, head size, block size, GQA and MHA, in batches that mix prefill chunks and decode steps over
shuffled blocks, with every slot the batch does not write checked bit for bit afterwards."""

from __future__ import annotations

import dataclasses
import math
import re
import zlib
from typing import Any

import pytest
import torch
import triton
import triton.language as tl

from toolchain.engine import ops
from toolchain.engine.ops import AttentionAttrs
from toolchain.plugins.kernels import common, kv_write
from toolchain.reference.rope import apply_rotary, attention_factor, inv_freq

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
STORAGE = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int8": torch.int8}
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}  # a float pool compared as its bit patterns (NaN == NaN)
INT8_SENTINEL = -128  # never written: the test's values stay inside +-127 * kv_scale
FP8_NAN = 0x7F
LAYERS, LAYER = 2, 1  # the batch writes layer 1 only; layer 0 must stay untouched like every other unwritten slot
# rotary_style and scaling fields of AttentionAttrs per variant; llama3 with Llama 3.1's own numbers
ROTARY: dict[str, dict[str, Any]] = {
    "none": {"rotary_style": "none"},
    "neox": {"rotary_base": 10000.0},
    "linear": {"rotary_base": 10000.0, "rotary_scaling_type": "linear", "rotary_scaling_factor": 2.5},
    "llama3": {
        "rotary_base": 500000.0,
        "rotary_scaling_type": "llama3",
        "rotary_scaling_factor": 8.0,
        "rotary_low_freq_factor": 1.0,
        "rotary_high_freq_factor": 4.0,
        "rotary_original_max_positions": 8192,
    },
    # gpt-oss-20b's YaRN (untruncated ramp) and its attention factor 0.1 ln(32) + 1
    "yarn": {
        "rotary_base": 150000.0,
        "rotary_scaling_type": "yarn",
        "rotary_scaling_factor": 32.0,
        "rotary_original_max_positions": 4096,
        "rotary_beta_fast": 32.0,
        "rotary_beta_slow": 1.0,
        "rotary_truncate": 0,
        "rotary_attention_factor": 0.1 * math.log(32.0) + 1.0,
    },
}
FAR = 3000  # the largest position of every batch (a decode step): angles up to 3000 radians


@dataclasses.dataclass(frozen=True)
class Case:
    activation: str
    pool: str  # kv_cache_dtype; "same": the activation's own float type
    rotary: str
    head_size: int
    tokens_per_block: int
    heads: tuple[int, int]  # (num_heads, num_kv_heads)

    def attrs(self) -> AttentionAttrs:
        pool = str(DTYPES[self.activation]).removeprefix("torch.") if self.pool == "same" else self.pool
        return AttentionAttrs(
            layer=LAYER,
            num_heads=self.heads[0],
            num_kv_heads=self.heads[1],
            head_size=self.head_size,
            tokens_per_block=self.tokens_per_block,
            kv_cache_dtype=pool,
            kv_scale=0.075 if pool == "int8" else 0.0087,  # fp8: |x| / scale beyond 448 saturates, int8: never clamps
            **ROTARY[self.rotary],
        )

    def __str__(self) -> str:
        h, kvh = self.heads
        return f"{self.activation}-{self.pool}-{self.rotary}-d{self.head_size}-tpb{self.tokens_per_block}-h{h}kv{kvh}"


# Every value of every axis, each code path: float pools of all three types, int8 and fp8 codes under each
# activation; rotary off, plain, linear and llama3; head sizes that are (64, 8) and are not (24, 96) powers of two;
# one token's heads in one program and (96, 20 heads) in two; MHA and GQA at ratios 2, 3 and 4.
CASES = [
    Case("fp32", "same", "neox", 64, 16, (4, 2)),
    Case("fp32", "int8", "llama3", 24, 32, (2, 2)),
    Case("fp32", "fp8", "none", 8, 64, (3, 1)),
    Case("fp16", "same", "llama3", 8, 32, (4, 1)),
    Case("fp16", "int8", "none", 64, 64, (2, 2)),
    Case("fp16", "fp8", "linear", 24, 16, (6, 2)),
    Case("bf16", "same", "linear", 24, 64, (2, 2)),
    Case("bf16", "int8", "neox", 8, 16, (4, 2)),
    Case("bf16", "fp8", "llama3", 64, 32, (4, 2)),
    Case("fp32", "same", "none", 24, 32, (2, 1)),
    Case("fp16", "fp8", "neox", 96, 16, (12, 4)),
    Case("bf16", "same", "yarn", 64, 16, (4, 2)),
    Case("fp32", "int8", "yarn", 24, 32, (2, 1)),
]


@dataclasses.dataclass(frozen=True)
class Batch:
    position_ids: torch.Tensor
    context_lens: torch.Tensor
    new_lens: torch.Tensor
    block_tables: torch.Tensor
    num_blocks: int
    written: list[tuple[int, int]]  # (block, slot) of each new token, in batch order


def make_batch(tpb: int, gen: torch.Generator) -> Batch:
    """Sequences (cached tokens, new tokens): a decode step, a prefill chunk after a cached prefix that crosses a
    block boundary, a first prefill chunk, a decode far out; their blocks a shuffle of the pool, two blocks owned
    by nobody, every table row padded with those (a wrong column lands in a slot the batch does not own)."""
    seqs = [(36, 1), (tpb - 3, 5), (0, 4), (FAR, 1)]
    need = [-(-(cached + new) // tpb) for cached, new in seqs]
    spare = 2
    num_blocks = sum(need) + spare
    order = torch.randperm(num_blocks, generator=gen)
    max_blocks = max(need) + 1
    tables = order[-spare:].repeat(len(seqs), max_blocks)[:, :max_blocks].clone()
    first = 0
    for s, n in enumerate(need):
        tables[s, :n] = order[first : first + n]
        first += n
    positions = torch.cat([torch.arange(cached, cached + new) for cached, new in seqs])
    seq_of = torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor([new for _, new in seqs]))
    written = [
        (int(tables[s, p // tpb]), int(p % tpb)) for s, p in zip(seq_of.tolist(), positions.tolist(), strict=True)
    ]
    return Batch(
        position_ids=positions.to(torch.int32),
        context_lens=torch.tensor([c + n for c, n in seqs], dtype=torch.int32),
        new_lens=torch.tensor([n for _, n in seqs], dtype=torch.int32),
        block_tables=tables.to(torch.int32),
        num_blocks=num_blocks,
        written=written,
    )


def empty_pool(a: AttentionAttrs, num_blocks: int, dtype: torch.dtype, layers: int = LAYERS) -> torch.Tensor:
    """A pool whose every slot holds what no write gives: NaN, fp8's NaN code, int8's unused -128."""
    shape = (layers, num_blocks, 2, a.num_kv_heads, a.tokens_per_block, a.head_size)
    fill = {torch.int8: INT8_SENTINEL, torch.uint8: FP8_NAN}.get(dtype, math.nan)
    return torch.full(shape, fill, dtype=dtype)


def written_mask(pool: torch.Tensor, batch: Batch) -> torch.Tensor:
    mask = torch.zeros(pool.shape[:5], dtype=torch.bool)
    for block, slot in batch.written:
        mask[LAYER, block, :, :, slot] = True
    return mask


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(BITS[x.element_size()])


def rotary_tolerance(a: AttentionAttrs, x: torch.Tensor, rotated: bool) -> torch.Tensor:
    """Bound of |kernel - reference| on each fp32 rotary output, before either rounds it to its dtype or code.

    Both compute x1 * cos - x2 * sin and x2 * cos + x1 * sin in fp32 with separate roundings, from the same fp32
    angle (the kernel reproduces the reference's fp32 inverse frequencies and its fp32 product position * freq,
    so the angle error at the farthest position, FAR, is zero; a frequency off by one ulp would move FAR's angle by
    ~2e-4 radians, far outside this bound). They differ in cos / sin: the kernel's are correctly rounded (<= 1/2
    ulp), torch's within 1 ulp (SLEEF u10), so they differ by <= 1.5 * 2**-24 absolute (|cos| <= 1). Each product
    then differs by <= |x| * 1.5 * 2**-24 plus two half-ulp roundings (<= 2**-23 |x|): 3.5 * 2**-24 |x|; the sum
    adds two half-ulp roundings of at most 2**-24 (|x1| + |x2|) each: in all <= 5.5 * 2**-24 (|x1| + |x2|) <
    2**-21 (|x1| + |x2|). Without rotary both store x itself: bound 0."""
    if not rotated or a.rotary_style == "none":
        return torch.zeros_like(x)
    half = a.head_size // 2
    heads = x.reshape(x.shape[0], -1, 2, half)
    partner = heads.flip(2).reshape(x.shape)
    return 2.0**-21 * (x.abs() + partner.abs())


def within_rounding(
    a: AttentionAttrs, got: torch.Tensor, exact: torch.Tensor, tol: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Whether each `got` (a dtype value or pool code) is the reference's own rounding (ops._store, a cast for
    float outputs) of some value within `tol` of the reference's fp32 result `exact`: rounding is monotonic, so
    `got` lies between the roundings of exact - tol and exact + tol (decoded by the reference's ops._load).
    With tol 0 that is equality; otherwise it allows the neighbouring value only where `exact` lies within the
    fp32 rotary difference of a rounding boundary."""

    def value(codes: torch.Tensor) -> torch.Tensor:
        return ops._load(codes, a, torch.float64)

    lo = value(ops._store(exact - tol, a, dtype))
    hi = value(ops._store(exact + tol, a, dtype))
    v = value(got)
    return (lo <= v) & (v <= hi)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_kernel_matches_the_reference_and_writes_only_the_batch_s_slots(case: Case) -> None:
    a = case.attrs()
    gen = torch.Generator().manual_seed(zlib.crc32(str(case).encode()))  # fresh inputs per case, reproducible
    batch = make_batch(a.tokens_per_block, gen)
    dtype = DTYPES[case.activation]
    h, kvh, d = a.num_heads, a.num_kv_heads, a.head_size
    tokens = batch.position_ids.shape[0]
    qkv = (torch.randn(tokens, (h + 2 * kvh) * d, generator=gen) * 1.3).to(dtype)
    storage = STORAGE.get(a.kv_cache_dtype, torch.uint8)
    before = empty_pool(a, batch.num_blocks, storage)
    args = (batch.position_ids, batch.context_lens, batch.new_lens, batch.block_tables)

    ref_pool, got_pool = before.clone(), before.clone()
    ref_q = ops.kv_cache_write(a, qkv, *args, ref_pool)
    got_q = kv_write.kv_cache_write(a, qkv, *args, got_pool)
    # the reference's fp32 results before it rounds them: the same op on fp32 inputs (exact upcasts) into fp32
    a32 = dataclasses.replace(a, kv_cache_dtype="float32")
    exact_pool = empty_pool(a32, batch.num_blocks, torch.float32)
    exact_q = ops.kv_cache_write(a32, qkv.float(), *args, exact_pool)

    written = written_mask(before, batch)
    assert torch.equal(bits(ref_pool)[~written], bits(before)[~written])  # the test's map of written slots is right
    changed = (bits(got_pool) != bits(before)) & ~written[..., None]
    assert not changed.any(), f"kernel wrote {int(changed.sum())} elements outside the batch's slots"

    x = qkv.float()
    q_tol = rotary_tolerance(a, x[:, : h * d], rotated=True)
    ok = within_rounding(a32, got_q, exact_q, q_tol, dtype) & ((q_tol > 0) | (bits(got_q) == bits(ref_q)))
    err = (got_q.float() - ref_q.float()).abs().max().item()
    assert ok.all(), f"q: {int((~ok).sum())} of {ok.numel()} values beyond rounding tolerance, max |diff| {err:.3g}"

    k_tol = rotary_tolerance(a, x[:, h * d : (h + kvh) * d], rotated=True).reshape(tokens, kvh, d)
    rows = torch.tensor(batch.written)
    for kv, tol in ((0, k_tol), (1, torch.zeros_like(k_tol))):  # V: no rotary, the reference's bits exactly
        got, ref, exact = (p[LAYER, rows[:, 0], kv, :, rows[:, 1]] for p in (got_pool, ref_pool, exact_pool))
        ok = within_rounding(a, got, exact, tol, storage) & ((tol > 0) | (bits(got) == bits(ref)))
        assert ok.all(), f"{'KV'[kv]}: {int((~ok).sum())} of {ok.numel()} stored values beyond rounding tolerance"
    if storage == torch.int8:
        assert (ref_pool[written] != INT8_SENTINEL).all()  # so a slot the kernel left unwritten would show


@pytest.mark.parametrize(
    ("rotary", "head_size"),
    [("neox", 256), ("linear", 24), ("llama3", 128), ("llama3", 96), ("yarn", 64), ("yarn", 24)],
)
def test_rotary_is_the_reference_s_formula_with_correctly_rounded_cos_sin(rotary: str, head_size: int) -> None:
    """Bit for bit, fp32 in and out, positions up to 500,000: rope.apply_rotary with the reference's own fp32
    angles (rope.inv_freq, one fp32 product) and their cos / sin correctly rounded to fp32 (float64 cos, sin).
    The comparison with the op above has to allow torch's fp32 cos / sin their 1 ulp; this one allows nothing."""
    positions = torch.tensor([0, 1, 37, 4095, 8191, 8192, 65535, 131071, 500000], dtype=torch.int32)
    tpb, n = 64, positions.shape[0]
    a = AttentionAttrs(
        layer=LAYER, num_heads=2, num_kv_heads=1, head_size=head_size, tokens_per_block=tpb, **ROTARY[rotary]
    )
    tables = torch.arange(n, dtype=torch.int32)[:, None].repeat(1, int(positions.max()) // tpb + 1)  # seq s: block s
    gen = torch.Generator().manual_seed(25)
    qkv = torch.randn(n, 4 * head_size, generator=gen)
    pool = empty_pool(a, n, torch.float32)
    ones = torch.ones(n, dtype=torch.int32)
    q = kv_write.kv_cache_write(a, qkv, positions, positions + 1, ones, tables, pool)

    freqs = inv_freq(head_size, a.rotary_base, a.rotary_scaling(), torch.float32)
    angles = (positions.float()[:, None] * freqs[None, :]).repeat(1, 2).double()
    factor = attention_factor(a.rotary_scaling())  # YaRN's, one fp32 product on each (1.0: none)
    cos, sin = (f(angles).float()[:, None] * factor if factor != 1.0 else f(angles).float()[:, None]
                for f in (torch.cos, torch.sin))  # fmt: skip
    want = apply_rotary(qkv[:, : 3 * head_size].reshape(n, 3, head_size), cos, sin)
    k = pool[LAYER, torch.arange(n), 0, 0, positions % tpb]
    assert torch.equal(q, want[:, :2].reshape(n, -1)), f"q differs in {int((q != want[:, :2].reshape(n, -1)).sum())}"
    assert torch.equal(k, want[:, 2]), f"k differs in {int((k != want[:, 2]).sum())} elements"


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # fp16: numpy's inf, as torch's
def test_bf16_cast_rounds_to_nearest_even_as_torch_does() -> None:
    """common.cast on random fp32 bit patterns (normals, subnormals, infinities) and ties: torch's bf16 and fp16."""
    gen = torch.Generator().manual_seed(7)
    patterns = torch.randint(-(2**31), 2**31 - 1, (4096,), generator=gen, dtype=torch.int64).to(torch.int32)
    ties = torch.tensor([1.00390625, 1.01171875, -1.00390625, 3.3961514e38, float("inf"), -0.0, 1e-40])
    x = torch.cat([patterns.view(torch.float32), ties, torch.randn(4096 - ties.numel(), generator=gen)])
    x = x[~x.isnan()]
    for dtype in (torch.bfloat16, torch.float16):
        y = torch.empty(x.numel(), dtype=dtype)
        _cast_kernel[(1,)](x, y, x.numel(), BLOCK=triton.next_power_of_2(x.numel()))
        assert torch.equal(bits(y), bits(x.to(dtype))), f"{dtype}: {int((bits(y) != bits(x.to(dtype))).sum())} differ"


@triton.jit
def _cast_kernel(x, y, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(y + i, common.cast(tl.load(x + i, mask=i < n), y.dtype.element_ty), mask=i < n)


@pytest.mark.parametrize(
    ("change", "activation", "named"),
    [
        ({"kv_cache_dtype": "float16"}, "bfloat16", "KV cache float16 with bfloat16"),
        ({"kv_cache_dtype": "float32"}, "float16", "KV cache float32 with float16"),
        ({"kv_cache_dtype": "int4"}, "float16", "'int4'"),
        ({"head_size": 7}, "float16", "head_size 7"),
        ({"head_size": 258}, "float16", "head_size 258"),
        ({"rotary_style": "gptj"}, "float16", "'gptj'"),
        ({"rotary_scaling_type": "dynamic"}, "float16", "'dynamic'"),
        ({}, "float64", "'float64'"),
    ],
)
def test_what_no_variant_serves_is_refused_by_name(change: dict[str, Any], activation: str, named: str) -> None:
    served = AttentionAttrs(
        layer=0, num_heads=2, num_kv_heads=1, head_size=8, tokens_per_block=16, kv_cache_dtype="float16"
    )
    a = dataclasses.replace(served, **change)
    for refuse in (kv_write.check, kv_write.signature):
        with pytest.raises(ValueError, match=re.escape(named)):
            refuse(a, activation)


def test_the_entry_point_refuses_a_pool_it_cannot_write_in_place() -> None:
    a = AttentionAttrs(layer=0, num_heads=2, num_kv_heads=1, head_size=8, tokens_per_block=16, kv_cache_dtype="fp8")
    qkv = torch.zeros(1, 32)
    ints = (torch.zeros(1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), torch.ones(1, dtype=torch.int32))
    tables = torch.zeros(1, 1, dtype=torch.int32)
    for pool, named in [
        (torch.zeros(1, 2, 2, 1, 16, 8, dtype=torch.float8_e4m3fn), "float8_e4m3fn"),
        (torch.zeros(1, 2, 2, 1, 16, 16, dtype=torch.uint8)[..., :8], "contiguous: False"),
    ]:
        with pytest.raises(ValueError, match=re.escape(named)):
            kv_write.kv_cache_write(a, qkv, ints[0], ints[1], ints[2], tables, pool)


@pytest.mark.parametrize("block", [-1, 3])
def test_a_block_outside_the_pool_is_never_written(block: int) -> None:
    """A table entry outside [0, num_blocks) (a corrupt table: the reference op would fail to index it) writes
    nothing anywhere, not even past the pool's end (the pool is the front of a larger buffer, whose tail a write
    to block num_blocks of the last layer would hit); q is still written."""
    a = AttentionAttrs(layer=LAYER, num_heads=2, num_kv_heads=1, head_size=8, tokens_per_block=16, rotary_style="none")
    qkv = torch.randn(1, 32, generator=torch.Generator().manual_seed(3))
    pos, one = torch.tensor([5], dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    buffer = empty_pool(a, 3, torch.float32, layers=LAYERS + 1)
    q = kv_write.kv_cache_write(a, qkv, pos, pos + 1, one, torch.tensor([[block]], dtype=torch.int32), buffer[:LAYERS])
    assert torch.equal(bits(buffer), bits(empty_pool(a, 3, torch.float32, layers=LAYERS + 1)))
    assert torch.equal(q, qkv[:, :16])
