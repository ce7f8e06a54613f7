"""ModelOpt's unified HF export (export_hf_checkpoint) read by `convert`: ModelOpt 0.47 quantizes stories260K on the
CPU (FP8 with and without an FP8 KV cache, INT4 AWQ, W4A8 AWQ, NVFP4; tests/prequant/modelopt_hf_worker.py), and

- our reader's tensors, through each method's `dequantize`, equal ModelOpt's own dequantization of the export in
  float32 (the worker's), linear by linear;
- the engine built from the converted checkpoint agrees with the export dequantized by ModelOpt in a float32
  transformers model (issue 28's gate, tests/prequant/harness.py); the fake-quant model's KLD is reported beside it,
  not gated: 0.47's export is not its fake-quant model (AWQ's pre_quant_scale folded into the norms);
- fused q/k/v keep their per-projection scales (0.47's FP8 export gives q, k and v different weight scales), the
  KV cache scales merge as TensorRT-LLM merges them, the manifest names the producer.

Slow (ModelOpt calibrates and exports on the CPU: seconds per format); skipped, saying so, where no python has
ModelOpt.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import WIKI
from safetensors.torch import load_file

from tests.prequant.harness import SHORT_ROW, agreement, assert_reads_exactly, engine_logits, token_rows
from tests.quantize.test_modelopt_interop import PEER_VENV, modelopt_python
from toolchain.checkpoint.convert import convert
from toolchain.quantize.methods.base import PARTS, Stored
from toolchain.quantize.methods.registry import by_algo

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent
WORKER = HERE / "modelopt_hf_worker.py"
ALGOS = ("fp8", "fp8_kv", "int4_awq", "w4a8_awq", "nvfp4")
QUANT_ALGO = {"fp8": "FP8", "fp8_kv": "FP8", "int4_awq": "W4A16_AWQ", "w4a8_awq": "W4A8_AWQ", "nvfp4": "NVFP4"}
# activations quantized at run time: judged on short rows (harness.SHORT_ROW), weight-only formats on longer ones
ROWS = {algo: (16, SHORT_ROW) if algo != "int4_awq" else (4, 32) for algo in ALGOS}
# the linears ModelOpt quantized, HF prefixes per our fused linear (stories260K: 5 layers, down_proj excluded)
FUSED = {
    "attention.qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "attention.dense": ("self_attn.o_proj",),
    "mlp.fc": ("mlp.gate_proj",),
    "mlp.gate": ("mlp.up_proj",),
}


@pytest.fixture(scope="module")
def python() -> str:
    found = modelopt_python()
    if found is None:
        pytest.skip(
            "nvidia-modelopt not importable (pip install -e .[peers], or a venv at "
            f"{PEER_VENV.parent.parent}, or TRTBUILD_MODELOPT_PYTHON)"
        )
    return found


def _run(python: str, *args: Any) -> None:
    done = subprocess.run([python, str(WORKER), *map(str, args)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="module")
def exported(python: str, stories: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Path]]:
    """Per format: ModelOpt's export, our conversion of it, the rows, ModelOpt's reference and fake-quant logits and
    its dequantized weights."""
    root = tmp_path_factory.mktemp("modelopt_hf")
    out: dict[str, dict[str, Path]] = {}
    for algo in ALGOS:
        (root / algo).mkdir()
        n, length = ROWS[algo]
        (root / algo / "rows.json").write_text(json.dumps(token_rows(512, n, length, seed=1)))
    _run(python, stories, root, WIKI / "valid.txt", *ALGOS)
    for algo in ALGOS:
        d = root / algo
        convert(d / "export", d / "ckpt")
        out[algo] = {k: d / k for k in ("export", "ckpt", "rows.json", "fake.npy", "ref.npy", "weights.safetensors")}
    return out


def _stored(ckpt: Path, prefix: str, tensors: dict[str, torch.Tensor]) -> Stored:
    config = json.loads((ckpt / "config.json").read_text())
    in_features = config["hidden_size"]  # every quantized linear of stories260K reads the hidden width
    own = {n: t for n, t in tensors.items() if n.startswith(f"{prefix}.")}
    return Stored(prefix, own, in_features, config["quantization"]["group_size"])


@pytest.mark.parametrize("algo", ALGOS)
def test_reader_equals_modelopts_dequantization(algo: str, exported: dict[str, dict[str, Path]]) -> None:
    e = exported[algo]
    ours = load_file(str(e["ckpt"] / "rank0.safetensors"))
    theirs = load_file(str(e["weights.safetensors"]))
    method = by_algo(QUANT_ALGO[algo])
    config = json.loads((e["ckpt"] / "config.json").read_text())
    assert config["quantization"]["quant_algo"] == QUANT_ALGO[algo]
    checked = 0
    for layer in range(config["num_hidden_layers"]):
        for ours_name, hf_names in FUSED.items():
            prefix = f"transformer.layers.{layer}.{ours_name}"
            s = _stored(e["ckpt"], prefix, ours)
            got = method.dequantize(s)
            want = torch.cat([theirs[f"model.layers.{layer}.{h}"] for h in hf_names])
            # FP8 and int4: one float32 product, as ModelOpt's; NVFP4: ModelOpt multiplies the block scale by the
            # global first, nvfp4.dequantize the value by the block scale first (exact: ≤ 2 + 4 significant bits),
            # so the two differ by at most one rounding of float32: a relative 2^-23
            rtol = 2.0**-23 if algo == "nvfp4" else 0.0
            assert torch.allclose(got, want, rtol=rtol, atol=0.0), f"{prefix}: {(got - want).abs().max()}"
            checked += 1
    assert checked == 4 * config["num_hidden_layers"]


def test_fused_qkv_keeps_per_projection_scales(exported: dict[str, dict[str, Path]]) -> None:
    """0.47's FP8 export does not unify q/k/v weight scales: our qkv carries all three and its parts (D4)."""
    e = exported["fp8"]
    theirs = load_file(str(e["export"] / "model.safetensors"))
    ours = load_file(str(e["ckpt"] / "rank0.safetensors"))
    for layer in range(5):
        hf = [theirs[f"model.layers.{layer}.self_attn.{p}_proj.weight_scale"].item() for p in "qkv"]
        assert len(set(hf)) > 1, "the export's q/k/v scales coincide: this test would prove nothing"
        prefix = f"transformer.layers.{layer}.attention.qkv"
        assert ours[f"{prefix}.weights_scaling_factor"].tolist() == hf
        assert ours[f"{prefix}.{PARTS}"].tolist() == [64, 32, 32]
        acts = [theirs[f"model.layers.{layer}.self_attn.{p}_proj.input_scale"].item() for p in "qkv"]
        assert ours[f"{prefix}.activation_scaling_factor"].tolist() == acts
    # NVFP4's export unifies weight_scale_2 over q/k/v (preprocess_linear_fusion): then one scale, no parts
    nv = load_file(str(exported["nvfp4"]["ckpt"] / "rank0.safetensors"))
    assert f"transformer.layers.0.attention.qkv.{PARTS}" not in nv
    assert nv["transformer.layers.0.attention.qkv.weights_scaling_factor_2"].shape == (1,)


