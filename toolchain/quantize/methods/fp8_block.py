"""FP8_BLOCK_SCALES: FP8 E4M3 weights with one float32 scale per square block of G x G (config.json's group_size,
128 in every checkpoint met: Qwen3-*-FP8, DeepSeek-V3; TensorRT-LLM asserts 128), activations quantized at run time
per token in groups of G input channels (1 x G, dynamic), as TensorRT-LLM runs FP8_BLOCK_SCALES.

PREFIX.weight float8_e4m3fn [out, in]; PREFIX.weights_scaling_factor float32 [ceil(out/G), ceil(in/G)] (it
multiplies: the checkpoint's `weight_scale_inv` is, despite its name, the dequantization factor); the last block of
a row or column may be partial.

The graph: the weight as one blocked DequantizeLinear (axis 1, block_size G) whose scales are the block scales
repeated over each block's rows ([out, ceil(in/G)], exact: one DequantizeLinear has one block axis); the input per
token in groups of G (the last group partial where G does not divide `in`, zero-padded: zeros change no maximum)
through the dynamic FP8 quantizer of fp8_pc_pt.py (`export_dynamic_fp8`: Pad → Reshape [tokens, groups, G] →
per-group scale → Reshape → Slice). The reference (`fake_linear`) does the same in torch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from toolchain.checkpoint.safetensors_io import TensorInfo
from toolchain.quantize.methods.base import WEIGHT, WEIGHT_SCALE, Context, GraphBuilder, QuantMethod, Stored, info
from toolchain.quantize.methods.fp8_pc_pt import export_dynamic_fp8, fake_dynamic_fp8


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

    def export_input(self, b: GraphBuilder, s: Stored, x: str) -> str:
        g, n, p = s.group_size, s.in_features, s.prefix
        groups = _blocks(n, g)
        pad = groups * g - n
        if pad:
            pads = b.const(f"{p}.input_pads", torch.tensor([0, 0, 0, pad], dtype=torch.int64))
            x = b.op("Pad", [x, pads], f"{p}.input_padded")
        grouped = b.const(f"{p}.input_groups", torch.tensor([0, groups, g], dtype=torch.int64))
        y = export_dynamic_fp8(b, b.op("Reshape", [x, grouped], f"{p}.input_grouped"), f"{p}.input", per_token=True)
        flat = b.const(f"{p}.input_flat", torch.tensor([0, groups * g], dtype=torch.int64))
        y = b.op("Reshape", [y, flat], f"{p}.input_ungrouped")
        if pad:
            ends = b.const(f"{p}.input_end", torch.tensor([n], dtype=torch.int64))
            starts = b.const(f"{p}.input_start", torch.tensor([0], dtype=torch.int64))
            axes = b.const(f"{p}.input_axis", torch.tensor([1], dtype=torch.int64))
            y = b.op("Slice", [y, starts, ends, axes], f"{p}.input_cut")
        return y

    def export_weight(self, b: GraphBuilder, s: Stored) -> str:
        rows = s[WEIGHT].shape[0]
        scale = s.weight_scale().repeat_interleave(s.group_size, dim=0)[:rows]
        codes = b.const(s.name(WEIGHT), s[WEIGHT])
        scales = b.const(s.name(WEIGHT_SCALE), scale)
        return b.op("DequantizeLinear", [codes, scales], f"{s.prefix}.weight_dq", axis=1, block_size=s.group_size)

    def fake_linear(self, s: Stored, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(fake_groups(x, s.group_size), weight)


def fake_groups(x: torch.Tensor, g: int) -> torch.Tensor:
    """x quantized per token in groups of g along the last axis (the last group partial), as the graph does."""
    n = x.shape[-1]
    pad = _blocks(n, g) * g - n
    grouped = F.pad(x, (0, pad)).reshape(*x.shape[:-1], -1, g)
    return fake_dynamic_fp8(grouped, (-1,)).reshape(*x.shape[:-1], -1)[..., :n]
