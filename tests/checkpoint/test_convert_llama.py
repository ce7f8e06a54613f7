"""Conversion of Llama checkpoints, proven by the reference forward against transformers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from models import LLAMA3_ROPE, compare
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from toolchain.checkpoint.convert import convert
from toolchain.checkpoint.trtllm import read_config
from toolchain.reference.model import ReferenceModel


def test_float64_reference(make_llama: Any, tmp_path: Path) -> None:
    """In float64 the only gap left is transformers' rope, which computes angles in float32 whatever the model
    dtype (about 5e-6 here); the float32 run has matmul rounding on top."""
    hf_dir = make_llama(rope_parameters=LLAMA3_ROPE)
    convert(hf_dir, tmp_path / "ckpt")
    max_abs, same_top1 = compare(hf_dir, tmp_path / "ckpt", dtype=torch.float64)
    assert max_abs < 2e-5
    assert same_top1 == 1.0


@pytest.mark.parametrize("rope", [LLAMA3_ROPE, {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}])
def test_rope_frequencies_match_transformers(rope: dict[str, Any]) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from toolchain.reference.rope import inv_freq

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, rope_parameters=rope)
    expected, _ = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, "cpu")
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    got = inv_freq(16, rope["rope_theta"], scaling, torch.float64)
    torch.testing.assert_close(got, expected.to(torch.float64), rtol=1e-6, atol=0)


def test_wrong_mapping_would_be_caught(make_llama: Any, tmp_path: Path) -> None:
    """The comparison has teeth: swapping TensorRT-LLM's fc/gate convention breaks it."""
    hf_dir = make_llama()
    convert(hf_dir, tmp_path / "ckpt")
    ref = ReferenceModel.from_checkpoint(tmp_path / "ckpt")
    w = ref.w
    w["transformer.layers.0.mlp.fc.weight"], w["transformer.layers.0.mlp.gate.weight"] = (
        w["transformer.layers.0.mlp.gate.weight"],
        w["transformer.layers.0.mlp.fc.weight"],
    )
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ids = torch.arange(32)[None]
    with torch.no_grad():
        assert (hf(ids).logits - ref.forward(ids)).abs().max().item() > 1e-2


def test_stories260k_matches_transformers(stories: Path, tmp_path: Path) -> None:
    convert(stories, tmp_path / "ckpt")
    max_abs, same_top1 = compare(stories, tmp_path / "ckpt", seq=128)
    assert max_abs < 1e-4
    assert same_top1 == 1.0


def test_tensor_names_fusion_and_config(make_llama: Any, tmp_path: Path) -> None:
    hf_dir = make_llama(rope_parameters=LLAMA3_ROPE, head_dim=24, num_attention_heads=4, num_key_value_heads=2)
    convert(hf_dir, tmp_path / "ckpt")
    src = load_file(str(hf_dir / "model.safetensors"))
    out = load_file(str(tmp_path / "ckpt" / "rank0.safetensors"))
    layer = "transformer.layers.1"
    assert torch.equal(
        out[f"{layer}.attention.qkv.weight"],
        torch.cat([src[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"]),
    )
    assert torch.equal(out[f"{layer}.mlp.fc.weight"], src["model.layers.1.mlp.gate_proj.weight"])
    assert torch.equal(out[f"{layer}.mlp.gate.weight"], src["model.layers.1.mlp.up_proj.weight"])
    assert torch.equal(out[f"{layer}.mlp.proj.weight"], src["model.layers.1.mlp.down_proj.weight"])
    assert torch.equal(out[f"{layer}.post_layernorm.weight"], src["model.layers.1.post_attention_layernorm.weight"])
    assert torch.equal(out["transformer.vocab_embedding.weight"], src["model.embed_tokens.weight"])
    assert torch.equal(out["transformer.ln_f.weight"], src["model.norm.weight"])
    assert torch.equal(out["lm_head.weight"], src["lm_head.weight"])
    assert out[f"{layer}.attention.qkv.weight"].shape == (4 * 24 + 2 * 2 * 24, 64)

    cfg = read_config(tmp_path / "ckpt").to_dict()
    assert cfg["architecture"] == "LlamaForCausalLM"
    assert cfg["position_embedding_type"] == "rope_gpt_neox"
    assert cfg["head_size"] == 24 and cfg["num_key_value_heads"] == 2
    assert cfg["rotary_base"] == 500000.0
    assert cfg["rotary_scaling"]["rope_type"] == "llama3" and cfg["rotary_scaling"]["factor"] == 8.0
    assert cfg["mapping"] == {
        "world_size": 1,
        "tp_size": 1,
        "pp_size": 1,
        "cp_size": 1,
        "moe_tp_size": 1,
        "moe_ep_size": 1,
    }
    assert cfg["quantization"]["quant_algo"] is None
    for key in (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "intermediate_size",
        "hidden_act",
        "norm_epsilon",
        "max_position_embeddings",
        "dtype",
    ):
        assert key in cfg


def test_tied_embeddings_write_lm_head(make_llama: Any, tmp_path: Path) -> None:
    hf_dir = make_llama(tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(str(hf_dir / "model.safetensors"))
    convert(hf_dir, tmp_path / "ckpt")
    out = load_file(str(tmp_path / "ckpt" / "rank0.safetensors"))
    assert torch.equal(out["lm_head.weight"], out["transformer.vocab_embedding.weight"])
    assert read_config(tmp_path / "ckpt").tie_word_embeddings


@pytest.mark.parametrize(
    ("source", "target"),
    [
        (torch.bfloat16, "float32"),
        (torch.float16, "float32"),
        (torch.float32, "bfloat16"),
        (torch.float32, "float16"),
        (torch.bfloat16, "float16"),
        (torch.bfloat16, "auto"),
    ],
)
def test_dtype_conversion(source: torch.dtype, target: str, make_llama: Any, tmp_path: Path) -> None:
    hf_dir = make_llama(dtype=source)
    convert(hf_dir, tmp_path / "ckpt", dtype=target)
    expected = source if target == "auto" else getattr(torch, target)
    src = load_file(str(hf_dir / "model.safetensors"))
    out = load_file(str(tmp_path / "ckpt" / "rank0.safetensors"))
    assert {t.dtype for t in out.values()} == {expected}
    assert torch.equal(out["transformer.ln_f.weight"], src["model.norm.weight"].to(expected))
    assert read_config(tmp_path / "ckpt").dtype == str(expected).removeprefix("torch.")


def test_sharded_checkpoint_converts_to_the_same_bytes(make_llama: Any, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    hf_dir = make_llama()
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(hf_dir).save_pretrained(sharded, max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 3
    convert(hf_dir, tmp_path / "a")
    convert(sharded, tmp_path / "b")
    for name in ("config.json", "rank0.safetensors"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
