"""The MoE reference op (toolchain/engine/ops.py `moe`) against a naive float64 dense mixture (every expert on every
token, masked by the routing), and its routing against transformers' routers (ties included)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch
from models import TPB, build
from torch.nn import functional as F

from toolchain.checkpoint.spec import ROUTER_NORMS
from toolchain.engine.ops import MoEAttrs, moe, route

HIDDEN, INTER = 48, 40
# float32 against float64: each output sums hidden + inter products of O(1) terms, each rounded at ~6e-8 (2^-24),
# so |error| / scale stays near sqrt(88) * 6e-8 ~ 6e-7; 1e-5 of the output's scale leaves a 15x margin
TOL = 1e-5


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


NAIVE_ACT: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": _gelu_tanh,
    "gelu_pytorch_tanh": _gelu_tanh,
    "relu": F.relu,
}


def make(
    a: MoEAttrs, tokens: int, seed: int, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """x, router_weight, fc_weight, proj_weight and the op's bias inputs, random (std 1 / sqrt(fan-in): O(1)
    activations)."""
    g = torch.Generator().manual_seed(seed)
    e, h = a.number_of_experts, a.expert_hidden_size

    def rand(*shape: int, fan_in: int = 1) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, dtype=torch.float64) / math.sqrt(fan_in)).to(dtype)

    x = rand(tokens, h)
    biases = [rand(e, a.fc_rows), rand(e, h)] if a.use_bias else []
    if a.router_bias:
        biases.append(rand(e))
    return (
        x,
        rand(e, h, fan_in=h) * 4,
        rand(e, a.fc_rows, h, fan_in=h),
        rand(e, h, a.expert_inter_size, fan_in=INTER),
        biases,
    )


def naive(
    a: MoEAttrs,
    x: torch.Tensor,
    router_weight: torch.Tensor,
    fc: torch.Tensor,
    proj: torch.Tensor,
    biases: list[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, chosen experts as a [tokens, experts] mask), float64, dense: a gate per (token, expert), zero where
    the expert is not among the token's top k, and every expert computed on every token."""
    x, router_weight, fc, proj = (t.double() for t in (x, router_weight, fc, proj))
    biases = [b.double() for b in biases]
    logits = x @ router_weight.T
    if a.router_bias:
        logits = logits + biases[-1]
    kth = logits.topk(a.top_k, dim=-1).values[:, -1:]
    chosen = logits >= kth  # top k by logit = top k by probability (softmax is monotone)
    if a.router_norm == "topk_softmax":
        gates = torch.softmax(logits.masked_fill(~chosen, -math.inf), dim=-1)
    else:
        gates = torch.softmax(logits, dim=-1) * chosen
        if a.router_norm == "softmax_topk_renormalise":
            gates = gates / gates.sum(dim=-1, keepdim=True)
    out = torch.zeros_like(x)
    for e in range(a.number_of_experts):
        h = x @ fc[e].T + (biases[0][e] if a.use_bias else 0)
        if a.clamped_swiglu:  # gpt-oss: transformers' GptOssExperts._apply_gate, written out
            up, gate = h[:, : a.expert_inter_size], h[:, a.expert_inter_size :]
            if a.swiglu_limit:
                gate, up = gate.clamp(max=a.swiglu_limit), up.clamp(-a.swiglu_limit, a.swiglu_limit)
            h = gate / (1 + torch.exp(-a.swiglu_alpha * gate)) * (up + a.swiglu_beta)
        elif a.gated:
            up, gate = h[:, : a.expert_inter_size], h[:, a.expert_inter_size :]
            h = up * NAIVE_ACT[a.activation](gate)
        else:
            h = NAIVE_ACT[a.activation](h)
        y = h @ proj[e].T + (biases[1][e] if a.use_bias else 0)
        out += gates[:, e : e + 1] * y
    return out, chosen


def check(a: MoEAttrs, tokens: int = 37, seed: int = 0) -> None:
    x, rw, fc, proj, biases = make(a, tokens, seed)
    got = moe(a, x, rw, fc, proj, *biases)
    want, chosen = naive(a, x, rw, fc, proj, biases)
    assert got.dtype == torch.float32 and got.shape == want.shape
    scale = want.abs().max().item()
    err = (got.double() - want).abs().max().item()
    assert err <= TOL * scale, f"{a}: max-abs {err:.3g}, scale {scale:.3g}"
    _, experts = route(a, x, rw, biases[-1] if a.router_bias else None)
    picked = torch.zeros_like(chosen).scatter_(1, experts, True)
    assert torch.equal(picked, chosen), "the op chose other experts than the float64 routing"


