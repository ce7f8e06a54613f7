"""TensorRT-LLM checkpoints written by NVIDIA ModelOpt as input to `trtbuild build` and `eval`.

The layout rules run without ModelOpt (a checkpoint of ours rewritten the way ModelOpt writes it); the end-to-end
test runs tests/quantize/modelopt_export.py with a python that has ModelOpt (TRTBUILD_MODELOPT_PYTHON, else the venv
`~/.cache/trtbuild-peers/venvs/modelopt`, else this interpreter, which `make setup` gives ModelOpt) and skips, saying
so, where none has it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import WIKI
from safetensors.torch import load_file, save_file

from toolchain.checkpoint.tiny import make_tiny_llama
from toolchain.checkpoint.trtllm import kv_cache_scale
from toolchain.errors import UserError

pytestmark = pytest.mark.slow  # ModelOpt quantizes and exports on the CPU: seconds per case

HERE = Path(__file__).parent
PEER_VENV = Path.home() / ".cache" / "trtbuild-peers" / "venvs" / "modelopt" / "bin" / "python"


def modelopt_python() -> str | None:
    candidates = [os.environ.get("TRTBUILD_MODELOPT_PYTHON"), str(PEER_VENV), sys.executable]
    for python in candidates:
        if python and Path(python).is_file():
            probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('modelopt') is None)"
            if subprocess.run([python, "-c", probe], capture_output=True).returncode == 0:
                return python
    return None


# -- layout rules, no ModelOpt needed ------------------------------------------------------------------------------


def test_kv_scales_merge_as_tensorrt_llm_does() -> None:
    layer = "transformer.layers.0"
    w = {f"{layer}.attention.k_cache_scaling_factor": torch.tensor([2.0])}
    with pytest.raises(UserError, match="v_cache_scaling_factor"):
        kv_cache_scale(w, layer)
    w[f"{layer}.attention.v_cache_scaling_factor"] = torch.tensor([0.5])
    assert kv_cache_scale(w, layer) == 2.0  # max(k, v): modeling_utils.preprocess_weights
    w[f"{layer}.attention.kv_cache_scaling_factor"] = torch.tensor([2.0])
    assert kv_cache_scale(w, layer) == 2.0
    w[f"{layer}.attention.kv_cache_scaling_factor"] = torch.tensor([1.0])
    with pytest.raises(UserError, match="disagree"):
        kv_cache_scale(w, layer)
    with pytest.raises(UserError, match="kv_cache_scaling_factor missing"):
        kv_cache_scale({}, layer)
    with pytest.raises(UserError, match="positive"):
        kv_cache_scale({f"{layer}.attention.kv_cache_scaling_factor": torch.tensor([0.0])}, layer)


@pytest.fixture(scope="module")
def fp8_kv_ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny fp8 + fp8-KV checkpoint of ours, with its tokenizer removed (as ModelOpt exports it)."""
    from toolchain.checkpoint.convert import convert
    from toolchain.quantize.stage import QuantizeOptions, quantize_checkpoint

    root = tmp_path_factory.mktemp("mo")
    make_tiny_llama(root / "hf", seed=0)
    convert(root / "hf", root / "ckpt")
    opts = QuantizeOptions("fp8", kv_cache="fp8", calib_data=WIKI / "valid.txt", calib_samples=2, calib_seq_len=64)
    quantize_checkpoint(root / "ckpt", root / "fp8", opts)
    for path in (root / "fp8").iterdir():
        if path.name not in ("config.json", "rank0.safetensors"):
            path.unlink()
    return root / "hf", root / "fp8"


