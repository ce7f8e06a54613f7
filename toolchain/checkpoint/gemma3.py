"""Gemma 3 text (`Gemma3ForCausalLM`): five sliding-window layers to one global, each kind with its own rope base,
sandwich norms, qk-norm, embeddings scaled by sqrt(hidden), a gelu-tanh GatedMLP, tied embeddings.

Checked against TensorRT-LLM's Gemma converter and config (tensorrt_llm/models/gemma/convert.py
`load_gemma_weights`, config.py `Gemma3ConfigGroup`, model.py `GemmaDecoderLayer` / `GemmaModel.forward`):
- names: input_layernorm, post_layernorm (HF post_attention_layernorm: on the attention output, before the
  residual), pre_feedforward_layernorm, post_feedforward_layernorm, attention.q_layernorm / k_layernorm, ln_f;
  q, k, v fuse into attention.qkv; gate_proj -> mlp.fc, up_proj -> mlp.gate, down_proj -> mlp.proj.
- Gemma's RMSNorm multiplies by (1 + w): TensorRT-LLM writes 1 + w (in float32, then the checkpoint dtype) into the
  checkpoint for every norm, q/k norms included, and its graph applies a plain RMSNorm. So do we (`Rule.offset`).
- config fields: query_pre_attn_scalar (attention scale query_pre_attn_scalar ** -0.5, TensorRT-LLM's
  q_scaling = sqrt(query_pre_attn_scalar) / sqrt(head_size)), final_logit_softcapping, rope_local_base_freq (the
  sliding layers' rope base; rotary_base / rotary_scaling are the global layers'), sliding_window,
  _sliding_window_pattern, inter_layernorms. TensorRT-LLM takes each layer's window at build time; we also write
  `layer_types` (transformers' name, docs/conversion.md) so the checkpoint says which layers slide.
- the embedding scale sqrt(hidden) is applied in the graph (no config field, weights unscaled).
transformers 5 saves the rope bases in `rope_parameters` per layer type and `layer_types` explicitly; Hub configs
carry rope_theta / rope_local_base_freq / sliding_window_pattern at the top level. Both are read.
Gemma 2's attention logit soft-capping is not part of Gemma 3 (transformers' Gemma3 config defaults it to null);
a config that sets it, or bidirectional attention, is refused.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from toolchain.checkpoint.hf_fields import boolean, positive_float, positive_int
from toolchain.checkpoint.llama import (
    DROPPED,
    LAYER_TABLE,
    QK_NORM_TABLE,
    LayerRow,
    Shape,
    build_table,
    check_layer_types,
    llama_style_config,
    windows_of,
)
from toolchain.checkpoint.llama import source_shapes as llama_shapes
from toolchain.checkpoint.sharding import Rule
from toolchain.checkpoint.spec import DenseFFN, LayerSpec, ModelSpec, Norm, Rope, in_layer
from toolchain.checkpoint.trtllm import ModelConfig
from toolchain.errors import UserError

__all__ = ["DROPPED", "config_from_hf", "source_shapes", "spec", "weight_table"]

ARCHITECTURE = "Gemma3ForCausalLM"
ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_new")  # the tanh approximation; exact-erf gelu is another function
SANDWICH_ROWS: tuple[LayerRow, ...] = (
    ("post_layernorm.weight", ("post_attention_layernorm.weight",)),
    ("pre_feedforward_layernorm.weight", ("pre_feedforward_layernorm.weight",)),
    ("post_feedforward_layernorm.weight", ("post_feedforward_layernorm.weight",)),
)
_NORM_OFFSET = 1.0  # Gemma's RMSNorm weight is 1 + w


def _rope_bases(hf: dict[str, Any], source: str) -> tuple[dict[str, Any], float]:
    """(the global layers' rope parameters in transformers-5 form, the sliding layers' base)."""
    params = hf.get("rope_parameters")
    if params is not None and not (
        isinstance(params, dict) and set(params) and set(params) <= {"full_attention", "sliding_attention"}
    ):
        raise UserError(
            f"{source}: 'rope_parameters' must be an object per layer type, "
            f'{{"full_attention": {{...}}, "sliding_attention": {{...}}}}, got {params!r}'
        )
    if params is not None:
        full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
        if not isinstance(full, dict) or not isinstance(local, dict):
            raise UserError(f"{source}: 'rope_parameters' per layer type must be objects, got {params!r}")
        kind = local.get("rope_type", local.get("type", "default"))
        if kind != "default":
            raise UserError(
                f"{source}: rope_parameters.sliding_attention rope_type {kind!r} is not supported (only default)"
            )
        local_base = positive_float(local, "rope_theta", f"{source} (rope_parameters.sliding_attention)", 10_000.0)
        return {"rope_theta": 1_000_000.0, **full}, local_base
    full = {"rope_theta": positive_float(hf, "rope_theta", source, 1_000_000.0)}
    if hf.get("rope_scaling"):
        if not isinstance(hf["rope_scaling"], dict):
            raise UserError(f"{source}: 'rope_scaling' must be an object, got {hf['rope_scaling']!r}")
        full.update(hf["rope_scaling"])
    return full, positive_float(hf, "rope_local_base_freq", source, 10_000.0)


def _layer_types(hf: dict[str, Any], layers: int, source: str) -> tuple[list[str], int | None]:
    """Which layers slide, and the repeating pattern when there is one (TensorRT-LLM's `_sliding_window_pattern`:
    layer i slides unless (i + 1) % pattern == 0)."""
    pattern = hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6))
    if hf.get("layer_types") is not None:
        types = check_layer_types(hf["layer_types"], layers, source)
    else:
        pattern = positive_int({"sliding_window_pattern": pattern}, "sliding_window_pattern", source)
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
    fits = isinstance(pattern, int) and pattern > 0
    if fits:
        fits = types == ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
    return types, pattern if fits else None


def config_from_hf(hf: dict[str, Any], dtype: str, source: str) -> ModelConfig:
    act = hf.get("hidden_activation", hf.get("hidden_act", "gelu_pytorch_tanh"))
    if act not in ACTIVATIONS:
        raise UserError(
            f"{source}: hidden_activation {act!r} is not supported for Gemma 3; supported: gelu_pytorch_tanh"
        )
    if hf.get("attn_logit_softcapping") is not None:
        raise UserError(
            f"{source}: attn_logit_softcapping {hf['attn_logit_softcapping']!r} is not supported (Gemma 3 has none); "
            "set it to null"
        )
    if boolean(hf, "attention_bias", source):  # transformers would add q, k, v and o biases; no Gemma 3 has them
        raise UserError(f"{source}: attention_bias=true is not supported for Gemma 3; set it to false")
    if boolean(hf, "use_bidirectional_attention", source):
        raise UserError(f"{source}: use_bidirectional_attention=true is not supported (causal attention only)")
    layers = positive_int(hf, "num_hidden_layers", source)
    full_rope, local_base = _rope_bases(hf, source)
    types, pattern = _layer_types(hf, layers, source)
    cap = hf.get("final_logit_softcapping")
    family: dict[str, Any] = {
        "query_pre_attn_scalar": positive_float(hf, "query_pre_attn_scalar", source, 256.0),
        "final_logit_softcapping": None if cap is None else positive_float(hf, "final_logit_softcapping", source),
        "rope_local_base_freq": local_base,
        "inter_layernorms": True,
        "layer_types": types,
    }
    if pattern is not None:
        family["_sliding_window_pattern"] = pattern
    clean = {k: v for k, v in hf.items() if k not in ("rope_scaling", "rope_theta", "hidden_act", "hidden_activation")}
    clean["rope_parameters"] = full_rope  # llama_style_config reads the global rope from it
    for key, default in (("head_dim", 256), ("max_position_embeddings", 131_072)):  # Gemma3TextConfig's defaults
        clean.setdefault(key, default)
    return llama_style_config(
        clean,
        dtype,
        source,
        ARCHITECTURE,
        hidden_act=act,
        qk_layernorm=True,
        sliding_window=positive_int(hf, "sliding_window", source, 4096),
        tie_word_embeddings=boolean(hf, "tie_word_embeddings", source, True),
        family_fields=family,
    )


def _field(cfg: ModelConfig, name: str, optional: bool = False) -> float | None:
    value = cfg.family_fields.get(name)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise UserError(f"'{name}' must be a finite positive number for {ARCHITECTURE}, got {value!r}")
    return float(value)


def _types(cfg: ModelConfig) -> list[str]:
    """Which layers slide: our `layer_types`, else TensorRT-LLM's `_sliding_window_pattern` (a checkpoint written by
    TensorRT-LLM or ModelOpt has only that)."""
    n, types = cfg.num_hidden_layers, cfg.family_fields.get("layer_types")
    if types is not None:
        return check_layer_types(types, n, None)
    pattern = cfg.family_fields.get("_sliding_window_pattern")
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
        raise UserError(
            f"{ARCHITECTURE} needs 'layer_types' or '_sliding_window_pattern' (a positive integer) to know which "
            f"layers slide, got {pattern!r}; re-run convert"
        )
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]


def spec(cfg: ModelConfig) -> ModelSpec:
    eps = cfg.norm_epsilon
    types = _types(cfg)
    windows = windows_of(cfg, types)
    scale = _field(cfg, "query_pre_attn_scalar")
    assert scale is not None
    local_base = _field(cfg, "rope_local_base_freq", optional=True)
    local = Rope(10_000.0 if local_base is None else local_base)  # Gemma3TextConfig's default when absent
    full = Rope(cfg.rotary_base, cfg.rotary_scaling)

    def layer(i: int) -> LayerSpec:
        p = f"transformer.layers.{i}"
        return LayerSpec(
            index=i,
            attn_norm=Norm(f"{p}.input_layernorm", eps=eps),
            attn_out_norm=Norm(f"{p}.post_layernorm", eps=eps),
            mlp_norm=Norm(f"{p}.pre_feedforward_layernorm", eps=eps),
            mlp_out_norm=Norm(f"{p}.post_feedforward_layernorm", eps=eps),
            q_norm=Norm(f"{p}.attention.q_layernorm", eps=eps),
            k_norm=Norm(f"{p}.attention.k_layernorm", eps=eps),
            rope=local if types[i] == "sliding_attention" else full,
            window=windows[i],
            attn_scale=scale**-0.5,
            ffn=in_layer(i, DenseFFN, activation=cfg.hidden_act),
        )

    return ModelSpec.of(
        cfg,
        Norm("transformer.ln_f", eps=eps),
        tuple(layer(i) for i in range(cfg.num_hidden_layers)),
        embedding_scale=cfg.hidden_size**0.5,
        final_logit_softcap=_field(cfg, "final_logit_softcapping", optional=True),
    )


def weight_table(cfg: ModelConfig, available: set[str]) -> list[Rule]:
    rows = [r for r in LAYER_TABLE if r[0] != "post_layernorm.weight"] + [*SANDWICH_ROWS, *QK_NORM_TABLE]
    return [
        dataclasses.replace(rule, offset=_NORM_OFFSET) if "layernorm" in rule.dst or "ln_f" in rule.dst else rule
        for rule in build_table(cfg, available, rows)
    ]


def source_shapes(cfg: ModelConfig, available: set[str]) -> dict[str, Shape]:
    shapes = llama_shapes(cfg, available)
    for i in range(cfg.num_hidden_layers):
        for _, (src,) in SANDWICH_ROWS:
            shapes[f"model.layers.{i}.{src}"] = (cfg.hidden_size,)
    return shapes
