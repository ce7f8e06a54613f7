"""What each family's conversion records and refuses: sliding windows, config fields, GPT-2's tensor prefixes, Phi-3's
fused layout, tensor parallelism, CPU engine and refused ropes. Their parity cases are test_family_parity.py's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import edit_config, one_line_error
from models import compare, save_case, save_random
from safetensors.torch import load_file, save_file

from toolchain.checkpoint.convert import convert
from toolchain.checkpoint.trtllm import read_config


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


def test_qwen_windows_without_use_sliding_window_are_ignored(tmp_path: Path) -> None:
    """Qwen2.5 configs carry sliding_window and max_window_layers with use_sliding_window false: no layer slides."""
    from toolchain.checkpoint.spec import spec_of

    hf = save_random(tmp_path / "hf", "qwen2", sliding_window=4, max_window_layers=0)
    convert(hf, tmp_path / "ckpt")
    assert spec_of(read_config(tmp_path / "ckpt")).windows == [None, None]
    max_abs, _ = compare(hf, tmp_path / "ckpt", seq=40)
    assert max_abs < 1e-4


def test_gpt2_exact_gelu_is_refused(cli: Any, tmp_path: Path) -> None:
    """TensorRT-LLM's gelu is the tanh approximation: an erf-GELU model would not be what the engine computes."""
    from conftest import one_line_error

    hf = save_random(tmp_path / "hf", "gpt2", activation_function="gelu")
    line = one_line_error(cli("convert", hf, "-o", tmp_path / "out"))
    assert "activation_function 'gelu'" in line and "gelu_new" in line


# --- Phi-3 (Phi3ForCausalLM): fused qkv_proj and gate_up_proj, sliding window, refused long-context rope ---------

# TensorRT-LLM's Phi-3 converter (tensorrt_llm/models/phi3/convert.py, `load_weights_from_hf_model`, lines 27-63 at
# commit 89fd9b74; model.py's Phi3DecoderLayer): per layer, these names and shapes (H hidden, I intermediate, Q the
# fused qkv rows), nothing else; mlp.fc is gate_up_proj with its halves swapped to [up; gate] (lines 56-63), and
# there is no mlp.gate. Outside the layers: the embedding, ln_f and lm_head.
TRTLLM_PHI3_LAYER = {
    "input_layernorm.weight": ("H",),
    "attention.qkv.weight": ("Q", "H"),
    "attention.dense.weight": ("H", "H"),
    "post_layernorm.weight": ("H",),
    "mlp.fc.weight": ("2I", "H"),
    "mlp.proj.weight": ("H", "I"),
}
TRTLLM_PHI3_OUTSIDE = {
    "transformer.vocab_embedding.weight": ("V", "H"),
    "transformer.ln_f.weight": ("H",),
    "lm_head.weight": ("V", "H"),
}


def test_phi3_checkpoint_has_exactly_trtllm_phi3_names_and_shapes(tmp_path: Path) -> None:
    hf = save_case(tmp_path / "hf", "phi3-window")
    convert(hf, tmp_path / "ckpt")
    src, out = load_file(str(hf / "model.safetensors")), load_file(str(tmp_path / "ckpt" / "rank0.safetensors"))
    cfg = read_config(tmp_path / "ckpt")
    h, i = cfg.hidden_size, cfg.intermediate_size
    sizes = {"H": h, "I": i, "2I": 2 * i, "V": cfg.vocab_size}
    sizes["Q"] = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_size
    expected = {name: shape for name, shape in TRTLLM_PHI3_OUTSIDE.items()}
    for layer in range(cfg.num_hidden_layers):
        expected.update({f"transformer.layers.{layer}.{n}": shape for n, shape in TRTLLM_PHI3_LAYER.items()})
    assert {n: tuple(t.shape) for n, t in out.items()} == {n: tuple(sizes[d] for d in s) for n, s in expected.items()}
    gate_up = src["model.layers.1.mlp.gate_up_proj.weight"]  # HF: [gate; up]
    assert torch.equal(out["transformer.layers.1.mlp.fc.weight"], torch.cat([gate_up[i:], gate_up[:i]]))
    assert torch.equal(
        out["transformer.layers.1.attention.qkv.weight"], src["model.layers.1.self_attn.qkv_proj.weight"]
    )
    assert cfg.architecture == "Phi3ForCausalLM" and cfg.sliding_window == 8 and cfg.rotary_scaling is None
    assert cfg.norm_epsilon == 1e-5 and not cfg.attn_bias and not cfg.mlp_bias and cfg.hidden_act == "swiglu"
    convert(hf, tmp_path / "threads", workers=3)  # the bytes do not depend on threads
    threads, one = (tmp_path / d / "rank0.safetensors" for d in ("threads", "ckpt"))
    assert threads.read_bytes() == one.read_bytes()


