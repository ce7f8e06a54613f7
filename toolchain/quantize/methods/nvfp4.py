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

The arithmetic is ModelOpt 0.47's, read in modelopt/torch/quantization/qtensor/nvfp4_tensor.py:
- global scale = amax / (6 · 448), in float32 (`NVFP4QTensor.get_weights_scaling_factor_2`; the input's the same of
  its calibrated amax, `get_activation_scaling_factor`: amax / (maxbound 6 · 448));
- block scale = block amax / (6 · global), 0 -> 1, clamped to [2^-9, 448] and cast to E4M3 (round to nearest even)
  (`get_weights_scaling_factor`, `_cast_per_block_scale_to_fp8`);
- codes = E2M1 of x / (block scale · global) — the product rounded to float32 first —, nearest with ties to the
  even code, |x| > 6 saturating, the sign bit set for every negative x (`quantize`, `_cast_fp4`);
- dequantization multiplies: e2m1 · (block scale · global) (`dequantize`: `per_block_scale = q_per_block_scale *
  double_scale`, then the data times it), which is also what TensorRT's two DequantizeLinear nodes compute.
Activations are quantized at run time by the same arithmetic over the stored input global scale (`nvfp4_qdq`): what
`NVFP4QTensor.quantize(x, 16, weights_scaling_factor_2=input_scale)` computes. ModelOpt's own activation
fake-quant is a CUDA kernel (tensor_quant.py `_dynamic_block_quantize_impl` refuses CPU amax;
kernels/quantization/gemm/fp4_kernel_hopper.py `fp4_fake_quant_block`): it saturates the block scale at 448 without
the 2^-9 floor, and a block whose absolute scale (E4M3 scale · global) is under 1e-5 is quantized at scale 1 — the
two differ only on blocks whose amax is below 2^-9 · 6 · global (the input's calibrated amax / 229376) or whose
absolute scale is under 1e-5, blocks whose values both quantize to (almost) zero.

The graph is TensorRT's (ModelOpt's ONNX export: torch/quantization/export_onnx.py `export_fp4`,
onnx/export/nvfp4_exporter.py): the weight a FLOAT4E2M1 initializer [out, in] (ONNX packs 4-bit elements two a byte,
the first in the low nibble: our stored bytes as they are), its block scales a FLOAT8E4M3FN initializer, the global
a float32 scalar; DequantizeLinear(block scales, global) -> float32 scales, DequantizeLinear(weight, scales,
axis=-1, block_size=16). The input: `trt::TRT_FP4DynamicQuantize(x, input global; axis=-1, block_size=16,
scale_type=FLOAT8E4M3FN) -> (x_fp4, scales_fp8)`, DequantizeLinear(scales_fp8, input global), DequantizeLinear(x_fp4,
scales, axis=-1, block_size=16). FP4 needs opset 23 (engine/export.py picks it for such graphs only); ONNX Runtime
cannot run it, so the CPU engine lowers the graph when it loads it (engine/trt_ops.py).
"""

from __future__ import annotations

from typing import Any

import torch

from toolchain.checkpoint.prequant.codecs import E2M1_VALUES, e2m1_decode
from toolchain.checkpoint.safetensors_io import TensorInfo
from toolchain.errors import UserError
from toolchain.quantize.core import FP8_E4M3_MAX
from toolchain.quantize.methods.base import (
    ACTIVATION_SCALE,
    PARTS,
    WEIGHT,
    WEIGHT_SCALE,
    WEIGHT_SCALE_2,
    Context,
    GraphBuilder,
    InputScales,
    Layer,
    QuantMethod,
    Stored,
    info,
    per_row,
)
from toolchain.quantize.methods.fp8 import FP8, Fused

BLOCK = 16
E2M1_MAX = 6.0
GLOBAL_DIVISOR = E2M1_MAX * FP8_E4M3_MAX  # 2688: a global scale maps the tensor's amax onto E4M3's 448 · E2M1's 6
BLOCK_SCALE_MIN = 2.0**-9  # the smallest E4M3 subnormal: ModelOpt clamps block scales to it (no underflow to 0)
# ModelOpt's decision bounds between E2M1 magnitudes (nvfp4_tensor.py `e2m1_bounds`); at the odd-indexed ones
# (0.75, 1.75, 3.5) a tie goes up to the even code, at the others down
_BOUNDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
_ODD_BOUNDS = (0.75, 1.75, 3.5)
_VALUES = torch.from_numpy(E2M1_VALUES)
TRT_DOMAIN = "trt"  # TensorRT's ONNX domain of its own ops (TRT_FP4DynamicQuantize, TRT_MXFP8*)
FP4_QUANTIZE_OP = "TRT_FP4DynamicQuantize"


def check_blocks(prefix: str, in_dim: int, block: int, name: str) -> None:
    if in_dim % block:
        raise UserError(
            f"{prefix}: {in_dim} input channels; {name} needs a multiple of {block}: keep it float with "
            f"--exclude {'.'.join(prefix.split('.')[-2:])} (or choose another method)"
        )


def global_scale(amax: torch.Tensor | float) -> torch.Tensor:
    """float32 [1]: amax / (6 · 448) in float32; 1 where amax is 0 (ModelOpt would divide 0 by 0: any positive
    scale reproduces an all-zero tensor exactly)."""
    g = torch.as_tensor(amax, dtype=torch.float32).reshape(1) / GLOBAL_DIVISOR
    return torch.where(g > 0, g, torch.ones_like(g))


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """float32 -> uint8 E2M1 codes (unpacked), as ModelOpt's `_cast_fp4`: the sign bit for every x < 0."""
    magnitude = x.abs()
    index = torch.searchsorted(_BOUNDS, magnitude.contiguous())  # side left: a value on a bound goes below ...
    tie_up = sum((magnitude == b).to(torch.int64) for b in _ODD_BOUNDS)  # ... unless the even code is above
    return (((x < 0).to(torch.int64) << 3) + index + tie_up).to(torch.uint8)


