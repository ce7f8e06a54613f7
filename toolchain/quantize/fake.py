"""The reference forward of a quantized checkpoint: weights dequantized; each linear's input multiplied by its
`prequant_scaling_factor` when it has one; and what the engine quantizes at run time — INT8 (SmoothQuant) or FP8
activations at each linear's input, the KV cache — quantized and dequantized in place (fake quantization), so the
reference computes what the engine will compute, up to accumulation order."""

from __future__ import annotations

from pathlib import Path

import torch

from toolchain.checkpoint.spec import spec_of
from toolchain.checkpoint.trtllm import CONFIG_NAME, load_rank, rank_file, read_config
from toolchain.errors import UserError
from toolchain.quantize.core import fake_quant
from toolchain.quantize.methods.registry import by_algo, kv_by_algo
from toolchain.quantize.scheme import dequantize
from toolchain.reference.model import Hooks, ReferenceModel


class FakeQuant(Hooks):
    def __init__(
        self,
        prequant: dict[str, torch.Tensor],
        activation_scales: dict[str, float],
        activation_kind: str | None,
        kv_scales: dict[str, float],
        kv_kind: str | None,
    ):
        self.prequant, self.activation_scales, self.activation_kind = prequant, activation_scales, activation_kind
        self.kv_scales, self.kv_kind = kv_scales, kv_kind

    def linear_input(self, prefix: str, x: torch.Tensor) -> torch.Tensor:
        pre = self.prequant.get(prefix)
        if pre is not None:
            x = x * pre.to(x.dtype)
        scale = self.activation_scales.get(prefix)
        if scale is None or self.activation_kind is None:
            return x
        return fake_quant(x, scale, self.activation_kind)

    def kv_cache(self, layer: str, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kv_kind is None:
            return k, v
        scale = self.kv_scales[layer]
        return fake_quant(k, scale, self.kv_kind), fake_quant(v, scale, self.kv_kind)


def load_quantized(directory: Path, dtype: torch.dtype = torch.float32) -> ReferenceModel:
    cfg = read_config(directory)
    method = by_algo(cfg.quantization.quant_algo, str(directory / CONFIG_NAME))
    kv = kv_by_algo(cfg.quantization.kv_cache_quant_algo, str(directory / CONFIG_NAME))
    spec = spec_of(cfg)
    raw = load_rank(directory, 0)
    weights: dict[str, torch.Tensor] = {}
    activation: dict[str, float] = {}
    kv_scales: dict[str, float] = {}
    prequant: dict[str, torch.Tensor] = {}
    for name, tensor in raw.items():
        if name.endswith(".weights_scaling_factor"):
            prefix = name.removesuffix(".weights_scaling_factor")
            try:
                weights[f"{prefix}.weight"] = dequantize(cfg, spec, raw, prefix)
            except UserError as e:  # a scale on something that is not one of the model's linears
                raise UserError(f"{directory / rank_file(0)}: {name}: {e}") from e
        elif name.endswith(".activation_scaling_factor"):
            activation[name.removesuffix(".activation_scaling_factor")] = tensor.item()
        elif name.endswith(".attention.kv_cache_scaling_factor"):
            kv_scales[name.removesuffix(".attention.kv_cache_scaling_factor")] = tensor.item()
        elif name.endswith(".prequant_scaling_factor"):
            prequant[name.removesuffix(".prequant_scaling_factor")] = tensor
        elif name.removesuffix(".weight") + ".weights_scaling_factor" not in raw:
            weights[name] = tensor
    model = ReferenceModel(cfg, weights, dtype)
    activation_kind = method.activation_kind if method else None
    model.hooks = FakeQuant(prequant, activation, activation_kind, kv_scales, kv.quant_algo if kv else None)
    return model