def test_a_phi3_checkpoint_in_the_old_split_layout_is_refused(cli: Any, tmp_path: Path) -> None:
    """Before issue 23 we wrote Phi-3 as Llama's split MLP (hidden_act silu); read as fused it would be another
    model, so every stage that reads it says to convert again."""
    import json

    convert(save_case(tmp_path / "hf", "phi3-gqa"), tmp_path / "ckpt")
    path = tmp_path / "ckpt" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "hidden_act": "silu"}))
    for args in (["quantize", tmp_path / "ckpt", "-o", tmp_path / "q", "--method", "w8a16"],
                 ["build", tmp_path / "ckpt", "-o", tmp_path / "e"]):  # fmt: skip
        line = one_line_error(cli(*args))
        assert "hidden_act 'silu'" in line and "re-run `trtbuild convert`" in line
        assert not (tmp_path / "q").exists() and not (tmp_path / "e").exists()


def test_phi3_window_is_recorded_and_matters(tmp_path: Path) -> None:
    import json

    hf = save_case(tmp_path / "hf", "phi3-window")
    convert(hf, tmp_path / "ckpt")
    path = tmp_path / "ckpt" / "config.json"
    config = json.loads(path.read_text())
    assert config["sliding_window"] == 8
    config["sliding_window"] = None
    path.write_text(json.dumps(config))
    max_abs, _ = compare(hf, tmp_path / "ckpt", seq=40)
    assert max_abs > 1e-3


@pytest.mark.parametrize(("name", "tp"), [("phi3-window", 2), ("phi3-gqa", 4)])
def test_phi3_tensor_parallel(name: str, tp: int, tmp_path: Path) -> None:
    """Each rank's mlp.fc is [up_r; gate_r], its slice of each half; tp 4 > 2 KV heads replicates them."""
    from toolchain.reference.model import ReferenceModel
    from toolchain.reference.parallel import merge_ranks, tp_logits

    hf = save_case(tmp_path / "hf", name)
    convert(hf, tmp_path / "one")
    convert(hf, tmp_path / "tp", tp=tp)
    single = load_file(str(tmp_path / "one" / "rank0.safetensors"))
    merged = merge_ranks(tmp_path / "tp")
    assert merged.keys() == single.keys()
    assert all(torch.equal(merged[n], t) for n, t in single.items())
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(3))
    expected = ReferenceModel.from_checkpoint(tmp_path / "one", torch.float64).forward(ids)
    assert (expected - tp_logits(tmp_path / "tp", ids, torch.float64)).abs().max().item() < 1e-10


LONGROPE = {"long_factor": [1.0] * 4, "short_factor": [1.0] * 4}


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"rope_scaling": {"type": "longrope", **LONGROPE}}, "rope_scaling.type 'longrope'"),
        ({"rope_scaling": {"type": "su", **LONGROPE}}, "rope_scaling.type 'su'"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, **LONGROPE}}, "rope_parameters.rope_type"),
        ({"partial_rotary_factor": 0.75}, "partial_rotary_factor 0.75"),
        ({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}}, "partial_rotary_factor 0.5"),
    ],
)
def test_phi3_unsupported_rope_is_refused(changes: dict[str, Any], expected: str, cli: Any, tmp_path: Path) -> None:
    from conftest import one_line_error

    hf = save_case(tmp_path / "hf", "phi3-gqa")
    edit_config(hf, **changes)
    line = one_line_error(cli("convert", hf, "-o", tmp_path / "out"))
    assert expected in line and "config.json" in line
    assert not (tmp_path / "out").exists()
