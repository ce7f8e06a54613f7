"""The feed-forward variant of a layer (toolchain/checkpoint/spec.py): DenseFFN and ExpertsFFN validate themselves
at construction, the families describe their MLPs with DenseFFN, and every consumer (the spec's linears, the
reference forward, the ONNX export, sharding, calibration) either runs an ExpertsFFN or refuses it with one clear
line naming what does run (issue 26 lands mixture-of-experts layers in slices: convert and the reference forward
first; tests/checkpoint/test_moe.py runs them)."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from toolchain.checkpoint.sharding import Rule, split_of
from toolchain.checkpoint.spec import (
    DenseFFN,
    ExpertsFFN,
    LayerSpec,
    ModelSpec,
    Norm,
    Rope,
    SharedExperts,
    in_layer,
    spec_of,
)
from toolchain.checkpoint.trtllm import ModelConfig
from toolchain.engine.export import _Exporter
from toolchain.errors import UserError
from toolchain.quantize.calibrate import check_ffns
from toolchain.reference.model import ReferenceModel

MOE = "mixture-of-experts layers (8 experts, top 2) are not supported here yet: convert (tp=1, or split with --tp"
MOE_RE = re.escape(MOE)


def _config(**fields: object) -> ModelConfig:
    base: dict[str, object] = {
        "architecture": "LlamaForCausalLM",
        "dtype": "float32",
        "vocab_size": 97,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_size": 8,
        "intermediate_size": 96,
        "hidden_act": "silu",
        "norm_epsilon": 1e-5,
        "max_position_embeddings": 128,
    }
    return ModelConfig(**{**base, **fields})  # type: ignore[arg-type]


def _layer(ffn: DenseFFN | ExpertsFFN, index: int = 1) -> LayerSpec:
    p = f"transformer.layers.{index}"
    return LayerSpec(index, Norm(f"{p}.input_layernorm"), Norm(f"{p}.post_layernorm"), rope=Rope(10_000.0), ffn=ffn)


EXPERTS = ExpertsFFN(num_experts=8, top_k=2, expert_intermediate_size=32, shared=SharedExperts(1, 64))


def test_dense_ffn_defaults_are_llamas_gated_mlp() -> None:
    ffn = _layer(DenseFFN()).ffn
    assert ffn == DenseFFN(gated=True, gate_up_fused=False, activation="silu", bias=False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ffn.gated = False  # type: ignore[misc]


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"activation": "gelu_exact"}, ["hidden_act 'gelu_exact' is not supported", "silu", "relu"]),
        ({"gated": False, "gate_up_fused": True}, ["fused gate/up projection needs a gated MLP"]),
    ],
)
def test_dense_ffn_refuses_what_no_stage_runs(fields: dict[str, object], words: list[str]) -> None:
    with pytest.raises(UserError) as e:
        DenseFFN(**fields)  # type: ignore[arg-type]
    assert all(w in str(e.value) for w in words)


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"num_experts": 0}, ["num_experts 0 must be a positive integer"]),
        ({"top_k": 0}, ["top_k 0 must be a positive integer"]),
        ({"top_k": 9}, ["top_k 9 exceeds num_experts 8"]),
        ({"expert_intermediate_size": -1}, ["expert intermediate size -1"]),
        ({"router_norm": "sigmoid"}, ["'sigmoid'", "softmax_topk", "topk_softmax", "softmax_topk_renormalise"]),
        ({"activation": "tanh"}, ["hidden_act 'tanh'"]),
        ({"num_experts": True}, ["num_experts True must be a positive integer"]),
    ],
)
def test_experts_ffn_is_validated_at_construction(fields: dict[str, object], words: list[str]) -> None:
    base: dict[str, object] = {"num_experts": 8, "top_k": 2, "expert_intermediate_size": 32}
    with pytest.raises(UserError) as e:
        ExpertsFFN(**{**base, **fields})  # type: ignore[arg-type]
    assert all(w in str(e.value) for w in words), str(e.value)


@pytest.mark.parametrize(("count", "size"), [(0, 64), (1, 0)])
def test_shared_experts_are_validated(count: int, size: int) -> None:
    with pytest.raises(UserError, match="must be a positive integer"):
        SharedExperts(count, size)


def test_a_layer_part_s_error_names_its_layer() -> None:
    """A family builds a layer's FFN with `in_layer`, so a bad hidden_act in config.json names the layer, as it
    did when the activation was LayerSpec's own field."""
    with pytest.raises(UserError, match=r"^layer 3: hidden_act 'nope' is not supported; supported: silu"):
        in_layer(3, DenseFFN, activation="nope")
    with pytest.raises(UserError, match=r"config\.json: layer 0: hidden_act 'nope' is not supported"):
        spec_of(_config(hidden_act="nope"))