def attrs(**kw: Any) -> MoEAttrs:
    base: dict[str, Any] = dict(number_of_experts=8, top_k=2, expert_hidden_size=HIDDEN, expert_inter_size=INTER)
    return MoEAttrs(**{**base, **kw})


@pytest.mark.parametrize("norm", ROUTER_NORMS)
@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_every_router_norm_matches_the_dense_float64_mixture(norm: str, top_k: int) -> None:
    check(attrs(router_norm=norm, top_k=top_k), seed=top_k)


@pytest.mark.parametrize(
    "kw",
    [
        dict(activation="gelu"),
        dict(activation="relu", gated=0),
        dict(activation="gelu_pytorch_tanh", gated=0, use_bias=1),
        dict(use_bias=1, router_bias=1, router_norm="topk_softmax"),
        dict(router_bias=1),
        # gpt-oss: a limit the O(1) activations cross, alpha and beta away from plain silu
        dict(router_bias=1, router_norm="topk_softmax", swiglu_alpha=1.702, swiglu_beta=1.0, swiglu_limit=0.5),
        dict(use_bias=1, swiglu_alpha=1.702),
    ],
)
def test_activations_ungated_experts_and_biases(kw: dict[str, Any]) -> None:
    check(attrs(**kw), seed=5)


@pytest.mark.parametrize("norm", ROUTER_NORMS)
def test_top_k_equal_to_the_expert_count(norm: str) -> None:
    check(attrs(number_of_experts=4, top_k=4, router_norm=norm), seed=9)


def test_an_expert_no_token_chose_is_never_computed() -> None:
    """Expert 3's router bias is far below the others', so no token picks it; its weights are NaN, which a dense
    loop over all experts (even masked: NaN * 0 is NaN) would spread into every token."""
    a = attrs(number_of_experts=6, top_k=2, router_norm="softmax_topk_renormalise", router_bias=1)
    x, rw, fc, proj, biases = make(a, 29, seed=3)
    biases[-1][3] = -1e4
    assert not (route(a, x, rw, biases[-1])[1] == 3).any()
    want, _ = naive(a, x, rw, fc, proj, biases)
    fc[3], proj[3] = math.nan, math.nan
    got = moe(a, x, rw, fc, proj, *biases)
    assert torch.isfinite(got).all()
    assert (got.double() - want).abs().max().item() <= TOL * want.abs().max().item()


def test_only_the_chosen_tokens_reach_an_expert() -> None:
    """Token 0 alone is routed to expert 0 (top 1): NaN weights of expert 0 reach token 0 and no other."""
    a = attrs(number_of_experts=4, top_k=1)
    x, rw, fc, proj, _ = make(a, 9, seed=4)
    experts = route(a, x, rw)[1][:, 0]
    only = int(experts[0])
    fc[only] = math.nan
    got = moe(a, x, rw, fc, proj)
    assert torch.equal(torch.isnan(got).any(dim=1), experts == only)


