"""GPT-2 (`GPT2LMHeadModel`): learned positions, LayerNorm with bias, a plain GELU MLP, Conv1D weights.

From TensorRT-LLM's tensorrt_llm/models/gpt/convert.py and config.py: wte -> `transformer.vocab_embedding`,
wpe -> `transformer.position_embedding`, ln_1/ln_2 -> `input_layernorm`/`post_layernorm` (weight and bias),
attn.c_attn -> `attention.qkv`, attn.c_proj -> `attention.dense`, mlp.c_fc -> `mlp.fc`, mlp.c_proj ->
`mlp.proj`, ln_f -> `transformer.ln_f`, lm_head = wte when tied. HF's Conv1D stores weights as [in, out], the
transpose of Linear, so every Conv1D weight is transposed. Config: `architecture` = "GPT2LMHeadModel",
`position_embedding_type` = "learned_absolute", `hidden_act` = HF `activation_function` ("gelu_new", the tanh
approximation), `bias` = true, `gpt_variant` = "gpt2". Checkpoints exist with and without the `transformer.`
prefix on HF names (the original release has none); both are read.
"""

from __future__ import annotations

import re
from typing import Any

from toolchain.checkpoint.hf_fields import boolean, positive_float, positive_int
from toolchain.checkpoint.sharding import Rule
from toolchain.checkpoint.spec import DenseFFN, LayerSpec, ModelSpec, Norm, in_layer
from toolchain.checkpoint.trtllm import ModelConfig
from toolchain.errors import UserError

Shape = tuple[int, ...]
# Causal-mask buffers some GPT-2 exports carry: not weights.
DROPPED: tuple[re.Pattern[str], ...] = (re.compile(r"(transformer\.)?h\.\d+\.attn\.(masked_)?bias"),)
# HF's exact-erf "gelu" is not among them: TensorRT-LLM's gelu is the tanh approximation, so the engine would
# compute another function than the model was trained with.
ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh", "relu")

# TRT-LLM layer name <- HF layer name, stored transposed (Conv1D).
_LAYER: tuple[tuple[str, str, bool], ...] = (
    ("input_layernorm.weight", "ln_1.weight", False),
    ("input_layernorm.bias", "ln_1.bias", False),
    ("attention.qkv.weight", "attn.c_attn.weight", True),
    ("attention.qkv.bias", "attn.c_attn.bias", False),
    ("attention.dense.weight", "attn.c_proj.weight", True),
    ("attention.dense.bias", "attn.c_proj.bias", False),
    ("post_layernorm.weight", "ln_2.weight", False),
    ("post_layernorm.bias", "ln_2.bias", False),
    ("mlp.fc.weight", "mlp.c_fc.weight", True),
    ("mlp.fc.bias", "mlp.c_fc.bias", False),
    ("mlp.proj.weight", "mlp.c_proj.weight", True),
    ("mlp.proj.bias", "mlp.c_proj.bias", False),
)


def config_from_hf(hf: dict[str, Any], dtype: str, source: str) -> ModelConfig:
    hidden = positive_int(hf, "n_embd", source)
    heads = positive_int(hf, "n_head", source)
    if hidden % heads:
        raise UserError(f"{source}: n_embd {hidden} is not a multiple of n_head {heads}; fix config.json")
    act = hf.get("activation_function", "gelu_new")
    if act not in ACTIVATIONS:
        raise UserError(f"{source}: activation_function {act!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
    if not boolean(hf, "scale_attn_weights", source, True) or boolean(hf, "scale_attn_by_inverse_layer_idx", source):
        raise UserError(f"{source}: only standard 1/sqrt(head_dim) attention scaling is supported")
    return ModelConfig(
        architecture="GPT2LMHeadModel",
        dtype=dtype,
        vocab_size=positive_int(hf, "vocab_size", source),
        hidden_size=hidden,
        num_hidden_layers=positive_int(hf, "n_layer", source),
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_size=hidden // heads,
        intermediate_size=positive_int(hf, "n_inner", source, 4 * hidden),
        hidden_act=act,
        norm_epsilon=positive_float(hf, "layer_norm_epsilon", source, 1e-5),
        max_position_embeddings=positive_int(hf, "n_positions", source, 1024),
        position_embedding_type="learned_absolute",
        tie_word_embeddings=boolean(hf, "tie_word_embeddings", source, True),
        attn_bias=True,
        mlp_bias=True,
        family_fields={"bias": True, "gpt_variant": "gpt2"},
    )


def spec(cfg: ModelConfig) -> ModelSpec:
    """LayerNorm (with bias) before attention and MLP, a plain MLP, biases everywhere, learned positions."""
    eps = cfg.norm_epsilon
    layers = tuple(
        LayerSpec(
            index=i,
            attn_norm=Norm(f"transformer.layers.{i}.input_layernorm", "layer", eps),
            mlp_norm=Norm(f"transformer.layers.{i}.post_layernorm", "layer", eps),
            qkv_bias=True,
            dense_bias=True,
            ffn=in_layer(i, DenseFFN, gated=False, activation=cfg.hidden_act, bias=True),
        )
        for i in range(cfg.num_hidden_layers)
    )
    return ModelSpec.of(cfg, Norm("transformer.ln_f", "layer", eps), layers, learned_positions=True)


def _prefix(available: set[str]) -> str:
    return "" if "wte.weight" in available and "transformer.wte.weight" not in available else "transformer."


def weight_table(cfg: ModelConfig, available: set[str]) -> list[Rule]:
    p = _prefix(available)
    head = "lm_head.weight" if "lm_head.weight" in available or not cfg.tie_word_embeddings else f"{p}wte.weight"
    table = [
        Rule("transformer.vocab_embedding.weight", (f"{p}wte.weight",)),
        Rule("transformer.position_embedding.weight", (f"{p}wpe.weight",)),
        Rule("transformer.ln_f.weight", (f"{p}ln_f.weight",)),
        Rule("transformer.ln_f.bias", (f"{p}ln_f.bias",)),
        Rule("lm_head.weight", (head,)),
    ]
    for i in range(cfg.num_hidden_layers):
        table += [
            Rule(f"transformer.layers.{i}.{dst}", (f"{p}h.{i}.{src}",), transpose) for dst, src, transpose in _LAYER
        ]
    return table


def source_shapes(cfg: ModelConfig, available: set[str]) -> dict[str, Shape]:
    p, h, i, v = _prefix(available), cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    per_layer: dict[str, Shape] = {
        "ln_1.weight": (h,),
        "ln_1.bias": (h,),
        "attn.c_attn.weight": (h, 3 * h),
        "attn.c_attn.bias": (3 * h,),
        "attn.c_proj.weight": (h, h),
        "attn.c_proj.bias": (h,),
        "ln_2.weight": (h,),
        "ln_2.bias": (h,),
        "mlp.c_fc.weight": (h, i),
        "mlp.c_fc.bias": (i,),
        "mlp.c_proj.weight": (i, h),
        "mlp.c_proj.bias": (h,),
    }
    shapes: dict[str, Shape] = {
        f"{p}wte.weight": (v, h),
        f"{p}wpe.weight": (cfg.max_position_embeddings, h),
        f"{p}ln_f.weight": (h,),
        f"{p}ln_f.bias": (h,),
        "lm_head.weight": (v, h),
    }
    for layer in range(cfg.num_hidden_layers):
        shapes.update({f"{p}h.{layer}.{k}": s for k, s in per_layer.items()})
    return shapes
