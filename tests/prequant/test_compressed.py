"""compressed-tensors checkpoints read exactly (checkpoint/prequant/compressed.py).

Fast: checkpoints written here to compressed-tensors' layout (its `pack_to_int32` offset and dense packing, the
act-order `weight_g_idx` that 0.19 no longer writes) read back through convert and the method's `dequantize`, and
every scheme we do not read refused by name. Slow, in the llm-compressor venv (tests/prequant/producers.py):
llm-compressor 0.14 quantizes a random Llama on CPU; every weight we convert dequantizes bit for bit to
compressed-tensors' own float32 decompression, and our engine's logits agree with the producer's model (its float32
decompression, its own input quantization) by the issue's gates (tests/prequant/harness.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch
from conftest import edit_weights, save_random_llama
from safetensors.torch import load_file, save_file

from tests.prequant.harness import SHORT_ROW, agreement, assert_reads_exactly, engine_logits
from tests.prequant.producers import ROWS, converted, dequantized, hf_weight, produce
from toolchain.checkpoint.convert import convert
from toolchain.checkpoint.hf import HFCheckpoint
from toolchain.checkpoint.prequant import detect
from toolchain.checkpoint.prequant.codecs import pack_int32
from toolchain.checkpoint.trtllm import read_config
from toolchain.errors import UserError
from toolchain.quantize.methods.base import INPUT_PERM, PARTS

# --- checkpoints written here to compressed-tensors' layout ---


def ct_config(weights: dict[str, Any], inputs: dict[str, Any] | None, fmt: str, **extra: Any) -> dict[str, Any]:
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "version": "0.19.0",
        "ignore": ["lm_head"],
        "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": weights, "input_activations": inputs, "format": fmt}
        },
        **extra,
    }


def write_ct(path: Path, convert_linear: Any, config: dict[str, Any], **model: Any) -> dict[str, torch.Tensor]:
    """A random Llama saved by transformers, its linears replaced by `convert_linear(name, weight)` -> tensors;
    returns the float weights each linear dequantizes to (computed here from the codes, as the layout says)."""
    save_random_llama(path, **model)
    tensors = load_file(str(path / "model.safetensors"))
    want: dict[str, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if ".layers." in name and name.endswith("proj.weight"):
            made, w = convert_linear(name.removesuffix(".weight"), t)
            out.update(made)
            want[name] = w
        else:
            out[name] = t
    save_file(out, str(path / "model.safetensors"))
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = config
    (path / "config.json").write_text(json.dumps(cfg))
    return want


def int4_group(symmetric: bool, actorder: bool, g: int = 16) -> Any:
    rng = np.random.default_rng(7)
    orders: dict[tuple[str, int], np.ndarray] = {}  # one act-order per input: q/k/v (and gate/up) read the same x

    def make(prefix: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        out_dim, in_dim = w.shape
        q = rng.integers(-8, 8, (out_dim, in_dim))  # signed codes, compressed-tensors' quantize() range
        z = (
            np.zeros((out_dim, in_dim // g), dtype=np.int64)
            if symmetric
            else rng.integers(-8, 8, (out_dim, in_dim // g))
        )
        s = rng.uniform(0.01, 0.1, (out_dim, in_dim // g)).astype(np.float32)
        key = (
            prefix.split(".")[2],
            in_dim if prefix.endswith(("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")) else -in_dim,
        )
        g_idx = orders.setdefault(key, rng.permutation(np.arange(in_dim) // g)) if actorder else np.arange(in_dim) // g
        made = {
            f"{prefix}.weight_packed": torch.from_numpy(pack_int32(q + 8, 4, 1)),  # pack_to_int32: value + 2^(b-1)
            f"{prefix}.weight_scale": torch.from_numpy(s).to(torch.bfloat16),
            f"{prefix}.weight_shape": torch.tensor([out_dim, in_dim]),
        }
        if not symmetric:
            made[f"{prefix}.weight_zero_point"] = torch.from_numpy(pack_int32(z + 8, 4, 0))  # along dim 0
        if actorder:
            made[f"{prefix}.weight_g_idx"] = torch.from_numpy(g_idx.astype(np.int32))
        s_bf16 = made[f"{prefix}.weight_scale"].float().numpy()
        w_ref = (q - z[:, g_idx]).astype(np.float32) * s_bf16[:, g_idx]  # column k in group g_idx[k]
        return made, torch.from_numpy(w_ref)

    return make


@pytest.mark.parametrize(("symmetric", "actorder"), [(True, False), (False, False), (False, True), (True, True)])
def test_int4_pack_quantized_reads_exactly(tmp_path: Path, symmetric: bool, actorder: bool) -> None:
    weights = {"num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": "group", "group_size": 16}
    if actorder:
        weights["actorder"] = "group"
    want = write_ct(tmp_path / "hf", int4_group(symmetric, actorder), ct_config(weights, None, "pack-quantized"))
    convert(tmp_path / "hf", tmp_path / "out")
    cfg = read_config(tmp_path / "out")
    assert (cfg.quantization.quant_algo, cfg.quantization.group_size) == ("W4A16_GPTQ", 16)
    got = dequantized(tmp_path / "out")
    assert len(got) == 2 * 5
    for prefix, w in got.items():
        assert torch.equal(w, hf_weight(want, prefix)), prefix
    raw = load_file(str(tmp_path / "out" / "rank0.safetensors"))
    assert any(n.endswith(INPUT_PERM) for n in raw) == actorder


def test_int8_channel_reads_as_w8a16(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)

    def make(prefix: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        q = rng.integers(-128, 128, tuple(w.shape))
        s = rng.uniform(0.01, 0.1, (w.shape[0], 1)).astype(np.float32)
        made = {
            f"{prefix}.weight_packed": torch.from_numpy(pack_int32(q + 128, 8, 1)),
            f"{prefix}.weight_scale": torch.from_numpy(s),
            f"{prefix}.weight_shape": torch.tensor(list(w.shape)),
        }
        return made, torch.from_numpy((q * s).astype(np.float32))

    weights = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
    want = write_ct(tmp_path / "hf", make, ct_config(weights, None, "pack-quantized"))
    convert(tmp_path / "hf", tmp_path / "out")
    assert read_config(tmp_path / "out").quantization.quant_algo == "W8A16"
    for prefix, w in dequantized(tmp_path / "out").items():
        assert torch.equal(w, hf_weight(want, prefix)), prefix


def test_fp8_static_keeps_each_projections_input_scale(tmp_path: Path) -> None:
    """q, k and v of one layer with three different input scales: three scales and PREFIX.parts, not their max."""
    rng = np.random.default_rng(5)

    def make(prefix: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        codes = torch.from_numpy(
            np.clip(rng.normal(0, 100, tuple(w.shape)), -440, 440).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
        )
        codes = codes.view(torch.float8_e4m3fn)
        s = torch.tensor([rng.uniform(0.001, 0.01)], dtype=torch.float32)
        made = {
            f"{prefix}.weight": codes,
            f"{prefix}.weight_scale": s,
            f"{prefix}.input_scale": torch.tensor([rng.uniform(0.01, 0.1)], dtype=torch.float32),
        }
        return made, codes.float() * s

    fp8 = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": False}
    src = tmp_path / "hf"
    write_ct(src, make, ct_config(fp8, dict(fp8), "float-quantized"))
    convert(src, tmp_path / "out")
    raw = load_file(str(tmp_path / "out" / "rank0.safetensors"))
    hf = load_file(str(src / "model.safetensors"))
    qkv = "transformer.layers.0.attention.qkv"
    inputs = [hf[f"model.layers.0.self_attn.{p}_proj.input_scale"].item() for p in "qkv"]
    assert len(set(inputs)) == 3
    assert raw[f"{qkv}.activation_scaling_factor"].tolist() == inputs
    assert raw[f"{qkv}.{PARTS}"].tolist() == [64, 16, 16]
    assert raw["transformer.layers.0.mlp.fc.activation_scaling_factor"].shape == (1,)
    # what the producer left float is listed, as our quantize stage lists it (TensorRT-LLM reads null as "all")
    assert read_config(tmp_path / "out").quantization.exclude_modules == ["lm_head", "transformer.vocab_embedding"]

    for tensor, value in (("q_proj.input_scale", 0.0), ("o_proj.weight_scale", -0.01)):
        bad = tmp_path / f"bad-{value}"
        shutil.copytree(src, bad)
        edit_weights(bad, lambda t, n=f"model.layers.1.self_attn.{tensor}", v=value: t.update({n: torch.tensor([v])}))
        with pytest.raises(UserError, match=rf"{tensor}.*not finite and positive"):  # 0 divides, < 0 flips signs
            convert(bad, tmp_path / f"out-{value}")
        assert not (tmp_path / f"out-{value}").exists()


def test_fp8_kv_cache_scales_read_where_k_and_v_agree(tmp_path: Path) -> None:
    fp8 = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": False}
    layer_scale = {0: (0.5, 0.5), 1: (0.25, 0.25)}

    def make(prefix: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        codes = w.to(torch.float8_e4m3fn)
        made = {
            f"{prefix}.weight": codes,
            f"{prefix}.weight_scale": torch.ones(1),
            f"{prefix}.input_scale": torch.ones(1),
        }
        if prefix.endswith("q_proj"):  # one place a layer: its attention's k_scale / v_scale
            k, v = layer_scale[int(prefix.split(".")[2])]
            attn = prefix.removesuffix(".q_proj")
            made |= {f"{attn}.k_scale": torch.tensor([k]), f"{attn}.v_scale": torch.tensor([v])}
        return made, codes.float()

    config = ct_config(fp8, dict(fp8), "float-quantized", kv_cache_scheme=dict(fp8))
    write_ct(tmp_path / "hf", make, config)
    convert(tmp_path / "hf", tmp_path / "out")
    assert read_config(tmp_path / "out").quantization.kv_cache_quant_algo == "FP8"
    raw = load_file(str(tmp_path / "out" / "rank0.safetensors"))
    assert [raw[f"transformer.layers.{i}.attention.kv_cache_scaling_factor"].item() for i in (0, 1)] == [0.5, 0.25]
    convert(tmp_path / "hf", tmp_path / "float", dequantize=True)  # the KV scales are read, then dropped
    assert read_config(tmp_path / "float").quantization.kv_cache_quant_algo is None
    assert not [n for n in load_file(str(tmp_path / "float" / "rank0.safetensors")) if "kv_cache" in n]

    layer_scale[1] = (0.25, 0.3)  # differing k / v: their max, as TensorRT-LLM merges them, and a warning
    write_ct(tmp_path / "hf2", make, config)
    result = convert(tmp_path / "hf2", tmp_path / "out2")
    raw = load_file(str(tmp_path / "out2" / "rank0.safetensors"))
    assert raw["transformer.layers.1.attention.kv_cache_scaling_factor"].item() == pytest.approx(0.3)
    assert [w for w in result.warnings if "k_scale and v_scale differ in 1 of 2 layers (up to 1.2x)" in w]


# --- refusals by name ---


def refused(tmp_path: Path, config: dict[str, Any]) -> str:
    save_random_llama(tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg["quantization_config"] = config
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError) as e:
        detect(HFCheckpoint.open(tmp_path / "hf"))
    return str(e.value)


INT4 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 16}
FP8_T = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor"}


@pytest.mark.parametrize(
    ("config", "words"),
    [
        (
            {
                **ct_config(INT4, None, "pack-quantized"),
                "config_groups": {
                    "group_0": {"targets": ["re:.*mlp.*"], "weights": INT4, "format": "pack-quantized"},
                    "group_1": {"targets": ["re:.*self_attn.*"], "weights": FP8_T, "input_activations": FP8_T},
                },
            },
            ["group_0", "group_1", "mixed precision"],
        ),
        (ct_config(INT4, None, "mixed-precision"), ["mixed-precision", "pack-quantized"]),
        (ct_config(INT4, None, "pack-quantized", kv_cache_scheme={"num_bits": 8, "type": "int"}), ["kv_cache_scheme"]),
        (ct_config(INT4, None, "pack-quantized", transform_config={"config_groups": {"u": {}}}), ["transform_config"]),
        (ct_config({**INT4, "num_bits": 8}, None, "pack-quantized"), ["8-bit int group", "int4 group"]),
        (ct_config({**INT4, "num_bits": 4}, FP8_T, "pack-quantized"), ["8-bit float tensor"]),
        (ct_config(FP8_T, None, "float-quantized"), ["no input quantization"]),
        (ct_config({**FP8_T, "strategy": "channel"}, {**FP8_T, "dynamic": False}, "float-quantized"), ["channel"]),
        (
            ct_config(
                {**FP8_T, "strategy": "block", "block_structure": [128, 64]},
                {**FP8_T, "strategy": "group", "group_size": 64, "dynamic": True},
                "float-quantized",
            ),
            ["[128, 64]", "square"],
        ),
        (
            ct_config(
                {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16},
                None,
                "nvfp4-pack-quantized",
            ),
            ["NVFP4 weights only"],
        ),
        ({**ct_config(INT4, None, "pack-quantized"), "quantization_status": "frozen"}, ["frozen", "compressed"]),
        (ct_config(INT4, None, "int-quantized"), ["int-quantized", "supported"]),
    ],
)
def test_unread_schemes_are_refused_by_name(tmp_path: Path, config: dict[str, Any], words: list[str]) -> None:
    message = refused(tmp_path, config)
    assert "compressed-tensors" in message
    for word in words:
        assert word in message, message


def test_partly_quantized_fused_linear_is_refused(tmp_path: Path) -> None:
    make = int4_group(True, False)

    def only_q(prefix: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        if prefix.endswith(("k_proj", "v_proj")):
            return {f"{prefix}.weight": w}, w
        return make(prefix, w)

    write_ct(tmp_path / "hf", only_q, ct_config(INT4, None, "pack-quantized"))
    with pytest.raises(UserError, match=r"k_proj.*only some are quantized"):
        convert(tmp_path / "hf", tmp_path / "out")


# --- llm-compressor on CPU: the producer's own checkpoints ---

SCHEMES = {  # llm-compressor preset (or bench/prequant_producers.py's spelled-out scheme) -> (quant_algo, weight-only)
    "FP8": ("FP8", False),
    "FP8_DYNAMIC": ("FP8_PER_CHANNEL_PER_TOKEN", False),
    "FP8_DYNAMIC_TENSOR": ("FP8_DYNAMIC", False),
    "FP8_BLOCK64": ("FP8_BLOCK_SCALES", False),
    "FP8_KV_SHARED": ("FP8", False),  # its k_scale / v_scale set to their max after oneshot: our one KV scale
    "W4A16": ("W4A16_GPTQ", True),
    "W4A16_ASYM": ("W4A16_GPTQ", True),
    "W8A16_CHANNEL": ("W8A16", True),
    "NVFP4": ("NVFP4", False),
}


@pytest.fixture(scope="session")
def producer_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("producers")


@pytest.fixture(scope="session")
def llmcompressor(producer_root: Path) -> Any:
    return converted(producer_root, "llmcompressor")


@pytest.mark.slow
@pytest.mark.parametrize("scheme", [s for s in SCHEMES if s != "NVFP4"])
def test_llmcompressor_weights_read_bit_for_bit(llmcompressor: Any, scheme: str) -> None:
    made, out = llmcompressor(scheme)
    assert read_config(out).quantization.quant_algo == SCHEMES[scheme][0]
    got = dequantized(out)
    assert len(got) == 2 * 5
    for prefix, w in got.items():
        assert torch.equal(w, hf_weight(made.dequant, prefix)), prefix


@pytest.mark.slow
def test_llmcompressor_fp8_kv_with_its_own_k_and_v_scales_converts_with_a_warning(producer_root: Path) -> None:
    """llm-compressor calibrates k and v apart: the KV cache takes the max (TensorRT-LLM's reading), said in one
    warning line and kept in the manifest; not gated by KLD (the cost against the producer is in
    docs/conversion.md)."""
    made = produce(producer_root, "llmcompressor", "FP8_KV")
    result = convert(made.ckpt, producer_root / "ours-FP8_KV")
    assert [w for w in result.warnings if "k_scale and v_scale differ" in w and "TensorRT-LLM" in w]
    manifest = json.loads((producer_root / "ours-FP8_KV" / "manifest.json").read_text())
    assert any("k_scale and v_scale differ" in w for w in manifest["warnings"])


@pytest.mark.slow
def test_llmcompressor_nvfp4_global_scale_inverted(llmcompressor: Any) -> None:
    """compressed-tensors divides by its global scale in float32 (w = e2m1 · (s / g)); we store 1/g rounded to
    float32 and multiply (ModelOpt's direction). Those differ in the last bit where s / g and s · fl(1/g) round
    differently: the test bounds that at one float32 rounding (2^-23 relative, twice: the quotient and the product)
    and reports how many weights differ."""
    made, out = llmcompressor("NVFP4")
    got = dequantized(out)
    total = differ = 0
    for prefix, w in got.items():
        ref = hf_weight(made.dequant, prefix)
        total += w.numel()
        differ += int((w != ref).sum())
        assert torch.allclose(w, ref, rtol=2 * 2.0**-23, atol=0), prefix
    print(f"NVFP4 weights differing from compressed-tensors' float32 decompression: {differ} of {total}")


@pytest.mark.slow
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_llmcompressor_engine_agrees_with_the_producer(llmcompressor: Any, scheme: str, tmp_path: Path) -> None:
    made, out = llmcompressor(scheme)
    weight_only = SCHEMES[scheme][1]
    for name, rows in ROWS.items():
        ours = engine_logits(out, tmp_path / f"engine{name}", rows)
        a = agreement(made.logits[name], ours)
        print(f"llmcompressor {scheme} rows {len(rows)}x{name}: {a.line()}")
        if weight_only or len(rows[0]) <= SHORT_ROW:
            assert_reads_exactly(a, weight_only)
