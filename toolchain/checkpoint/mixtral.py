"""Mixtral (`MixtralForCausalLM`): Llama's attention and norms, every MLP a mixture of experts.

HF names (transformers' MixtralSparseMoeBlock, as `save_pretrained` writes them): `block_sparse_moe.gate.weight`
[E, H] the router; `block_sparse_moe.experts.{e}.w1` the gate (activated), `w3` the up, `w2` the down projection.
The router takes a softmax over all `num_local_experts` logits in float32, the top `num_experts_per_tok`, and
renormalises them to sum to 1 (TensorRT-LLM's normalization_mode RENORMALIZE). TensorRT-LLM converts Mixtral with its
LLaMA converter (`MixtureOfExperts`, tensorrt_llm/layers/moe.py: fc = [w3; w1] stacked over experts, proj = w2,
router = gate in float32); the layout is docs/conversion.md's "Mixture-of-experts layers". `sliding_window` as for
Mistral. `router_jitter_noise` acts in training only and is ignored.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from toolchain.checkpoint import moe
from toolchain.checkpoint.hf_fields import positive_int
from toolchain.checkpoint.llama import DROPPED, llama_style_config
from toolchain.checkpoint.trtllm import ModelConfig

__all__ = ["DROPPED", "config_from_hf", "source_shapes", "spec", "weight_table"]

NAMES = moe.ExpertNames(
    router="block_sparse_moe.gate.weight",
    gate="block_sparse_moe.experts.{e}.w1.weight",
    up="block_sparse_moe.experts.{e}.w3.weight",
    down="block_sparse_moe.experts.{e}.w2.weight",
)


def config_from_hf(hf: dict[str, Any], dtype: str, source: str) -> ModelConfig:
    fields = moe.hf_moe_fields(
        hf, source, ("num_local_experts", "num_experts"), "intermediate_size", True, [], top_k_default=2
    )
    window = positive_int(hf, "sliding_window", source) if hf.get("sliding_window") is not None else None
    return llama_style_config(hf, dtype, source, "MixtralForCausalLM", sliding_window=window, family_fields=fields)


spec = moe.moe_spec
weight_table = partial(moe.weight_table, names=NAMES)
source_shapes = partial(moe.source_shapes, names=NAMES)
