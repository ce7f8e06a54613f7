"""gpt-oss (`GptOssForCausalLM`): Llama-style attention with q/k/v/o biases and attention sinks, sliding-window and
full layers alternating, YaRN rope, and every MLP a mixture of experts with biases and a clamped SwiGLU.

HF names (transformers' modeling_gpt_oss.py, as `save_pretrained` writes them): `self_attn.sinks` [heads];
`mlp.router.{weight,bias}` [E, H], [E]; `mlp.experts.gate_up_proj` [E, H, 2I] stored input-major with gate and up
interleaved on its last dim (even columns the gate, odd the up), `gate_up_proj_bias` [E, 2I] likewise,
`down_proj` [E, I, H] and `down_proj_bias` [E, H]. The published checkpoints store the two expert weights in MXFP4
instead (toolchain/checkpoint/mxfp4.py): `{gate_up,down}_proj_blocks` uint8 [E, out, in / 32, 16] and `_scales`
uint8 [E, out, in / 32], output-major; they are dequantized here, exactly, expert by expert. Either form is read, per
projection, by which tensors the checkpoint holds.

The router (`GptOssTopKRouter`) takes the top `num_experts_per_tok` of its biased logits and a softmax over those
(spec.ROUTER_NORMS "topk_softmax"; TensorRT-LLM's `RenormalizeMoeRoutingMethod`); an expert computes
gate * sigmoid(alpha * gate) * (up + 1) with the gate clamped to at most `swiglu_limit` and the up to
[-limit, limit] (`GptOssExperts._apply_gate`; TensorRT-LLM's swiglu_alpha 1.702, swiglu_beta 1, swiglu_limit 7).
Attention (`eager_attention_forward`) appends each head's sink logit to every query's scores before the softmax and
drops it after. `layer_types` says which layers slide (`sliding_window`); rope is YaRN (`rope_parameters` or the
older `rope_scaling`; absent, transformers' GptOssConfig default: factor 32 over 4096 positions, beta 32 / 1, not
truncated).

TensorRT-LLM runs gpt-oss on its PyTorch backend from the HF checkpoint (tensorrt_llm/_torch/models/
modeling_gpt_oss.py; checkpoints/hf/gpt_oss_weight_mapper.py de-interleaves gate/up and stacks the experts, sinks in
float32); it has no TensorRT-LLM checkpoint layout of its own, so ours is docs/conversion.md's MoE layout: fc
[E, 2I, H] = each expert's [up; gate], fc.bias [E, 2I] likewise, proj [E, H, I], proj.bias [E, H], router weight
and bias float32, attention.sinks [heads] float32.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from toolchain.checkpoint import moe
from toolchain.checkpoint.hf_fields import boolean, positive_float, positive_int
from toolchain.checkpoint.llama import (
    DENSE_BIAS_TABLE,
    DROPPED,
    LAYER_TABLE,
    QKV_BIAS_TABLE,
    build_table,
    check_layer_types,
    llama_style_config,
    llama_style_spec,
)
from toolchain.checkpoint.llama import source_shapes as llama_source_shapes
from toolchain.checkpoint.mxfp4 import BLOCK
from toolchain.checkpoint.sharding import Rule
from toolchain.checkpoint.spec import ModelSpec
from toolchain.checkpoint.trtllm import ModelConfig
from toolchain.errors import UserError

__all__ = ["DROPPED", "config_from_hf", "source_shapes", "spec", "weight_table"]

ARCHITECTURE = "GptOssForCausalLM"
# transformers' GptOssConfig defaults (configuration_gpt_oss.py)
DEFAULT_THETA = 150000.0
DEFAULT_YARN: dict[str, Any] = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
_YARN_NUMBERS = ("factor", "beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim")
_EXPERTS = "mlp.experts"


def _rope(hf: dict[str, Any], source: str) -> tuple[float, dict[str, Any] | None]:
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {**DEFAULT_YARN, "rope_theta": DEFAULT_THETA}
    if not isinstance(params, dict):
        raise UserError(f"{source}: 'rope_parameters' must be an object, got {params!r}; fix config.json")
    theta = positive_float(params, "rope_theta", source, hf.get("rope_theta", DEFAULT_THETA))
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "yarn":
        raise UserError(f"{source}: rope type {kind!r} is not supported for {ARCHITECTURE}; supported: yarn, default")
    where = f"{source} (rope scaling)"
    positive_int(scaling, "original_max_position_embeddings", where)
    positive_float(scaling, "factor", where)
    for key in _YARN_NUMBERS[1:]:
        if scaling.get(key) is not None:
            positive_float(scaling, key, where)
    boolean(scaling, "truncate", where, True)
    if scaling.get("partial_rotary_factor", 1.0) != 1.0:
        raise UserError(f"{where}: 'partial_rotary_factor' {scaling['partial_rotary_factor']!r} is not supported; 1.0")
    return theta, dict(sorted(scaling.items()))


def _layer_types(hf: dict[str, Any], layers: int, source: str) -> list[str]:
    """transformers' default: even layers slide, odd ones attend to everything."""
    types = hf.get("layer_types")
    if types is None:
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    return check_layer_types(types, layers, source)


