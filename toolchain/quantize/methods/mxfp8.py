"""MXFP8 (OCP Microscaling Formats v1.0): FP8 E4M3 weights and activations in blocks of 32 along the input, each
block's scale a power of two stored as E8M0 — TensorRT-LLM's `QuantAlgo.MXFP8`, TensorRT Edge-LLM's MXFP8.

PREFIX.weight float8_e4m3fn [out, in]; PREFIX.weights_scaling_factor uint8 [out, in/32] (E8M0: 2^(s − 127)). The
input is quantized at run time the same way (per 32, a power-of-two scale each); nothing static is stored for it.
MXFP8 means these per-32 block scales, never per-tensor FP8 relabelled.
"""

from __future__ import annotations

import torch

from toolchain.checkpoint.prequant.codecs import e8m0_decode
from toolchain.checkpoint.safetensors_io import TensorInfo
from toolchain.quantize.methods.base import WEIGHT, WEIGHT_SCALE, Context, QuantMethod, Stored, info
from toolchain.quantize.methods.nvfp4 import check_blocks

BLOCK = 32


class MXFP8(QuantMethod):
    quant_algo = "MXFP8"
    suffixes = (WEIGHT, WEIGHT_SCALE)

    def plan(self, prefix: str, shape: tuple[int, ...], ctx: Context) -> dict[str, TensorInfo]:
        out_dim, in_dim = shape
        check_blocks(prefix, in_dim, BLOCK, "MXFP8")
        return {
            **info(f"{prefix}.{WEIGHT}", torch.float8_e4m3fn, out_dim, in_dim),
            **info(f"{prefix}.{WEIGHT_SCALE}", torch.uint8, out_dim, in_dim // BLOCK),
        }

    def dequantize(self, s: Stored) -> torch.Tensor:
        scales = torch.from_numpy(e8m0_decode(s[WEIGHT_SCALE].numpy()))
        return s[WEIGHT].float() * torch.repeat_interleave(scales, BLOCK, dim=1)
