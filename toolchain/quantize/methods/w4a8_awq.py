"""W4A8_AWQ: int4 weights per group with AWQ's per-input-channel scales (w4a16_awq's layout) and FP8 activations
per tensor — ModelOpt's `w4a8_awq` and TensorRT-LLM's `QuantAlgo.W4A8_AWQ`.

PREFIX.weight int8 [out/2, in'] and PREFIX.weights_scaling_factor float32 [out, in'/G] as W4A16 (the full int4
step: ModelOpt's `weight_scale`); PREFIX.prequant_scaling_factor [in] (1/s); PREFIX.weights_scaling_factor_2
float32 [1] (ModelOpt's `weight_scale_2`, the scale of its FP8 stage of the weight); PREFIX.activation_scaling_factor
float32 [1] (the static FP8 input scale, of the input after the prequant multiply).

What weights_scaling_factor_2 means, measured (ModelOpt 0.47, `W4A8_AWQ_BETA_CFG` on a CPU Linear): the weight
quantizer is a `SequentialQuantizer` [int4 per group of 128, FP8 per tensor], so the forward multiplies the input's
FP8 fake-quant by w' = FP8(int4(w) / ws2) · ws2 with ws2 = amax(int4(w)) / 448 — the int4-dequantized weight
re-rounded to E4M3 at ws2 (the linear's output equals that product exactly; leaving the FP8 stage out differs by
0.03 on a 256-wide row). The export's `weight_scale` = the int4 amax / 7 and its codes round(w / weight_scale)
(modelopt/torch/export/quant_utils.py `get_weight_scaling_factor`, `pack_int4_in_uint8`), `weight_scale_2` = the FP8
stage's amax / 448 (`get_weight_scaling_factor_2`): so the dequantized weight is E4M3(codes · ws / ws2) · ws2 — what
TensorRT-LLM's W4A8 kernel computes too (int4 codes times ws / ws2 converted to FP8, an FP8 GEMM, alpha = the input
scale · ws2). `dequantize` is that; the graph is DequantizeLinear(int4 codes, ws, blocked) -> QuantizeLinear(E4M3,
ws2) -> DequantizeLinear(ws2), and the input's static FP8 Q/DQ after the prequant Mul (base.py `export_input`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from toolchain.checkpoint.safetensors_io import TensorInfo
from toolchain.errors import UserError
from toolchain.quantize.core import FP8_E4M3_MAX, dequantize_groupwise, fake_quant, int4_proto, unpack_int4
from toolchain.quantize.methods.base import (
    ACTIVATION_SCALE,
    PARTS,
    PREQUANT,
    WEIGHT,
    WEIGHT_SCALE,
    WEIGHT_SCALE_2,
    Context,
    GraphBuilder,
    InputScales,
    Stored,
    info,
    per_row,
    zero_point,
)
from toolchain.quantize.methods.w4a16_awq import W4A16Awq
from toolchain.quantize.methods.w8a8_sq import activation_scale


def fp8_stage(w: torch.Tensor, ws2: torch.Tensor) -> torch.Tensor:
    """E4M3(w / ws2) · ws2, saturating at ±448 (`ws2` [1] or a column [out, 1])."""
    return (w / ws2).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).float() * ws2


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

    def quantize(
        self, prefix: str, weight: torch.Tensor, ctx: Context, prepared: Any = None
    ) -> dict[str, torch.Tensor]:
        made = super().quantize(prefix, weight, ctx, prepared)
        int4 = dequantize_groupwise(unpack_int4(made[f"{prefix}.{WEIGHT}"]), made[f"{prefix}.{WEIGHT_SCALE}"])
        ws2 = activation_scale(int4.abs().amax().item(), FP8_E4M3_MAX)  # the FP8 stage's amax / 448
        # the input the FP8 quantizer sees is x · (1/s): its amax from the per-channel calibration maxima
        pre = made[f"{prefix}.{PREQUANT}"].double()
        act = activation_scale((ctx.calib.input_channel_amax[prefix] * pre).max().item(), FP8_E4M3_MAX)
        return {**made, f"{prefix}.{WEIGHT_SCALE_2}": ws2, f"{prefix}.{ACTIVATION_SCALE}": act}

    def dequantize(self, s: Stored) -> torch.Tensor:
        int4 = super().dequantize(s)
        return fp8_stage(int4, per_row(s, s[WEIGHT_SCALE_2], int4.shape[0]))

    def input_scales(self, s: Stored) -> InputScales:
        """Without parts, the prequant and the static FP8 scale; with parts there is no one scale (`fake_linear`)."""
        scales = super().input_scales(s)
        return InputScales(scales.prequant, None) if s.get(PARTS) is not None else scales

    def fake_linear(self, s: Stored, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        """x · 1/s, FP8 fake-quantized at the activation scale (each part's own where the linear has parts: those
        rows with it), times the dequantized weight."""
        pre, acts = s[PREQUANT], s[ACTIVATION_SCALE].float().reshape(-1)
        x = x * pre.to(x.dtype)
        parts = s.get(PARTS)
        if parts is None:
            return F.linear(fake_quant(x, acts[0].item(), "FP8"), weight)
        rows = torch.split(weight, parts.long().tolist())
        return torch.cat([F.linear(fake_quant(x, a.item(), "FP8"), w) for a, w in zip(acts, rows, strict=True)], -1)

    def export(self, b: GraphBuilder, s: Stored, x: str) -> tuple[str, str]:
        if s.get(PARTS) is not None:
            raise UserError(f"{s.name(PARTS)}: per-part W4A8 scales are exported by export_gemm, one GEMM a part")
        return self.export_input(b, s, x), self.export_weight(b, s)

    def export_weight(self, b: GraphBuilder, s: Stored) -> str:
        int4 = super().export_weight(b, s)
        ws2 = b.const(s.name(WEIGHT_SCALE_2), s[WEIGHT_SCALE_2].float().reshape(()))
        q = b.op("QuantizeLinear", [int4, ws2, zero_point(b, "FP8")], f"{s.prefix}.weight_fp8")
        return b.op("DequantizeLinear", [q, ws2], f"{s.prefix}.weight_fp8_dq")

    def export_gemm(self, b: GraphBuilder, s: Stored, x: str) -> str | None:
        """With parts: x · 1/s once, then per part the input's FP8 Q/DQ at the part's scale and a Gemm with the
        part's rows (int4 DequantizeLinear, its FP8 stage at the part's weights_scaling_factor_2), concatenated.
        Without parts: None (`export`)."""
        parts = s.get(PARTS)
        if parts is None:
            return None
        p = s.prefix
        x = b.op("Mul", [x, b.float_const(s.name(PREQUANT), s[PREQUANT])], f"{p}.input_prequant")
        acts, ws2 = s[ACTIVATION_SCALE].float().reshape(-1), s[WEIGHT_SCALE_2].float().reshape(-1)
        codes, scales = unpack_int4(s[WEIGHT])[:, : s.in_features], s.weight_scale()
        outs, start = [], 0
        for i, rows in enumerate(parts.long().tolist()):
            act = b.float_const(f"{s.name(ACTIVATION_SCALE)}.{i}", acts[i].reshape(()))
            q = b.op("QuantizeLinear", [x, act, zero_point(b, "FP8")], f"{p}.part{i}.input_q")
            xi = b.op("DequantizeLinear", [q, act], f"{p}.part{i}.input_dq")
            part = b.add_initializer(int4_proto(f"{s.name(WEIGHT)}.{i}", codes[start : start + rows]))
            scale = b.const(f"{s.name(WEIGHT_SCALE)}.{i}", scales[start : start + rows])
            int4 = b.op("DequantizeLinear", [part, scale], f"{p}.part{i}.weight_dq", axis=1, block_size=s.group_size)
            g = b.const(f"{s.name(WEIGHT_SCALE_2)}.{i}", ws2[i].reshape(()))
            fp8 = b.op("QuantizeLinear", [int4, g, zero_point(b, "FP8")], f"{p}.part{i}.weight_fp8")
            dq = b.op("DequantizeLinear", [fp8, g], f"{p}.part{i}.weight_fp8_dq")
            wi = b.op("CastLike", [dq, xi], f"{p}.part{i}.weight_cast")
            outs.append(b.op("Gemm", [xi, wi], f"{p}.part{i}.out", transB=1))
            start += rows
        return b.op("Concat", outs, f"{p}.parts", axis=-1)
