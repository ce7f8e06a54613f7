"""FP8_BLOCK_SCALES: FP8 E4M3 weights with one float32 scale per square block of G x G (config.json's group_size,
128 in every checkpoint met: Qwen3-*-FP8, DeepSeek-V3; TensorRT-LLM asserts 128), activations quantized at run time
per token in groups of G input channels (1 x G, dynamic), as TensorRT-LLM runs FP8_BLOCK_SCALES.

PREFIX.weight float8_e4m3fn [out, in]; PREFIX.weights_scaling_factor float32 [ceil(out/G), ceil(in/G)] (it
multiplies: the checkpoint's `weight_scale_inv` is, despite its name, the dequantization factor); the last block of
a row or column may be partial.
"""

from __future__ import annotations

import torch

from toolchain.checkpoint.safetensors_io import TensorInfo
from toolchain.quantize.methods.base import WEIGHT, WEIGHT_SCALE, Context, QuantMethod, Stored, info


def _blocks(n: int, g: int) -> int:
    return -(-n // g)


class FP8Block(QuantMethod):
    quant_algo = "FP8_BLOCK_SCALES"
    suffixes = (WEIGHT, WEIGHT_SCALE)
    grouped = True

    def plan(self, prefix: str, shape: tuple[int, ...], ctx: Context) -> dict[str, TensorInfo]:
        out_dim, in_dim = shape
        g = ctx.group_size
        return {
            **info(f"{prefix}.{WEIGHT}", torch.float8_e4m3fn, out_dim, in_dim),
            **info(f"{prefix}.{WEIGHT_SCALE}", torch.float32, _blocks(out_dim, g), _blocks(in_dim, g)),
        }

    def dequantize(self, s: Stored) -> torch.Tensor:
        w, g = s[WEIGHT].float(), s.group_size
        scale = s.weight_scale().repeat_interleave(g, dim=0).repeat_interleave(g, dim=1)
        return w * scale[: w.shape[0], : w.shape[1]]
