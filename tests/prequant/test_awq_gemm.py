"""AutoAWQ GEMM checkpoints (`quant_method: awq`, version gemm) read by `convert` into w4a16_gptq.

No producer runs here: AutoAWQ (and gptqmodel's AWQ path) quantize on CUDA only. The checkpoint is written to the
published layout from known codes, zero points and scales (qweight / qzeros packed along the output with
codecs.AWQ_ORDER, as AutoAWQ's GEMM packer does); the file is then unpacked here independently, word shifts from
AWQ_REVERSE_ORDER as vLLM's AWQ reader does, to prove it is that layout, and what we read is held to
w = (q − z) · s from the known values — exactly, as float32 holds every float16 scale and every small product.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import save_random_llama
from safetensors.numpy import load_file as load_np
from safetensors.numpy import save_file as save_np
from safetensors.torch import load_file

from tests.prequant.harness import HF_LINEARS, PARTS_OF
from toolchain.checkpoint.convert import convert
from toolchain.checkpoint.prequant.codecs import AWQ_ORDER, AWQ_REVERSE_ORDER, pack_int32
from toolchain.errors import UserError
from toolchain.quantize.methods.base import Stored
from toolchain.quantize.methods.registry import by_algo

G = 32


def independent_unpack(words: np.ndarray) -> np.ndarray:
    """int32 [rows, out/8] -> [rows, out]: value j of a word sits at bits 4 · AWQ_REVERSE_ORDER[j] (vLLM's
    `awq_dequantize` shifts)."""
    u = words.view(np.uint32).astype(np.int64)
    shifts = np.array(AWQ_REVERSE_ORDER) * 4
    return ((u[:, :, None] >> shifts) & 0xF).reshape(u.shape[0], -1)


def write_awq(float_dir: Path, out: Path, config: dict[str, Any] | None = None, drop: str | None = None) -> dict:
    """The float model's linears replaced by random AWQ GEMM tensors; returns the known (q, z, s) per HF prefix."""
    out.mkdir()
    rng = np.random.default_rng(0)
    known: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    written: dict[str, np.ndarray] = {}
    for name, t in load_np(str(float_dir / "model.safetensors")).items():
        prefix = name.removesuffix(".weight")
        if not any(prefix.endswith(lin) for lin in HF_LINEARS):
            written[name] = t
            continue
        o, i = t.shape
        q = rng.integers(0, 16, (i, o))
        z = rng.integers(0, 16, (i // G, o))
        s = rng.uniform(0.001, 0.02, (i // G, o)).astype(np.float16)
        written[f"{prefix}.qweight"] = pack_int32(q, 4, axis=1, order=AWQ_ORDER)
        written[f"{prefix}.qzeros"] = pack_int32(z, 4, axis=1, order=AWQ_ORDER)
        written[f"{prefix}.scales"] = s
        known[prefix] = (q, z, s)
    if drop:
        del written[drop]
    save_np(written, str(out / "model.safetensors"))
    cfg = json.loads((float_dir / "config.json").read_text())
    q_cfg = {"quant_method": "awq", "version": "gemm", "bits": 4, "group_size": G, "zero_point": True,
             "modules_to_not_convert": None}  # fmt: skip
    cfg["quantization_config"] = {**q_cfg, **(config or {})}
    (out / "config.json").write_text(json.dumps(cfg))
    return known


def test_awq_gemm_reads_exactly(tmp_path: Path) -> None:
    hf = tmp_path / "awq"
    known = write_awq(save_random_llama(tmp_path / "float"), hf)
    files = load_np(str(hf / "model.safetensors"))
    for prefix, (q, z, _) in known.items():  # the file is the layout vLLM unpacks
        assert np.array_equal(independent_unpack(files[f"{prefix}.qweight"]), q)
        assert np.array_equal(independent_unpack(files[f"{prefix}.qzeros"]), z)
    convert(hf, tmp_path / "ckpt")
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert config["quantization"]["quant_algo"] == "W4A16_GPTQ" and config["quantization"]["has_zero_point"]
    ours = load_file(str(tmp_path / "ckpt" / "rank0.safetensors"))
    method, checked = by_algo("W4A16_GPTQ"), 0
    for layer in range(config["num_hidden_layers"]):
        for dst, parts in PARTS_OF.items():
            prefix = f"transformer.layers.{layer}.{dst}"
            own = {n: t for n, t in ours.items() if n.startswith(f"{prefix}.")}
            got = method.dequantize(Stored(prefix, own, own[f"{prefix}.weight"].shape[1], G))
            want = []
            for p in parts:
                q, z, s = known[f"model.layers.{layer}.{p}"]
                w = (q - np.repeat(z, G, 0)).astype(np.float32) * np.repeat(s.astype(np.float32), G, 0)
                want.append(torch.from_numpy(w.T))
            assert torch.equal(got, torch.cat(want)), prefix
            checked += 1
    assert checked == 2 * len(PARTS_OF)
    source = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())["details"]["quantization_source"]
    assert source["format"] == "awq" and source["quant_algo"] == "W4A16_GPTQ"


@pytest.mark.parametrize(
    ("config", "drop", "message"),
    [
        ({"version": "gemv"}, None, "AutoAWQ version 'gemv'; trtbuild reads the GEMM packing"),
        ({"bits": 8}, None, "AutoAWQ bits 8; only 4 is read"),
        ({}, "model.layers.1.self_attn.k_proj.qzeros", "model.layers.1.self_attn.k_proj.qzeros missing"),
    ],
)
def test_awq_refusals_name_the_setting_or_tensor(
    tmp_path: Path, cli: Any, config: dict[str, Any], drop: str | None, message: str
) -> None:
    write_awq(save_random_llama(tmp_path / "float"), tmp_path / "awq", config, drop)
    r = cli("convert", tmp_path / "awq", "-o", tmp_path / "ckpt")
    errors = [line for line in r.output.splitlines() if line.startswith("error:")]
    assert r.exit_code == 1 and len(errors) == 1 and message in errors[0], r.output
    assert not (tmp_path / "ckpt").exists()
    with pytest.raises(UserError):
        convert(tmp_path / "awq", tmp_path / "ckpt")


@pytest.mark.slow
def test_engine_agrees_with_the_known_weights(tmp_path: Path) -> None:
    """Issue 28's gate (weight-only): our engine vs a float32 transformers model holding w = (q − z) · s."""
    from transformers import LlamaForCausalLM

    from tests.prequant.harness import agreement, assert_reads_exactly, engine_logits, token_rows

    float_dir = save_random_llama(tmp_path / "float")
    known = write_awq(float_dir, tmp_path / "awq")
    convert(tmp_path / "awq", tmp_path / "ckpt")
    model = LlamaForCausalLM.from_pretrained(float_dir, dtype=torch.float32).eval()
    state = {}
    for prefix, (q, z, s) in known.items():
        w = (q - np.repeat(z, G, 0)).astype(np.float32) * np.repeat(s.astype(np.float32), G, 0)
        state[f"{prefix}.weight"] = torch.from_numpy(np.ascontiguousarray(w.T))
    model.load_state_dict(state, strict=False)
    rows = token_rows(97, 4, 32, seed=3)
    with torch.no_grad():
        ref = np.stack([model(torch.tensor([r])).logits[0].numpy() for r in rows])
    a = agreement(ref, engine_logits(tmp_path / "ckpt", tmp_path / "engine", rows))
    print(f"\nAutoAWQ GEMM G{G} (4 rows x 32 tokens): {a.line()}")
    assert_reads_exactly(a, weight_only=True)


def test_dequantize_writes_the_float_weights(tmp_path: Path, cli: Any) -> None:
    """`convert --dequantize`: the float detour when asked — w = (q − z) · s as float weights, nothing quantized."""
    float_dir = save_random_llama(tmp_path / "float")
    known = write_awq(float_dir, tmp_path / "awq")
    r = cli("convert", tmp_path / "awq", "-o", tmp_path / "ckpt", "--dequantize")
    assert r.exit_code == 0, r.output
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert config["quantization"]["quant_algo"] is None
    ours = load_file(str(tmp_path / "ckpt" / "rank0.safetensors"))
    assert not [n for n in ours if "scaling_factor" in n or "zero_point" in n]
    for layer in range(config["num_hidden_layers"]):
        for dst, parts in PARTS_OF.items():
            want = []
            for p in parts:
                q, z, s = known[f"model.layers.{layer}.{p}"]
                w = (q - np.repeat(z, G, 0)).astype(np.float32) * np.repeat(s.astype(np.float32), G, 0)
                want.append(torch.from_numpy(w.T))
            assert torch.equal(ours[f"transformer.layers.{layer}.{dst}.weight"], torch.cat(want)), dst
    manifest = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())
    assert manifest["details"]["quantization_source"]["dequantized"] is True
    r = cli("convert", float_dir, "-o", tmp_path / "ckpt2", "--dequantize")
    assert r.exit_code == 1 and "--dequantize, but the checkpoint is not pre-quantized" in r.output