def _number(hf: dict[str, Any], key: str, source: str, default: float) -> float:
    value = hf.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise UserError(f"{source}: '{key}' must be a finite positive number, got {value!r}; fix config.json")
    return float(value)


def config_from_hf(hf: dict[str, Any], dtype: str, source: str) -> ModelConfig:
    quant = hf.get("quantization_config")
    if quant is not None and (not isinstance(quant, dict) or quant.get("quant_method") != "mxfp4"):
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise UserError(
            f"{source}: quantization_config quant_method {method!r} is not supported for {ARCHITECTURE}; supported: "
            "mxfp4 (the published experts, dequantized at convert), or none"
        )
    experts = moe.expert_count(hf, source, ("num_local_experts", "num_experts"))
    top_k = positive_int(hf, "num_experts_per_tok", source, 4)
    layers = positive_int(hf, "num_hidden_layers", source)
    fields = {
        **moe.moe_fields(experts, top_k, True, positive_int(hf, "intermediate_size", source), [], source),
        "moe_router_norm": "topk_softmax",
        "moe_router_bias": True,
        "swiglu_alpha": _number(hf, "swiglu_alpha", source, 1.702),
        "swiglu_beta": 1.0,
        "swiglu_limit": _number(hf, "swiglu_limit", source, 7.0),
        "layer_types": _layer_types(hf, layers, source),
    }
    theta, scaling = _rope(hf, source)
    return llama_style_config(
        {**hf, "rope_parameters": None, "rope_scaling": None},  # read above: Llama's reader refuses YaRN
        dtype,
        source,
        ARCHITECTURE,
        sliding_window=positive_int(hf, "sliding_window", source, 128),
        attn_bias=boolean(hf, "attention_bias", source, True),
        mlp_bias=True,  # the experts' biases
        rotary_base=theta,
        rotary_scaling=scaling,
        family_fields=fields,
    )


def spec(cfg: ModelConfig) -> ModelSpec:
    """Llama-style layers (windows from layer_types), each with sinks and the experts as its FFN."""
    base = llama_style_spec(dataclasses.replace(cfg, mlp_bias=False))
    ffn, dense = moe.experts_ffn(cfg, biases=True)
    if dense:
        raise UserError(f"'mlp_only_layers' {sorted(dense)}: {ARCHITECTURE} has no dense layers; set it to []")
    return dataclasses.replace(base, layers=tuple(dataclasses.replace(ls, ffn=ffn, sinks=True) for ls in base.layers))


def _mxfp4(available: set[str], src: str, proj: str) -> bool:
    return f"{src}.{_EXPERTS}.{proj}_blocks" in available