def _hf_router(norm: str, e: int, k: int, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.nn.Module:
    """transformers' router of the family whose routing `norm` is (5.x: softmax, topk, renormalised for Mixtral
    and Qwen3-MoE's norm_topk_prob; topk then softmax for gpt-oss)."""
    if norm == "topk_softmax":
        from transformers import GptOssConfig
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

        oss = GptOssConfig(hidden_size=weight.shape[1], num_local_experts=e, num_experts_per_tok=k)
        router: torch.nn.Module = GptOssTopKRouter(oss)  # type: ignore[no-untyped-call]
        router.bias.data = torch.zeros(e) if bias is None else bias.clone()
    else:
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

        config = Qwen3MoeConfig(
            hidden_size=weight.shape[1],
            num_experts=e,
            num_experts_per_tok=k,
            norm_topk_prob=norm == "softmax_topk_renormalise",
        )
        router = Qwen3MoeTopKRouter(config)  # type: ignore[no-untyped-call]
    router.weight.data = weight.clone()
    return router


@pytest.mark.parametrize("norm", ROUTER_NORMS)
def test_ties_break_as_in_transformers(norm: str) -> None:
    """Experts 1, 2 and 5 share a router row, 0 and 6 another: exact ties in the logits, at the k-th place for
    many tokens. The op chooses the experts transformers' router chooses, in the same order, with its weights."""
    a = attrs(number_of_experts=8, top_k=3, router_norm=norm)
    x, rw, _, _, _ = make(a, 64, seed=6)
    rw[2] = rw[5] = rw[1]
    rw[6] = rw[0]
    weights, experts = route(a, x, rw)
    _, hf_weights, hf_experts = _hf_router(norm, 8, 3, rw, None)(x)
    assert torch.equal(experts, hf_experts)
    torch.testing.assert_close(weights, hf_weights, rtol=0, atol=1e-7)
    tied = (experts.unsqueeze(-1) == torch.tensor([1, 2, 5])).any(-1).sum(-1)
    assert ((tied > 0) & (tied < 3)).any(), "no token had a tie at its k-th place: the case tests nothing"


@pytest.mark.parametrize("norm", ROUTER_NORMS)
def test_routing_matches_transformers(norm: str) -> None:
    a = attrs(number_of_experts=16, top_k=4, router_norm=norm, router_bias=int(norm == "topk_softmax"))
    x, rw, _, _, biases = make(a, 50, seed=8)
    bias = biases[-1] if a.router_bias else None
    weights, experts = route(a, x, rw, bias)
    _, hf_weights, hf_experts = _hf_router(norm, 16, 4, rw, bias)(x)
    assert torch.equal(experts, hf_experts)
    torch.testing.assert_close(weights, hf_weights, rtol=0, atol=1e-7)


def test_inputs_that_disagree_with_the_attributes_are_refused() -> None:
    a = attrs()
    x, rw, fc, proj, _ = make(a, 5, seed=1)
    with pytest.raises(ValueError, match=r"MoE fc_weight \(8, 40, 48\): expected \(8, 80, 48\)"):
        moe(a, x, rw, fc[:, :INTER], proj)
    with pytest.raises(ValueError, match="2 bias inputs, expected 0"):
        moe(a, x, rw, fc, proj, fc[:, :, 0], proj[:, :, 0])
    with pytest.raises(ValueError, match="top_k 9 exceeds number_of_experts 8"):
        attrs(top_k=9)
    with pytest.raises(ValueError, match="router_norm 'sparsemixer': expected one of"):
        attrs(router_norm="sparsemixer")


# -- the op in the CPU engine ---------------------------------------------------------------------------------------

# A stand-in family for the engine test: a Llama whose layers but `mlp_only_layers` are sparse, read from the MoE
# config fields of docs/conversion.md ("Mixture-of-experts layers": TensorRT-LLM's `moe` object,
# `moe_intermediate_size`, our `mlp_only_layers`) plus `test_router_norm`, so that every ROUTER_NORMS mode runs through
# the engine. The Mixtral and Qwen3-MoE families run end to end in tests/checkpoint/test_moe_engine.py; this test
# needs only a spec with ExpertsFFN layers, under an architecture name of its own.
ARCH = "TrtbuildTestMoeForCausalLM"
EXPERTS, TOP_K, EXPERT_WIDTH = 6, 2, 40


def spec(cfg: Any) -> Any:
    """The family's `spec` (registry.Family), found through this module while the test registers it."""
    import dataclasses

    from toolchain.checkpoint.llama import llama_style_spec
    from toolchain.checkpoint.spec import ExpertsFFN

    f = cfg.family_fields
    ffn = ExpertsFFN(
        num_experts=f["moe"]["num_experts"],
        top_k=f["moe"]["top_k"],
        expert_intermediate_size=f["moe_intermediate_size"],
        router_norm=f["test_router_norm"],
    )
    base = llama_style_spec(cfg)
    layers = tuple(ls if ls.index in f["mlp_only_layers"] else dataclasses.replace(ls, ffn=ffn) for ls in base.layers)
    return dataclasses.replace(base, layers=layers)


@pytest.fixture
def moe_family(monkeypatch: pytest.MonkeyPatch) -> None:
    """Registers the stand-in family (every ROUTER_NORMS mode through the engine, which Mixtral and Qwen3-MoE alone
    do not reach)."""
    from toolchain.checkpoint import registry

    monkeypatch.setitem(registry._FAMILIES, ARCH, __name__)


def save_moe_checkpoint(tmp: Path, router_norm: str, seed: int = 0) -> Path:
    """A converted random Llama of 3 layers made a MoE: layers 0 and 2 sparse (router float32, experts random),
    layer 1 dense, written in the layout of docs/conversion.md."""
    from conftest import save_random_llama
    from safetensors.torch import save_file

    from toolchain.checkpoint.convert import convert
    from toolchain.checkpoint.trtllm import CONFIG_NAME, load_rank, rank_file

    hf = save_random_llama(tmp / "hf", seed=seed, num_hidden_layers=3)
    ckpt = tmp / "ckpt"
    convert(hf, ckpt)
    config = json.loads((ckpt / CONFIG_NAME).read_text())
    config.update(
        architecture=ARCH,
        moe={"num_experts": EXPERTS, "top_k": TOP_K, "normalization_mode": 0, "sparse_mixer_epsilon": 0.01,
             "tp_mode": 0},
        moe_intermediate_size=EXPERT_WIDTH,
        moe_shared_expert_intermediate_size=0,
        mlp_only_layers=[1],
        test_router_norm=router_norm,
    )  # fmt: skip
    (ckpt / CONFIG_NAME).write_text(json.dumps(config))
    weights = load_rank(ckpt, 0)
    h, g = config["hidden_size"], torch.Generator().manual_seed(seed + 1)
    for i in (0, 2):
        p = f"transformer.layers.{i}.mlp"
        for name in ("fc", "gate", "proj"):
            del weights[f"{p}.{name}.weight"]
        # router rows of std 1: logits of a few units, so routing differs token to token
        weights[f"{p}.router.weight"] = torch.randn(EXPERTS, h, generator=g)
        weights[f"{p}.fc.weight"] = torch.randn(EXPERTS, 2 * EXPERT_WIDTH, h, generator=g) * h**-0.5
        weights[f"{p}.proj.weight"] = torch.randn(EXPERTS, h, EXPERT_WIDTH, generator=g) * EXPERT_WIDTH**-0.5
    save_file(weights, str(ckpt / rank_file(0)), metadata={"format": "pt"})
    return ckpt


def naive_op(a: MoEAttrs, x: torch.Tensor, router_weight: torch.Tensor, fc: torch.Tensor, proj: torch.Tensor,
             *biases: torch.Tensor, memo: Any = None) -> torch.Tensor:  # fmt: skip
    """The dense float64 mixture (`naive`) with the engine's op signature."""
    return naive(a, x, router_weight, fc, proj, list(biases))[0].to(x.dtype)


def _calls(engine: Any) -> list[np.ndarray]:
    """Prefill of two sequences (21 and 9 tokens, every position's logits), then 5 decode steps of both (fixed
    tokens: the same inputs whatever the op), on shuffled blocks."""
    from toolchain.engine.contract import Batch

    pool = engine.new_kv_cache(32)
    prompts = [torch.randint(0, engine.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (21, 9)]  # fmt: skip
    blocks = torch.randperm(32, generator=torch.Generator().manual_seed(1)).tolist()
    tables = [blocks[: -(-26 // TPB)], blocks[16 : 16 + -(-14 // TPB)]]  # room for the 5 decode steps
    out = [engine.forward(Batch.from_sequences(prompts, [0, 0], tables, all_logits=True), pool)]
    for step in range(5):
        tokens = [[(7 * step + 3 * s + 1) % engine.vocab_size] for s in range(2)]
        out.append(engine.forward(Batch.from_sequences(tokens, [21 + step, 9 + step], tables), pool))
    return out


@pytest.mark.parametrize("norm", ROUTER_NORMS)
def test_cpu_engine_runs_moe_layers_as_the_dense_mixture(
    norm: str, tmp_path: Path, moe_family: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CPU engine of a MoE checkpoint against the same engine with the MoE op replaced by the dense float64
    mixture, over a prefill and 5 decode calls: logits within 1e-4 of their scale (float32 through 3 layers and
    lm_head, against float64 experts), same top-1."""
    from toolchain.engine import ort_backend

    engine = build(save_moe_checkpoint(tmp_path, norm), tmp_path / "engine")
    graph = onnx.load(str(tmp_path / "engine" / "model.onnx"))
    moe_nodes = [n for n in graph.graph.node if n.op_type == "MoE"]
    assert [(n.domain, n.input[1:]) for n in moe_nodes] == [
        ("trtbuild", [f"transformer.layers.{i}.mlp.{t}.weight" for t in ("router", "fc", "proj")]) for i in (0, 2)
    ]
    got = _calls(engine)
    called: list[int] = []

    def counted(*args: Any, **kw: Any) -> torch.Tensor:
        called.append(1)
        return naive_op(*args, **kw)

    monkeypatch.setitem(ort_backend.OPS, "MoE", counted)
    want = _calls(engine)
    assert len(called) == 2 * len(want)  # both sparse layers, every call
    for g, w in zip(got, want, strict=True):
        scale = np.abs(w).max()
        assert np.abs(g - w).max() <= 1e-4 * scale
        assert (g.argmax(-1) == w.argmax(-1)).all()
    zeros = lambda a, x, *rest, memo=None: torch.zeros_like(x)  # noqa: E731
    monkeypatch.setitem(ort_backend.OPS, "MoE", zeros)
    assert np.abs(_calls(engine)[0] - want[0]).max() > 100 * 1e-4 * np.abs(want[0]).max(), "the experts do nothing"


def test_moe_graph_layout_and_the_tensorrt_refusal(tmp_path: Path, moe_family: None) -> None:
    """A bf16 export: one trtbuild::MoE node per sparse layer with the ExpertsFFN's fields, the router in float32
    and the experts in the engine dtype; the dense layer keeps its three Gemms. The TensorRT backend takes the
    graph (its MoE nodes split into plugins) but refuses experts with input quantization in one line before needing
    TensorRT; experts that disagree with the config, or a quantized router, are refused."""
    from toolchain.checkpoint.trtllm import load_rank, read_config
    from toolchain.engine.api import Limits
    from toolchain.engine.export import export_model
    from toolchain.engine.tensorrt_backend import build_plan
    from toolchain.errors import UserError

    ckpt = save_moe_checkpoint(tmp_path, "softmax_topk_renormalise")
    cfg, weights = read_config(ckpt), load_rank(ckpt)
    model = export_model(cfg, weights, torch.bfloat16, 16)
    nodes = [n for n in model.graph.node if n.op_type == "MoE"]
    fields: dict[str, Any] = dict(number_of_experts=EXPERTS, top_k=TOP_K, expert_hidden_size=64)
    fields |= dict(expert_inter_size=EXPERT_WIDTH, router_norm="softmax_topk_renormalise", activation="silu")
    fields |= dict(gated=1, use_bias=0, router_bias=0)
    for node in nodes:
        assert {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute} == {
            k: v.encode() if isinstance(v, str) else v for k, v in fields.items()
        }
    assert [n.name for n in nodes] == ["transformer.layers.0.mlp/MoE", "transformer.layers.2.mlp/MoE"]
    types = {t.name: t.data_type for t in model.graph.initializer}
    assert types["transformer.layers.0.mlp.router.weight"] == onnx.TensorProto.FLOAT
    assert types["transformer.layers.0.mlp.fc.weight"] == onnx.TensorProto.BFLOAT16
    assert types["transformer.layers.2.mlp.proj.weight"] == onnx.TensorProto.BFLOAT16
    gemms = [n.name for n in model.graph.node if n.op_type == "Gemm" and ".mlp." in n.name]
    assert gemms == [f"transformer.layers.1.mlp.{t}.out/Gemm" for t in ("fc", "gate", "proj")]

    path = tmp_path / "model.onnx"
    path.write_bytes(model.SerializeToString())
    limits = Limits(max_batch_size=1, max_num_tokens=8, max_seq_len=8, tokens_per_block=16, num_blocks=1)
    with pytest.raises(UserError) as e:  # the MoE layers pass (split into plugins); TensorRT's absence stops it
        build_plan(path, tmp_path, limits, 3, (2, 2, 16, 8))
    assert str(e.value).startswith("--backend tensorrt: ") and "mixture-of-experts" not in str(e.value)
    assert "MoE" not in str(e.value)
    nodes[1].attribute.append(onnx.helper.make_attribute("int8_inputs", 1))  # w8a8_sq experts: no kernel
    path.write_bytes(model.SerializeToString())
    with pytest.raises(UserError) as e:
        build_plan(path, tmp_path, limits, 3, (2, 2, 16, 8))
    assert str(e.value).startswith(
        f"--backend tensorrt: {path}: transformer.layers.2.mlp: the MoE op's int8_inputs (w8a8_sq experts) has no "
        "TensorRT kernel yet"
    ) and str(e.value).endswith("--backend onnxruntime")

    weights["transformer.layers.2.mlp.proj.weight"] = weights["transformer.layers.2.mlp.proj.weight"][:, :, 1:]
    with pytest.raises(UserError, match=r"mlp.proj.weight is \(6, 64, 39\), layer 2's experts need \(6, 64, 40\)"):
        export_model(cfg, weights, torch.float32, 16)
    weights["transformer.layers.0.mlp.router.weights_scaling_factor"] = torch.ones(EXPERTS)  # a quantized router
    with pytest.raises(UserError, match=r"^ONNX export, layer 0: mixture-of-experts layers"):
        export_model(cfg, weights, torch.float32, 16)
