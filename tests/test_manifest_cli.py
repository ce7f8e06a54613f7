"""Manifest contents, verify and inspect, the CLI's contract (version, help, exit codes), the demo model."""

from __future__ import annotations

import hashlib
import json
from concurrent.futures import CancelledError
from pathlib import Path
from typing import Any

import pytest
import torch
import triton
from conftest import one_line_error

from toolchain.checkpoint.safetensors_io import SafetensorsWriter, TensorInfo, read_header
from toolchain.manifest import Cancelled, StageRecord
from toolchain.reference.model import ReferenceModel


@pytest.fixture
def converted(cli: Any, make_llama: Any, tmp_path: Path) -> Path:
    result = cli("convert", make_llama(), "-o", tmp_path / "ckpt")
    assert result.exit_code == 0, result.stderr
    return tmp_path / "ckpt"


def test_manifest_records_inputs_outputs_and_environment(converted: Path) -> None:
    m = json.loads((converted / "manifest.json").read_text())
    assert m["schema_version"] == 1 and m["stage"] == "convert"
    assert m["toolchain"]["version"] and "git_commit" in m["toolchain"]
    assert m["host"]["python"] and m["host"]["os"] and m["host"]["cpu"]
    assert m["packages"]["torch"] == torch.__version__
    for pkg in ("transformers", "safetensors", "onnx", "onnxruntime", "tensorrt"):
        assert pkg in m["packages"]
    assert m["packages"]["triton"] == triton.__version__  # the plugin kernels' compiler, pinned
    assert set(m["gpu"]) == {"name", "sm", "driver_version", "cuda_version"}
    assert m["wall_time_s"] > 0 and m["peak_rss_bytes"] > 10 * 2**20
    assert {e["path"] for e in m["outputs"]} == {"config.json", "rank0.safetensors", "generation_config.json"}
    for entry in m["outputs"]:
        data = (converted / entry["path"]).read_bytes()
        assert entry["size"] == len(data) and entry["sha256"] == hashlib.sha256(data).hexdigest()
    inputs = {e["path"]: e for e in m["inputs"]}
    assert set(inputs) == {"config.json", "model.safetensors", "generation_config.json"}
    src = Path(inputs["model.safetensors"]["root"]) / "model.safetensors"
    assert inputs["model.safetensors"]["sha256"] == hashlib.sha256(src.read_bytes()).hexdigest()


def test_verify_names_every_mismatch(cli: Any, converted: Path) -> None:
    assert cli("verify", converted).exit_code == 0
    rank = converted / "rank0.safetensors"
    data = bytearray(rank.read_bytes())
    data[-1] ^= 0xFF
    rank.write_bytes(bytes(data))
    (converted / "config.json").unlink()
    (converted / "extra.bin").write_bytes(b"x")
    result = cli("verify", converted)
    assert result.exit_code == 1
    assert "changed: rank0.safetensors" in result.stderr
    assert "missing: config.json" in result.stderr
    assert "unlisted: extra.bin" in result.stderr


def test_verify_inputs(cli: Any, converted: Path) -> None:
    assert cli("verify", converted, "--inputs").exit_code == 0
    m = json.loads((converted / "manifest.json").read_text())
    source = Path(m["inputs"][0]["root"]) / "config.json"
    source.write_text(source.read_text() + " ")
    result = cli("verify", converted, "--inputs")
    assert result.exit_code == 1 and "input changed" in result.stderr and "config.json" in result.stderr


def test_inspect_reports_checkpoint_and_manifest(cli: Any, converted: Path) -> None:
    info = json.loads(cli("inspect", converted, "--json").stdout)
    assert info["kind"] == "checkpoint" and info["architecture"] == "LlamaForCausalLM"
    assert info["mapping"] == {
        "world_size": 1,
        "tp_size": 1,
        "pp_size": 1,
        "cp_size": 1,
        "moe_tp_size": 1,
        "moe_ep_size": 1,
    }
    assert info["quantization"]["quant_algo"] is None
    assert info["manifest"]["stage"] == "convert" and info["manifest"]["outputs"] == 3
    text = cli("inspect", converted).stdout
    assert "LlamaForCausalLM" in text and "rank0.safetensors" in text


def test_inspect_and_verify_on_non_artifacts(cli: Any, tmp_path: Path) -> None:
    assert cli("inspect", tmp_path / "nope").exit_code == 1
    assert cli("verify", tmp_path).exit_code == 1


def test_version_help_and_usage_errors(cli: Any) -> None:
    from toolchain import __version__

    assert cli("--version").stdout.strip() == f"trtbuild {__version__}"
    for command in (["convert"], ["inspect"], ["verify"], ["run"], ["recipe", "schema"], ["tiny-model"]):
        result = cli(*command, "--help")
        assert result.exit_code == 0 and "Example" in result.stdout, command
    assert cli("convert", "somewhere").exit_code == 2  # missing -o
    assert cli("convert", "x", "-o", "y", "--dtype", "float64").exit_code == 2


