"""Every supported family, converted from random tiny configs with its distinctive features switched on, matches
transformers through the reference forward (float32: max abs < 1e-4, identical argmax)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import BASE
from safetensors.torch import load_file, save_file
from test_convert_llama import compare

from toolchain.checkpoint.convert import convert
from toolchain.checkpoint.trtllm import read_config


def save_random(path: Path, arch: str, seed: int = 0, **overrides: Any) -> Path:
    import transformers

    config_cls, model_cls = {
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "gpt2": (transformers.GPT2Config, transformers.GPT2LMHeadModel),
    }[arch]
    gpt2 = {"n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 97, "n_positions": 64}
    base: dict[str, Any] = gpt2 if arch == "gpt2" else BASE
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**base, **overrides}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            is_norm = "norm" in name or ".ln_" in name or name.startswith(("ln_f", "transformer.ln_f"))
            p.copy_(
                1 + 0.2 * torch.randn_like(p) if is_norm and name.endswith("weight") else 0.15 * torch.randn_like(p)
            )
    model.save_pretrained(path, safe_serialization=True)
    return path


FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "mistral-sliding-window": ("mistral", {"sliding_window": 8}),
    "qwen2-biases": ("qwen2", {}),
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3-qk-norm": ("qwen3", {"head_dim": 24}),
    "gpt2-tied": ("gpt2", {}),
    "gpt2-untied": ("gpt2", {"tie_word_embeddings": False}),
}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_matches_transformers(name: str, tmp_path: Path) -> None:
    arch, overrides = FAMILIES[name]
    hf = save_random(tmp_path / "hf", arch, **overrides)
    convert(hf, tmp_path / "ckpt")
    max_abs, same_top1 = compare(hf, tmp_path / "ckpt", seq=40)
    assert max_abs < 1e-4
    assert same_top1 == 1.0


def test_sliding_window_is_recorded_and_matters(tmp_path: Path) -> None:
    hf = save_random(tmp_path / "hf", "mistral", sliding_window=8)
    convert(hf, tmp_path / "ckpt")
    assert read_config(tmp_path / "ckpt").sliding_window == 8
    import json

    path = tmp_path / "ckpt" / "config.json"
    config = json.loads(path.read_text())
    config["sliding_window"] = None  # the window shorter than the sequence must change the logits
    path.write_text(json.dumps(config))
    max_abs, _ = compare(hf, tmp_path / "ckpt", seq=40)
    assert max_abs > 1e-3


def test_family_config_fields(tmp_path: Path) -> None:
    convert(save_random(tmp_path / "q2", "qwen2"), tmp_path / "c2")
    convert(save_random(tmp_path / "q3", "qwen3"), tmp_path / "c3")
    convert(save_random(tmp_path / "g", "gpt2"), tmp_path / "cg")
    q2, q3, g = (read_config(tmp_path / c).to_dict() for c in ("c2", "c3", "cg"))
    assert q2["architecture"] == "Qwen2ForCausalLM" and q2["qwen_type"] == "qwen2" and q2["attn_bias"]
    assert q3["qk_layernorm"] and q3["qwen_type"] == "qwen3"
    assert g["position_embedding_type"] == "learned_absolute" and g["hidden_act"] == "gelu_new"
    assert g["architecture"] == "GPT2LMHeadModel" and g["bias"] and g["gpt_variant"] == "gpt2"
    names = set(load_file(str(tmp_path / "c3" / "rank0.safetensors")))
    assert "transformer.layers.1.attention.q_layernorm.weight" in names
    assert "transformer.layers.0.attention.dense.bias" not in set(load_file(str(tmp_path / "c2" / "rank0.safetensors")))


def test_gpt2_without_transformer_prefix(tmp_path: Path) -> None:
    """The original GPT-2 release names tensors without `transformer.`; both spellings give the same bytes."""
    hf = save_random(tmp_path / "hf", "gpt2")
    bare = tmp_path / "bare"
    bare.mkdir()
    tensors = load_file(str(hf / "model.safetensors"))
    save_file({k.removeprefix("transformer."): v for k, v in tensors.items()}, str(bare / "model.safetensors"))
    (bare / "config.json").write_bytes((hf / "config.json").read_bytes())
    convert(hf, tmp_path / "a")
    convert(bare, tmp_path / "b")
    assert (tmp_path / "a" / "rank0.safetensors").read_bytes() == (tmp_path / "b" / "rank0.safetensors").read_bytes()


def test_gpt2_with_the_prefix_missing_on_some_tensors(cli: Any, tmp_path: Path) -> None:
    from conftest import one_line_error

    hf = save_random(tmp_path / "hf", "gpt2")
    tensors = load_file(str(hf / "model.safetensors"))
    mixed = {(k.removeprefix("transformer.") if ".h.1." in k else k): v for k, v in tensors.items()}
    save_file(mixed, str(hf / "model.safetensors"))
    line = one_line_error(cli("convert", hf, "-o", tmp_path / "out"))
    assert "missing" in line and "transformer.h.1." in line


def test_qwen_per_layer_window_is_refused(cli: Any, tmp_path: Path) -> None:
    from conftest import one_line_error
    from test_bad_input import edit_config

    hf = save_random(tmp_path / "hf", "qwen2")
    edit_config(hf, use_sliding_window=True)
    assert "use_sliding_window=true" in one_line_error(cli("convert", hf, "-o", tmp_path / "out"))


def test_gpt2_exact_gelu_is_refused(cli: Any, tmp_path: Path) -> None:
    """TensorRT-LLM's gelu is the tanh approximation: an erf-GELU model would not be what the engine computes."""
    from conftest import one_line_error

    hf = save_random(tmp_path / "hf", "gpt2", activation_function="gelu")
    line = one_line_error(cli("convert", hf, "-o", tmp_path / "out"))
    assert "activation_function 'gelu'" in line and "gelu_new" in line
