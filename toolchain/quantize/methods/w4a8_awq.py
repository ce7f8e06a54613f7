"""W4A8_AWQ: int4 weights per group with AWQ's per-input-channel scales (w4a16_awq's layout) and FP8 activations
per tensor — ModelOpt's `w4a8_awq` and TensorRT-LLM's `QuantAlgo.W4A8_AWQ`.

PREFIX.weight int8 [out/2, in'] and PREFIX.weights_scaling_factor float32 [out, in'/G] as W4A16 (the full int4
step: ModelOpt's `weight_scale`); PREFIX.prequant_scaling_factor [in] (1/s); PREFIX.weights_scaling_factor_2
float32 [1] (ModelOpt's `weight_scale_2`, the scale of its FP8 stage of the weight); PREFIX.activation_scaling_factor
float32 [1] (the static FP8 input scale). Whether the engine re-rounds the dequantized weight to FP8 at
weights_scaling_factor_2 follows ModelOpt's fake-quant forward (the method's `dequantize` says which).
"""

from __future__ import annotations

import torch

from toolchain.checkpoint.safetensors_io import TensorInfo
from toolchain.quantize.methods.base import (
    ACTIVATION_SCALE,
    PARTS,
    PREQUANT,
    WEIGHT,
    WEIGHT_SCALE,
    WEIGHT_SCALE_2,
    Context,
    info,
)
from toolchain.quantize.methods.w4a16_awq import W4A16Awq


class W4A8Awq(W4A16Awq):
    quant_algo = "W4A8_AWQ"
    suffixes = (WEIGHT, WEIGHT_SCALE, PREQUANT, WEIGHT_SCALE_2, ACTIVATION_SCALE, PARTS)
    activation_kind = "FP8"
    details_key = "awq"

    def plan(self, prefix: str, shape: tuple[int, ...], ctx: Context) -> dict[str, TensorInfo]:
        return {
            **super().plan(prefix, shape, ctx),
            **info(f"{prefix}.{WEIGHT_SCALE_2}", torch.float32, 1),
            **info(f"{prefix}.{ACTIVATION_SCALE}", torch.float32, 1),
        }
