"""Block-scaled FP8 (`quant_method: fp8`, `weight_block_size`: transformers' FineGrainedFP8 layout) read by
`convert` into fp8_block.

No producer runs here (FineGrainedFP8 quantizes on CUDA only): the checkpoints are written to the layout (weight
float8_e4m3fn, weight_scale_inv = block amax / 448) from a random Llama. The reference dequantization is
transformers' own: its loader's op `Fp8Dequantize._dequantize_one` (integrations/finegrained_fp8.py), called
directly because `from_pretrained` needs `accelerate` for a FineGrainedFP8 checkpoint (quantizer
`validate_environment`) and trtbuild's venv has none; with float32 output it is the product the loader makes on
CPU. transformers derives the block from the scale grid (rows // scale rows), so it misreads a partial edge block;
those are checked against the layout's definition instead.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch
from conftest import save_random_llama
from safetensors.numpy import load_file as load_np
from safetensors.numpy import save_file as save_np
from safetensors.torch import load_file

from tests.prequant.harness import HF_LINEARS, PARTS_OF
from toolchain.checkpoint.convert import convert
from toolchain.errors import UserError
from toolchain.quantize.methods.base import Stored
from toolchain.quantize.methods.registry import by_algo

# q 256 rows, k and v 128 (head_dim 64): whole blocks of 128, so q/k/v fuse; intermediate 384 = 3 blocks
SIZES = {"hidden_size": 256, "intermediate_size": 384, "num_attention_heads": 4, "num_key_value_heads": 2}


def block_quantize(w: np.ndarray, b: int) -> tuple[np.ndarray, np.ndarray]:
    """w [out, in] float32 -> (float8_e4m3fn codes, float32 scales [ceil(out/b), ceil(in/b)]): amax / 448 per block
    (DeepSeek's and transformers' `weight_scale_inv`, which multiplies)."""
    out, inn = w.shape
    rb, cb = -(-out // b), -(-inn // b)
    padded = np.zeros((rb * b, cb * b), np.float32)
    padded[:out, :inn] = np.abs(w)
    amax = padded.reshape(rb, b, cb, b).max(axis=(1, 3))
    scale = np.maximum(amax, 1e-12).astype(np.float32) / np.float32(448.0)
    full = np.repeat(np.repeat(scale, b, 0), b, 1)[:out, :inn]
    codes = (w / full).astype(ml_dtypes.float8_e4m3fn)
    return codes, scale


def write_block_fp8(float_dir: Path, out: Path, b: int, config: dict[str, Any] | None = None) -> Path:
    out.mkdir()
    tensors = load_np(str(float_dir / "model.safetensors"))
    written: dict[str, np.ndarray] = {}
    for name, t in tensors.items():
        prefix = name.removesuffix(".weight")
        if any(prefix.endswith(lin) for lin in HF_LINEARS):
            written[name], written[f"{prefix}.weight_scale_inv"] = block_quantize(t, b)
        else:
            written[name] = t
    save_np(written, str(out / "model.safetensors"))
    cfg = json.loads((float_dir / "config.json").read_text())
    q = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [b, b],
         "modules_to_not_convert": ["lm_head"]}  # fmt: skip
    cfg["quantization_config"] = {**q, **(config or {})}
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def transformers_dequantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    return Fp8Dequantize(None)._dequantize_one(weight, scale, torch.float32)


def _read_back(ckpt: Path, hf: Path, b: int, reference: Any) -> int:
    ours = load_file(str(ckpt / "rank0.safetensors"))
    theirs = load_file(str(hf / "model.safetensors"))
    config = json.loads((ckpt / "config.json").read_text())
    assert config["quantization"]["quant_algo"] == "FP8_BLOCK_SCALES" and config["quantization"]["group_size"] == b
    method, checked = by_algo("FP8_BLOCK_SCALES"), 0
    for layer in range(config["num_hidden_layers"]):
        for dst, parts in PARTS_OF.items():
            prefix = f"transformer.layers.{layer}.{dst}"
            own = {n: t for n, t in ours.items() if n.startswith(f"{prefix}.")}
            got = method.dequantize(Stored(prefix, own, own[f"{prefix}.weight"].shape[1], b))
            names = [f"model.layers.{layer}.{p}" for p in parts]
            want = torch.cat([reference(theirs[f"{n}.weight"], theirs[f"{n}.weight_scale_inv"]) for n in names])
            assert torch.equal(got, want), f"{prefix}: {(got - want).abs().max()}"  # one float32 product each
            checked += 1
    return checked


def test_block_fp8_reads_as_transformers_dequantizes(tmp_path: Path) -> None:
    hf = write_block_fp8(save_random_llama(tmp_path / "float", **SIZES), tmp_path / "fp8", 128)
    convert(hf, tmp_path / "ckpt")
    assert _read_back(tmp_path / "ckpt", hf, 128, transformers_dequantize) == 2 * len(PARTS_OF)
    w = load_file(str(tmp_path / "ckpt" / "rank0.safetensors"))
    assert w["transformer.layers.0.attention.qkv.weights_scaling_factor"].shape == (4, 2)  # (256+128+128)/128, 2
    assert w["lm_head.weight"].dtype == torch.float32  # modules_to_not_convert
    source = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())["details"]["quantization_source"]
    assert source["quant_method"] == "fp8" and source["settings"]["weight_block_size"] == [128, 128]


def test_partial_edge_blocks_read_by_the_layouts_definition(tmp_path: Path) -> None:
    """intermediate 320 = 2.5 blocks of 128: the last block of gate/up's rows and of down's columns is partial."""
    sizes = {**SIZES, "intermediate_size": 320}
    hf = write_block_fp8(save_random_llama(tmp_path / "float", **sizes), tmp_path / "fp8", 128)
    convert(hf, tmp_path / "ckpt")

    def definition(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[: weight.shape[0], : weight.shape[1]]
        return weight.float() * full

    assert _read_back(tmp_path / "ckpt", hf, 128, definition) == 2 * len(PARTS_OF)
    w = load_file(str(tmp_path / "ckpt" / "rank0.safetensors"))
    assert w["transformer.layers.0.mlp.proj.weights_scaling_factor"].shape == (2, 3)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"weight_block_size": [1, 128]}, "weight_block_size [1, 128] is not square; trtbuild reads square blocks "
         "(TensorRT-LLM asserts [128, 128])"),
        ({"activation_scheme": "static"}, "activation_scheme 'static'"),
        ({"weight_block_size": None}, "quant_method fp8 without weight_block_size"),
    ],
)  # fmt: skip
def test_block_fp8_settings_refused_by_name(tmp_path: Path, change: dict[str, Any], message: str) -> None:
    hf = write_block_fp8(save_random_llama(tmp_path / "float", **SIZES), tmp_path / "fp8", 128, change)
    with pytest.raises(UserError, match=re.escape(message)):
        convert(hf, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


def test_fused_parts_must_be_whole_blocks(tmp_path: Path) -> None:
    """k/v of 64 rows (head_dim 32) in blocks of 128: fused into qkv, k's block would straddle v."""
    sizes = {**SIZES, "hidden_size": 128, "num_attention_heads": 4}
    hf = write_block_fp8(save_random_llama(tmp_path / "float", **sizes), tmp_path / "fp8", 128)
    with pytest.raises(UserError, match=r"self_attn.q_proj.weight has 128 rows|k_proj.weight has 64 rows, not whole"):
        convert(hf, tmp_path / "ckpt")


