"""Phi-3 (`Phi3ForCausalLM`, e.g. microsoft/Phi-3-mini-4k-instruct): Llama's layer with fused projections.

HF Phi-3 (transformers models/phi3/modeling_phi3.py) stores `self_attn.qkv_proj` (rows q, k, v) and
`mlp.gate_up_proj` (rows: gate, then up; `gate, up = chunk(2)`, `down(up * silu(gate))`); no biases.
TensorRT-LLM's converter (tensorrt_llm/models/phi3/convert.py `load_weights_from_hf_model`) renames
`qkv_proj` -> `attention.qkv`, `o_proj` -> `attention.dense`, `down_proj` -> `mlp.proj`,
`post_attention_layernorm` -> `post_layernorm`, `model.norm` -> `transformer.ln_f`; its config
(models/phi3/config.py) takes `rotary_base` = rope_theta, `norm_epsilon` = rms_norm_eps, `rotary_pct` =
partial_rotary_factor, `position_embedding_type` rope_gpt_neox, and "long_rope" for the 128k models.
The MLP as TensorRT-LLM's Phi-3 writes it (convert.py `load_weights_from_hf_model`; its Phi3DecoderLayer uses the
plain `MLP` with `hidden_act` "swiglu", config.py `from_hugging_face`): `gate_up_proj` stays fused in `mlp.fc`
with its halves swapped to [up; gate], because TensorRT-LLM's `swiglu` activates the second half
(`x, gate = chunk(input, 2)`; `silu(gate) * x`, tensorrt_llm/functional.py); there is no `mlp.gate`. The spec marks
it (`DenseFFN.gate_up_fused`), and tensor parallelism splits each half on its own ("gate_up", sharding.py).
`sliding_window` is recorded as for Mistral: HF Phi-3 masks with it (each query sees itself and the
window - 1 tokens before it). Refused with one line: long-context rope ("longrope", "su", "yarn") and
`partial_rotary_factor` != 1 (Phi-4-mini), which neither the reference nor our attention plugin implement.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from toolchain.checkpoint.hf_fields import positive_float, positive_int
from toolchain.checkpoint.llama import DROPPED, LayerRow, build_table, llama_style_config
from toolchain.checkpoint.llama import source_shapes as llama_shapes
from toolchain.checkpoint.llama import spec as llama_spec
from toolchain.checkpoint.sharding import Rule
from toolchain.checkpoint.spec import DenseFFN, ModelSpec
from toolchain.checkpoint.trtllm import ModelConfig
from toolchain.errors import UserError

__all__ = ["DROPPED", "config_from_hf", "source_shapes", "spec", "weight_table"]

Shape = tuple[int, ...]

LAYER_TABLE: tuple[LayerRow, ...] = (
    ("input_layernorm.weight", ("input_layernorm.weight",)),
    ("attention.qkv.weight", ("self_attn.qkv_proj.weight",)),  # already q, k, v on the output dim
    ("attention.dense.weight", ("self_attn.o_proj.weight",)),
    ("post_layernorm.weight", ("post_attention_layernorm.weight",)),
    ("mlp.proj.weight", ("mlp.down_proj.weight",)),
)
FUSED_MLP = ("mlp.fc.weight", "mlp.gate_up_proj.weight")  # HF [gate; up] -> TRT-LLM [up; gate], halves swapped


def _refuse_unsupported_rope(hf: dict[str, Any], source: str) -> None:
    for key in ("rope_scaling", "rope_parameters"):
        params = hf.get(key)
        if not isinstance(params, dict):
            continue  # absent (null) here; a malformed value is refused by llama_style_config
        field = "rope_type" if "rope_type" in params else "type"
        kind = params.get(field, "default")
        if kind != "default":
            raise UserError(
                f"{source}: {key}.{field} {kind!r} (Phi-3 long-context rope) is not supported; only unscaled rope "
                "is: use a 4k-context Phi-3 model"
            )
    for where, params in (("", hf), ("rope_parameters.", hf.get("rope_parameters"))):
        factor = params.get("partial_rotary_factor", 1.0) if isinstance(params, dict) else 1.0
        if factor != 1:
            raise UserError(
                f"{source}: {where}partial_rotary_factor {factor!r} is not supported (rotary over part of each "
                "head); supported: 1.0"
            )


def config_from_hf(hf: dict[str, Any], dtype: str, source: str) -> ModelConfig:
    _refuse_unsupported_rope(hf, source)
    window = positive_int(hf, "sliding_window", source) if hf.get("sliding_window") is not None else None
    return llama_style_config(
        hf,
        dtype,
        source,
        "Phi3ForCausalLM",
        norm_epsilon=positive_float(hf, "rms_norm_eps", source, 1e-5),  # Phi3Config's default, not Llama's
        attn_bias=False,  # HF Phi-3 has no biases whatever config.json says
        mlp_bias=False,
        sliding_window=window,
        hidden_act="swiglu",  # TensorRT-LLM's Phi3Config: silu over the fused [up; gate] fc
    )


def _ffn(cfg: ModelConfig) -> DenseFFN:
    """Llama's gated MLP with gate and up fused in mlp.fc: what the spec describes and the fused rule splits by."""
    return DenseFFN(gate_up_fused=True, activation=cfg.hidden_act, bias=cfg.mlp_bias)


def spec(cfg: ModelConfig) -> ModelSpec:
    """Llama's layer, its MLP's gate and up fused in mlp.fc. A checkpoint an older trtbuild wrote (Llama's split
    mlp.fc / mlp.gate, hidden_act silu) is refused: read as fused it would be a different model."""
    if cfg.hidden_act != "swiglu":
        raise UserError(
            f"config.json: Phi3ForCausalLM with hidden_act {cfg.hidden_act!r} is the split MLP layout trtbuild wrote "
            "before it followed TensorRT-LLM's Phi-3 (fused mlp.fc, hidden_act swiglu); re-run `trtbuild convert`"
        )
    base = llama_spec(cfg)
    layers = tuple(dataclasses.replace(ls, ffn=_ffn(cfg)) for ls in base.layers)
    return dataclasses.replace(base, layers=layers)


def weight_table(cfg: ModelConfig, available: set[str]) -> list[Rule]:
    table = build_table(cfg, available, list(LAYER_TABLE))
    dst, src, ffn = *FUSED_MLP, _ffn(cfg)
    for layer in range(cfg.num_hidden_layers):
        fused = Rule(
            f"transformer.layers.{layer}.{dst}", (f"model.layers.{layer}.{src}",), halves_swapped=True, ffn=ffn
        )
        table.append(fused)
    return table


def source_shapes(cfg: ModelConfig, available: set[str]) -> dict[str, Shape]:
    """Llama's, plus the two fused tensors (entries no rule reads are never checked)."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_size
    shapes = llama_shapes(cfg, available)
    for layer in range(cfg.num_hidden_layers):
        shapes[f"model.layers.{layer}.self_attn.qkv_proj.weight"] = (qkv, h)
        shapes[f"model.layers.{layer}.mlp.gate_up_proj.weight"] = (2 * i, h)
    return shapes
