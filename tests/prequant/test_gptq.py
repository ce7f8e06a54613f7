"""GPTQ checkpoints read exactly (checkpoint/prequant/gptq.py).

Fast: checkpoints written here to gptqmodel's layout — qweight packed along the input, qzeros along the output, v1
zeros stored minus one (and read back by gptqmodel's whole-word addition, carries included), act-order g_idx —
read back through convert and W4A16_GPTQ's `dequantize`; what we do not read is refused by name. Slow, in the
gptqmodel venv (tests/prequant/producers.py): gptqmodel 7.7 quantizes a random Llama on CPU, desc_act on and off;
every converted weight equals gptqmodel's own float32 dequantization bit for bit and our engine's logits agree with
the producer's model by the issue's gates."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import save_random_llama
from safetensors.torch import load_file, save_file

from tests.prequant.harness import agreement, assert_reads_exactly, engine_logits
from tests.prequant.producers import ROWS, converted, dequantized, hf_weight, producer_python
from toolchain.checkpoint.convert import convert
from toolchain.checkpoint.hf import HFCheckpoint
from toolchain.checkpoint.prequant import detect
from toolchain.checkpoint.prequant.codecs import AWQ_ORDER, pack_int32
from toolchain.checkpoint.prequant.gptq import V1_ZERO_FIX
from toolchain.checkpoint.trtllm import read_config
from toolchain.errors import UserError
from toolchain.quantize.methods.base import INPUT_PERM


def gptq_config(**over: Any) -> dict[str, Any]:
    return {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": 16,
        "desc_act": False,
        "sym": False,
        "checkpoint_format": "gptq_v2",
        "pack_dtype": "int32",
        **over,
    }


def write_gptq(path: Path, config: dict[str, Any], zeros_at: int | None = None) -> dict[str, torch.Tensor]:
    """A random Llama with its projections in gptqmodel's layout; returns each projection's weight [out, in] as
    gptqmodel dequantizes it: scales[g_idx] · (q − z[g_idx]), with v1's zeros as its word addition leaves them.
    `zeros_at`: every true zero set to that value (v1 stores it minus one: 0 wraps to 15 and carries)."""
    save_random_llama(path)
    tensors = load_file(str(path / "model.safetensors"))
    rng = np.random.default_rng(11)
    g, v1, act = config["group_size"], config["checkpoint_format"] == "gptq", config["desc_act"]
    orders: dict[tuple[str, int], np.ndarray] = {}
    out: dict[str, torch.Tensor] = {}
    want: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if not (".layers." in name and name.endswith("proj.weight")):
            out[name] = t
            continue
        prefix = name.removesuffix(".weight")
        o, i = t.shape
        q = rng.integers(0, 16, (i, o))  # [in, out]
        z = np.full((i // g, o), zeros_at) if zeros_at is not None else rng.integers(0, 16, (i // g, o))
        s = rng.uniform(0.01, 0.1, (i // g, o)).astype(np.float16)
        shared = prefix.endswith(("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))
        key = (prefix.split(".")[2], i if shared else -len(out))
        g_idx = orders.setdefault(key, rng.permutation(np.arange(i) // g)) if act else np.arange(i) // g
        stored_z = pack_int32((z - 1) & 0xF, 4, 1) if v1 else pack_int32(z, 4, 1)
        out |= {
            f"{prefix}.qweight": torch.from_numpy(pack_int32(q, 4, 0)),
            f"{prefix}.qzeros": torch.from_numpy(stored_z),
            f"{prefix}.scales": torch.from_numpy(s),
            f"{prefix}.g_idx": torch.from_numpy(g_idx.astype(np.int32)),
        }
        if v1:  # what gptqmodel reads back: the int32 word plus 0x11111111, wrapping
            words = (stored_z.view(np.uint32).astype(np.uint64) + V1_ZERO_FIX).astype(np.uint32)
            fields = (words[..., None] >> (np.arange(8, dtype=np.uint32) * 4)) & 0xF
            z = fields.reshape(i // g, o).astype(np.int64)
        w = s.astype(np.float32)[g_idx] * (q - z[g_idx]).astype(np.float32)  # [in, out]
        want[name] = torch.from_numpy(np.ascontiguousarray(w.T))
    save_file(out, str(path / "model.safetensors"))
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = config
    (path / "config.json").write_text(json.dumps(cfg))
    return want


@pytest.mark.parametrize(
    ("fmt", "desc_act", "zeros_at"),
    [
        ("gptq_v2", False, None),
        ("gptq", False, None),
        ("gptq", True, None),
        ("gptq_v2", True, None),
        ("gptq", False, 0),
    ],
)
def test_gptq_reads_as_gptqmodel_dequantizes(tmp_path: Path, fmt: str, desc_act: bool, zeros_at: int | None) -> None:
    want = write_gptq(tmp_path / "hf", gptq_config(checkpoint_format=fmt, desc_act=desc_act), zeros_at)
    convert(tmp_path / "hf", tmp_path / "out")
    cfg = read_config(tmp_path / "out")
    assert (cfg.quantization.quant_algo, cfg.quantization.group_size) == ("W4A16_GPTQ", 16)
    got = dequantized(tmp_path / "out")
    assert len(got) == 2 * 5
    for prefix, w in got.items():
        assert torch.equal(w, hf_weight(want, prefix)), prefix
    raw = load_file(str(tmp_path / "out" / "rank0.safetensors"))
    assert any(n.endswith(INPUT_PERM) for n in raw) == desc_act


@pytest.mark.parametrize("desc_act", [False, True])
def test_dequantize_gives_gptqmodels_float_weights(tmp_path: Path, desc_act: bool) -> None:
    """`convert --dequantize` of a GPTQ checkpoint (two sources a linear: qweight and g_idx) is a float checkpoint
    whose weights are gptqmodel's dequantization, in the model's column order."""
    want = write_gptq(tmp_path / "hf", gptq_config(desc_act=desc_act))
    convert(tmp_path / "hf", tmp_path / "out", dequantize=True)
    assert read_config(tmp_path / "out").quantization.quant_algo is None
    raw = load_file(str(tmp_path / "out" / "rank0.safetensors"))
    for prefix in ("transformer.layers.0.attention.qkv", "transformer.layers.1.mlp.proj"):
        assert torch.equal(raw[f"{prefix}.weight"], hf_weight(want, prefix)), prefix


def test_v1_zero_of_zero_carries_as_gptqmodel_reads_it(tmp_path: Path) -> None:
    """A true zero of 0 is stored as −1 (nibble 15); gptqmodel's word addition turns 0xFFFFFFFF into 0x11111110:
    the first zero reads 0 and the others 1 (the carry), not 0 each. We read what gptqmodel reads."""
    write_gptq(tmp_path / "hf", gptq_config(checkpoint_format="gptq"), zeros_at=0)
    convert(tmp_path / "hf", tmp_path / "out")
    raw = load_file(str(tmp_path / "out" / "rank0.safetensors"))
    zeros = raw["transformer.layers.0.attention.dense.weights_zero_point"]
    assert zeros[0].tolist() == [0] * zeros.shape[1] and zeros[1].tolist() == [1] * zeros.shape[1]


@pytest.mark.parametrize(
    ("over", "words"),
    [
        ({"bits": 8}, ["bits 8", "4-bit"]),
        ({"bits": 3}, ["bits 3"]),
        ({"group_size": -1}, ["group_size -1", "per channel"]),
        ({"checkpoint_format": "marlin"}, ["'marlin'", "gptq, gptq_v2"]),
        ({"pack_dtype": "int16"}, ["pack_dtype 'int16'"]),
    ],
)
def test_unread_gptq_is_refused_by_name(tmp_path: Path, over: dict[str, Any], words: list[str]) -> None:
    save_random_llama(tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg["quantization_config"] = gptq_config(**over)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError) as e:
        detect(HFCheckpoint.open(tmp_path / "hf"))
    for word in ["GPTQ", *words]:
        assert word in str(e.value), str(e.value)


def test_fused_projections_with_different_act_orders_are_refused(tmp_path: Path) -> None:
    write_gptq(tmp_path / "hf", gptq_config(desc_act=True))
    raw = load_file(str(tmp_path / "hf" / "model.safetensors"))
    name = "model.layers.0.self_attn.k_proj.g_idx"
    raw[name] = raw[name].flip(0).contiguous()
    save_file(raw, str(tmp_path / "hf" / "model.safetensors"))
    with pytest.raises(UserError, match=r"k_proj.g_idx differs from .*q_proj.g_idx"):
        convert(tmp_path / "hf", tmp_path / "out")


# --- gptqmodel 7.7 on CPU: the producer's own checkpoints ---


@pytest.fixture(scope="session")
def gptqmodel(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return converted(tmp_path_factory.mktemp("gptqmodel"), "gptqmodel")


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["plain", "desc_act"])
def test_gptqmodel_weights_read_bit_for_bit(gptqmodel: Any, variant: str) -> None:
    made, out = gptqmodel(variant)
    q = json.loads((made.ckpt / "config.json").read_text())["quantization_config"]
    assert (q["desc_act"], q["checkpoint_format"]) == (variant == "desc_act", "gptq")  # v1 as it saves
    got = dequantized(out)
    assert len(got) == 2 * 5
    for prefix, w in got.items():
        assert torch.equal(w, hf_weight(made.dequant, prefix)), prefix


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["plain", "desc_act"])
def test_gptqmodel_engine_agrees_with_the_producer(gptqmodel: Any, variant: str, tmp_path: Path) -> None:
    made, out = gptqmodel(variant)
    for name, rows in ROWS.items():
        a = agreement(made.logits[name], engine_logits(out, tmp_path / f"engine{name}", rows))
        print(f"gptqmodel {variant} rows {len(rows)}x{name}: {a.line()}")
        assert_reads_exactly(a, weight_only=True)


AWQ_CHECK = """
import sys, numpy as np, torch
from gptqmodel.quantization.awq.utils.packing_utils import dequantize_gemm
d = sys.argv[1]
w = dequantize_gemm(*(torch.from_numpy(np.load(f"{d}/{n}.npy")) for n in ("qweight", "qzeros", "scales")), 4, 32)
np.save(f"{d}/dequant.npy", w.float().numpy())
"""


@pytest.mark.slow
def test_awq_gemm_packing_is_what_gptqmodels_awq_reader_unpacks(tmp_path: Path) -> None:
    """codecs.AWQ_ORDER (the AutoAWQ GEMM layout the AWQ reader and its fixture use) against a real AWQ reader:
    gptqmodel's `dequantize_gemm` (quantization/awq/utils/packing_utils.py) of words packed with it gives
    (q − z) · s for the known codes, zeros and scales (float32 scales: every product exact)."""
    python = producer_python("gptqmodel")
    rng = np.random.default_rng(2)
    q, z = rng.integers(0, 16, (64, 96)), rng.integers(0, 16, (2, 96))
    s = rng.uniform(0.01, 0.1, (2, 96)).astype(np.float32)
    np.save(tmp_path / "qweight.npy", pack_int32(q, 4, 1, AWQ_ORDER))
    np.save(tmp_path / "qzeros.npy", pack_int32(z, 4, 1, AWQ_ORDER))
    np.save(tmp_path / "scales.npy", s)
    run = [str(python), "-c", AWQ_CHECK, str(tmp_path)]
    done = subprocess.run(run, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    want = (q - np.repeat(z, 32, axis=0)).astype(np.float32) * np.repeat(s, 32, axis=0)
    assert np.array_equal(np.load(tmp_path / "dequant.npy"), want)
