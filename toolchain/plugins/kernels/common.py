"""Pieces both plugin kernels share: which sequence a token of the packed batch belongs to, and the KV pool's
codecs (int8 and fp8 e4m3 with the layer's scale), written with integer and fp32 arithmetic only so one code path
serves every SM from sm_80 (Triton's own fp8 e4m3 conversions need sm_89) and Triton's interpreter.

Kernel arguments follow TensorRT's ahead-of-time plugin convention: input pointers, then int32 scalars (a float
travels as its bit pattern, `float_bits`), then output pointers; everything else is a `tl.constexpr` compiled in.
"""

from __future__ import annotations

import struct

import triton
import triton.language as tl

# The pool's storage, a constexpr of both kernels: the activation's own float type, or codes with a scale.
KV_FLOAT = 0
KV_INT8 = 1
KV_FP8 = 2
KV_CODES = {"float32": KV_FLOAT, "float16": KV_FLOAT, "bfloat16": KV_FLOAT, "int8": KV_INT8, "fp8": KV_FP8}

FP8_MAX = 448.0  # e4m3fn's largest finite value (OCP 8-bit floating point spec, E4M3: S.1111.110)
_RINT_MAGIC = 12582912.0  # 1.5 * 2**23: x + M - M rounds an fp32 |x| < 2**22 to the nearest integer, ties to even


def float_bits(x: float) -> int:
    """A float32 as the int32 a kernel argument carries (read back with `.to(tl.float32, bitcast=True)`)."""
    return int(struct.unpack("<i", struct.pack("<f", x))[0])


@triton.jit
def sequence_of(token, new_lens_ptr, num_seqs):
    """(sequence, its first row in the batch) of row `token`: new_lens are the sequences' row counts, in order."""
    seq = token * 0
    start = token * 0
    end = token * 0
    for s in range(num_seqs):
        n = tl.load(new_lens_ptr + s)
        before = end + n <= token
        seq += before.to(tl.int32)
        start = tl.where(before, end + n, start)
        end += n
    return seq, start


@triton.jit
def rint(x):
    """Round fp32 to the nearest integer, ties to even (torch.round's rule), for |x| < 2**22."""
    magic = 12582912.0
    return (x + magic) - magic


@triton.jit
def encode_int8(x, scale):
    """torch.round(x / scale).clamp(-128, 127) as int8 (the reference's _store). NaN has no int8 code: torch's
    conversion is undefined there, and so is this one."""
    y = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -128.0), 127.0)
    return rint(y).to(tl.int8)


@triton.jit
def decode_int8(code, scale):
    return code.to(tl.float32) * scale


@triton.jit
def encode_fp8(x, scale):
    """(x / scale) saturated to +-448 and rounded to the nearest e4m3fn value (ties to even), as its uint8 code:
    what torch's float8_e4m3fn conversion gives after the reference's clamp. NaN stays NaN (0x7f | sign)."""
    y = tl.minimum(
        tl.maximum(tl.math.div_rn(x, scale), -448.0, propagate_nan=tl.PropagateNan.ALL),
        448.0,
        propagate_nan=tl.PropagateNan.ALL,
    )
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = tl.abs(y)
    # normal range (|y| >= 2**-6): round the fp32 mantissa to 3 bits, ties to even, then rebias 127 -> 7
    mbits = mag.to(tl.int32, bitcast=True)
    rounded = (mbits + 0x7FFFF + ((mbits >> 20) & 1)) >> 20
    normal = rounded - ((127 - 7) << 3)
    # subnormal range: multiples of 2**-9, which as integers 0..8 are the codes themselves (8 = the least normal)
    sub = rint(mag * 512.0).to(tl.int32)
    code = tl.where(mag >= 0.015625, normal, sub)
    code = tl.where(y != y, 0x7F, code)
    return (code | sign).to(tl.uint8)