def test_kv_scales_merge_as_tensorrt_llm_does(exported: dict[str, dict[str, Path]]) -> None:
    e = exported["fp8_kv"]
    theirs = load_file(str(e["export"] / "model.safetensors"))
    ours = load_file(str(e["ckpt"] / "rank0.safetensors"))
    differ = 0
    for layer in range(5):
        k = theirs[f"model.layers.{layer}.self_attn.k_proj.k_scale"].item()
        v = theirs[f"model.layers.{layer}.self_attn.v_proj.v_scale"].item()
        differ += k != v
        assert ours[f"transformer.layers.{layer}.attention.kv_cache_scaling_factor"].tolist() == [max(k, v)]
    assert differ, "k_scale == v_scale in every layer: the max would not be tested"
    config = json.loads((e["ckpt"] / "config.json").read_text())
    assert config["quantization"]["kv_cache_quant_algo"] == "FP8"


@pytest.mark.parametrize("algo", ALGOS)
def test_manifest_names_the_producer(algo: str, exported: dict[str, dict[str, Path]]) -> None:
    manifest = json.loads((exported[algo]["ckpt"] / "manifest.json").read_text())
    source = manifest["details"]["quantization_source"]
    assert source["format"] == "modelopt" and source["producer"] == "modelopt"
    assert source["version"] == "0.47.0" and source["quant_algo"] == QUANT_ALGO[algo]


