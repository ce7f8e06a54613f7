"""W4A16_GPTQ: int4 weights per group of G input channels with integer zero points, optionally in act-order —
what GPTQ (gptqmodel), AutoAWQ's GEMM packing and compressed-tensors' asymmetric pack-quantized int4 hold.

PREFIX.weight uint8 [out/2, in] — unsigned codes 0..15, two output rows a byte, row 2j in the low nibble (our
w4a16 packing); PREFIX.weights_scaling_factor float32 [out, in/G]; PREFIX.weights_zero_point uint8 [out, in/G]
(0..15): w = (q − z) · s, per group. With PREFIX.input_perm int64 [in] (act-order), the stored columns are the
input's in that order (stored column j multiplies input channel input_perm[j]), so each group is contiguous and the
engine reads x[..., input_perm]; `dequantize` gives the weight in the model's column order. TensorRT-LLM's own
W4A16_GPTQ layout (a pre-scaled float `zero` [in/G, out], codes [in, out/4]) is a kernel layout we do not write.
"""

from __future__ import annotations

import torch

from toolchain.checkpoint.prequant.codecs import int4_rows_unpack
from toolchain.checkpoint.safetensors_io import TensorInfo
from toolchain.quantize.methods.base import (
    INPUT_PERM,
    WEIGHT,
    WEIGHT_SCALE,
    ZERO_POINT,
    Context,
    QuantMethod,
    Stored,
    info,
)
from toolchain.quantize.methods.nvfp4 import check_blocks


class W4A16Gptq(QuantMethod):
    quant_algo = "W4A16_GPTQ"
    suffixes = (WEIGHT, WEIGHT_SCALE, ZERO_POINT, INPUT_PERM)
    grouped = True

    def plan(self, prefix: str, shape: tuple[int, ...], ctx: Context) -> dict[str, TensorInfo]:
        out_dim, in_dim = shape
        check_blocks(prefix, in_dim, ctx.group_size, f"int4 per group of {ctx.group_size}")
        return {
            **info(f"{prefix}.{WEIGHT}", torch.uint8, out_dim // 2, in_dim),
            **info(f"{prefix}.{WEIGHT_SCALE}", torch.float32, out_dim, in_dim // ctx.group_size),
            **info(f"{prefix}.{ZERO_POINT}", torch.uint8, out_dim, in_dim // ctx.group_size),
        }

    def dequantize(self, s: Stored) -> torch.Tensor:
        codes = torch.from_numpy(int4_rows_unpack(s[WEIGHT].numpy(), signed=False)).float()
        g = s.group_size
        zeros = s[ZERO_POINT].float().repeat_interleave(g, dim=1)
        scales = s.weight_scale().repeat_interleave(g, dim=1)
        stored = (codes - zeros) * scales
        perm = s.get(INPUT_PERM)
        if perm is None:
            return stored
        w = torch.empty_like(stored)
        w[:, perm.long()] = stored
        return w
