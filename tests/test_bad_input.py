"""Bad input: one clear line on stderr naming the file/key/value, exit 1, and nothing written."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import convert_fails, edit_config, edit_weights, one_line_error
from safetensors.torch import load_file


def test_truncated_safetensors(cli: Any, make_llama: Any, tmp_path: Path) -> None:
    hf = make_llama()
    path = hf / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    line = convert_fails(cli, hf, tmp_path / "out")
    assert "model.safetensors" in line and "truncated" in line and "re-download" in line


def test_header_length_beyond_file(cli: Any, make_llama: Any, tmp_path: Path) -> None:
    hf = make_llama()
    (hf / "model.safetensors").write_bytes(struct.pack("<Q", 10**6) + b"{}")
    line = convert_fails(cli, hf, tmp_path / "out")
    assert "header length 1000000" in line and "model.safetensors" in line


def test_missing_tensor(cli: Any, make_llama: Any, tmp_path: Path) -> None:
    hf = make_llama()
    edit_weights(hf, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    line = convert_fails(cli, hf, tmp_path / "out")
    assert "model.layers.1.mlp.up_proj.weight" in line and "missing" in line


def test_shape_mismatch_between_config_and_weights(cli: Any, make_llama: Any, tmp_path: Path) -> None:
    hf = make_llama()
    edit_config(hf, intermediate_size=128)
    line = convert_fails(cli, hf, tmp_path / "out")
    assert "model.layers.0.mlp.down_proj.weight has shape [64, 96]" in line
    assert "config.json implies [64, 128]" in line


def test_unsupported_architecture_lists_supported(cli: Any, make_llama: Any, tmp_path: Path) -> None:
    hf = make_llama()
    edit_config(hf, architectures=["FalconForCausalLM"])
    line = convert_fails(cli, hf, tmp_path / "out")
    assert "FalconForCausalLM" in line
    from toolchain.checkpoint.registry import supported_architectures  # families are added: list them all

    assert "supported: " + ", ".join(supported_architectures()) in line
    assert {"GPT2LMHeadModel", "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"} <= set(
        supported_architectures()
    )


def test_unsupported_rope_scaling(cli: Any, make_llama: Any, tmp_path: Path) -> None:
    hf = make_llama()
    edit_config(hf, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0})
    line = convert_fails(cli, hf, tmp_path / "out")
    assert "'yarn'" in line and "llama3" in line


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weight_is_refused(value: float, cli: Any, make_llama: Any, tmp_path: Path) -> None:
    hf = make_llama()

    def poison(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.0.self_attn.k_proj.weight"][3, 5] = value

    edit_weights(hf, poison)
    line = convert_fails(cli, hf, tmp_path / "out")
    assert "model.layers.0.self_attn.k_proj.weight" in line and "NaN/Inf" in line


def test_float16_overflow_is_refused(cli: Any, make_llama: Any, tmp_path: Path) -> None:
    hf = make_llama()

    def huge(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.0.mlp.down_proj.weight"][0, 0] = 1e6

    edit_weights(hf, huge)
    line = convert_fails(cli, hf, tmp_path / "out", "--dtype", "float16")
    assert "transformer.layers.0.mlp.proj.weight" in line and "bfloat16" in line


def test_unconsumed_tensor_is_named(cli: Any, make_llama: Any, tmp_path: Path) -> None:
    hf = make_llama()
    edit_weights(hf, lambda t: t.update({"model.layers.0.mlp.experts.0.w1": torch.zeros(2)}))
    line = convert_fails(cli, hf, tmp_path / "out")
    assert "not consumed" in line and "model.layers.0.mlp.experts.0.w1" in line


def test_rotary_inv_freq_is_dropped_on_purpose(cli: Any, make_llama: Any, tmp_path: Path) -> None:
    hf = make_llama()
    edit_weights(hf, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)}))
    assert cli("convert", hf, "-o", tmp_path / "out").exit_code == 0


def test_missing_model_dir(cli: Any, tmp_path: Path) -> None:
    line = convert_fails(cli, tmp_path / "nope", tmp_path / "out")
    assert "nope" in line and "does not exist" in line


def test_missing_config(cli: Any, tmp_path: Path) -> None:
    (tmp_path / "hf").mkdir()
    line = convert_fails(cli, tmp_path / "hf", tmp_path / "out")
    assert "config.json not found" in line


def test_missing_tokenizer_warns_and_records(cli: Any, make_llama: Any, tmp_path: Path) -> None:
    hf = make_llama()
    result = cli("convert", hf, "-o", tmp_path / "out")
    assert result.exit_code == 0
    assert "warning:" in result.stderr and "no tokenizer" in result.stderr
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert any("no tokenizer" in w for w in manifest["warnings"])


def test_tokenizer_files_are_copied(cli: Any, stories: Path, tmp_path: Path) -> None:
    result = cli("convert", stories, "-o", tmp_path / "out")
    assert result.exit_code == 0 and "warning" not in result.stderr
    for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / "out" / name).read_bytes() == (stories / name).read_bytes()


def test_pickle_refused_unless_opted_in(cli: Any, make_llama: Any, tmp_path: Path) -> None:
    hf = make_llama()
    tensors = load_file(str(hf / "model.safetensors"))
    (hf / "model.safetensors").unlink()
    torch.save(tensors, hf / "pytorch_model.bin")
    line = convert_fails(cli, hf, tmp_path / "out")
    assert "pickle" in line and "--allow-pickle" in line
    assert cli("convert", hf, "-o", tmp_path / "out", "--allow-pickle").exit_code == 0
    out = load_file(str(tmp_path / "out" / "rank0.safetensors"))
    assert torch.equal(out["lm_head.weight"], tensors["lm_head.weight"])


def test_existing_output_needs_force(cli: Any, make_llama: Any, tmp_path: Path) -> None:
    hf = make_llama()
    out = tmp_path / "out"
    assert cli("convert", hf, "-o", out).exit_code == 0
    line = one_line_error(cli("convert", hf, "-o", out))
    assert "--force" in line
    assert cli("convert", hf, "-o", out, "--force").exit_code == 0
    assert cli("verify", out).exit_code == 0


def test_force_never_replaces_a_foreign_directory(cli: Any, make_llama: Any, tmp_path: Path) -> None:
    hf = make_llama()
    foreign = tmp_path / "precious"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("years of work")
    line = one_line_error(cli("convert", hf, "-o", foreign, "--force"))
    assert "not a trtbuild artifact" in line
    assert (foreign / "thesis.tex").read_text() == "years of work"


def test_output_inside_input_is_refused(cli: Any, make_llama: Any) -> None:
    hf = make_llama()
    line = one_line_error(cli("convert", hf, "-o", hf / "ckpt"))
    assert "overlaps input" in line
    assert not (hf / "ckpt").exists()


def test_index_naming_a_missing_shard(cli: Any, make_llama: Any, tmp_path: Path) -> None:
    hf = make_llama()
    index = {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    line = convert_fails(cli, hf, tmp_path / "out")
    assert "model-00002-of-00002.safetensors" in line and "download" in line