def block_scales(blocks: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """float [..., n, 16] -> E4M3 block scales [..., n] over global scale(s) `g` (broadcasting over [..., n])."""
    scale = blocks.abs().amax(dim=-1).float() / (E2M1_MAX * g)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return scale.clamp(BLOCK_SCALE_MIN, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def quantize_nvfp4(weight: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] over global scale(s) `g` ([1], or [out, 1] per row) -> (packed uint8 [out, in/2], E4M3
    block scales [out, in/16])."""
    out_dim, in_dim = weight.shape
    blocks = weight.float().reshape(out_dim, in_dim // BLOCK, BLOCK)
    g = g.float().reshape(-1, 1)
    scales = block_scales(blocks, g)
    codes = e2m1_codes((blocks / (scales.float() * g).unsqueeze(-1)).reshape(out_dim, in_dim))
    return codes[:, 0::2] | (codes[:, 1::2] << 4), scales


def nvfp4_qdq(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Quantize-dequantize x [..., in] in blocks of 16 along the last axis over input global scale `g` [1] (float32),
    in float32, returned in x's dtype: what the engine's TRT_FP4DynamicQuantize and its two DequantizeLinear nodes
    compute."""
    blocks = x.float().reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    g = g.float().reshape(())
    scale = block_scales(blocks, g).float() * g  # the first DequantizeLinear: one float32 rounding
    values = _VALUES[e2m1_codes(blocks / scale.unsqueeze(-1)).long()]
    return (values * scale.unsqueeze(-1)).reshape(x.shape).to(x.dtype)


def fp4_proto(name: str, packed: torch.Tensor) -> Any:
    """uint8 [rows, cols/2] (two E2M1 codes a byte, even column low) as a FLOAT4E2M1 initializer [rows, cols]: ONNX
    packs 4-bit elements in row-major order, the first of a pair in the low nibble, i.e. these very bytes."""
    from onnx import TensorProto

    proto = TensorProto(name=name, data_type=TensorProto.FLOAT4E2M1, dims=[packed.shape[0], packed.shape[1] * 2])
    proto.raw_data = packed.contiguous().numpy().tobytes()
    return proto


class NVFP4(QuantMethod):
    quant_algo = "NVFP4"
    suffixes = (WEIGHT, WEIGHT_SCALE, WEIGHT_SCALE_2, ACTIVATION_SCALE, PARTS)
    needs_calibration = True  # the input's global scale is its calibrated amax / (6 · 448)
    streamable = False  # `prepare`: mlp.fc and mlp.gate share their global scales (one GEMM in TensorRT-LLM)

    def plan(self, prefix: str, shape: tuple[int, ...], ctx: Context) -> dict[str, TensorInfo]:
        out_dim, in_dim = shape
        check_blocks(prefix, in_dim, BLOCK, "NVFP4")
        return {
            **info(f"{prefix}.{WEIGHT}", torch.uint8, out_dim, in_dim // 2),
            **info(f"{prefix}.{WEIGHT_SCALE}", torch.float8_e4m3fn, out_dim, in_dim // BLOCK),
            **info(f"{prefix}.{WEIGHT_SCALE_2}", torch.float32, 1),
            **info(f"{prefix}.{ACTIVATION_SCALE}", torch.float32, 1),
        }

    def prepare(self, layer: Layer, ctx: Context) -> dict[str, Any]:
        """mlp.fc and mlp.gate, one GEMM in TensorRT-LLM, share the larger weight amax and input amax (ModelOpt's
        export unifies `weight_scale_2` and `input_scale` of fused linears alike: `preprocess_linear_fusion`)."""
        return _FUSION.prepare(layer, ctx)

    def quantize(
        self, prefix: str, weight: torch.Tensor, ctx: Context, prepared: Any = None
    ) -> dict[str, torch.Tensor]:
        check_blocks(prefix, weight.shape[1], BLOCK, "NVFP4")
        fused = prepared if isinstance(prepared, Fused) else None
        g = global_scale(fused.weight_amax if fused else weight.abs().amax())
        packed, scales = quantize_nvfp4(weight, g)
        linears = fused.linears if fused else (prefix,)
        act = global_scale(max(ctx.calib.input_amax[p] for p in linears))
        return {
            f"{prefix}.{WEIGHT}": packed,
            f"{prefix}.{WEIGHT_SCALE}": scales,
            f"{prefix}.{WEIGHT_SCALE_2}": g,
            f"{prefix}.{ACTIVATION_SCALE}": act,
        }

    def dequantize(self, s: Stored) -> torch.Tensor:
        values = torch.from_numpy(e2m1_decode(s[WEIGHT].numpy()))
        out_dim = values.shape[0]
        scale = s.weight_scale() * per_row(s, s[WEIGHT_SCALE_2], out_dim)  # ModelOpt's order: one rounding here
        return values * torch.repeat_interleave(scale, BLOCK, dim=1)

    def input_scales(self, s: Stored) -> InputScales:
        raise NotImplementedError("NVFP4 quantizes its input in blocks at run time: fake_linear computes it")

    def fake_linear(self, s: Stored, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        g = s[ACTIVATION_SCALE].float().reshape(-1)
        parts = s.get(PARTS)
        if parts is None:
            return torch.nn.functional.linear(nvfp4_qdq(x, g[:1]), weight)
        rows = torch.split(weight, parts.long().tolist(), dim=0)
        return torch.cat(
            [torch.nn.functional.linear(nvfp4_qdq(x, g[i : i + 1]), w) for i, w in enumerate(rows)], dim=-1
        )

    def export(self, b: GraphBuilder, s: Stored, x: str) -> tuple[str, str]:
        if s.get(PARTS) is not None:
            raise UserError(f"{s.name(PARTS)}: per-part NVFP4 scales are exported by export_gemm, one GEMM a part")
        return self.export_input(b, s, x), self.export_weight(b, s)

    def export_gemm(self, b: GraphBuilder, s: Stored, x: str) -> str | None:
        """With parts (a fused GEMM whose projections kept their own global scales): per part, the input's FP4 chain
        over the part's input global, a Gemm with the part's rows (their own FP4 initializer, block scales and
        global), the parts' outputs concatenated. Without parts: None (`export`)."""
        parts = s.get(PARTS)
        if parts is None:
            return None
        p, acts, globals_ = s.prefix, s[ACTIVATION_SCALE].float().reshape(-1), s[WEIGHT_SCALE_2].float().reshape(-1)
        codes, blocks = s[WEIGHT], s[WEIGHT_SCALE]
        outs, start = [], 0
        for i, rows in enumerate(parts.long().tolist()):
            g_in = b.float_const(f"{s.name(ACTIVATION_SCALE)}.{i}", acts[i].reshape(()))
            xi = fp4_input(b, x, g_in, f"{p}.part{i}")
            w = b.add_initializer(fp4_proto(f"{s.name(WEIGHT)}.{i}", codes[start : start + rows]))
            block = b.const(f"{s.name(WEIGHT_SCALE)}.{i}", blocks[start : start + rows])
            g = b.const(f"{s.name(WEIGHT_SCALE_2)}.{i}", globals_[i].reshape(()))
            scale = b.op("DequantizeLinear", [block, g], f"{p}.part{i}.weight_scale_dq")
            dq = b.op("DequantizeLinear", [w, scale], f"{p}.part{i}.weight_dq", axis=-1, block_size=BLOCK)
            wi = b.op("CastLike", [dq, xi], f"{p}.part{i}.weight_cast")
            outs.append(b.op("Gemm", [xi, wi], f"{p}.part{i}.out", transB=1))
            start += rows
        return b.op("Concat", outs, f"{p}.parts", axis=-1)

    def export_input(self, b: GraphBuilder, s: Stored, x: str) -> str:
        """TensorRT's dynamic FP4 input: TRT_FP4DynamicQuantize over the input global scale, then the two
        DequantizeLinear nodes (ModelOpt's `export_fp4`)."""
        return fp4_input(b, x, b.float_const(s.name(ACTIVATION_SCALE), s[ACTIVATION_SCALE].reshape(())), s.prefix)

    def export_weight(self, b: GraphBuilder, s: Stored) -> str:
        p = s.prefix
        codes = b.add_initializer(fp4_proto(s.name(WEIGHT), s[WEIGHT]))
        block = b.const(s.name(WEIGHT_SCALE), s[WEIGHT_SCALE])
        g = b.const(s.name(WEIGHT_SCALE_2), s[WEIGHT_SCALE_2].float().reshape(()))
        scale = b.op("DequantizeLinear", [block, g], f"{p}.weight_scale_dq")
        return b.op("DequantizeLinear", [codes, scale], f"{p}.weight_dq", axis=-1, block_size=BLOCK)


def fp4_input(b: GraphBuilder, x: str, g: str, name: str) -> str:
    """x -> TRT_FP4DynamicQuantize(x, g) -> DequantizeLinear(scales, g) -> DequantizeLinear(x_fp4, scales)."""
    from onnx import TensorProto

    q = b.op(
        FP4_QUANTIZE_OP,
        [x, g],
        f"{name}.input_fp4",
        outputs=2,  # _Builder.node's: the outputs are named NAME:0 and NAME:1
        domain=TRT_DOMAIN,
        axis=-1,
        block_size=BLOCK,
        scale_type=TensorProto.FLOAT8E4M3FN,
    )
    scales_fp8 = q.removesuffix(":0") + ":1"
    scale = b.op("DequantizeLinear", [scales_fp8, g], f"{name}.input_scale_dq")
    return b.op("DequantizeLinear", [q, scale], f"{name}.input_dq", axis=-1, block_size=BLOCK)


_FUSION = FP8("fp8")  # its `prepare` finds the fused groups and their shared amax
