"""NVFP4: FP4 E2M1 weights and activations in blocks of 16 along the input, each block's scale an FP8 E4M3 value,
over a float32 per-tensor ("global") scale — ModelOpt's default format (`NVFP4QTensor`) and TensorRT-LLM's
`QuantAlgo.NVFP4`.

PREFIX.weight uint8 [out, in/2] (two E2M1 codes a byte, the even input column in the low nibble);
PREFIX.weights_scaling_factor float8_e4m3fn [out, in/16] (the block scales); PREFIX.weights_scaling_factor_2
float32 [1] (the global scale: it multiplies, w = e2m1 · block scale · global, as ModelOpt's `weight_scale_2` and
TensorRT-LLM's `weights_global_scaling_factor`); PREFIX.activation_scaling_factor float32 [1] (the input's global
scale, ModelOpt's `input_scale`, multiplying likewise: at run time the input is quantized in blocks of 16 with
E4M3 block scales over it). With PREFIX.parts (a fused GEMM's per-projection scales) the two global scales hold one
value per part. TensorRT-LLM's kernel-side tensors (`weights_block_scaling_factor_interleaved`, `alpha`) are
swizzles and products of these, not written.
"""

from __future__ import annotations

import torch

from toolchain.checkpoint.prequant.codecs import e2m1_decode
from toolchain.checkpoint.safetensors_io import TensorInfo
from toolchain.errors import UserError
from toolchain.quantize.methods.base import (
    ACTIVATION_SCALE,
    PARTS,
    WEIGHT,
    WEIGHT_SCALE,
    WEIGHT_SCALE_2,
    Context,
    QuantMethod,
    Stored,
    info,
    per_row,
)

BLOCK = 16


def check_blocks(prefix: str, in_dim: int, block: int, name: str) -> None:
    if in_dim % block:
        raise UserError(f"{prefix}: {in_dim} input channels; {name} needs a multiple of {block}")


class NVFP4(QuantMethod):
    quant_algo = "NVFP4"
    suffixes = (WEIGHT, WEIGHT_SCALE, WEIGHT_SCALE_2, ACTIVATION_SCALE, PARTS)

    def plan(self, prefix: str, shape: tuple[int, ...], ctx: Context) -> dict[str, TensorInfo]:
        out_dim, in_dim = shape
        check_blocks(prefix, in_dim, BLOCK, "NVFP4")
        return {
            **info(f"{prefix}.{WEIGHT}", torch.uint8, out_dim, in_dim // 2),
            **info(f"{prefix}.{WEIGHT_SCALE}", torch.float8_e4m3fn, out_dim, in_dim // BLOCK),
            **info(f"{prefix}.{WEIGHT_SCALE_2}", torch.float32, 1),
            **info(f"{prefix}.{ACTIVATION_SCALE}", torch.float32, 1),
        }

    def dequantize(self, s: Stored) -> torch.Tensor:
        values = torch.from_numpy(e2m1_decode(s[WEIGHT].numpy()))
        out_dim = values.shape[0]
        block = torch.repeat_interleave(s.weight_scale(), BLOCK, dim=1)
        return values * block * per_row(s, s[WEIGHT_SCALE_2], out_dim)