def act_quant(x: torch.Tensor, b: int) -> torch.Tensor:
    """First principles (DeepSeek-V3's `act_quant`, TensorRT-LLM's FP8_BLOCK_SCALES inputs): each token's input in
    groups of b channels quantized to E4M3 at amax / 448 and back, in float32."""
    g = x.float().reshape(*x.shape[:-1], x.shape[-1] // b, b)
    scale = (g.abs().amax(-1, keepdim=True) / 448.0).clamp(min=torch.finfo(torch.float32).tiny)
    return ((g / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale).reshape(x.shape)


@pytest.mark.slow
def test_engine_agrees_with_transformers_dequantized_model(tmp_path: Path) -> None:
    """Issue 28's gate: our engine vs the checkpoint dequantized by transformers' op in a float32 transformers model
    whose quantized linears quantize their input per token in 1 x 128 groups (forward pre-hooks: Q9(a))."""
    from transformers import LlamaForCausalLM

    from tests.prequant.harness import SHORT_ROW, agreement, assert_reads_exactly, engine_logits, token_rows

    float_dir = save_random_llama(tmp_path / "float", **SIZES)
    hf = write_block_fp8(float_dir, tmp_path / "fp8", 128)
    convert(hf, tmp_path / "ckpt")
    model = LlamaForCausalLM.from_pretrained(float_dir, dtype=torch.float32).eval()
    t = load_file(str(hf / "model.safetensors"))
    state = {}
    for name in model.state_dict():
        prefix = name.removesuffix(".weight")
        if f"{prefix}.weight_scale_inv" in t:
            state[name] = transformers_dequantize(t[name], t[f"{prefix}.weight_scale_inv"])
            model.get_submodule(prefix).register_forward_pre_hook(lambda _m, a: (act_quant(a[0], 128), *a[1:]))
    model.load_state_dict(state, strict=False)
    rows = token_rows(97, 16, SHORT_ROW, seed=2)
    with torch.no_grad():
        ref = np.stack([model(torch.tensor([r])).logits[0].numpy() for r in rows])
    a = agreement(ref, engine_logits(tmp_path / "ckpt", tmp_path / "engine", rows))
    print(f"\nblock FP8 128x128 (16 rows x {SHORT_ROW} tokens): {a.line()}")
    assert_reads_exactly(a, weight_only=False)
