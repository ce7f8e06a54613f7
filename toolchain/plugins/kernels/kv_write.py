"""KVCacheWrite in Triton: rotary on q and k, the new tokens' k and v stored into the paged pool in place.

Same contract as the reference op `toolchain.engine.ops.kv_cache_write` (its docstring is the op's definition):
`kv_cache_write(a, qkv, position_ids, context_lens, new_lens, block_tables, kv_cache)` here takes the same
arguments and returns the same q; one launch of `kv_write_kernel` over `grid(a, num_tokens)`.

Rotary follows toolchain/reference/rope.py step for step: the inverse frequencies in float64 (scaled there),
rounded to fp32; angle = fp32 position * fp32 frequency, one fp32 product, so the angles are the reference's bit
for bit; cos / sin of that fp32 angle in float64 (Cody-Waite reduction by pi/2, fdlibm's polynomials), rounded
once to fp32 — correctly rounded, where torch's own fp32 cos / sin are within 1 ulp (SLEEF u10) — and the
rotation itself in fp32 with separate products (no FMA: common.OPTIONS), as the reference rounds it. Nothing
goes through Triton's fp32 `/`, `sin`, `cos` or `exp2`, which are approximate on a GPU; float64 arithmetic is
IEEE there and in the interpreter alike, so a GPU gives the interpreter's bits.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import triton
import triton.language as tl

from toolchain.engine.ops import AttentionAttrs
from toolchain.plugins.kernels import common

OP = "KVCacheWrite"
NUM_WARPS = 4
TILE = 1024  # elements of one half-head tile [HEAD_BLOCK, BLOCK_D // 2]: 8 per thread of NUM_WARPS warps

ROTARY_STYLES = {"none": 0, "neox": 1}
ROTARY_SCALINGS = {"none": 0, "linear": 1, "llama3": 2, "yarn": 3}

# pi / 2 in three parts (fdlibm's pio2_1, pio2_2, pio2_2t): the first two have 33 significant bits, so k * part is
# exact for |k| < 2**20 (angles below ~1.6e6 radians) and the reduced angle carries no cancellation error.
PIO2_1 = tl.constexpr(float.fromhex("0x1.921fb54400000p+0"))
PIO2_2 = tl.constexpr(float.fromhex("0x1.0b4611a600000p-34"))
PIO2_2T = tl.constexpr(2.02226624879595063154e-21)
TWO_OVER_PI = tl.constexpr(2 / math.pi)
TWO_PI = tl.constexpr(2 * math.pi)  # rope._llama3's 2 * math.pi
RINT64 = tl.constexpr(6755399441055744.0)  # 1.5 * 2**52: x + M - M rounds a float64 |x| < 2**51, ties to even
# fdlibm's __kernel_sin / __kernel_cos minimax coefficients on [-pi/4, pi/4] (error < 2**-58)
S1 = tl.constexpr(-1.66666666666666324348e-01)
S2 = tl.constexpr(8.33333333332248946124e-03)
S3 = tl.constexpr(-1.98412698298579493134e-04)
S4 = tl.constexpr(2.75573137070700676789e-06)
S5 = tl.constexpr(-2.50507602534068634195e-08)
S6 = tl.constexpr(1.58969099521155010221e-10)
C1 = tl.constexpr(4.16666666666666019037e-02)
C2 = tl.constexpr(-1.38888888888741095749e-03)
C3 = tl.constexpr(2.48015872894767294178e-05)
C4 = tl.constexpr(-2.75573143513906633035e-07)
C5 = tl.constexpr(2.08757232129817482790e-09)
C6 = tl.constexpr(-1.13596475577881948265e-11)


@triton.jit
def _cos_sin(angle):
    """cos and sin of an fp32 tile, computed in float64 and rounded once to fp32 (|angle| < ~1.6e6)."""
    a = angle.to(tl.float64)
    k = (a * TWO_OVER_PI + RINT64) - RINT64  # nearest multiple of pi / 2
    r = a - k * PIO2_1 - k * PIO2_2 - k * PIO2_2T  # in [-pi/4, pi/4]
    z = r * r
    s = r + r * z * (S1 + z * (S2 + z * (S3 + z * (S4 + z * (S5 + z * S6)))))
    c = 1.0 - 0.5 * z + z * z * (C1 + z * (C2 + z * (C3 + z * (C4 + z * (C5 + z * C6)))))
    quadrant = k.to(tl.int32) & 3
    sin = tl.where(quadrant == 0, s, tl.where(quadrant == 1, c, tl.where(quadrant == 2, -s, -c)))
    cos = tl.where(quadrant == 0, c, tl.where(quadrant == 1, -s, tl.where(quadrant == 2, -c, s)))
    return cos.to(tl.float32), sin.to(tl.float32)


@triton.jit
def _inv_freq(
    i,
    BLOCK_HALF: tl.constexpr,
    STEP: tl.constexpr,
    SCALING: tl.constexpr,
    FACTOR: tl.constexpr,
    LOW: tl.constexpr,
    HIGH: tl.constexpr,
    ORIGINAL: tl.constexpr,
):
    """rope.inv_freq's fp32 values for pair index i: 1 / base**(2i / d) in float64 (STEP = base**(2/d) raised to
    the i-th power by squaring, within ~1e-14 of the reference's pow), scaled as rope.py does, rounded to fp32."""
    power = tl.full(i.shape, 1.0, tl.float64)
    square = tl.full(i.shape, STEP, tl.float64)
    for b in tl.static_range(7):  # i < 128 (head sizes up to 256)
        if (1 << b) < BLOCK_HALF:
            power = tl.where(((i >> b) & 1) != 0, power * square, power)
            square = square * square
    f = 1.0 / power
    if SCALING == 1:
        f = f / FACTOR
    elif SCALING == 2:  # rope._llama3, operation for operation
        wavelen = TWO_PI / f
        smooth = (ORIGINAL / wavelen - LOW) / (HIGH - LOW)
        interpolated = (1 - smooth) * f / FACTOR + smooth * f
        out = tl.where(wavelen > ORIGINAL / LOW, f / FACTOR, f)
        mid = (wavelen >= ORIGINAL / HIGH) & (wavelen <= ORIGINAL / LOW)
        f = tl.where(mid, interpolated, out)
    elif SCALING == 3:  # rope._yarn: LOW / HIGH are the ramp's ends in pair indices (_rotary), float64 as there
        ramp = tl.minimum(tl.maximum((i.to(tl.float64) - LOW) / (HIGH - LOW), 0.0), 1.0)
        f = f / FACTOR * ramp + f * (1 - ramp)
    return f.to(tl.float32)