def test_debug_env_shows_traceback(cli: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from toolchain.errors import UserError

    monkeypatch.setenv("TRTBUILD_DEBUG", "1")
    result = cli("convert", tmp_path / "nope", "-o", tmp_path / "o")
    assert isinstance(result.exception, UserError)


def test_tiny_model_is_deterministic_and_converts(cli: Any, tmp_path: Path) -> None:
    for name in ("a", "b"):
        assert cli("tiny-model", tmp_path / name, "--seed", "3").exit_code == 0
    a, b = (tmp_path / n / "model.safetensors" for n in ("a", "b"))
    assert a.read_bytes() == b.read_bytes()
    assert 1 << 20 < a.stat().st_size < 16 << 20  # "a few MB"
    assert cli("convert", tmp_path / "a", "-o", tmp_path / "ck").exit_code == 0
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp_path / "ck")
    ids = tok("Hello, wörld")["input_ids"]
    assert tok.decode(ids, skip_special_tokens=True) == "Hello, wörld"
    logits = ReferenceModel.from_checkpoint(tmp_path / "ck").forward(torch.tensor(ids))
    assert logits.shape == (1, len(ids), 320) and torch.isfinite(logits).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.int8])
def test_streaming_writer_round_trips_through_safetensors(dtype: torch.dtype, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    tensors = {
        "b.scalar": torch.randn(()).to(dtype),
        "a.matrix": torch.randn(5, 3).to(dtype),
        "c.empty": torch.zeros(0, 4).to(dtype),
    }
    infos = [TensorInfo(n, t.dtype, tuple(t.shape)) for n, t in sorted(tensors.items())]
    with SafetensorsWriter(tmp_path / "x.safetensors", infos, {"format": "pt"}) as w:
        for name, t in sorted(tensors.items()):
            w.write(name, t)
    loaded = load_file(str(tmp_path / "x.safetensors"))
    for name, t in tensors.items():
        assert loaded[name].dtype == dtype and torch.equal(
            loaded[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)
        )
    assert set(read_header(tmp_path / "x.safetensors")[0]) == set(tensors)


def test_cancel_stops_background_hashing(tmp_path: Path) -> None:
    big = tmp_path / "big.bin"
    with big.open("wb") as f:  # sparse: takes no disk, seconds to hash
        f.truncate(8 << 30)
    record = StageRecord("test")
    record.add_inputs(tmp_path, [big, big.with_name("other.bin")])
    record.cancel()
    for future in record._pending:
        with pytest.raises((Cancelled, CancelledError, FileNotFoundError)):
            future.result(timeout=30)


@pytest.mark.parametrize(
    "manifest",
    ["[1]", '{"schema_version": 1}', '{"schema_version": 1, "inputs": [], "outputs": [{"path": 3}]}', "\udcff"],
)
def test_verify_and_inspect_on_damaged_manifests(manifest: str, cli: Any, tmp_path: Path) -> None:
    (tmp_path / "manifest.json").write_bytes(manifest.encode("utf-8", "surrogateescape"))
    assert "manifest" in one_line_error(cli("verify", tmp_path))
    assert "manifest" in one_line_error(cli("inspect", tmp_path))


def test_verify_does_not_follow_paths_out_of_the_artifact(cli: Any, make_llama: Any, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert cli("convert", make_llama(), "-o", out).exit_code == 0
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["outputs"].append({"path": "../../etc/hostname", "size": 1, "sha256": "0"})
    manifest["gpu"] = None
    (out / "manifest.json").write_text(json.dumps(manifest))
    result = cli("verify", out)
    assert result.exit_code == 1 and "outside the artifact: ../../etc/hostname" in result.stderr
    assert cli("inspect", out).exit_code == 0


def test_damaged_checkpoint_config(cli: Any, make_llama: Any, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert cli("convert", make_llama(), "-o", out).exit_code == 0
    config = json.loads((out / "config.json").read_text())
    config["num_key_value_heads"] = 0
    (out / "config.json").write_text(json.dumps(config))
    assert "num_key_value_heads" in one_line_error(cli("inspect", out))


def test_inspect_a_hugging_face_dir(cli: Any, tmp_path: Path) -> None:
    assert cli("tiny-model", tmp_path / "hf").exit_code == 0
    info = json.loads(cli("inspect", tmp_path / "hf", "--json").stdout)
    assert info["kind"] == "hf-model" and info["architectures"] == ["LlamaForCausalLM"]
