"""W4A16_GPTQ: int4 weights per group of G input channels with integer zero points, optionally in act-order —
what GPTQ (gptqmodel), AutoAWQ's GEMM packing and compressed-tensors' asymmetric pack-quantized int4 hold.

PREFIX.weight uint8 [out/2, in] — unsigned codes 0..15, two output rows a byte, row 2j in the low nibble (our
w4a16 packing); PREFIX.weights_scaling_factor float32 [out, in/G]; PREFIX.weights_zero_point uint8 [out, in/G]
(0..15): w = (q − z) · s, per group. With PREFIX.input_perm int64 [in] (act-order), the stored columns are the
input's in that order (stored column j multiplies input channel input_perm[j]), so each group is contiguous and the
engine reads x[..., input_perm]; `dequantize` gives the weight in the model's column order. TensorRT-LLM's own
W4A16_GPTQ layout (a pre-scaled float `zero` [in/G, out], codes [in, out/4]) is a kernel layout we do not write.

The graph: `DequantizeLinear(codes UINT4 [out, in], scales float32 [out, in/G], zero points UINT4 [out, in/G],
axis=1, block_size=G)` — ONNX's blocked dequantization computes (q − z) · s itself, exact, no float weight stored —
and with act-order a `Gather(x, input_perm, axis=-1)` on the input before the GEMM. Both run on ONNX Runtime's CPU
provider at opset 21. The reference needs nothing of its own: `dequantize` puts the columns back in the model's
order, and x · wᵀ = x[..., input_perm] · storedᵀ.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from toolchain.checkpoint.prequant.codecs import int4_rows_unpack
from toolchain.checkpoint.safetensors_io import TensorInfo
from toolchain.quantize.methods.base import (
    INPUT_PERM,
    WEIGHT,
    WEIGHT_SCALE,
    ZERO_POINT,
    Context,
    GraphBuilder,
    QuantMethod,
    Stored,
    info,
)
from toolchain.quantize.methods.nvfp4 import check_blocks

if TYPE_CHECKING:  # the quantize stage need not import onnx
    from onnx import TensorProto


def uint4_proto(name: str, codes: torch.Tensor) -> TensorProto:
    """uint4 values (0..15, any integer tensor) as an ONNX UINT4 initializer: consecutive elements in row-major order
    share a byte, the first in the low nibble (as core.int4_proto packs INT4)."""
    from onnx import TensorProto

    flat = codes.reshape(-1).to(torch.int16) & 0xF
    if flat.numel() % 2:
        flat = torch.cat([flat, flat.new_zeros(1)])
    proto = TensorProto(name=name, data_type=TensorProto.UINT4, dims=list(codes.shape))
    proto.raw_data = (flat[0::2] | (flat[1::2] << 4)).to(torch.uint8).numpy().tobytes()
    return proto


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

    def export_input(self, b: GraphBuilder, s: Stored, x: str) -> str:
        perm = s.get(INPUT_PERM)
        if perm is None:
            return x
        return b.op("Gather", [x, b.const(s.name(INPUT_PERM), perm.long())], f"{s.prefix}.input_permuted", axis=-1)

    def export_weight(self, b: GraphBuilder, s: Stored) -> str:
        codes = torch.from_numpy(int4_rows_unpack(s[WEIGHT].numpy(), signed=False))
        q = b.add_initializer(uint4_proto(s.name(WEIGHT), codes))
        z = b.add_initializer(uint4_proto(s.name(ZERO_POINT), s[ZERO_POINT]))
        scale = b.const(s.name(WEIGHT_SCALE), s.weight_scale())
        return b.op("DequantizeLinear", [q, scale, z], f"{s.prefix}.weight_dq", axis=1, block_size=s.group_size)