def _rewrite(src: Path, dst: Path, change: dict[str, Any], config: dict[str, Any] | None = None) -> Path:
    dst.mkdir()
    w = load_file(str(src / "rank0.safetensors"))
    for name, value in change.items():
        if value is None:
            del w[name]
        else:
            w[name] = value
    save_file(w, str(dst / "rank0.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **(config or {})}))
    return dst


def _layers(ckpt: Path) -> int:
    return int(json.loads((ckpt / "config.json").read_text())["num_hidden_layers"])


def test_separate_kv_scales_build_the_same_engine(fp8_kv_ckpt: tuple[Path, Path], tmp_path: Path, cli: Any) -> None:
    hf, ckpt = fp8_kv_ckpt
    change: dict[str, Any] = {}
    for i in range(_layers(ckpt)):
        kv = load_file(str(ckpt / "rank0.safetensors"))[f"transformer.layers.{i}.attention.kv_cache_scaling_factor"]
        change[f"transformer.layers.{i}.attention.k_cache_scaling_factor"] = kv.clone()
        change[f"transformer.layers.{i}.attention.v_cache_scaling_factor"] = kv / 2  # max(k, v) = kv
    split = _rewrite(ckpt, tmp_path / "split", change)
    for name, src in (("ours", ckpt), ("split", split)):
        r = cli("build", src, "-o", tmp_path / f"eng-{name}", "--backend", "onnxruntime", "--max-seq-len", 64,
                "--tokenizer", hf)  # fmt: skip
        assert r.exit_code == 0, r.output
    ours, theirs = ((tmp_path / f"eng-{n}" / "model.onnx").read_bytes() for n in ("ours", "split"))
    assert ours == theirs  # same scales read, same graph
    assert (tmp_path / "eng-split" / "tokenizer.json").read_bytes() == (hf / "tokenizer.json").read_bytes()
    manifest = json.loads((tmp_path / "eng-split" / "manifest.json").read_text())
    assert any(e["path"] == "tokenizer.json" and e["root"] == str(hf.absolute()) for e in manifest["inputs"])


def test_unknown_tensor_refused_naming_it(fp8_kv_ckpt: tuple[Path, Path], tmp_path: Path, cli: Any) -> None:
    _, ckpt = fp8_kv_ckpt
    odd = _rewrite(ckpt, tmp_path / "odd", {"transformer.layers.1.attention.dense.output_scale": torch.ones(1)})
    r = cli("build", odd, "-o", tmp_path / "eng", "--backend", "onnxruntime")
    assert r.exit_code == 1
    assert "transformer.layers.1.attention.dense.output_scale not used" in r.output
    assert not (tmp_path / "eng").exists()
    # KV scales in a checkpoint whose KV cache is not quantized: a config that does not match its tensors
    plain = _rewrite(ckpt, tmp_path / "plain", {}, {"quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": None}})
    r = cli("build", plain, "-o", tmp_path / "eng", "--backend", "onnxruntime")
    assert r.exit_code == 1 and "attention.kv_cache_scaling_factor" in r.output


def test_model_changing_config_field_refused(fp8_kv_ckpt: tuple[Path, Path], tmp_path: Path, cli: Any) -> None:
    _, ckpt = fp8_kv_ckpt
    partial = _rewrite(ckpt, tmp_path / "partial", {}, {"rotary_pct": 0.5})
    r = cli("build", partial, "-o", tmp_path / "eng", "--backend", "onnxruntime")
    assert r.exit_code == 1 and "rotary_pct 0.5 is not supported" in r.output


def test_no_tokenizer_named_with_the_fix(fp8_kv_ckpt: tuple[Path, Path], tmp_path: Path, cli: Any) -> None:
    hf, ckpt = fp8_kv_ckpt
    r = cli("build", ckpt, "-o", tmp_path / "eng", "--backend", "onnxruntime", "--max-seq-len", 64)
    assert r.exit_code == 0 and "add --tokenizer HF_MODEL_DIR" in r.output
    r = cli("eval", tmp_path / "eng", "--reference", hf, "--data", WIKI / "test.txt")
    assert r.exit_code == 1 and "rebuild it with `trtbuild build CKPT -o ENGINE --tokenizer HF_MODEL_DIR`" in r.output
    r = cli("build", ckpt, "-o", tmp_path / "eng2", "--backend", "onnxruntime", "--tokenizer", tmp_path)
    assert r.exit_code == 1 and f"--tokenizer {tmp_path}: no tokenizer.json" in r.output
    assert not (tmp_path / "eng2").exists()


# -- end to end with ModelOpt ----------------------------------------------------------------------------------------

# mean KLD against the float model the method gives on stories260K (ModelOpt's own fake-quant, and trtbuild's
# reading of its export, on 29,835 tokens of wiki.test.raw: docs/conversion.md): fp8 with an fp8 KV cache 0.10;
# SmoothQuant α 0.5 0.014; int4 AWQ G32 with mlp.proj in float 0.20. The bands allow for the shorter text here.
EXPECTED_KLD = {"fp8-fp8kv": (0.04, 0.2), "w8a8_sq": (0.004, 0.04), "int4_awq": (0.08, 0.4)}


@pytest.fixture(scope="module")
def modelopt_exports(stories: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    python = modelopt_python()
    if python is None:
        pytest.skip(
            "nvidia-modelopt not importable (pip install -e .[peers], or a venv at "
            f"{PEER_VENV.parent.parent}, or TRTBUILD_MODELOPT_PYTHON); see tests/quantize/modelopt_export.py"
        )
    out = tmp_path_factory.mktemp("modelopt") / "exports"
    cmd = [python, str(HERE / "modelopt_export.py"), str(stories), "-o", str(out)]
    cmd += ["--method", "fp8:fp8", "--method", "w8a8_sq", "--method", "int4_awq", "--group-size", "32"]
    cmd += ["--awq-exclude", "*mlp.down_proj*", "--calib-data", str(WIKI / "valid.txt")]
    cmd += ["--calib-samples", "8", "--calib-seq-len", "256"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("method", list(EXPECTED_KLD))
def test_modelopt_checkpoint_builds_and_scores(
    method: str, modelopt_exports: Path, stories: Path, tmp_path: Path, cli: Any
) -> None:
    ckpt = modelopt_exports / method
    config = json.loads((ckpt / "config.json").read_text())
    assert config["producer"]["name"] == "modelopt" and not (ckpt / "tokenizer.json").exists()
    if method == "fp8-fp8kv":  # the layout differences this reads: separate K/V scales, one fc/gate weight scale
        w = load_file(str(ckpt / "rank0.safetensors"))
        assert "transformer.layers.0.attention.k_cache_scaling_factor" in w
        assert torch.equal(w["transformer.layers.0.mlp.fc.weights_scaling_factor"],
                           w["transformer.layers.0.mlp.gate.weights_scaling_factor"])  # fmt: skip
    if method == "w8a8_sq":  # a prequant_scaling_factor on every linear, not only where we write one
        w = load_file(str(ckpt / "rank0.safetensors"))
        assert "transformer.layers.0.attention.qkv.prequant_scaling_factor" in w
    engine = tmp_path / "engine"
    r = cli("build", ckpt, "-o", engine, "--backend", "onnxruntime", "--max-seq-len", 256, "--tokenizer", stories)
    assert r.exit_code == 0, r.output
    r = cli("eval", engine, "--reference", stories, "--data", WIKI / "test.txt", "--max-tokens", 2048, "--json")
    assert r.exit_code == 0, r.output
    kld = json.loads(r.stdout)["quality"]["kld_mean"]
    low, high = EXPECTED_KLD[method]
    assert low < kld < high, f"{method}: mean KLD {kld:.4f} outside [{low}, {high}]"
