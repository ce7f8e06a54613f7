"""FP8: E4M3 weights and activations, per-tensor static scales. PREFIX.weight float8_e4m3fn [out, in];
PREFIX.weights_scaling_factor and PREFIX.activation_scaling_factor float32 [1].

mlp.fc and mlp.gate share their scales where both are quantized: TensorRT-LLM fuses the two into one GEMM with
one per-tensor scale, max(gate scale, fc scale), re-quantizing the FP8 weights to it (`fuse_gate_mlp`,
tensorrt_llm/models/modeling_utils.py); ModelOpt's export gives both that max amax up front
(`preprocess_linear_fusion`, modelopt/torch/export/quant_utils.py). So `prepare` takes the max |w| of the two
before either is quantized, and the fused pair's activation scale is the max of the two inputs' too.

Per-part scales (imported checkpoints only: checkpoint/prequant/; decision D4 of issue 28): with PREFIX.parts int64
[parts] (the output rows of each fused projection, q/k/v into attention.qkv), PREFIX.weights_scaling_factor and
PREFIX.activation_scaling_factor hold one float32 value per part. Each part's rows multiply the input quantized at
that part's own activation scale — never requantized to the largest (issue 28: that cost KLD 0.02) — so the graph
is one Q/DQ of the input, one weight DequantizeLinear and one Gemm per part, then a Concat of the parts' outputs
(`export_gemm`), and the reference likewise (`fake_linear`). `quantize --method fp8` never writes parts.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import reduce
from typing import Any

import torch
import torch.nn.functional as F

from toolchain.checkpoint.safetensors_io import TensorInfo
from toolchain.quantize.core import FP8_E4M3_MAX, fake_quant, quantize_fp8
from toolchain.quantize.methods.base import (
    ACTIVATION_SCALE,
    PARTS,
    WEIGHT,
    WEIGHT_SCALE,
    Context,
    GraphBuilder,
    InputScales,
    Layer,
    QuantMethod,
    Stored,
    info,
    per_row,
    zero_point,
)
from toolchain.quantize.methods.w8a8_sq import activation_scale


@dataclass(frozen=True)
class Fused:
    """What linears fused into one GEMM (the spec's group reading one input: mlp.fc with mlp.gate) share: the
    largest |w| of them all, and the linears whose input maxima set the one activation scale."""

    weight_amax: torch.Tensor
    linears: tuple[str, ...]


class FP8(QuantMethod):
    quant_algo = "FP8"
    suffixes = (WEIGHT, WEIGHT_SCALE, ACTIVATION_SCALE, PARTS)
    needs_calibration = True
    streamable = False
    activation_kind = "FP8"

    def plan(self, prefix: str, shape: tuple[int, ...], ctx: Context) -> dict[str, TensorInfo]:
        out_dim, in_dim = shape
        return {
            **info(f"{prefix}.{WEIGHT}", torch.float8_e4m3fn, out_dim, in_dim),
            **info(f"{prefix}.{WEIGHT_SCALE}", torch.float32, 1),
            **info(f"{prefix}.{ACTIVATION_SCALE}", torch.float32, 1),
        }

    def prepare(self, layer: Layer, ctx: Context) -> dict[str, Any]:
        """What each linear of a fused group (the layer spec's linears reading one input, more than one and all
        quantized: mlp.fc with mlp.gate) shares with the others, by prefix."""
        shared: dict[str, Fused] = {}
        for group in layer.spec.input_groups() if layer.spec else []:
            if len(group) > 1 and all(p in layer.linears for p in group):
                amax = reduce(torch.maximum, [layer.tensors[f"{p}.weight"].abs().amax() for p in group])
                shared.update(dict.fromkeys(group, Fused(amax, tuple(group))))
        return shared

    def quantize(
        self, prefix: str, weight: torch.Tensor, ctx: Context, prepared: Any = None
    ) -> dict[str, torch.Tensor]:
        fused = prepared if isinstance(prepared, Fused) else None
        codes, scale = quantize_fp8(weight, fused.weight_amax if fused else None)
        linears = fused.linears if fused else (prefix,)  # fused: one activation scale too (the max)
        act = activation_scale(max(ctx.calib.input_amax[p] for p in linears), FP8_E4M3_MAX)
        return {
            f"{prefix}.{WEIGHT}": codes,
            f"{prefix}.{WEIGHT_SCALE}": scale,
            f"{prefix}.{ACTIVATION_SCALE}": act,
        }

    def input_scales(self, s: Stored) -> InputScales:
        """Without parts, the static per-tensor scale; with parts there is no one scale (`fake_linear`)."""
        return InputScales() if s.get(PARTS) is not None else super().input_scales(s)

    def dequantize(self, s: Stored) -> torch.Tensor:
        if s.get(PARTS) is None:
            return s[WEIGHT].float() * s.weight_scale()
        w = s[WEIGHT].float()
        return w * per_row(s, s.weight_scale(), w.shape[0])

    def export_weight(self, b: GraphBuilder, s: Stored) -> str:
        scale = b.const(s.name(WEIGHT_SCALE), s.weight_scale().reshape(()))
        return b.op("DequantizeLinear", [b.const(s.name(WEIGHT), s[WEIGHT]), scale], f"{s.prefix}.weight_dq")

    def export_gemm(self, b: GraphBuilder, s: Stored, x: str) -> str | None:
        """With parts: per part, the input's Q/DQ at the part's activation scale (in the engine dtype, as
        `export_input`) and a Gemm with the part's rows dequantized at its weight scale (float32, cast like the
        input: the engine dtype, as the exporter casts a dequantized weight); the parts' outputs concatenated.
        Without parts: None (`export`'s one Q/DQ and one Gemm)."""
        parts = s.get(PARTS)
        if parts is None:
            return None
        codes, p = s[WEIGHT], s.prefix
        acts, scales = s[ACTIVATION_SCALE].reshape(-1), s.weight_scale().reshape(-1)
        outs, start = [], 0
        for i, rows in enumerate(parts.tolist()):
            act = b.float_const(f"{s.name(ACTIVATION_SCALE)}.{i}", acts[i].reshape(()))
            q = b.op("QuantizeLinear", [x, act, zero_point(b, "FP8")], f"{p}.part{i}.input_q")
            xi = b.op("DequantizeLinear", [q, act], f"{p}.part{i}.input_dq")
            part = b.const(f"{s.name(WEIGHT)}.{i}", codes[start : start + rows])
            scale = b.const(f"{s.name(WEIGHT_SCALE)}.{i}", scales[i].reshape(()))
            dq = b.op("DequantizeLinear", [part, scale], f"{p}.part{i}.weight_dq")
            wi = b.op("CastLike", [dq, xi], f"{p}.part{i}.weight_cast")
            outs.append(b.op("Gemm", [xi, wi], f"{p}.part{i}.out", transB=1))
            start += rows
        return b.op("Concat", outs, f"{p}.parts", axis=-1)

    def fake_linear(self, s: Stored, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        """With parts: each part's rows times the input fake-quantized at the part's scale, concatenated. Without:
        None, the reference's usual static per-tensor input quantization."""
        parts = s.get(PARTS)
        if parts is None:
            return None
        acts = s[ACTIVATION_SCALE].float().reshape(-1)
        rows = torch.split(weight, parts.tolist())
        return torch.cat([F.linear(fake_quant(x, a.item(), "FP8"), w) for a, w in zip(acts, rows, strict=True)], -1)