# One program per (token, group of HEAD_BLOCK heads), each head seen as two halves [HEAD_BLOCK, BLOCK_D // 2] so the
# rotate-half partner of every element is at the same place in the other half: no gather, no shuffle. A 2D tile of
# heads gives wide contiguous loads (a token's q, k, v heads are one contiguous row of qkv); splitting a token's
# heads over several programs keeps the SMs busy in decode steps, where a batch has few tokens. The kernel moves
# ~(heads + 2 kv_heads) * head_size elements per token and is bound by memory; the float64 cos / sin cost
# BLOCK_D / 2 values per program, next to HEAD_BLOCK * BLOCK_D elements moved.
@triton.jit
def kv_write_kernel(
    qkv,
    position_ids,
    context_lens,
    new_lens,
    block_tables,
    kv_cache,
    num_tokens,
    num_seqs,
    max_blocks,
    num_blocks,
    layer,
    kv_scale_bits,
    q_out,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TOKENS_PER_BLOCK: tl.constexpr,
    KV: tl.constexpr,
    HEAD_BLOCK: tl.constexpr,
    ROTARY: tl.constexpr,
    ROTARY_STEP: tl.constexpr,
    ROTARY_SCALING: tl.constexpr,
    ROTARY_FACTOR: tl.constexpr,
    ROTARY_LOW: tl.constexpr,
    ROTARY_HIGH: tl.constexpr,
    ROTARY_ORIGINAL: tl.constexpr,
    ROTARY_ATTENTION: tl.constexpr,
):
    HALF: tl.constexpr = HEAD_SIZE // 2
    BLOCK_HALF: tl.constexpr = BLOCK_D // 2
    ROWS: tl.constexpr = NUM_HEADS + 2 * NUM_KV_HEADS  # a token's heads in qkv: q, then k, then v
    t = tl.program_id(0)
    row = tl.program_id(1) * HEAD_BLOCK + tl.arange(0, HEAD_BLOCK)
    i = tl.arange(0, BLOCK_HALF)
    inside = (row < ROWS)[:, None] & (i < HALF)[None, :]
    offset = row[:, None] * HEAD_SIZE + i[None, :]  # first half; the second is + HALF
    src = qkv + t.to(tl.int64) * (ROWS * HEAD_SIZE) + offset
    x1 = tl.load(src, mask=inside, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=inside, other=0.0).to(tl.float32)
    pos = tl.load(position_ids + t)
    if ROTARY:
        freq = _inv_freq(
            i, BLOCK_HALF, ROTARY_STEP, ROTARY_SCALING, ROTARY_FACTOR, ROTARY_LOW, ROTARY_HIGH, ROTARY_ORIGINAL
        )
        cos, sin = _cos_sin(pos.to(tl.float32) * freq)
        if ROTARY_SCALING == 3:  # YaRN's attention factor on cos and sin, one fp32 product each (rope.cos_sin)
            cos = cos * ROTARY_ATTENTION
            sin = sin * ROTARY_ATTENTION
        c = cos[None, :]
        s = sin[None, :]
        rotated = (row < NUM_HEADS + NUM_KV_HEADS)[:, None]  # q and k heads; v stays as it is
        y1 = tl.where(rotated, x1 * c - x2 * s, x1)  # the reference's x * cos + rotate_half(x) * sin, rounded alike
        y2 = tl.where(rotated, x2 * c + x1 * s, x2)
    else:
        y1 = x1
        y2 = x2

    is_q = inside & (row < NUM_HEADS)[:, None]
    dst = q_out + t.to(tl.int64) * (NUM_HEADS * HEAD_SIZE) + offset
    tl.store(dst, common.cast(y1, q_out.dtype.element_ty), mask=is_q)
    tl.store(dst + HALF, common.cast(y2, q_out.dtype.element_ty), mask=is_q)

    seq, _ = common.sequence_of(t, new_lens, num_seqs)
    column = pos // TOKENS_PER_BLOCK
    in_table = (pos >= 0) & (column < max_blocks)
    block = tl.load(block_tables + seq.to(tl.int64) * max_blocks + column, mask=in_table, other=-1)
    owned = in_table & (block >= 0) & (block < num_blocks)  # never write outside the pool, whatever the table says
    # (tl.cast: an int argument a native launch specializes to a constexpr, such as layer 1, has no .to)
    # kv rows (row - NUM_HEADS) run over K's heads then V's: exactly a block's [2, kv_heads] leading dims
    kv_row = (row - NUM_HEADS).to(tl.int64)
    block_row = ((tl.cast(layer, tl.int64) * num_blocks + block) * (2 * NUM_KV_HEADS) + kv_row) * TOKENS_PER_BLOCK
    dst = kv_cache + (block_row + pos % TOKENS_PER_BLOCK)[:, None] * HEAD_SIZE + i[None, :]
    # tl.where, not `&`: a tile `&` a scalar int1 yields int32 data in triton 3.9's interpreter, refused as a mask
    is_kv = tl.where(owned, inside & (row >= NUM_HEADS)[:, None], False)
    scale = kv_scale_bits.to(tl.float32, bitcast=True)
    tl.store(dst, common.encode(y1, scale, KV, kv_cache.dtype.element_ty), mask=is_kv)
    tl.store(dst + HALF, common.encode(y2, scale, KV, kv_cache.dtype.element_ty), mask=is_kv)


