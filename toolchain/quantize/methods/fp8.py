"""FP8: E4M3 weights and activations, per-tensor static scales. PREFIX.weight float8_e4m3fn [out, in];
PREFIX.weights_scaling_factor and PREFIX.activation_scaling_factor float32 [1].

mlp.fc and mlp.gate share their scales where both are quantized: TensorRT-LLM fuses the two into one GEMM with
one per-tensor scale, max(gate scale, fc scale), re-quantizing the FP8 weights to it (`fuse_gate_mlp`,
tensorrt_llm/models/modeling_utils.py); ModelOpt's export gives both that max amax up front
(`preprocess_linear_fusion`, modelopt/torch/export/quant_utils.py). So `prepare` takes the max |w| of the two
before either is quantized, and the fused pair's activation scale is the max of the two inputs' too.
"""

from __future__ import annotations

from typing import Any

import torch

from toolchain.checkpoint.safetensors_io import TensorInfo
from toolchain.quantize.core import FP8_E4M3_MAX, quantize_fp8
from toolchain.quantize.methods.base import Context, GraphBuilder, Layer, QuantMethod, info
from toolchain.quantize.methods.w8a8_sq import activation_scale


def _partner(prefix: str) -> str | None:
    if prefix.endswith(".mlp.fc"):
        return prefix.removesuffix(".fc") + ".gate"
    if prefix.endswith(".mlp.gate"):
        return prefix.removesuffix(".gate") + ".fc"
    return None


class FP8(QuantMethod):
    quant_algo = "FP8"
    needs_calibration = True
    streamable = False
    activation_kind = "FP8"

    def plan(self, prefix: str, shape: tuple[int, ...], ctx: Context) -> dict[str, TensorInfo]:
        out_dim, in_dim = shape
        return {
            **info(f"{prefix}.weight", torch.float8_e4m3fn, out_dim, in_dim),
            **info(f"{prefix}.weights_scaling_factor", torch.float32, 1),
            **info(f"{prefix}.activation_scaling_factor", torch.float32, 1),
        }

    def prepare(self, layer: Layer, ctx: Context) -> dict[str, Any]:
        """The weight amax each of mlp.fc and mlp.gate shares with the other (both quantized), by prefix."""
        shared: dict[str, torch.Tensor] = {}
        for fc in [p for p in layer.linears if p.endswith(".mlp.fc")]:
            gate = _partner(fc)
            if gate in layer.linears:
                w = layer.tensors
                shared[fc] = shared[gate] = torch.maximum(
                    w[f"{fc}.weight"].abs().amax(), w[f"{gate}.weight"].abs().amax()
                )
        return shared

    def quantize(
        self, prefix: str, weight: torch.Tensor, ctx: Context, prepared: Any = None
    ) -> dict[str, torch.Tensor]:
        codes, scale = quantize_fp8(weight, prepared)
        partner = _partner(prefix) if prepared is not None else None  # fused: one activation scale too (the max)
        amax = ctx.calib.input_amax
        act = activation_scale(max(amax[prefix], amax.get(partner, 0.0) if partner else 0.0), FP8_E4M3_MAX)
        return {
            f"{prefix}.weight": codes,
            f"{prefix}.weights_scaling_factor": scale,
            f"{prefix}.activation_scaling_factor": act,
        }

    def dequantize(self, codes: torch.Tensor, scale: torch.Tensor, in_features: int) -> torch.Tensor:
        return codes.float() * scale

    def export(
        self, b: GraphBuilder, prefix: str, codes: torch.Tensor, scale: torch.Tensor, in_features: int, group_size: int
    ) -> str:
        sname = b.const(f"{prefix}.weights_scaling_factor", scale.reshape(()))
        return b.op("DequantizeLinear", [b.const(f"{prefix}.weight", codes), sname], f"{prefix}.weight_dq")
