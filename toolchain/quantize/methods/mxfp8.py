"""MXFP8 (OCP Microscaling Formats v1.0): FP8 E4M3 weights and activations in blocks of 32 along the input, each
block's scale a power of two stored as E8M0 — TensorRT-LLM's `QuantAlgo.MXFP8`, TensorRT Edge-LLM's MXFP8.

PREFIX.weight float8_e4m3fn [out, in]; PREFIX.weights_scaling_factor uint8 [out, in/32] (E8M0: 2^(s − 127)). The
input is quantized at run time the same way (per 32, a power-of-two scale each); nothing static is stored for it.
MXFP8 means these per-32 block scales, never per-tensor FP8 relabelled.

The block scale: X = 2^ceil(log2(amax / 448)), the exponent clamped to [−127, 127] (an all-zero block: 2^−127), then
codes = E4M3(clamp(x / X, ±448)), round to nearest even. That is NVIDIA's rule — ModelOpt 0.47
modelopt/torch/quantization/qtensor/mxfp8_tensor.py `MXFP8QTensor._compute_e8m0_exponent` and `quantize_with_scale`,
cuDNN's block-scale quantize ("scale = quantize_round_up(amax / vmax)"); TensorRT's DynamicQuantize page does not
state its rounding (assumed the same, unverified: nothing here runs TensorRT). OCP MX v1.0 §6.3's reference
conversion differs: X = 2^(floor(log2 amax) − 8) (8: E4M3's largest exponent), values past 448 saturating. The two
agree unless a block's amax / 2^floor(log2 amax) exceeds 1.75 (448 = 1.75 · 2^8): there OCP's scale saturates the
block's largest values at 448, NVIDIA's takes the next power of two. docs/quality.md compares the two on
stories260K.

The graph is TensorRT's (ModelOpt's ONNX export, torch/quantization/export_onnx.py `export_mxfp8`, and
onnx/export/mxfp8_exporter.py): the weight `trt::TRT_MXFP8DequantizeLinear(E4M3 weight, uint8 E8M0 scales;
axis=-1, block_size=32, output_dtype=FLOAT)`; the input `trt::TRT_MXFP8DynamicQuantize(x; axis=-1, block_size=32,
output_dtype=FLOAT8E4M3FN) -> (x_fp8, scales)` then `trt::TRT_MXFP8DequantizeLinear(x_fp8, scales; ...,
output_dtype=the engine dtype)`. The CPU engine lowers both when it loads the graph (engine/trt_ops.py).
"""

from __future__ import annotations

from typing import Any

import torch

from toolchain.checkpoint.prequant.codecs import e8m0_decode
from toolchain.checkpoint.safetensors_io import TensorInfo
from toolchain.quantize.core import FP8_E4M3_MAX
from toolchain.quantize.methods.base import (
    WEIGHT,
    WEIGHT_SCALE,
    Context,
    GraphBuilder,
    InputScales,
    QuantMethod,
    Stored,
    info,
)
from toolchain.quantize.methods.nvfp4 import TRT_DOMAIN, check_blocks

BLOCK = 32
E8M0_BIAS = 127
MXFP8_QUANTIZE_OP, MXFP8_DEQUANTIZE_OP = "TRT_MXFP8DynamicQuantize", "TRT_MXFP8DequantizeLinear"


def e8m0_exponents(amax: torch.Tensor) -> torch.Tensor:
    """Per-block amax -> the unbiased exponent ceil(log2(amax / 448)) in [−127, 127] (0 amax: −127)."""
    descale = amax.float() / FP8_E4M3_MAX
    log2 = torch.where(descale > 0, torch.log2(descale), torch.full_like(descale, -127.0))
    return torch.ceil(log2).clamp(-127, 127)


def mxfp8_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., n] (n a multiple of 32) -> (float8_e4m3fn codes [..., n], uint8 E8M0 scales [..., n/32])."""
    blocks = x.float().reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    exponent = e8m0_exponents(blocks.abs().amax(dim=-1))
    scaled = blocks * torch.exp2(-exponent).unsqueeze(-1)  # a power of two: exact
    codes = scaled.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).reshape(x.shape)
    return codes, (exponent + E8M0_BIAS).to(torch.uint8)


def mxfp8_dequantize(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """codes [..., n] times their block's 2^(s − 127), float32 (exact)."""
    values = torch.from_numpy(e8m0_decode(scales.numpy()))
    return codes.float() * torch.repeat_interleave(values, BLOCK, dim=-1)


def mxfp8_qdq(x: torch.Tensor) -> torch.Tensor:
    """Quantize-dequantize x [..., n] in blocks of 32 along the last axis, in x's dtype: what the engine's
    TRT_MXFP8DynamicQuantize and TRT_MXFP8DequantizeLinear compute."""
    codes, scales = mxfp8_quantize(x)
    return mxfp8_dequantize(codes, scales).to(x.dtype)


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

    def quantize(
        self, prefix: str, weight: torch.Tensor, ctx: Context, prepared: Any = None
    ) -> dict[str, torch.Tensor]:
        check_blocks(prefix, weight.shape[1], BLOCK, "MXFP8")
        codes, scales = mxfp8_quantize(weight)
        return {f"{prefix}.{WEIGHT}": codes, f"{prefix}.{WEIGHT_SCALE}": scales}

    def dequantize(self, s: Stored) -> torch.Tensor:
        return mxfp8_dequantize(s[WEIGHT], s[WEIGHT_SCALE])

    def input_scales(self, s: Stored) -> InputScales:
        raise NotImplementedError("MXFP8 quantizes its input in blocks at run time: fake_linear computes it")

    def fake_linear(self, s: Stored, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        return torch.nn.functional.linear(mxfp8_qdq(x), weight)

    def export_input(self, b: GraphBuilder, s: Stored, x: str) -> str:
        from onnx import TensorProto

        q = b.op(
            MXFP8_QUANTIZE_OP,
            [x],
            f"{s.prefix}.input_mxfp8",
            outputs=2,  # _Builder.node's: the outputs are named NAME:0 and NAME:1
            domain=TRT_DOMAIN,
            axis=-1,
            block_size=BLOCK,
            output_dtype=TensorProto.FLOAT8E4M3FN,
        )
        engine_type = getattr(b, "onnx_dtype", TensorProto.FLOAT)  # the exporter's engine dtype
        return b.op(
            MXFP8_DEQUANTIZE_OP,
            [q, q.removesuffix(":0") + ":1"],
            f"{s.prefix}.input_dq",
            domain=TRT_DOMAIN,
            axis=-1,
            block_size=BLOCK,
            output_dtype=engine_type,
        )

    def export_weight(self, b: GraphBuilder, s: Stored) -> str:
        from onnx import TensorProto, numpy_helper

        codes = b.const(s.name(WEIGHT), s[WEIGHT])
        scales = b.add_initializer(numpy_helper.from_array(s[WEIGHT_SCALE].numpy(), s.name(WEIGHT_SCALE)))
        return b.op(
            MXFP8_DEQUANTIZE_OP,
            [codes, scales],
            f"{s.prefix}.weight_dq",
            domain=TRT_DOMAIN,
            axis=-1,
            block_size=BLOCK,
            output_dtype=TensorProto.FLOAT,
        )
