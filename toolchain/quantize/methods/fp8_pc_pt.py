"""FP8 with activations quantized at run time (dynamic), read from pre-quantized checkpoints.

FP8_PER_CHANNEL_PER_TOKEN (TensorRT-LLM's QuantAlgo; compressed-tensors' "FP8-dynamic": channel weights, token
inputs): PREFIX.weight float8_e4m3fn [out, in]; PREFIX.weights_scaling_factor float32 [out] (one scale per output
row); each token's input row quantized to E4M3 at its own scale max|x| / 448 at run time.

FP8_DYNAMIC (ours: TensorRT-LLM has no QuantAlgo for per-tensor weights with a dynamic per-tensor input scale,
compressed-tensors' `strategy: tensor, dynamic: true`): PREFIX.weights_scaling_factor float32 [1] (or one per part
with PREFIX.parts); the whole input quantized at max|x| / 448 at run time.
"""

from __future__ import annotations

import torch

from toolchain.checkpoint.safetensors_io import TensorInfo
from toolchain.quantize.methods.base import PARTS, WEIGHT, WEIGHT_SCALE, Context, QuantMethod, Stored, info, per_row


class FP8PerChannelPerToken(QuantMethod):
    quant_algo = "FP8_PER_CHANNEL_PER_TOKEN"
    suffixes = (WEIGHT, WEIGHT_SCALE)

    def plan(self, prefix: str, shape: tuple[int, ...], ctx: Context) -> dict[str, TensorInfo]:
        out_dim, in_dim = shape
        return {
            **info(f"{prefix}.{WEIGHT}", torch.float8_e4m3fn, out_dim, in_dim),
            **info(f"{prefix}.{WEIGHT_SCALE}", torch.float32, out_dim),
        }

    def dequantize(self, s: Stored) -> torch.Tensor:
        return s[WEIGHT].float() * s.weight_scale().reshape(-1, 1)


class FP8Dynamic(QuantMethod):
    quant_algo = "FP8_DYNAMIC"
    suffixes = (WEIGHT, WEIGHT_SCALE, PARTS)

    def plan(self, prefix: str, shape: tuple[int, ...], ctx: Context) -> dict[str, TensorInfo]:
        out_dim, in_dim = shape
        return {
            **info(f"{prefix}.{WEIGHT}", torch.float8_e4m3fn, out_dim, in_dim),
            **info(f"{prefix}.{WEIGHT_SCALE}", torch.float32, 1),
        }

    def dequantize(self, s: Stored) -> torch.Tensor:
        w = s[WEIGHT].float()
        return w * per_row(s, s.weight_scale(), w.shape[0])
