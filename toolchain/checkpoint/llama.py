"""Llama (`LlamaForCausalLM`): HF config -> TensorRT-LLM config, and the weight-name table.

Names and conventions checked against TensorRT-LLM's own converter (tensorrt_llm/models/llama/convert.py and
config.py, `LLaMAConfig.from_hugging_face`):
- q, k, v projections are fused along the output dim into `attention.qkv` (order q, k, v); o_proj -> `dense`.
- TensorRT-LLM's GatedMLP computes act(fc(x)) * gate(x), so HF `gate_proj` (the activated branch) -> `mlp.fc`
  and HF `up_proj` -> `mlp.gate`; `down_proj` -> `mlp.proj`.
- position_embedding_type 'rope_gpt_neox' (rotate-half), rotary_base = rope_theta, rotary_scaling = the HF
  rope scaling dict as is (e.g. {"rope_type": "llama3", "factor": 8.0, ...}).
- Tied embeddings still get an `lm_head.weight` (a copy of the embedding), as TensorRT-LLM writes it.
"""

from __future__ import annotations

import re
from typing import Any

from toolchain.checkpoint.hf_fields import boolean, positive_float, positive_int
from toolchain.checkpoint.sharding import Rule
from toolchain.checkpoint.spec import DenseFFN, LayerSpec, ModelSpec, Norm, Rope, in_layer
from toolchain.checkpoint.trtllm import ModelConfig
from toolchain.errors import UserError

Shape = tuple[int, ...]

# Tensors present in some HF Llama checkpoints that carry no weights (recomputed from the config).
DROPPED: tuple[re.Pattern[str], ...] = (re.compile(r"model\.(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq"),)

# Rope scaling types the reference forward (and our attention plugin) implement.
ROPE_TYPES = ("default", "linear", "llama3")

