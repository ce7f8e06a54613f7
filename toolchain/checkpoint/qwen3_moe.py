"""Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3's attention (per-head q/k RMSNorm), mixture-of-experts MLPs, and dense
MLPs on the layers `mlp_only_layers` and `decoder_sparse_step` leave dense.

HF names, as transformers 5.x's `save_pretrained` writes them (it holds the experts fused in memory, `gate_up_proj`
[E, 2I, H] and `down_proj`, but saves them per expert): `mlp.gate.weight` [E, H] the router,
`mlp.experts.{e}.{gate,up,down}_proj.weight`; a dense layer has Llama's `mlp.{gate,up,down}_proj`. The router (its
`Qwen3MoeTopKRouter`) takes a softmax over all experts in float32 and the top `num_experts_per_tok`, renormalised to
sum to 1 only with `norm_topk_prob` (TensorRT-LLM's normalization_mode RENORMALIZE, else NONE). A layer i is sparse
when it is not in `mlp_only_layers` and (i + 1) % `decoder_sparse_step` == 0 (transformers' Qwen3MoeDecoderLayer);
we write the dense ones as `mlp_only_layers`. Released configs name the expert count `num_experts`, transformers 5.x
`num_local_experts`: both are read. With `use_sliding_window` every layer slides (transformers' Qwen3MoeConfig keeps
`sliding_window` then, and the model masks every layer with it); no `max_window_layers`.

TensorRT-LLM (tensorrt_llm/models/qwen/config.py, `QWenConfig.from_hugging_face`): `qwen_type: qwen3_moe`,
`moe_intermediate_size`, `moe_shared_expert_intermediate_size`, `moe`, expert layout as Mixtral's
(`MixtureOfExperts`). Unlike it we write normalization_mode from `norm_topk_prob` (it writes NONE whatever the
config says) and keep `hidden_act: silu` (it writes `swiglu`). Shared experts (Qwen2-MoE's
`shared_expert_intermediate_size`) are refused.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from toolchain.checkpoint import moe
from toolchain.checkpoint.hf_fields import boolean, positive_int
from toolchain.checkpoint.llama import DROPPED, llama_style_config
from toolchain.checkpoint.trtllm import ModelConfig
from toolchain.errors import UserError

__all__ = ["DROPPED", "config_from_hf", "source_shapes", "spec", "weight_table"]

NAMES = moe.ExpertNames(
    router="mlp.gate.weight",
    gate="mlp.experts.{e}.gate_proj.weight",
    up="mlp.experts.{e}.up_proj.weight",
    down="mlp.experts.{e}.down_proj.weight",
)


def dense_layers(hf: dict[str, Any], layers: int, source: str) -> list[int]:
    """The layers with a dense MLP, as transformers' Qwen3MoeDecoderLayer decides."""
    step = positive_int(hf, "decoder_sparse_step", source, 1)
    only = hf.get("mlp_only_layers") or []
    if not isinstance(only, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in only):
        raise UserError(f"{source}: 'mlp_only_layers' must be a list of layer indices, got {only!r}; fix config.json")
    outside = [i for i in only if not 0 <= i < layers]
    if outside:
        raise UserError(
            f"{source}: 'mlp_only_layers' names layer {outside[0]}, outside 0..{layers - 1}; fix config.json"
        )
    return [i for i in range(layers) if i in only or (i + 1) % step != 0]


def config_from_hf(hf: dict[str, Any], dtype: str, source: str) -> ModelConfig:
    moe.refuse_set(hf, source, "shared_expert_intermediate_size", "shared experts")
    layers = positive_int(hf, "num_hidden_layers", source)
    renormalise = boolean(hf, "norm_topk_prob", source)
    dense = dense_layers(hf, layers, source)
    experts = moe.hf_moe_fields(
        hf, source, ("num_experts", "num_local_experts"), "moe_intermediate_size", renormalise, dense
    )
    slides = boolean(hf, "use_sliding_window", source)
    window = positive_int(hf, "sliding_window", source, 4096) if slides else None
    return llama_style_config(
        hf,
        dtype,
        source,
        "Qwen3MoeForCausalLM",
        qk_layernorm=True,
        sliding_window=window,
        family_fields={"qwen_type": "qwen3_moe", **experts},
    )


spec = moe.moe_spec
weight_table = partial(moe.weight_table, names=NAMES)
source_shapes = partial(moe.source_shapes, names=NAMES)
