"""The number formats pre-quantized checkpoints store, decoded and encoded exactly, in numpy (convert never imports
torch; the methods call these through `torch.from_numpy`).

- FP4 E2M1 (NVFP4's values; OCP MX v1.0 §5.3.3): a sign, two exponent bits with bias 1, one mantissa bit, so
  ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}. Packed two a byte, **the low nibble the even element** (ModelOpt's
  `NVFP4QTensor`, compressed-tensors' `pack_fp4_to_uint8`, gpt-oss' MXFP4 blocks all agree).
- E8M0 (MX block scales): 2^(s − 127), s = 255 NaN.
- Integers packed into int32 words (compressed-tensors' pack-quantized, GPTQ's `qweight`/`qzeros`, AutoAWQ's GEMM
  layout): `32 / bits` values a word, the lowest bits the first value unless an `order` says which value sits in
  which slot (AutoAWQ packs slot i with value AWQ_ORDER[i]).
- Our int4 rows (TensorRT-LLM-named w4a16 layout, methods/w4a16.py): two output rows a byte, row 2j the low nibble.
"""

from __future__ import annotations

from typing import Any

import numpy as np

Array = np.ndarray[Any, Any]

E2M1_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32
)
E2M1_MAX = 6.0
E8M0_BIAS, E8M0_NAN = 127, 255
# AutoAWQ's GEMM packing: word slot i holds value AWQ_ORDER[i] of its 8 consecutive output columns (AutoAWQ's
# gemm packer; unpacking reads slot AWQ_REVERSE_ORDER[j] for value j, as vLLM's and gptqmodel's AWQ readers do)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


def e2m1_decode(packed: Array) -> Array:
    """uint8 [..., n] (two E2M1 codes a byte, low nibble first) -> float32 [..., 2n]."""
    packed = np.asarray(packed, dtype=np.uint8)
    values = np.stack([E2M1_VALUES[packed & 0x0F], E2M1_VALUES[packed >> 4]], axis=-1)
    return values.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def e2m1_codes(x: Array) -> Array:
    """float [..., n] -> the nearest E2M1 code of each value, ties to the even code (round half to even, as
    IEEE rounding and ModelOpt's `_cast_fp4` do: 0.25 -> 0, 0.75 -> 1, 2.5 -> 2, 5 -> 4); |x| > 6 saturates to
    6. uint8 codes 0-15, unpacked."""
    x = np.asarray(x, dtype=np.float32)
    mag = np.abs(x)
    grid = E2M1_VALUES[:8]
    # index of the nearest magnitude; at a tie the even index (the value with mantissa bit 0)
    below = np.clip(np.searchsorted(grid, mag, side="right") - 1, 0, 7)
    above = np.minimum(below + 1, 7)
    d_below, d_above = mag - grid[below], grid[above] - mag
    pick_above = (d_above < d_below) | ((d_above == d_below) & (above % 2 == 0))
    index = np.where(pick_above, above, below).astype(np.uint8)
    sign = (np.signbit(x) & (index > 0)).astype(np.uint8) << 3
    codes: Array = (index | sign).astype(np.uint8)
    return codes


def e2m1_pack(codes: Array) -> Array:
    """uint8 codes [..., 2n] -> packed uint8 [..., n], the even element in the low nibble."""
    codes = np.asarray(codes, dtype=np.uint8)
    if codes.shape[-1] % 2:
        raise ValueError(f"E2M1 packing needs an even last dimension, got {codes.shape[-1]}")
    packed: Array = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return packed


def e8m0_decode(scales: Array) -> Array:
    """uint8 E8M0 -> float32 2^(s − 127) (exact: float32 holds 2^-127 as a subnormal); 255 -> NaN."""
    scales = np.asarray(scales, dtype=np.uint8)
    exponent = np.where(scales == E8M0_NAN, 0, scales.astype(np.int32) - E8M0_BIAS)
    values = np.ldexp(np.float32(1.0), exponent).astype(np.float32)
    decoded: Array = np.where(scales == E8M0_NAN, np.float32(np.nan), values)
    return decoded


def unpack_int32(packed: Array, bits: int, axis: int, order: tuple[int, ...] | None = None) -> Array:
    """int32 words -> their unsigned `bits`-bit fields (int32), `32 / bits` per word along `axis`: the result's
    length along `axis` is `32 / bits` times the packed one. Field k of a word (bits k·bits upwards) is value k,
    or value order[k] when an `order` is given (AutoAWQ's interleave)."""
    if 32 % bits:
        raise ValueError(f"{bits}-bit values do not tile an int32 word")
    per = 32 // bits
    words = np.moveaxis(np.asarray(packed).view(np.uint32), axis, -1)
    shifts = (np.arange(per, dtype=np.uint32) * bits).astype(np.uint32)
    fields = ((words[..., None] >> shifts) & np.uint32((1 << bits) - 1)).astype(np.int32)  # [..., n, per]
    if order is not None:
        inverse = np.argsort(np.asarray(order))  # value j sits in slot order.index(j)
        fields = fields[..., inverse]
    out = fields.reshape(*fields.shape[:-2], -1)
    return np.moveaxis(out, -1, axis)


def pack_int32(values: Array, bits: int, axis: int, order: tuple[int, ...] | None = None) -> Array:
    """The inverse of `unpack_int32`: unsigned `bits`-bit values (any int dtype) packed into int32 words along
    `axis` (its length a multiple of 32 / bits). For tests and writers of those layouts."""
    per = 32 // bits
    v = np.moveaxis(np.asarray(values).astype(np.uint32), axis, -1)
    if v.shape[-1] % per:
        raise ValueError(f"{v.shape[-1]} values along axis {axis} do not fill {bits}-bit words of 32 bits")
    v = v.reshape(*v.shape[:-1], -1, per) & np.uint32((1 << bits) - 1)
    if order is not None:
        v = v[..., list(order)]  # slot k holds value order[k]
    shifts = (np.arange(per, dtype=np.uint32) * bits).astype(np.uint32)
    words = np.bitwise_or.reduce(v << shifts, axis=-1).astype(np.uint32).view(np.int32)
    return np.moveaxis(words, -1, axis)


def int4_rows_pack(codes: Array) -> Array:
    """int4 codes [out, in] (signed −8..7 or unsigned 0..15) -> our w4a16 layout: uint8 [out / 2, in], row 2j in
    the low nibble, row 2j + 1 in the high one (ModelOpt's `pack_int4_in_uint8` is the same)."""
    c = np.asarray(codes).astype(np.int16) & 0x0F
    if c.shape[0] % 2:
        raise ValueError(f"int4 row packing needs an even number of rows, got {c.shape[0]}")
    return (c[0::2] | (c[1::2] << 4)).astype(np.uint8)


def int4_rows_unpack(packed: Array, signed: bool) -> Array:
    """The inverse of `int4_rows_pack`: int8 codes [out, in] (−8..7 when `signed`, else 0..15)."""
    p = np.asarray(packed).view(np.uint8)
    low, high = (p & 0x0F).astype(np.int8), (p >> 4).astype(np.int8)
    if signed:
        low, high = np.where(low > 7, low - 16, low), np.where(high > 7, high - 16, high)
    out = np.empty((p.shape[0] * 2, *p.shape[1:]), dtype=np.int8)
    out[0::2], out[1::2] = low, high
    return out
