"""Symmetric round-to-nearest quantization of weights, and its inverse; int4 codes as an ONNX initializer. Pure
functions on tensors.

Conventions, as TensorRT-LLM and ModelOpt store them (docs/research/trtllm-quantized-layouts.md): a scale is a
dequantization factor, w ≈ q · scale, with scale = amax / maxbound. Integer codes are clamped to the signed range
of their width; FP8 codes are saturated to ±448 (E4M3's largest normal) before the cast, because torch turns an
out-of-range value into NaN when casting to float8_e4m3fn. A channel or group that is all zeros gets scale 1 (any
positive value reproduces the zeros exactly) instead of a division by zero.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # the quantize stage need not import onnx: int4_proto imports it when the exporter calls it
    from onnx import TensorProto

FP8_E4M3_MAX = 448.0


def _scale(amax: torch.Tensor, maxbound: float) -> torch.Tensor:
    scale = amax.float() / maxbound
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def quantize_per_channel(
    weight: torch.Tensor, bits: int = 8, maxbound: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (int8 codes [out, in], float32 scales [out])."""
    low, high = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    scale = _scale(weight.abs().amax(dim=1), maxbound or high)
    codes = torch.round(weight.float() / scale[:, None]).clamp(low, high).to(torch.int8)
    return codes, scale


def quantize_groupwise(weight: torch.Tensor, group_size: int, bits: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (int8 codes [out, in], float32 scales [out, in / group_size]); `in` must divide."""
    out_dim, in_dim = weight.shape
    if in_dim % group_size:
        raise ValueError(f"input dim {in_dim} is not a multiple of group size {group_size}")
    low, high = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    groups = weight.float().reshape(out_dim, in_dim // group_size, group_size)
    scale = _scale(groups.abs().amax(dim=2), high)
    codes = torch.round(groups / scale[..., None]).clamp(low, high).to(torch.int8)
    return codes.reshape(out_dim, in_dim), scale


def dequantize_groupwise(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    out_dim, in_dim = codes.shape
    group_size = in_dim // scale.shape[1]
    return (codes.float().reshape(out_dim, -1, group_size) * scale[..., None]).reshape(out_dim, in_dim)


def quantize_fp8(tensor: torch.Tensor, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor FP8 E4M3 -> (float8_e4m3fn codes, float32 scale of shape [1]); never NaN for finite input."""
    peak = tensor.abs().amax() if amax is None else amax
    scale = _scale(peak.reshape(1), FP8_E4M3_MAX)
    codes = (tensor.float() / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return codes, scale


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """int4 codes [out, in] (values -8..7, out even) -> int8 [out / 2, in]: row 2j in the low nibble, 2j+1 in the
    high one (ModelOpt's `pack_int4_in_uint8` layout)."""
    if codes.shape[0] % 2:
        raise ValueError(f"output dim {codes.shape[0]} must be even to pack two int4 rows per byte")
    nibbles = codes.to(torch.int16) & 0xF
    packed = nibbles[0::2] | (nibbles[1::2] << 4)
    return packed.to(torch.uint8).view(torch.int8)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    raw = packed.view(torch.uint8).to(torch.int16)
    low, high = raw & 0xF, raw >> 4
    codes = torch.stack([low, high], dim=1).reshape(-1, packed.shape[1])
    return torch.where(codes > 7, codes - 16, codes).to(torch.int8)


def int4_proto(name: str, codes: torch.Tensor) -> TensorProto:
    """int4 codes (int8 tensor, values -8..7) as an ONNX initializer in ONNX's packing: consecutive elements in
    row-major order share a byte, the first in the low nibble (onnx.helper.make_tensor's int4 rule)."""
    from onnx import TensorProto

    flat = codes.reshape(-1).to(torch.int16) & 0xF
    if flat.numel() % 2:
        flat = torch.cat([flat, flat.new_zeros(1)])
    packed = (flat[0::2] | (flat[1::2] << 4)).to(torch.uint8)
    proto = TensorProto(name=name, data_type=TensorProto.INT4, dims=list(codes.shape))
    proto.raw_data = packed.numpy().tobytes()
    return proto


def fake_quant(x: torch.Tensor, scale: float, kind: str) -> torch.Tensor:
    """Quantize-dequantize `x` at a static per-tensor `scale`, as the engine's Q/DQ pair does: kind "FP8" (E4M3,
    saturated) or "INT8" (round to nearest, clamped to [-128, 127])."""
    if kind == "FP8":
        return (x / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).to(x.dtype) * scale
    return torch.round(x / scale).clamp(-128, 127) * scale  # INT8