@triton.jit
def decode_fp8(code, scale):
    """An e4m3fn code (uint8) to fp32, times the scale. 0x7f / 0xff are NaN."""
    c = code.to(tl.int32) & 0xFF
    sign = tl.where((c & 0x80) != 0, -1.0, 1.0)
    e = (c >> 3) & 0xF
    m = c & 0x7
    normal = ((e + 120) << 23 | (m << 20)).to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) * 0.001953125  # m * 2**-9
    v = tl.where(e == 0, sub, normal)
    v = tl.where((c & 0x7F) == 0x7F, float("nan"), v)
    return sign * v * scale


@triton.jit
def cast(x, dtype: tl.constexpr):
    """x.to(dtype), rounded to nearest (ties to even) on every backend, as torch rounds: triton 3.9's interpreter
    truncates fp32 to bf16 (its cast passes no rounding mode), where a GPU's cvt.rn.bf16.f32 rounds. NaN stays
    NaN (0x7fc0)."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.float32).to(tl.int32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(x != x, 0x7FC0, rounded)
        return rounded.to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)


@triton.jit
def encode(x, scale, KV: tl.constexpr, dtype: tl.constexpr):
    """A float tile to the pool's storage type `dtype` (KV_FLOAT: a cast, rounded to nearest)."""
    if KV == 1:
        return encode_int8(x, scale)
    elif KV == 2:
        return encode_fp8(x, scale)
    else:
        return cast(x, dtype)


@triton.jit
def decode(stored, scale, KV: tl.constexpr):
    """The pool's storage back to fp32."""
    if KV == 1:
        return decode_int8(stored, scale)
    elif KV == 2:
        return decode_fp8(stored, scale)
    else:
        return stored.to(tl.float32)


# Triton's names for the activations and the pool's storage (signature strings of triton.compile's ASTSource).
ACTIVATIONS = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
STORAGE = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "int8": "i8", "fp8": "u8"}
MAX_HEAD_SIZE = 256


def check_types(kv_cache_dtype: str, head_size: int, activation: str) -> None:
    """Refuse, naming the value, what no kernel variant serves: a float pool of another float type than the
    activations (the pool's floats are the activations' own), an unknown dtype, an odd or too large head size."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation dtype {activation!r} has no kernel; choose one of {', '.join(ACTIVATIONS)}")
    if kv_cache_dtype == "nvfp4":
        raise ValueError(
            "KV cache nvfp4 has no Triton kernel (no variant was run against the reference op): build with the CPU "
            "engine (its reference KVCacheWrite quantizes it), or quantize with --kv-cache fp8 for TensorRT"
        )
    if kv_cache_dtype not in STORAGE:
        raise ValueError(f"KV cache dtype {kv_cache_dtype!r} has no kernel; choose one of {', '.join(STORAGE)}")
    if kv_cache_dtype in ACTIVATIONS and kv_cache_dtype != activation:
        raise ValueError(f"KV cache {kv_cache_dtype} with {activation} activations has no kernel")
    if head_size % 2 or not 2 <= head_size <= MAX_HEAD_SIZE:
        raise ValueError(f"head_size {head_size}: the kernels take even head sizes up to {MAX_HEAD_SIZE}")


def common_signature(activation: str, kv_cache_dtype: str, first: str, out: str) -> dict[str, str]:
    """The non-constexpr parameters both kernels take, in TensorRT's order: six inputs (the first is `first`, qkv
    or q, in the activation type), six int32 scalars, one output `out`."""
    act = "*" + ACTIVATIONS[activation]
    return {
        first: act,
        "position_ids": "*i32",
        "context_lens": "*i32",
        "new_lens": "*i32",
        "block_tables": "*i32",
        "kv_cache": "*" + STORAGE[kv_cache_dtype],
        **dict.fromkeys(SCALARS, "i32"),
        out: act,
    }


# Compile options of every launch, native or ahead of time (the PTX TensorRT gets must be the code the GPU check
# ran). No fused multiply-add contraction: a rotated key then rounds as the reference's separate products do, so
# its int8 / fp8 code is the reference's, on every SM (attention's cost is its memory traffic, not these flops).
OPTIONS = {"enable_fp_fusion": False}

SCALARS = ("num_tokens", "num_seqs", "max_blocks", "num_blocks", "layer", "kv_scale_bits")
