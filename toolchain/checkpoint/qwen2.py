"""Qwen2 (`Qwen2ForCausalLM`): Llama's layout with biases on q, k and v (none on o_proj).

From TensorRT-LLM's tensorrt_llm/models/qwen/convert.py and utils.py (`get_qwen_key_list`): q/k/v weights and
biases fuse into `attention.qkv.{weight,bias}`, gate_proj -> `mlp.fc`, up_proj -> `mlp.gate`; config
`architecture` = "Qwen2ForCausalLM", `qwen_type` = "qwen2", `attn_bias` = true. Qwen2's per-layer sliding
windows (`use_sliding_window` with `max_window_layers` or `layer_types`) become `sliding_window` + `layer_types`
(llama.layer_windows); TensorRT-LLM's Qwen config has no window field, it takes windows at build time.
"""

from __future__ import annotations

from typing import Any

from toolchain.checkpoint.llama import (
    DROPPED,
    LAYER_TABLE,
    QKV_BIAS_TABLE,
    build_table,
    layer_windows,
    llama_style_config,
    llama_style_spec,
    source_shapes,
)
from toolchain.checkpoint.spec import ModelSpec
from toolchain.checkpoint.trtllm import ModelConfig

__all__ = ["DROPPED", "config_from_hf", "source_shapes", "spec", "weight_table"]


def config_from_hf(hf: dict[str, Any], dtype: str, source: str) -> ModelConfig:
    windows = layer_windows(hf, source)
    family = {"qwen_type": "qwen2", **windows.pop("family_fields", {})}
    return llama_style_config(hf, dtype, source, "Qwen2ForCausalLM", attn_bias=True, family_fields=family, **windows)


def weight_table(cfg: ModelConfig, available: set[str]) -> list[Any]:
    return build_table(cfg, available, [*LAYER_TABLE, *QKV_BIAS_TABLE])


def spec(cfg: ModelConfig) -> ModelSpec:
    return llama_style_spec(cfg, dense_bias=False)  # biases on q, k and v only
