"""Mixture-of-experts layers of the Llama-style families (Mixtral, Qwen3-MoE): config fields, weight rules, spec.

The layout is TensorRT-LLM's `MixtureOfExperts` (tensorrt_llm/layers/moe.py; docs/conversion.md, "Mixture-of-experts
layers"): per sparse layer `mlp.router.weight` [E, H] in float32 (its router is a float32 `RowLinear`),
`mlp.fc.weight` [E, 2I, H] holding each expert's [up; gate] (`MOEWeightWrapper` stacks the w3s then the w1s on
dim -2: the first half is the linear branch, the second the activated one) and `mlp.proj.weight` [E, H, I]. The
config is TensorRT-LLM's `moe` object (`MoeConfig.to_dict`), `moe_intermediate_size` and
`moe_shared_expert_intermediate_size` (its Qwen config), plus ours, `mlp_only_layers`: the dense layers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from toolchain.checkpoint.hf_fields import positive_int
from toolchain.checkpoint.llama import (
    DENSE_BIAS_TABLE,
    LAYER_TABLE,
    QK_NORM_TABLE,
    QKV_BIAS_TABLE,
    LayerRow,
    build_table,
    llama_style_spec,
)
from toolchain.checkpoint.llama import source_shapes as llama_source_shapes
from toolchain.checkpoint.sharding import Rule
from toolchain.checkpoint.spec import ExpertsFFN, ModelSpec
from toolchain.checkpoint.trtllm import ModelConfig
from toolchain.errors import UserError

Shape = tuple[int, ...]

# TensorRT-LLM's MoeConfig.ExpertScaleNormalizationMode values we implement -> spec.ROUTER_NORMS: NONE (softmax over
# all experts, the top k as they are) and RENORMALIZE (the top k renormalised to sum to 1). SPARSE_MIXER (2) is not.
NORMALIZATION_MODES: dict[int, str] = {0: "softmax_topk", 1: "softmax_topk_renormalise"}
_MLP_ROWS = {"mlp.fc.weight", "mlp.gate.weight", "mlp.proj.weight"}


@dataclass(frozen=True)
class ExpertNames:
    """A family's HF names under `model.layers.{i}.`: the router, and expert {e}'s gate, up and down projections."""

    router: str
    gate: str
    up: str
    down: str


def moe_fields(
    num_experts: int, top_k: int, renormalise: bool, expert_size: int, dense_layers: list[int], source: str
) -> dict[str, Any]:
    """The config.json fields of a MoE model (flat, as TensorRT-LLM writes them; `mlp_only_layers` is ours)."""
    if top_k > num_experts:
        raise UserError(f"{source}: num_experts_per_tok {top_k} exceeds the {num_experts} experts; use at most that")
    return {
        "moe": {
            "num_experts": num_experts,
            "top_k": top_k,
            "normalization_mode": 1 if renormalise else 0,
            "sparse_mixer_epsilon": 0.01,
            "tp_mode": 0,
        },
        "moe_intermediate_size": expert_size,
        "moe_shared_expert_intermediate_size": 0,
        "mlp_only_layers": sorted(dense_layers),
    }


def _int(value: Any, what: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise UserError(f"'{what}' must be an integer of at least {minimum}, got {value!r}; re-run convert")
    return value


# Which of the two RENORMALIZE orders (spec.ROUTER_NORMS, equal in exact arithmetic) a router computes: ours,
# `moe_router_norm`, written where it is not the default (gpt-oss: the top k logits, then a softmax over them).
RENORMALIZE_ORDERS = ("softmax_topk_renormalise", "topk_softmax")


def experts_ffn(cfg: ModelConfig, biases: bool = False) -> tuple[ExpertsFFN, frozenset[int]]:
    """The experts of a MoE checkpoint config and its dense layers, every field checked (a config.json is input).
    `biases`: the family's experts may add biases (`mlp_bias`, gpt-oss); elsewhere `mlp_bias` is refused. Our
    optional fields (docs/conversion.md): `moe_router_norm`, `moe_router_bias`, `swiglu_alpha` / `swiglu_beta` /
    `swiglu_limit`."""
    fields = cfg.family_fields
    moe = fields.get("moe")
    if not isinstance(moe, dict):
        raise UserError(f"'moe' must be an object with num_experts and top_k, got {moe!r}; re-run convert")
    mode = moe.get("normalization_mode", 1)  # MoeConfig's default: RENORMALIZE
    if mode not in NORMALIZATION_MODES or isinstance(mode, bool):
        modes = ", ".join(f"{k} ({v})" for k, v in NORMALIZATION_MODES.items())
        raise UserError(f"'moe.normalization_mode' {mode!r} is not supported; supported: {modes}")
    router_norm = fields.get("moe_router_norm", NORMALIZATION_MODES[mode])
    allowed = RENORMALIZE_ORDERS if mode == 1 else (NORMALIZATION_MODES[mode],)
    if router_norm not in allowed:
        raise UserError(
            f"'moe_router_norm' {router_norm!r} does not go with 'moe.normalization_mode' {mode}; use one of "
            f"{', '.join(allowed)}"
        )
    router_bias = fields.get("moe_router_bias", False)
    if not isinstance(router_bias, bool):
        raise UserError(f"'moe_router_bias' must be true or false, got {router_bias!r}; re-run convert")
    swiglu = {k: fields[k] for k in ("swiglu_alpha", "swiglu_beta", "swiglu_limit") if k in fields}
    if cfg.mlp_bias and not biases:
        raise UserError(f"'mlp_bias' true: expert biases are not supported for {cfg.architecture}; set it false")
    shared = fields.get("moe_shared_expert_intermediate_size", 0)
    if shared not in (0, None):
        raise UserError(
            f"'moe_shared_expert_intermediate_size' {shared!r}: shared experts are not supported for "
            f"{cfg.architecture} (it has none); set it to 0"
        )
    size = _int(fields.get("moe_intermediate_size", cfg.intermediate_size), "moe_intermediate_size")
    dense = fields.get("mlp_only_layers") or []
    layers = cfg.num_hidden_layers
    if not isinstance(dense, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in dense):
        raise UserError(f"'mlp_only_layers' must be a list of layer indices, got {dense!r}; re-run convert")
    if any(not 0 <= i < layers for i in dense) or len(set(dense)) != len(dense):
        raise UserError(f"'mlp_only_layers' {dense!r} must list distinct layers in 0..{layers - 1}; re-run convert")
    ffn = ExpertsFFN(
        num_experts=_int(moe.get("num_experts"), "moe.num_experts"),
        top_k=_int(moe.get("top_k"), "moe.top_k"),
        expert_intermediate_size=size,
        router_norm=router_norm,
        activation="silu",  # gated silu (TensorRT-LLM's MoE "swiglu"); hidden_act is the dense layers'
        bias=cfg.mlp_bias,
        router_bias=router_bias,
        **swiglu,
    )
    return ffn, frozenset(dense)


def moe_spec(cfg: ModelConfig) -> ModelSpec:
    """Llama-style layers (q/k norms where `qk_layernorm`), the sparse ones with the experts as their FFN."""
    base = llama_style_spec(cfg)
    ffn, dense = experts_ffn(cfg)
    layers = tuple(ls if ls.index in dense else dataclasses.replace(ls, ffn=ffn) for ls in base.layers)
    return dataclasses.replace(base, layers=layers)


def weight_table(cfg: ModelConfig, available: set[str], names: ExpertNames) -> list[Rule]:
    """Llama's rows for attention, norms and the dense layers' MLPs; for a sparse layer the router (float32) and the
    experts stacked: fc = each expert's [up; gate], proj = its down."""
    ffn, dense = experts_ffn(cfg)
    attention = [row for row in LAYER_TABLE if row[0] not in _MLP_ROWS]
    rows: list[LayerRow] = attention + (list(QK_NORM_TABLE) if cfg.qk_layernorm else [])
    if cfg.attn_bias:
        rows += QKV_BIAS_TABLE + DENSE_BIAS_TABLE
    table = build_table(cfg, available, rows)
    mlp = [row for row in LAYER_TABLE if row[0] in _MLP_ROWS]
    for i in range(cfg.num_hidden_layers):
        dst, src = f"transformer.layers.{i}", f"model.layers.{i}"
        if i in dense:
            table += [Rule(f"{dst}.{d}", tuple(f"{src}.{s}" for s in srcs)) for d, srcs in mlp]
            continue
        experts = range(ffn.num_experts)
        fc = tuple(f"{src}.{n.format(e=e)}" for e in experts for n in (names.up, names.gate))
        proj = tuple(f"{src}.{names.down.format(e=e)}" for e in experts)
        table += [
            Rule(f"{dst}.mlp.router.weight", (f"{src}.{names.router}",), ffn=ffn, dtype="float32"),
            Rule(f"{dst}.mlp.fc.weight", fc, ffn=ffn, experts=ffn.num_experts),
            Rule(f"{dst}.mlp.proj.weight", proj, ffn=ffn, experts=ffn.num_experts),
        ]
    return table


