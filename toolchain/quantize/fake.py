"""The reference forward of a quantized checkpoint: weights dequantized; each linear's input multiplied by its
`prequant_scaling_factor` when it has one (each expert's routed input by its own, for AWQ / SmoothQuant experts);
and what the engine quantizes at run time — INT8 (SmoothQuant) or FP8 activations at each linear's input (at each
expert's routed input for experts), the KV cache (NVFP4: in blocks of 16 along head_size, as KVCacheWrite stores
it) — quantized and dequantized in place (fake quantization), so the reference computes what the engine will
compute, up to accumulation order. Each quantized linear's method reads its own tensors (methods/base.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from toolchain.checkpoint.spec import spec_of
from toolchain.checkpoint.trtllm import CONFIG_NAME, load_rank, rank_file, read_config
from toolchain.errors import UserError
from toolchain.quantize import experts
from toolchain.quantize.core import fake_quant
from toolchain.quantize.methods.base import WEIGHT, QuantMethod, Stored, quantized_prefix
from toolchain.quantize.methods.kv_cache import KV_SCALE
from toolchain.quantize.methods.nvfp4 import nvfp4_qdq
from toolchain.quantize.methods.registry import by_algo, kv_by_algo
from toolchain.quantize.scheme import stored
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
        self.expert_scales: dict[str, torch.Tensor] = {}  # stacked experts' linear -> activation scale per expert
        self.expert_prequant: dict[str, torch.Tensor] = {}  # stacked experts' linear -> 1/s per expert [E, in]
        self.linears: dict[str, tuple[QuantMethod, Stored]] = {}  # linears whose method computes them (fake_linear)

    def linear(self, prefix: str, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        owned = self.linears.get(prefix)
        return owned[0].fake_linear(owned[1], x, weight) if owned else None

    def linear_input(self, prefix: str, x: torch.Tensor) -> torch.Tensor:
        pre = self.prequant.get(prefix)
        if pre is not None:
            x = x * pre.to(x.dtype)
        scale = self.activation_scales.get(prefix)
        if scale is None or self.activation_kind is None:
            return x
        return fake_quant(x, scale, self.activation_kind)

    def expert_input(self, prefix: str, expert: int, x: torch.Tensor) -> torch.Tensor:
        pre = self.expert_prequant.get(prefix)
        if pre is not None:  # AWQ / SmoothQuant experts: the expert's own 1/s first, as the MoE op applies it
            x = x * pre[expert].to(x.dtype)
        scales = self.expert_scales.get(prefix)
        if scales is None or self.activation_kind is None:
            return x
        return fake_quant(x, scales[expert].item(), self.activation_kind)

    def kv_cache(self, layer: str, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kv_kind is None:
            return k, v
        scale = self.kv_scales[layer]
        if self.kv_kind == "NVFP4":  # blocks of 16 along head_size (the last axis) over the layer's global scale
            g = torch.tensor([scale], dtype=torch.float32)
            return nvfp4_qdq(k, g), nvfp4_qdq(v, g)
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
    expert_scales: dict[str, torch.Tensor] = {}  # stacked experts' linear -> per-expert activation scales [E]
    expert_prequant: dict[str, torch.Tensor] = {}  # stacked experts' linear -> per-expert 1/s [E, in]
    owned: set[str] = set()  # the quantized linears' tensors, which their method has read
    computed: dict[str, tuple[QuantMethod, Stored]] = {}  # linears whose method's fake_linear computes them
    for name in raw:
        prefix = quantized_prefix(name)
        if prefix is not None:
            try:
                qm, linear = stored(method, cfg, spec, raw, prefix)
                weights[linear.name(WEIGHT)] = experts.dequantize(qm, linear)  # dense or stacked
            except UserError as e:  # a scale on something that is not one of the model's linears
                raise UserError(f"{directory / rank_file(0)}: {name}: {e}") from e
            if experts.stacked(tuple(linear[WEIGHT].shape)):  # each expert's routed input (`expert_input`): its
                act, pre = experts.activation_scales(qm, linear), experts.prequant_scales(qm, linear)
                if act is not None:  # own static scale (fp8, w8a8_sq)
                    expert_scales[prefix] = act
                if pre is not None:  # own 1/s (w4a16_awq, w8a8_sq)
                    expert_prequant[prefix] = pre
                owned.update(qm.tensor_names(prefix))
                continue
            if type(qm).fake_linear is not QuantMethod.fake_linear:  # the method may compute the linear itself
                own = {n: raw[n] for n in qm.tensor_names(prefix) if n in raw}
                computed[prefix] = (qm, Stored(prefix, own, linear.in_features, linear.group_size))
                if qm.activation_kind is None and not qm.pre_quant_scale:  # no static input treatment: it always
                    owned.update(qm.tensor_names(prefix))  # does (a None from FP8 without parts: the scales below)
                    continue
            scales = qm.input_scales(linear)
            if scales.prequant is not None:
                prequant[prefix] = scales.prequant
            if scales.activation is not None:
                activation[prefix] = scales.activation.item()
            owned.update(qm.tensor_names(prefix))
        elif name.endswith(f".{KV_SCALE}"):
            kv_scales[name.removesuffix(f".{KV_SCALE}")] = raw[name].item()
            owned.add(name)
    weights.update({name: tensor for name, tensor in raw.items() if name not in owned})
    model = ReferenceModel(cfg, weights, dtype)
    activation_kind = method.activation_kind if method else None
    model.hooks = FakeQuant(prequant, activation, activation_kind, kv_scales, kv.quant_algo if kv else None)
    model.hooks.expert_scales = expert_scales
    model.hooks.expert_prequant = expert_prequant
    model.hooks.linears = computed
    return model
