"""MXFP4 weights as gpt-oss checkpoints store their experts: read and dequantized exactly at convert.

The format is the OCP Microscaling (MX) Formats Specification v1.0's MXFP4: blocks of 32 values share one E8M0
scale (a power of two, 2^(s - 127); s = 255 is NaN) and each value is FP4 E2M1 (a sign, two exponent bits with
bias 1, one mantissa bit: +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}). gpt-oss packs them as transformers'
`convert_moe_packed_tensors` (integrations/mxfp4.py) and TensorRT-LLM's `GptOssHfWeightMapper` read them:
`{name}_blocks` uint8 [..., rows, in / 32, 16], two values a byte, the low nibble first; `{name}_scales` uint8
[..., rows, in / 32]. Each value times its scale is exact in float32 (and in bfloat16: 2 mantissa bits suffice),
so the dequantized weights are exactly what transformers computes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from toolchain.checkpoint.hf import HFCheckpoint
from toolchain.checkpoint.safetensors_io import TORCH_NAMES
from toolchain.errors import UserError

if TYPE_CHECKING:
    import torch

BLOCK = 32  # values per shared scale
# FP4 E2M1 code -> value: bit 3 the sign, bits 2-1 the exponent, bit 0 the mantissa
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127
SCALE_NAN = 255


def dequantize_array(blocks: np.ndarray[Any, Any], scales: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """blocks uint8 [..., G, 16], scales uint8 [..., G] -> float32 [..., G * 32]; a NaN scale (255) gives NaN, a
    value beyond float32's range infinity (convert refuses both)."""
    table = np.array(E2M1, dtype=np.float32)
    values = np.stack([table[blocks & 0x0F], table[blocks >> 4]], axis=-1)  # low nibble first
    exponent = scales.astype(np.int32) - SCALE_BIAS
    with np.errstate(over="ignore"):
        scaled = np.ldexp(values.reshape(*values.shape[:-2], -1), exponent[..., None])
    scaled = np.where((scales == SCALE_NAN)[..., None], np.float32(np.nan), scaled)
    result: np.ndarray[Any, Any] = scaled.reshape(*scaled.shape[:-2], -1)
    return result


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`dequantize_array` on torch tensors."""
    import torch

    return torch.from_numpy(dequantize_array(blocks.numpy(), scales.numpy()))


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [..., in] (in a multiple of 32) -> (blocks, scales) in the layout above: each block's scale the
    smallest power of two that fits its largest magnitude in 6, each value rounded to the nearest E2M1 value. For
    tests and tools that write MXFP4 checkpoints; dequantize(quantize(w)) is w's MXFP4 approximation."""
    import torch

    if weight.shape[-1] % BLOCK:
        raise UserError(f"MXFP4 needs the last dimension to be a multiple of {BLOCK}, got {weight.shape[-1]}")
    w = weight.float().reshape(*weight.shape[:-1], -1, BLOCK)
    peak = w.abs().amax(-1).clamp(min=2.0**-126)
    exponent = torch.ceil(torch.log2(peak / 6.0)).clamp(-SCALE_BIAS, SCALE_BIAS).to(torch.int32)
    normalised = w / torch.ldexp(torch.ones_like(peak), exponent)[..., None]
    table = torch.tensor(E2M1, dtype=torch.float32)
    codes = (normalised[..., None] - table).abs().argmin(-1).to(torch.uint8)  # nearest value (first code on ties)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, (exponent + SCALE_BIAS).to(torch.uint8)


def check_sources(ckpt: HFCheckpoint, names: tuple[str, ...]) -> None:
    """Refuse MXFP4 blocks or scales not stored as uint8, and a scales shape that does not match its blocks."""
    blocks, scales = (ckpt.tensors[n] for n in names)
    for info in (blocks, scales):
        if info.code != "U8":
            raise UserError(
                f"{ckpt.files[info.name]}: MXFP4 tensor {info.name} is {TORCH_NAMES[info.code]}, "
                "expected uint8 (packed E2M1 values or E8M0 scales); re-export the checkpoint"
            )
    if len(blocks.shape) < 2 or blocks.shape[-1] != BLOCK // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise UserError(
            f"{ckpt.files[blocks.name]}: MXFP4 blocks {blocks.name} {list(blocks.shape)} and scales "
            f"{list(scales.shape)} do not pair (blocks [..., G, {BLOCK // 2}], scales [..., G]); re-export the "
            "checkpoint"
        )
