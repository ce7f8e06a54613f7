"""Qwen3 (`Qwen3ForCausalLM`): Llama's layout plus per-head RMSNorm of q and k before rotary.

From TensorRT-LLM's tensorrt_llm/models/qwen/convert.py: `self_attn.q_norm` -> `attention.q_layernorm.weight`,
`self_attn.k_norm` -> `attention.k_layernorm.weight` (replicated across TP ranks), `qk_layernorm` = true
(PretrainedConfig, models/modeling_utils.py), `qwen_type` = "qwen3". Unlike TensorRT-LLM's Qwen converter we
take head_size from HF `head_dim`, which Qwen3 sets independently of hidden_size / num_attention_heads.
"""

from __future__ import annotations

from typing import Any

from toolchain.checkpoint.llama import (
    DROPPED,
    layer_windows,
    llama_style_config,
    source_shapes,
    spec,
    weight_table,
)
from toolchain.checkpoint.trtllm import ModelConfig

__all__ = ["DROPPED", "config_from_hf", "source_shapes", "spec", "weight_table"]


def config_from_hf(hf: dict[str, Any], dtype: str, source: str) -> ModelConfig:
    windows = layer_windows(hf, source)
    family = {"qwen_type": "qwen3", **windows.pop("family_fields", {})}
    return llama_style_config(hf, dtype, source, "Qwen3ForCausalLM", qk_layernorm=True, family_fields=family, **windows)