# One row per output tensor of a layer: TRT-LLM name <- HF name(s) (several: concatenated on dim 0).
LayerRow = tuple[str, tuple[str, ...]]
LAYER_TABLE: tuple[LayerRow, ...] = (
    ("input_layernorm.weight", ("input_layernorm.weight",)),
    ("attention.qkv.weight", ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")),
    ("attention.dense.weight", ("self_attn.o_proj.weight",)),
    ("post_layernorm.weight", ("post_attention_layernorm.weight",)),
    ("mlp.fc.weight", ("mlp.gate_proj.weight",)),
    ("mlp.gate.weight", ("mlp.up_proj.weight",)),
    ("mlp.proj.weight", ("mlp.down_proj.weight",)),
)
QKV_BIAS_TABLE: tuple[LayerRow, ...] = (
    ("attention.qkv.bias", ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")),
)
DENSE_BIAS_TABLE: tuple[LayerRow, ...] = (("attention.dense.bias", ("self_attn.o_proj.bias",)),)
MLP_BIAS_TABLE: tuple[LayerRow, ...] = (
    ("mlp.fc.bias", ("mlp.gate_proj.bias",)),
    ("mlp.gate.bias", ("mlp.up_proj.bias",)),
    ("mlp.proj.bias", ("mlp.down_proj.bias",)),
)
QK_NORM_TABLE: tuple[LayerRow, ...] = (
    ("attention.q_layernorm.weight", ("self_attn.q_norm.weight",)),
    ("attention.k_layernorm.weight", ("self_attn.k_norm.weight",)),
)


def _rope(hf: dict[str, Any], source: str) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) from either transformers-5 `rope_parameters` or the older keys."""
    params = hf.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise UserError(f"{source}: 'rope_parameters' must be an object, got {params!r}")
    scaling = {k: v for k, v in params.items() if k != "rope_theta"} if params else hf.get("rope_scaling")
    theta = positive_float(params or hf, "rope_theta", source, hf.get("rope_theta", 10000.0))
    if not scaling:
        return theta, None
    if not isinstance(scaling, dict):
        raise UserError(f'{source}: \'rope_scaling\' must be an object like {{"rope_type": "llama3", ...}}')
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise UserError(f"{source}: rope scaling type {kind!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    if kind == "default":
        return theta, None
    where = f"{source} (rope scaling)"
    positive_float(scaling, "factor", where)
    if kind == "llama3":
        low = positive_float(scaling, "low_freq_factor", where)
        high = positive_float(scaling, "high_freq_factor", where)
        positive_int(scaling, "original_max_position_embeddings", where)
        if high <= low:
            raise UserError(f"{where}: high_freq_factor {high} must exceed low_freq_factor {low}")
    return theta, dict(sorted(scaling.items()))


LAYER_TYPES = ("full_attention", "sliding_attention")


def layer_windows(hf: dict[str, Any], source: str) -> dict[str, Any]:
    """Qwen2/Qwen3's per-layer windows as config fields: with `use_sliding_window`, the layers from
    `max_window_layers` on slide (or those `layer_types` marks "sliding_attention"), as transformers' Qwen2Config
    decides; without it no layer slides, whatever `sliding_window` says. TensorRT-LLM's Qwen config has no window
    field (windows are a build option there); we write `sliding_window` and `layer_types` (docs/conversion.md)."""
    if not boolean(hf, "use_sliding_window", source):
        return {}
    layers = positive_int(hf, "num_hidden_layers", source)
    window = positive_int(hf, "sliding_window", source, 4096)  # transformers' Qwen2Config / Qwen3Config defaults
    types = hf.get("layer_types")
    if types is None:
        first = hf.get("max_window_layers", 28)
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise UserError(f"{source}: 'max_window_layers' must be a non-negative integer, got {first!r}")
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    return {"sliding_window": window, "family_fields": {"layer_types": check_layer_types(types, layers, source)}}


def check_layer_types(types: Any, layers: int, source: str | None) -> list[str]:
    """`source` names the file in the message (None: the caller prefixes it, as spec_of does)."""
    if not isinstance(types, list) or len(types) != layers or any(t not in LAYER_TYPES for t in types):
        where = f"{source}: " if source else ""
        raise UserError(
            f"{where}'layer_types' must list {layers} entries, each one of {', '.join(LAYER_TYPES)}; got {types!r}"
        )
    return list(types)


def windows_of(cfg: ModelConfig, types: list[str] | None = None) -> list[int | None]:
    """Each layer's attention window: `sliding_window` on the layers `types` (default: config.json's `layer_types`)
    marks sliding, or on every layer when there is no such list (Mistral, Phi-3)."""
    types = cfg.family_fields.get("layer_types") if types is None else types
    if types is None:
        return [cfg.sliding_window] * cfg.num_hidden_layers
    types = check_layer_types(types, cfg.num_hidden_layers, None)
    if cfg.sliding_window is None and "sliding_attention" in types:
        raise UserError("'layer_types' marks sliding layers but 'sliding_window' is null; set the window")
    return [cfg.sliding_window if t == "sliding_attention" else None for t in types]


def config_from_hf(hf: dict[str, Any], dtype: str, source: str) -> ModelConfig:
    return llama_style_config(hf, dtype, source, "LlamaForCausalLM")


def llama_style_config(hf: dict[str, Any], dtype: str, source: str, architecture: str, **fields: Any) -> ModelConfig:
    """The config of every Llama-style family; `fields` override or add (attn_bias, qk_layernorm, ...)."""
    hidden = positive_int(hf, "hidden_size", source)
    heads = positive_int(hf, "num_attention_heads", source)
    kv_heads = positive_int(hf, "num_key_value_heads", source, heads)
    if heads % kv_heads:
        raise UserError(
            f"{source}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}; "
            "fix config.json"
        )
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise UserError(f"{source}: hidden_act {act!r} is not supported for {architecture}; supported: silu")
    theta, scaling = _rope(hf, source)
    values: dict[str, Any] = dict(
        architecture=architecture,
        dtype=dtype,
        vocab_size=positive_int(hf, "vocab_size", source),
        hidden_size=hidden,
        num_hidden_layers=positive_int(hf, "num_hidden_layers", source),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_size=positive_int(hf, "head_dim", source, hidden // heads),
        intermediate_size=positive_int(hf, "intermediate_size", source),
        hidden_act=act,
        norm_epsilon=positive_float(hf, "rms_norm_eps", source, 1e-6),
        max_position_embeddings=positive_int(hf, "max_position_embeddings", source, 2048),
        position_embedding_type="rope_gpt_neox",
        rotary_base=theta,
        rotary_scaling=scaling,
        tie_word_embeddings=boolean(hf, "tie_word_embeddings", source),
        attn_bias=boolean(hf, "attention_bias", source),
        mlp_bias=boolean(hf, "mlp_bias", source),
    )
    return ModelConfig(**{**values, **fields})


def spec(cfg: ModelConfig) -> ModelSpec:
    return llama_style_spec(cfg)


def llama_style_spec(cfg: ModelConfig, dense_bias: bool | None = None) -> ModelSpec:
    """Every Llama-style family: RMSNorm before attention and MLP, GatedMLP, rotary on every layer, Mistral's window
    on every layer or Qwen's on those `layer_types` marks; `attn_bias` puts biases on q, k, v and o_proj (Llama's
    attention_bias), unless `dense_bias` says otherwise for o_proj (Qwen2: q, k, v only)."""
    eps = cfg.norm_epsilon
    windows = windows_of(cfg)

    def layer(i: int) -> LayerSpec:
        p = f"transformer.layers.{i}"
        return LayerSpec(
            index=i,
            attn_norm=Norm(f"{p}.input_layernorm", eps=eps),
            mlp_norm=Norm(f"{p}.post_layernorm", eps=eps),
            q_norm=Norm(f"{p}.attention.q_layernorm", eps=eps) if cfg.qk_layernorm else None,
            k_norm=Norm(f"{p}.attention.k_layernorm", eps=eps) if cfg.qk_layernorm else None,
            rope=Rope(cfg.rotary_base, cfg.rotary_scaling),
            window=windows[i],
            qkv_bias=cfg.attn_bias,
            dense_bias=cfg.attn_bias if dense_bias is None else dense_bias,
            ffn=in_layer(i, DenseFFN, activation=cfg.hidden_act, bias=cfg.mlp_bias),
        )

    return ModelSpec.of(cfg, Norm("transformer.ln_f", eps=eps), tuple(layer(i) for i in range(cfg.num_hidden_layers)))


def _lm_head_source(cfg: ModelConfig, available: set[str]) -> str:
    if "lm_head.weight" in available or not cfg.tie_word_embeddings:
        return "lm_head.weight"
    return "model.embed_tokens.weight"


def layer_rows(cfg: ModelConfig) -> list[LayerRow]:
    rows = list(LAYER_TABLE)
    if cfg.attn_bias:
        rows += QKV_BIAS_TABLE + DENSE_BIAS_TABLE
    if cfg.mlp_bias:
        rows += MLP_BIAS_TABLE
    if cfg.qk_layernorm:
        rows += QK_NORM_TABLE
    return rows


def weight_table(cfg: ModelConfig, available: set[str]) -> list[Rule]:
    return build_table(cfg, available, layer_rows(cfg))


def build_table(cfg: ModelConfig, available: set[str], rows: list[LayerRow]) -> list[Rule]:
    """The table of every Llama-style family (Llama, Mistral, Qwen2, Qwen3); they differ in their layer rows."""
    table = [
        Rule("transformer.vocab_embedding.weight", ("model.embed_tokens.weight",)),
        Rule("transformer.ln_f.weight", ("model.norm.weight",)),
        Rule("lm_head.weight", (_lm_head_source(cfg, available),)),
    ]
    for i in range(cfg.num_hidden_layers):
        table += [
            Rule(f"transformer.layers.{i}.{dst}", tuple(f"model.layers.{i}.{s}" for s in srcs)) for dst, srcs in rows
        ]
    return table


def source_shapes(cfg: ModelConfig, available: set[str]) -> dict[str, Shape]:
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.num_attention_heads * cfg.head_size, cfg.num_key_value_heads * cfg.head_size
    per_layer: dict[str, Shape] = {
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
        "self_attn.q_proj.bias": (q,),
        "self_attn.k_proj.bias": (kv,),
        "self_attn.v_proj.bias": (kv,),
        "self_attn.o_proj.bias": (h,),
        "mlp.gate_proj.weight": (i, h),
        "mlp.up_proj.weight": (i, h),
        "mlp.down_proj.weight": (h, i),
        "mlp.gate_proj.bias": (i,),
        "mlp.up_proj.bias": (i,),
        "mlp.down_proj.bias": (h,),
        "self_attn.q_norm.weight": (cfg.head_size,),
        "self_attn.k_norm.weight": (cfg.head_size,),
    }
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    for layer in range(cfg.num_hidden_layers):
        shapes.update({f"model.layers.{layer}.{k}": s for k, s in per_layer.items()})
    return shapes