# every format but the FP8 KV cache one: the reference quantizes no KV cache (the KV scales' reading is tested above)
ENGINE_ALGOS = ("fp8", "int4_awq", "w4a8_awq", "nvfp4")


@pytest.mark.parametrize("algo", ENGINE_ALGOS)
def test_engine_agrees_with_modelopts_dequantized_export(
    algo: str, exported: dict[str, dict[str, Path]], tmp_path: Path
) -> None:
    e = exported[algo]
    rows = json.loads(e["rows.json"].read_text())
    ours = engine_logits(e["ckpt"], tmp_path / "engine", rows)
    gate = agreement(np.load(e["ref.npy"]), ours)
    n, length = ROWS[algo]
    print(f"\n{algo} ({n} rows x {length} tokens): vs ModelOpt's dequantized export: {gate.line()}")
    if e["fake.npy"].exists():  # not gated: the export is not ModelOpt's fake-quant model
        print(f"{algo}: vs ModelOpt's fake-quant model (reported): {agreement(np.load(e['fake.npy']), ours).line()}")
    else:
        print(f"{algo}: ModelOpt's NVFP4 fake-quant forward needs CUDA (tensor_quant.py asserts it): not compared")
    assert_reads_exactly(gate, weight_only=QUANT_ALGO[algo] == "W4A16_AWQ")


def test_dequantized_int4_awq_engine_agrees_too(exported: dict[str, dict[str, Path]], tmp_path: Path) -> None:
    """`convert --dequantize` of the INT4 AWQ export: float weights with o_proj's pre_quant_scale folded into their
    columns; a float engine of them agrees with ModelOpt's dequantized export as the quantized one does."""
    e = exported["int4_awq"]
    convert(e["export"], tmp_path / "float", dequantize=True)
    assert json.loads((tmp_path / "float" / "config.json").read_text())["quantization"]["quant_algo"] is None
    rows = json.loads(e["rows.json"].read_text())
    gate = agreement(np.load(e["ref.npy"]), engine_logits(tmp_path / "float", tmp_path / "engine", rows))
    print(f"\nint4_awq --dequantize: vs ModelOpt's dequantized export: {gate.line()}")
    assert_reads_exactly(gate, weight_only=True)


@pytest.mark.parametrize("algo", ["fp8_kv", "int4_awq", "nvfp4"])
def test_config_json_alone_reads_the_same(algo: str, exported: dict[str, dict[str, Path]], tmp_path: Path) -> None:
    """Without hf_quant_config.json, config.json's quantization_config (convert_hf_quant_config_format's form:
    quant_algo, config_groups, ignore, kv_cache_scheme) gives the same checkpoint."""
    import shutil

    e = exported[algo]
    alone = tmp_path / "alone"
    shutil.copytree(e["export"], alone)
    (alone / "hf_quant_config.json").unlink()
    assert json.loads((alone / "config.json").read_text())["quantization_config"]["quant_method"] == "modelopt"
    convert(alone, tmp_path / "ckpt")
    for name in ("rank0.safetensors", "config.json"):
        assert (tmp_path / "ckpt" / name).read_bytes() == (e["ckpt"] / name).read_bytes(), name
