"""gpt-oss (issue 26): the checkpoint holds docs/conversion.md's MoE layout (gate/up de-interleaved into [up; gate],
biases, a float32 router with its bias, float32 sinks), every feature of the parity case is live (each one, switched
off in the reference, moves the logits; the SwiGLU clamp is reached), the reference forward routes every token to
the experts transformers' router picks, MXFP4 experts are read exactly as transformers dequantizes them, the engine
graph carries sinks, YaRN and the clamped SwiGLU, and what is not implemented is refused in one line. Logit parity
itself (reference and CPU engine): models.PARITY "gpt-oss-every-feature"."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import BASE
from models import GPT_OSS, save_random
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from toolchain.checkpoint import gpt_oss, mxfp4
from toolchain.checkpoint.convert import convert
from toolchain.checkpoint.spec import ExpertsFFN, spec_of
from toolchain.checkpoint.trtllm import read_config
from toolchain.engine.build import BuildOptions, build_engine
from toolchain.errors import UserError
from toolchain.reference.model import ReferenceModel

SEQ = 48
LIMIT = GPT_OSS["swiglu_limit"]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("gpt_oss")
    hf = save_random(root / "hf", "gpt_oss", **GPT_OSS)
    convert(hf, root / "ckpt")
    return hf, root / "ckpt"


def _ids() -> torch.Tensor:
    return torch.randint(0, BASE["vocab_size"], (2, SEQ), generator=torch.Generator().manual_seed(3))


def _transformers(hf_dir: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()


def test_every_token_goes_to_the_experts_transformers_picks(model: tuple[Path, Path]) -> None:
    hf_dir, ckpt = model
    hf = _transformers(hf_dir)
    theirs: list[torch.Tensor] = []
    for m in hf.modules():
        if type(m).__name__ == "GptOssTopKRouter":
            m.register_forward_hook(lambda _m, _i, out: theirs.append(out[2]))
    ref = ReferenceModel.from_checkpoint(ckpt)
    ours: list[torch.Tensor] = []
    route = ref.route

    def recorded(x: torch.Tensor, layer: str, ffn: ExpertsFFN) -> tuple[torch.Tensor, torch.Tensor]:
        weights, experts = route(x, layer, ffn)
        ours.append(experts)
        return weights, experts

    ref.route = recorded  # type: ignore[method-assign]
    with torch.no_grad():
        hf(_ids())
    ref.forward(_ids())
    assert len(theirs) == len(ours) == GPT_OSS["num_hidden_layers"]
    for layer, (expected, got) in enumerate(zip(theirs, ours, strict=True)):
        assert got.shape == (2 * SEQ, GPT_OSS["num_experts_per_tok"])
        assert torch.equal(got, expected), f"layer {layer}: the experts chosen differ from transformers'"
        assert len(set(got.flatten().tolist())) == GPT_OSS["num_local_experts"]  # every expert gets tokens


def test_the_swiglu_clamp_is_reached_in_transformers(model: tuple[Path, Path]) -> None:
    """Gate values above the limit and up values outside [-limit, limit] occur, so the clamp changes the result."""
    hf = _transformers(model[0])
    seen: list[torch.Tensor] = []
    for m in hf.modules():
        if type(m).__name__ == "GptOssExperts":
            apply = m._apply_gate
            m._apply_gate = lambda gate_up, apply=apply: (seen.append(gate_up), apply(gate_up))[1]
    with torch.no_grad():
        hf(_ids())
    gate_up = torch.cat([g.flatten(0, -2) for g in seen])
    assert (gate_up[:, ::2] > LIMIT).float().mean() > 0.05
    assert (gate_up[:, 1::2].abs() > LIMIT).float().mean() > 0.05


@pytest.mark.parametrize("feature", ["sinks", "swiglu_limit", "router_bias", "expert_biases", "yarn", "window"])
def test_each_feature_moves_the_logits(feature: str, model: tuple[Path, Path]) -> None:
    """The reference forward with one feature switched off differs from itself by far more than the parity
    tolerance (1e-4): the parity case would catch that feature converted or computed wrong."""
    ref = ReferenceModel.from_checkpoint(model[1])
    expected = ref.forward(_ids())

    def changed(ls: Any) -> Any:
        ffn = ls.ffn
        match feature:
            case "sinks":
                return dataclasses.replace(ls, sinks=False)
            case "swiglu_limit":
                return dataclasses.replace(ls, ffn=dataclasses.replace(ffn, swiglu_limit=None))
            case "router_bias":
                return dataclasses.replace(ls, ffn=dataclasses.replace(ffn, router_bias=False))
            case "expert_biases":
                return dataclasses.replace(ls, ffn=dataclasses.replace(ffn, bias=False))
            case "yarn":
                return dataclasses.replace(ls, rope=dataclasses.replace(ls.rope, scaling=None))
            case _:
                return dataclasses.replace(ls, window=None)

    ref.spec = dataclasses.replace(ref.spec, layers=tuple(changed(ls) for ls in ref.spec.layers))
    assert (ref.forward(_ids()) - expected).abs().max() > 1e-2


def test_the_checkpoint_holds_the_moe_layout(model: tuple[Path, Path]) -> None:
    hf_dir, ckpt = model
    src, out = load_file(hf_dir / "model.safetensors"), load_file(ckpt / "rank0.safetensors")
    e, size, h = GPT_OSS["num_local_experts"], GPT_OSS["intermediate_size"], BASE["hidden_size"]
    p, s = "transformer.layers.1", "model.layers.1"
    gate_up, bias = src[f"{s}.mlp.experts.gate_up_proj"], src[f"{s}.mlp.experts.gate_up_proj_bias"]
    assert out[f"{p}.mlp.fc.weight"].shape == (e, 2 * size, h)
    for x in range(e):
        assert torch.equal(out[f"{p}.mlp.fc.weight"][x, :size], gate_up[x, :, 1::2].t())  # up
        assert torch.equal(out[f"{p}.mlp.fc.weight"][x, size:], gate_up[x, :, 0::2].t())  # gate
        assert torch.equal(out[f"{p}.mlp.fc.bias"][x], torch.cat([bias[x, 1::2], bias[x, 0::2]]))
        assert torch.equal(out[f"{p}.mlp.proj.weight"][x], src[f"{s}.mlp.experts.down_proj"][x].t())
    assert torch.equal(out[f"{p}.mlp.proj.bias"], src[f"{s}.mlp.experts.down_proj_bias"])
    for name, source in (("mlp.router.weight", "mlp.router.weight"), ("mlp.router.bias", "mlp.router.bias"),
                         ("attention.sinks", "self_attn.sinks")):  # fmt: skip
        assert out[f"{p}.{name}"].dtype == torch.float32
        assert torch.equal(out[f"{p}.{name}"], src[f"{s}.{source}"])
    cfg = read_config(ckpt)
    assert cfg.sliding_window == 6 and cfg.family_fields["layer_types"][:2] == ["sliding_attention", "full_attention"]
    assert cfg.rotary_scaling is not None and cfg.rotary_scaling["rope_type"] == "yarn"
    assert cfg.family_fields["moe_router_norm"] == "topk_softmax" and cfg.family_fields["swiglu_limit"] == LIMIT


def _mxfp4_pair(model: tuple[Path, Path], root: Path) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    """(float dir, MXFP4 dir, the MXFP4 tensors): the experts quantized to MXFP4; the float dir holds transformers'
    own dequantization of them (`convert_moe_packed_tensors`, its loader's), the MXFP4 dir the packed tensors as the
    published checkpoints store them, with their quantization_config."""
    tensors = load_file(model[0] / "model.safetensors")
    packed: dict[str, torch.Tensor] = {}
    for i in range(GPT_OSS["num_hidden_layers"]):
        for proj in ("gate_up_proj", "down_proj"):
            name = f"model.layers.{i}.mlp.experts.{proj}"
            blocks, scales = mxfp4.quantize(tensors.pop(name).transpose(1, 2))  # [E, out, in]
            packed |= {f"{name}_blocks": blocks.reshape(*scales.shape, 16), f"{name}_scales": scales}
            tensors[name] = convert_moe_packed_tensors(packed[f"{name}_blocks"], scales, dtype=torch.float32)
    float_dir, mx_dir = Path(shutil.copytree(model[0], root / "float")), Path(shutil.copytree(model[0], root / "mx"))
    save_file(tensors, float_dir / "model.safetensors", metadata={"format": "pt"})
    rest = {k: v for k, v in tensors.items() if not k.endswith(("gate_up_proj", "down_proj"))}
    save_file({**rest, **packed}, mx_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((mx_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (mx_dir / "config.json").write_text(json.dumps(config))
    return float_dir, mx_dir, packed


def test_mxfp4_experts_convert_to_exactly_transformers_dequantized_weights(
    model: tuple[Path, Path], tmp_path: Path
) -> None:
    float_dir, mx_dir, packed = _mxfp4_pair(model, tmp_path)
    blocks = packed["model.layers.0.mlp.experts.gate_up_proj_blocks"]
    assert blocks.dtype == torch.uint8 and blocks.shape == (8, 64, 2, 16)
    convert(float_dir, tmp_path / "from_float")
    convert(mx_dir, tmp_path / "from_mx")
    expected, got = (
        load_file(tmp_path / "from_float" / "rank0.safetensors"),
        load_file(tmp_path / "from_mx" / "rank0.safetensors"),
    )
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
    # and the dequantized weights are the MXFP4 grid: at most 16 distinct magnitudes per block's scale
    fc = got["transformer.layers.0.mlp.fc.weight"]
    assert len(torch.unique(fc)) < fc.numel() // 8


def test_mxfp4_tensors_of_the_wrong_kind_are_refused(model: tuple[Path, Path], tmp_path: Path) -> None:
    _, mx_dir, _ = _mxfp4_pair(model, tmp_path)
    tensors = load_file(mx_dir / "model.safetensors")
    name = "model.layers.0.mlp.experts.down_proj_scales"
    save_file({**tensors, name: tensors[name].to(torch.int16)}, mx_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UserError, match=r"MXFP4 tensor model\.layers\.0\.mlp\.experts\.down_proj_scales is int16, "
                       r"expected uint8"):  # fmt: skip
        convert(mx_dir, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


def test_mxfp4_dequantizes_the_e2m1_grid_and_e8m0_scales() -> None:
    """The OCP MX v1.0 encodings by hand: code 0b0111 is 6, 0b1010 is -1, the low nibble first; scale 127 is 1,
    130 is 8, 255 is NaN."""
    blocks = torch.zeros(3, 1, 16, dtype=torch.uint8)
    blocks[:, 0, 0] = 0xA7  # first value 6 (0x7), second -1 (0xA)
    scales = torch.tensor([[127], [130], [255]], dtype=torch.uint8)
    values = mxfp4.dequantize(blocks, scales)
    assert values.shape == (3, 32)
    assert values[0, :2].tolist() == [6.0, -1.0] and values[1, :2].tolist() == [48.0, -8.0]
    assert values[0, 2:].abs().sum() == 0 and values[2].isnan().all()


def _edit(hf: Path, **changes: Any) -> None:
    data = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**data, **changes}))


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"quantization_config": {"quant_method": "gptq"}}, r"quantization_config quant_method 'gptq' is not "
                                                            r"supported for GptOssForCausalLM; supported: mxfp4"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4}},
         r"rope type 'llama3' is not supported for GptOssForCausalLM; supported: yarn, default"),
        ({"layer_types": ["full_attention"]}, r"'layer_types' must list 3 entries"),
        ({"num_experts_per_tok": 9}, r"num_experts_per_tok 9 exceeds the 8 experts"),
        ({"swiglu_limit": -1}, r"'swiglu_limit' must be a finite positive number, got -1"),
    ],
)  # fmt: skip
def test_values_we_do_not_implement_are_refused_before_writing(
    changes: dict[str, Any], expected: str, model: tuple[Path, Path], tmp_path: Path
) -> None:
    hf = Path(shutil.copytree(model[0], tmp_path / "hf"))
    _edit(hf, **changes)
    with pytest.raises(UserError, match=expected):
        convert(hf, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


def test_every_source_tensor_is_consumed_or_the_conversion_is_refused(model: tuple[Path, Path], tmp_path: Path) -> None:
    hf = Path(shutil.copytree(model[0], tmp_path / "hf"))
    tensors = load_file(hf / "model.safetensors")
    name = "model.layers.0.mlp.experts.gate_up_proj"  # a float and an MXFP4 copy of one weight: the MXFP4 one is read
    blocks, scales = torch.zeros(8, 64, 2, 16, dtype=torch.uint8), torch.full((8, 64, 2), 127, dtype=torch.uint8)
    save_file({**tensors, f"{name}_blocks": blocks, f"{name}_scales": scales}, hf / "model.safetensors",
              metadata={"format": "pt"})  # fmt: skip
    with pytest.raises(UserError, match=r"1 tensor\(s\) not consumed by the GptOssForCausalLM converter: "
                       r"model\.layers\.0\.mlp\.experts\.gate_up_proj\b"):  # fmt: skip
        convert(hf, tmp_path / "ckpt")
    del tensors["model.layers.2.self_attn.sinks"]
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UserError, match=r"requires are missing: model\.layers\.2\.self_attn\.sinks"):
        convert(hf, tmp_path / "ckpt")


def test_the_engine_graph_carries_sinks_yarn_and_the_clamped_swiglu(model: tuple[Path, Path], tmp_path: Path) -> None:
    """What the CPU engine's parity (models.PARITY "gpt-oss-every-feature", engine=True) rests on, in the graph: each
    PagedAttention takes its layer's float32 sinks as a seventh input, KVCacheWrite the YaRN fields, MoE the router
    bias and the clamped SwiGLU's fields."""
    import onnx

    build_engine(model[1], tmp_path / "engine", BuildOptions(backend="onnxruntime"))
    graph = onnx.load(str(tmp_path / "engine" / "model.onnx"))
    inits = {t.name: t for t in graph.graph.initializer}

    def attrs(node: onnx.NodeProto) -> dict[str, Any]:
        return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}

    for layer in range(3):
        nodes = {n.op_type: n for n in graph.graph.node if n.name.startswith(f"transformer.layers.{layer}.")}
        attention, write, moe = nodes["PagedAttention"], nodes["KVCacheWrite"], nodes["MoE"]
        assert attention.input[6] == f"transformer.layers.{layer}.attention.sinks" and attrs(attention)["sinks"] == 1
        assert inits[attention.input[6]].data_type == onnx.TensorProto.FLOAT and inits[attention.input[6]].dims == [4]
        assert attrs(write)["rotary_scaling_type"] == b"yarn" and attrs(write)["rotary_truncate"] == 0
        assert attrs(write)["rotary_beta_fast"] == 8.0 and attrs(write)["rotary_attention_factor"] > 1
        assert attrs(moe)["router_bias"] == 1 and attrs(moe)["swiglu_limit"] == 0.5
        assert moe.input[-1] == f"transformer.layers.{layer}.mlp.router.bias"