def weight_table(cfg: ModelConfig, available: set[str]) -> list[Rule]:
    """Llama's attention rows (with biases), and per layer the sinks, the router (weight and bias, float32) and the
    experts unpacked from one tensor each (Rule.packing): gate/up de-interleaved into [up; gate], transposed to
    [out, in] from the float layout or dequantized from MXFP4."""
    ffn, _ = moe.experts_ffn(cfg, biases=True)
    rows = [row for row in LAYER_TABLE if not row[0].startswith("mlp.")]
    table = build_table(cfg, available, rows + list(QKV_BIAS_TABLE + DENSE_BIAS_TABLE if cfg.attn_bias else ()))
    f32 = "float32"
    for i in range(cfg.num_hidden_layers):
        dst, src = f"transformer.layers.{i}", f"model.layers.{i}"
        experts = f"{src}.{_EXPERTS}"
        table += [
            Rule(f"{dst}.attention.sinks", (f"{src}.self_attn.sinks",), dtype=f32),
            Rule(f"{dst}.mlp.router.weight", (f"{src}.mlp.router.weight",), ffn=ffn, dtype=f32),
            Rule(f"{dst}.mlp.router.bias", (f"{src}.mlp.router.bias",), ffn=ffn, dtype=f32),
            Rule(f"{dst}.mlp.fc.bias", (f"{experts}.gate_up_proj_bias",), ffn=ffn, packing="stacked", interleaved=True),
            Rule(f"{dst}.mlp.proj.bias", (f"{experts}.down_proj_bias",), ffn=ffn),
        ]
        for out, proj, interleaved in (("fc", "gate_up_proj", True), ("proj", "down_proj", False)):
            srcs: tuple[str, ...] = (f"{experts}.{proj}",)
            packing, transpose = "stacked", True
            if _mxfp4(available, src, proj):
                _check_mxfp4_sizes(cfg)
                srcs, packing, transpose = (f"{experts}.{proj}_blocks", f"{experts}.{proj}_scales"), "mxfp4", False
            table.append(
                Rule(f"{dst}.mlp.{out}.weight", srcs, transpose, ffn=ffn, packing=packing, interleaved=interleaved)
            )
    return table


def _check_mxfp4_sizes(cfg: ModelConfig) -> None:
    size = cfg.family_fields["moe_intermediate_size"]
    if cfg.hidden_size % BLOCK or size % BLOCK:
        raise UserError(
            f"MXFP4 experts need hidden_size {cfg.hidden_size} and intermediate_size {size} to be multiples of "
            f"{BLOCK} (one scale per {BLOCK} inputs); this checkpoint's sizes do not match its config.json"
        )


def source_shapes(cfg: ModelConfig, available: set[str]) -> dict[str, tuple[int, ...]]:
    shapes = llama_source_shapes(cfg, available)
    e, h, size = cfg.family_fields["moe"]["num_experts"], cfg.hidden_size, cfg.family_fields["moe_intermediate_size"]
    for i in range(cfg.num_hidden_layers):
        src, experts = f"model.layers.{i}", f"model.layers.{i}.{_EXPERTS}"
        shapes |= {
            f"{src}.self_attn.sinks": (cfg.num_attention_heads,),
            f"{src}.mlp.router.weight": (e, h),
            f"{src}.mlp.router.bias": (e,),
            f"{experts}.gate_up_proj": (e, h, 2 * size),
            f"{experts}.gate_up_proj_bias": (e, 2 * size),
            f"{experts}.down_proj": (e, size, h),
            f"{experts}.down_proj_bias": (e, h),
            f"{experts}.gate_up_proj_blocks": (e, 2 * size, h // BLOCK, BLOCK // 2),
            f"{experts}.gate_up_proj_scales": (e, 2 * size, h // BLOCK),
            f"{experts}.down_proj_blocks": (e, h, size // BLOCK, BLOCK // 2),
            f"{experts}.down_proj_scales": (e, h, size // BLOCK),
        }
    return shapes
