"""FP8 with activations quantized at run time (dynamic), read from pre-quantized checkpoints.

FP8_PER_CHANNEL_PER_TOKEN (TensorRT-LLM's QuantAlgo; compressed-tensors' "FP8-dynamic": channel weights, token
inputs): PREFIX.weight float8_e4m3fn [out, in]; PREFIX.weights_scaling_factor float32 [out] (one scale per output
row); each token's input row quantized to E4M3 at its own scale max|x| / 448 at run time.

FP8_DYNAMIC (ours: TensorRT-LLM has no QuantAlgo for per-tensor weights with a dynamic per-tensor input scale,
compressed-tensors' `strategy: tensor, dynamic: true`): PREFIX.weights_scaling_factor float32 [1] (or one per part
with PREFIX.parts); the whole input quantized at max|x| / 448 at run time.

The run-time quantizer, in the graph and in the reference alike (`export_dynamic_fp8`, `fake_dynamic_fp8`), in
float32 whatever the engine dtype: scale = max(amax / 448, smallest normal float32), codes = E4M3(x / scale)
saturated to ±448 (round to nearest even: QuantizeLinear's and torch's cast), value = codes · scale. The floor
keeps an all-zero row (amax 0) from dividing 0 by 0: its codes are 0 whatever the scale, and any row with a
nonzero value has amax / 448 above it unless |x| < 448 · 2^-126, where the floor scale still holds every value. In
ONNX: Abs → ReduceMax → Div 448 → Max floor → Div → QuantizeLinear(FLOAT8E4M3FN, scale 1) → DequantizeLinear →
Mul, standard opset-21 ops that ONNX Runtime's CPU provider runs and TensorRT reads as explicit FP8 quantization.
Per-tensor dynamic scales cover every token the engine is given at once (a batch), as compressed-tensors' and
vLLM's do: the reference matches the engine on one sequence's prefill, not across different batchings.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from toolchain.checkpoint.safetensors_io import TensorInfo
from toolchain.quantize.core import FP8_E4M3_MAX
from toolchain.quantize.methods.base import (
    PARTS,
    WEIGHT,
    WEIGHT_SCALE,
    Context,
    GraphBuilder,
    QuantMethod,
    Stored,
    info,
    per_row,
    zero_point,
)

FLOOR = torch.finfo(torch.float32).tiny  # the dynamic scale's floor: 2^-126


def fake_dynamic_fp8(x: torch.Tensor, dims: tuple[int, ...] | None) -> torch.Tensor:
    """x quantized to E4M3 and back at max|x| / 448 over `dims` (kept; None: the whole tensor), in float32."""
    xf = x.float()
    amax = xf.abs().amax() if dims is None else xf.abs().amax(dim=dims, keepdim=True)
    scale = torch.clamp(amax / FP8_E4M3_MAX, min=FLOOR)
    codes = (xf / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return (codes.float() * scale).to(x.dtype)


def _const(b: GraphBuilder, name: str, value: torch.Tensor) -> str:
    """A graph-wide constant shared by every dynamic quantizer, added on first use."""
    if not b.has(name):
        b.const(name, value)
    return name


def export_dynamic_fp8(b: GraphBuilder, x: str, name: str, per_token: bool) -> str:
    """`fake_dynamic_fp8` in the graph for input `x` [tokens, in] in the engine dtype: the scale per token (the last
    axis reduced) or per tensor; returns the quantized-dequantized input in the type of `x`."""
    xf = b.op("CastLike", [x, _const(b, "fp8_dyn_f32", torch.zeros((), dtype=torch.float32))], f"{name}.f32")
    amax_inputs = [b.op("Abs", [xf], f"{name}.abs")]
    if per_token:
        amax_inputs.append(_const(b, "fp8_dyn_axes", torch.tensor([-1], dtype=torch.int64)))
    amax = b.op("ReduceMax", amax_inputs, f"{name}.amax", keepdims=1)
    step = b.op("Div", [amax, _const(b, "fp8_dyn_max", torch.tensor(FP8_E4M3_MAX))], f"{name}.step")
    scale = b.op("Max", [step, _const(b, "fp8_dyn_floor", torch.tensor(FLOOR))], f"{name}.scale")
    one = _const(b, "fp8_dyn_one", torch.tensor(1.0))
    q = b.op("QuantizeLinear", [b.op("Div", [xf, scale], f"{name}.div"), one, zero_point(b, "FP8")], f"{name}.q")
    y = b.op("Mul", [b.op("DequantizeLinear", [q, one], f"{name}.dq"), scale], f"{name}.fp8")
    return b.op("CastLike", [y, x], f"{name}.cast")


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

    def export_input(self, b: GraphBuilder, s: Stored, x: str) -> str:
        return export_dynamic_fp8(b, x, f"{s.prefix}.input", per_token=True)

    def export_weight(self, b: GraphBuilder, s: Stored) -> str:
        scale = b.const(s.name(WEIGHT_SCALE), s.weight_scale().reshape(-1))
        codes = b.const(s.name(WEIGHT), s[WEIGHT])
        return b.op("DequantizeLinear", [codes, scale], f"{s.prefix}.weight_dq", axis=0)

    def fake_linear(self, s: Stored, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(fake_dynamic_fp8(x, (-1,)), weight)


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

    def export_input(self, b: GraphBuilder, s: Stored, x: str) -> str:
        return export_dynamic_fp8(b, x, f"{s.prefix}.input", per_token=False)

    def export_weight(self, b: GraphBuilder, s: Stored) -> str:
        """One DequantizeLinear: a per-tensor scale, or with parts one scale per output row (axis 0), exact since
        every part reads the same dynamically quantized input."""
        codes = b.const(s.name(WEIGHT), s[WEIGHT])
        if s.get(PARTS) is None:
            scale = b.const(s.name(WEIGHT_SCALE), s.weight_scale().reshape(()))
            return b.op("DequantizeLinear", [codes, scale], f"{s.prefix}.weight_dq")
        rows = per_row(s, s.weight_scale(), s[WEIGHT].shape[0]).reshape(-1)
        scale = b.const(s.name(WEIGHT_SCALE), rows)
        return b.op("DequantizeLinear", [codes, scale], f"{s.prefix}.weight_dq", axis=0)

    def fake_linear(self, s: Stored, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(fake_dynamic_fp8(x, None), weight)