def check(a: AttentionAttrs, activation: str) -> None:
    common.check_types(a.kv_cache_dtype, a.head_size, activation)
    if a.rotary_style not in ROTARY_STYLES:
        raise ValueError(f"rotary_style {a.rotary_style!r} has no kernel; choose one of {', '.join(ROTARY_STYLES)}")
    if a.rotary_scaling_type not in ROTARY_SCALINGS:
        raise ValueError(
            f"rotary_scaling_type {a.rotary_scaling_type!r} has no kernel; choose one of {', '.join(ROTARY_SCALINGS)}"
        )


def signature(a: AttentionAttrs, activation: str) -> dict[str, str]:
    """triton.compile's signature: the TensorRT-ordered parameters, then every constexpr."""
    check(a, activation)
    sig = common.common_signature(activation, a.kv_cache_dtype, "qkv", "q_out")
    return {**sig, **dict.fromkeys(constexprs(a, activation), "constexpr")}


def _head_block(a: AttentionAttrs) -> int:
    rows = a.num_heads + 2 * a.num_kv_heads
    half = triton.next_power_of_2(a.head_size) // 2
    return int(min(triton.next_power_of_2(rows), max(1, TILE // half)))


def _rotary(a: AttentionAttrs) -> dict[str, Any]:
    """The rotary constexprs, float64 values computed here; neutral ones where rotary or its scaling is off (one
    compiled variant per distinct plugin, not per unused field)."""
    neox = a.rotary_style == "neox"
    scaling = ROTARY_SCALINGS[a.rotary_scaling_type] if neox else 0
    low, high = (float(a.rotary_low_freq_factor), float(a.rotary_high_freq_factor)) if scaling == 2 else (1.0, 4.0)
    if scaling == 3:
        low, high = _yarn_ramp(a)
    return {
        "ROTARY": int(neox),
        "ROTARY_STEP": float(a.rotary_base) ** (2 / a.head_size) if neox else 1.0,
        "ROTARY_SCALING": scaling,
        "ROTARY_FACTOR": float(a.rotary_scaling_factor) if scaling else 1.0,
        "ROTARY_LOW": low,
        "ROTARY_HIGH": high,
        "ROTARY_ORIGINAL": float(a.rotary_original_max_positions) if scaling == 2 else 1.0,
        "ROTARY_ATTENTION": float(a.rotary_attention_factor) if scaling == 3 else 1.0,
    }


def _yarn_ramp(a: AttentionAttrs) -> tuple[float, float]:
    """YaRN's ramp ends (pair indices), as rope._yarn computes them from the plugin's fields."""
    d, base, original = a.head_size, float(a.rotary_base), float(a.rotary_original_max_positions)

    def correction_dim(rotations: float) -> float:
        return d * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(float(a.rotary_beta_fast)), correction_dim(float(a.rotary_beta_slow))
    if a.rotary_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    return float(low), float(high + 0.001 if low == high else high)


def constexprs(a: AttentionAttrs, activation: str) -> dict[str, Any]:
    return {
        "NUM_HEADS": a.num_heads,
        "NUM_KV_HEADS": a.num_kv_heads,
        "HEAD_SIZE": a.head_size,
        "BLOCK_D": triton.next_power_of_2(a.head_size),
        "TOKENS_PER_BLOCK": a.tokens_per_block,
        "KV": common.KV_CODES[a.kv_cache_dtype],
        "HEAD_BLOCK": _head_block(a),
        **_rotary(a),
    }


def scalars(a: AttentionAttrs, num_tokens: Any, num_seqs: Any, max_blocks: Any, num_blocks: Any) -> list[Any]:
    """The int32 arguments in order (common.SCALARS); the dims may be TensorRT symbolic expressions."""
    return [num_tokens, num_seqs, max_blocks, num_blocks, a.layer, common.float_bits(a.kv_scale)]


def grid(a: AttentionAttrs, num_tokens: Any) -> tuple[Any, Any, Any]:
    """One program per (new token, group of HEAD_BLOCK of its q, k and v heads)."""
    return num_tokens, triton.cdiv(a.num_heads + 2 * a.num_kv_heads, _head_block(a)), 1


_STORAGE = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int8": torch.int8}


def kv_cache_write(
    a: AttentionAttrs,
    qkv: torch.Tensor,
    position_ids: torch.Tensor,
    context_lens: torch.Tensor,
    new_lens: torch.Tensor,
    block_tables: torch.Tensor,
    kv_cache: torch.Tensor,
) -> torch.Tensor:
    activation = str(qkv.dtype).removeprefix("torch.")
    check(a, activation)
    storage = _STORAGE.get(a.kv_cache_dtype, torch.uint8)  # an fp8 pool is held as uint8 codes
    if kv_cache.dtype != storage or not kv_cache.is_contiguous():
        raise ValueError(
            f"kv_cache {kv_cache.dtype} (contiguous: {kv_cache.is_contiguous()}): a {a.kv_cache_dtype} pool is "
            f"written in place and must be a contiguous {storage} tensor"
        )
    t = qkv.shape[0]
    q = torch.empty(t, a.num_heads * a.head_size, dtype=qkv.dtype, device=qkv.device)
    if t == 0:
        return q
    ints = [x.to(torch.int32).contiguous() for x in (position_ids, context_lens, new_lens, block_tables)]
    dims = scalars(a, t, new_lens.shape[0], block_tables.shape[1], kv_cache.shape[1])
    kv_write_kernel[grid(a, t)](
        qkv.contiguous(), *ints, kv_cache, *dims, q,
        **constexprs(a, activation), num_warps=NUM_WARPS, **common.OPTIONS,
    )  # fmt: skip
    return q