def source_shapes(cfg: ModelConfig, available: set[str], names: ExpertNames) -> dict[str, Shape]:
    shapes = llama_source_shapes(cfg, available)
    ffn, _ = experts_ffn(cfg)
    h, size = cfg.hidden_size, ffn.expert_intermediate_size
    for i in range(cfg.num_hidden_layers):
        src = f"model.layers.{i}"
        shapes[f"{src}.{names.router}"] = (ffn.num_experts, h)
        for e in range(ffn.num_experts):
            shapes[f"{src}.{names.gate.format(e=e)}"] = (size, h)
            shapes[f"{src}.{names.up.format(e=e)}"] = (size, h)
            shapes[f"{src}.{names.down.format(e=e)}"] = (h, size)
    return shapes


def hf_moe_fields(
    hf: dict[str, Any],
    source: str,
    count_keys: tuple[str, ...],
    size_key: str,
    renormalise: bool,
    dense_layers: list[int],
    top_k_default: int | None = None,
) -> dict[str, Any]:
    """`moe_fields` read from an HF config.json: the expert count under whichever of `count_keys` it sets
    (`expert_count`), `num_experts_per_tok` (required where `top_k_default` is None) and the expert width under
    `size_key`."""
    experts = expert_count(hf, source, count_keys)
    default = () if top_k_default is None else (top_k_default,)
    top_k = positive_int(hf, "num_experts_per_tok", source, *default)
    size = positive_int(hf, size_key, source)
    return moe_fields(experts, top_k, renormalise, size, dense_layers, source)


def expert_count(hf: dict[str, Any], source: str, keys: tuple[str, ...]) -> int:
    """The number of experts under whichever of `keys` config.json sets (released configs and transformers 5.x name
    it differently); two that disagree are refused."""
    present = {k: positive_int(hf, k, source) for k in keys if hf.get(k) is not None}
    if not present:
        raise UserError(f"{source}: the expert count is missing; set '{keys[0]}' (a positive integer)")
    if len(set(present.values())) > 1:
        listing = ", ".join(f"'{k}' {v}" for k, v in present.items())
        raise UserError(f"{source}: {listing} disagree; the expert count must be one number, fix config.json")
    return next(iter(present.values()))


def refuse_set(hf: dict[str, Any], source: str, key: str, what: str) -> None:
    """Refuse a feature the family's config can switch on that we do not implement (a non-zero/non-empty value)."""
    value = hf.get(key)
    if value:
        raise UserError(f"{source}: '{key}' {value!r} ({what}) is not supported; it must be 0 or absent")