def test_families_describe_their_mlps_with_dense_ffns() -> None:
    llama = spec_of(_config(mlp_bias=True))
    assert {ls.ffn for ls in llama.layers} == {DenseFFN(activation="silu", bias=True)}
    phi3 = spec_of(_config(architecture="Phi3ForCausalLM", hidden_act="swiglu"))
    assert {ls.ffn for ls in phi3.layers} == {DenseFFN(gate_up_fused=True, activation="swiglu")}
    learned = {"position_embedding_type": "learned_absolute"}
    gpt2 = spec_of(_config(architecture="GPT2LMHeadModel", hidden_act="gelu_new", **learned))
    assert {ls.ffn for ls in gpt2.layers} == {DenseFFN(gated=False, activation="gelu_new", bias=True)}
    assert [len(ls.mlp_inputs()) for spec in (llama, phi3, gpt2) for ls in spec.layers[:1]] == [2, 1, 1]


def test_a_model_with_experts_names_its_router_and_stacked_experts() -> None:
    spec = ModelSpec(
        "SomeMoeForCausalLM", 97, 64, 8, 2, 8, 96, Norm("transformer.ln_f"), (_layer(DenseFFN(), 0), _layer(EXPERTS))
    )
    assert spec.layers[1].ffn.shared == SharedExperts(1, 64, gated=True)  # type: ignore[union-attr]
    p = "transformer.layers.1"
    assert spec.layers[1].linears() == [f"{p}.attention.qkv", f"{p}.attention.dense", f"{p}.mlp.router",
                                        f"{p}.mlp.fc", f"{p}.mlp.proj"]  # fmt: skip
    assert spec.layers[1].input_groups()[1] == [f"{p}.mlp.router", f"{p}.mlp.fc"]
    assert f"{p}.mlp.router.weight" in spec.tensor_names() and f"{p}.mlp.gate.weight" not in spec.tensor_names()
    with pytest.raises(UserError, match=r"ffn 'dense' is not a DenseFFN or an ExpertsFFN"):
        LayerSpec(0, Norm("a"), Norm("b"), ffn="dense")  # type: ignore[arg-type]


def test_every_consumer_refuses_experts_in_its_one_dispatch_place() -> None:
    cfg = _config()
    x = torch.zeros(1, 3, cfg.hidden_size)
    with pytest.raises(UserError, match=r"^transformer\.layers\.1: the reference forward runs gated experts without "
                       r"shared experts"):  # fmt: skip
        ReferenceModel(cfg, {}).mlp(x, _layer(EXPERTS))
    with pytest.raises(UserError, match=rf"^ONNX export, layer 1: {MOE_RE}"):
        _Exporter(cfg, {}, torch.float32, 16).ffn("x", _layer(EXPERTS))
    assert split_of("transformer.layers.1.mlp.fc.weight", EXPERTS) == "experts"  # whole at tp=1, refused above
    dense = spec_of(cfg)
    with pytest.raises(UserError, match=rf"^calibration, layer 1: {MOE_RE}"):
        check_ffns(dataclasses.replace(dense, layers=(dense.layers[0], _layer(EXPERTS))))
    check_ffns(dense)  # a dense model passes


def test_sharding_asks_the_ffn_only_for_its_own_tensors() -> None:
    fused = DenseFFN(gate_up_fused=True)
    assert split_of("transformer.layers.0.mlp.fc.weight", fused) == "gate_up"
    assert split_of("transformer.layers.0.mlp.fc.weight", DenseFFN()) == "column"
    assert split_of("transformer.layers.0.mlp.fc.weight") == "column"
    assert split_of("transformer.layers.0.mlp.proj.weight", fused) == "row"
    assert split_of("transformer.layers.0.attention.qkv.weight", EXPERTS) == "qkv"  # not the FFN's: no refusal


def test_a_conversion_rule_splits_as_its_ffn_says() -> None:
    """A family's weight table names the FFN a tensor belongs to (Phi-3's fused fc); convert's split asks it."""
    fc = "transformer.layers.0.mlp.fc.weight"
    assert Rule(fc, ("src",), halves_swapped=True, ffn=DenseFFN(gate_up_fused=True)).split == "gate_up"
    assert Rule(fc, ("src",)).split == "column"
    assert Rule(fc, ("src",), ffn=EXPERTS).split == "experts"