def test_the_published_gpt_oss_20b_config_is_read() -> None:
    """openai/gpt-oss-20b's config.json as published (transformers 4.55's keys: `rope_scaling` and a top-level
    `rope_theta`, `experts_per_token` beside `num_experts_per_tok`, the mxfp4 quantization_config)."""
    hf = {
        "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
        "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
        "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": 2880,
        "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
        "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
        "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
        "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                           "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
        "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                                "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                                "truncate": False},
        "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 201088,
    }  # fmt: skip
    cfg = gpt_oss.config_from_hf(hf, "bfloat16", "config.json")
    spec = spec_of(cfg)
    assert spec.windows == [128, None] * 12 and all(ls.sinks and ls.qkv_bias and ls.dense_bias for ls in spec.layers)
    ffn = spec.layers[0].ffn
    assert isinstance(ffn, ExpertsFFN)
    assert (ffn.num_experts, ffn.top_k, ffn.expert_intermediate_size) == (32, 4, 2880)
    assert (ffn.router_norm, ffn.router_bias, ffn.bias) == ("topk_softmax", True, True)
    assert (ffn.swiglu_alpha, ffn.swiglu_beta, ffn.swiglu_limit) == (1.702, 1.0, 7.0)
    rope = spec.layers[0].rope
    assert rope is not None and rope.base == 150000 and rope.scaling is not None
    assert rope.scaling["factor"] == 32.0 and rope.scaling["truncate"] is False


@pytest.mark.parametrize(
    "params",
    [
        {
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        {"factor": 8.0, "original_max_position_embeddings": 512},  # truncated ramp, default betas
        {"factor": 4.0, "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 0.5},
        {"factor": 4.0, "original_max_position_embeddings": 64, "attention_factor": 1.25},
    ],
)
def test_yarn_frequencies_and_attention_factor_are_transformers(params: dict[str, Any]) -> None:
    """Our YaRN (reference/rope.py) against transformers' `_compute_yarn_parameters` on gpt-oss-sized heads: the
    frequencies to float32 rounding (theirs are computed in float32, ours in float64), the factor exactly."""
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from toolchain.reference.rope import attention_factor, inv_freq

    scaling = {"rope_type": "yarn", **params}
    config = GptOssConfig(head_dim=64, rope_parameters={**scaling, "rope_theta": 150000.0})
    theirs, factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    ours = inv_freq(64, 150000.0, scaling, torch.float64)
    torch.testing.assert_close(ours.float(), theirs, rtol=2**-22, atol=0)
    assert attention_factor(scaling) == factor
