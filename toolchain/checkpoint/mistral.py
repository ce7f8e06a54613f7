"""Mistral (`MistralForCausalLM`): Llama's names and config, plus a sliding attention window.

TensorRT-LLM converts Mistral with its LLaMA converter (tensorrt_llm/models/__init__.py maps
MistralForCausalLM to LLaMAForCausalLM; names as in llama/convert.py) and takes the window at build time
(`max_attention_window_size`); its checkpoint config has no window field. We record `sliding_window` in
config.json so the build stage and the reference forward apply it from the checkpoint alone.
"""

from __future__ import annotations

from typing import Any

from toolchain.checkpoint.hf_fields import positive_int
from toolchain.checkpoint.llama import DROPPED, llama_style_config, source_shapes, spec, weight_table
from toolchain.checkpoint.trtllm import ModelConfig

__all__ = ["DROPPED", "config_from_hf", "source_shapes", "spec", "weight_table"]


def config_from_hf(hf: dict[str, Any], dtype: str, source: str) -> ModelConfig:
    window = positive_int(hf, "sliding_window", source) if hf.get("sliding_window") is not None else None
    return llama_style_config(hf, dtype, source, "MistralForCausalLM", sliding_window=window)
