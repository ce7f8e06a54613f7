"""Regression tests for inputs a reviewer used to break the tool: each gets one clear line, never a traceback."""

from __future__ import annotations

import json
import struct
from concurrent.futures import CancelledError
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import convert_fails, edit_config, edit_weights, nothing_written, one_line_error
from safetensors.torch import load_file

from toolchain.manifest import Cancelled, StageRecord


def test_hugging_face_cache_symlinks_convert(cli: Any, make_llama: Any, tmp_path: Path) -> None:
    """A hub cache snapshot is a folder of symlinks into blobs/: inputs are recorded under their names."""
    hf = make_llama()
    blobs, snap = tmp_path / "hub" / "blobs", tmp_path / "hub" / "snapshots" / "abc"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in hf.iterdir():
        (blobs / f"blob-{f.name}").write_bytes(f.read_bytes())
        (snap / f.name).symlink_to(Path("../../blobs") / f"blob-{f.name}")
    result = cli("convert", snap, "-o", tmp_path / "out", "--json")
    assert result.exit_code == 0, result.stderr
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert {e["path"] for e in manifest["inputs"]} >= {"config.json", "model.safetensors"}
    assert cli("verify", tmp_path / "out", "--inputs").exit_code == 0


def test_index_pointing_outside_the_model_dir(cli: Any, make_llama: Any, tmp_path: Path) -> None:
    hf = make_llama()
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "../x.safetensors"}}))
    assert "must sit beside the index" in convert_fails(cli, hf, tmp_path / "out")


def test_force_refuses_a_folder_with_a_foreign_manifest(cli: Any, make_llama: Any, tmp_path: Path) -> None:
    webapp = tmp_path / "webapp"
    webapp.mkdir()
    (webapp / "manifest.json").write_text('{"name": "app"}')
    (webapp / "index.html").write_text("<html>")
    line = one_line_error(cli("convert", make_llama(), "-o", webapp, "--force"))
    assert "not a trtbuild artifact" in line
    assert (webapp / "index.html").read_text() == "<html>"


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
    ("changes", "expected"),
    [
        ({"num_key_value_heads": "two"}, "'num_key_value_heads' must be a positive integer"),
        ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads 3"),
        ({"num_key_value_heads": 2.7}, "'num_key_value_heads' must be a positive integer"),
        ({"head_dim": "x"}, "'head_dim' must be a positive integer"),
        ({"head_dim": 16.9}, "'head_dim' must be a positive integer"),
        ({"rms_norm_eps": float("nan")}, "'rms_norm_eps' must be a finite positive number"),
        ({"rms_norm_eps": "abc"}, "'rms_norm_eps' must be a finite positive number"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": -1}}, "'rope_theta' must be a finite positive"),
        ({"rope_parameters": "linear"}, "'rope_parameters' must be an object"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 0}}, "'factor' must be a finite positive number"),
        ({"rope_parameters": {"rope_type": "linear", "factor": "x"}}, "'factor' must be a finite positive number"),
        ({"tie_word_embeddings": "yes"}, "'tie_word_embeddings' must be true or false"),
        ({"hidden_size": "128"}, "'hidden_size' must be a positive integer"),
        ({"num_hidden_layers": 10**9}, "num_hidden_layers 1000000000 but the checkpoint holds only"),
    ],
)
def test_bad_config_values(changes: dict[str, Any], expected: str, cli: Any, make_llama: Any, tmp_path: Path) -> None:
    hf = make_llama()
    edit_config(hf, **changes)
    line = convert_fails(cli, hf, tmp_path / "out")
    assert expected in line and "config.json" in line


def test_non_utf8_config(cli: Any, make_llama: Any, tmp_path: Path) -> None:
    hf = make_llama()
    (hf / "config.json").write_bytes(b"\xff\xfe{}")
    assert "not UTF-8" in convert_fails(cli, hf, tmp_path / "out")


def test_overlapping_offsets_are_refused(cli: Any, make_llama: Any, tmp_path: Path) -> None:
    hf = make_llama()
    path = hf / "model.safetensors"
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header["lm_head.weight"]["data_offsets"] = header["model.embed_tokens.weight"]["data_offsets"]
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + raw[8 + n :])
    assert "invalid offsets" in convert_fails(cli, hf, tmp_path / "out")


def test_metadata_that_is_not_an_object(cli: Any, make_llama: Any, tmp_path: Path) -> None:
    hf = make_llama()
    blob = json.dumps({"__metadata__": "oops"}).encode()
    (hf / "model.safetensors").write_bytes(struct.pack("<Q", len(blob)) + blob)
    assert "'__metadata__' must be a JSON object" in convert_fails(cli, hf, tmp_path / "out")


def test_pickles_in_a_training_dir(cli: Any, make_llama: Any, tmp_path: Path) -> None:
    hf = make_llama()
    tensors = load_file(str(hf / "model.safetensors"))
    (hf / "model.safetensors").unlink()
    first = dict(list(tensors.items())[:5])
    torch.save(first, hf / "pytorch_model-00001-of-00002.bin")
    torch.save(tensors, hf / "pytorch_model-00002-of-00002.bin")
    torch.save({"lr": 0.1}, hf / "training_args.bin")  # not a weights file: ignored
    assert "also in" in convert_fails(cli, hf, tmp_path / "out", "--allow-pickle")
    (hf / "pytorch_model-00001-of-00002.bin").unlink()
    torch.save({"state_dict": tensors}, hf / "pytorch_model-00002-of-00002.bin")
    assert "not a flat state dict" in convert_fails(cli, hf, tmp_path / "out", "--allow-pickle")


def test_output_under_a_file_and_parents_cleaned(cli: Any, make_llama: Any, tmp_path: Path) -> None:
    hf = make_llama()
    (tmp_path / "afile").write_text("x")
    line = one_line_error(cli("convert", hf, "-o", tmp_path / "afile" / "out"))
    assert "cannot create output dir" in line
    edit_weights(hf, lambda t: t["model.norm.weight"].fill_(float("nan")))
    assert "NaN/Inf" in one_line_error(cli("convert", hf, "-o", tmp_path / "deep" / "a" / "b" / "out"))
    assert not (tmp_path / "deep").exists()


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


def test_recipe_edge_cases(cli: Any, make_llama: Any, tmp_path: Path) -> None:
    hf = make_llama()
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model:\n  path: {hf}\n")
    assert "--set model.nope.deep" in one_line_error(
        cli("run", recipe, "-o", tmp_path / "o", "--set", "model.nope.deep=1")
    )
    assert "--set model.path.x" in one_line_error(cli("run", recipe, "-o", tmp_path / "o", "--set", "model.path.x=1"))
    assert "'build:'" in one_line_error(cli("run", recipe, "-o", tmp_path / "o", "--set", "eval.data=t.txt"))
    for bad in ("seed: '7'", "seed: 7.0", "model:\n  path: x\n  allow_pickle: 'yes'"):
        recipe.write_text(f"{bad}\n" if bad.startswith("model") else f"model:\n  path: {hf}\n{bad}\n")
        one_line_error(cli("run", recipe, "-o", tmp_path / "o"))
    recipe.write_bytes(b"model:\n  path: \xff\n")
    assert "not UTF-8" in one_line_error(cli("run", recipe, "-o", tmp_path / "o"))
    nothing_written(tmp_path / "o")


def test_tiny_model_seed_out_of_range_is_a_usage_error(cli: Any, tmp_path: Path) -> None:
    assert cli("tiny-model", tmp_path / "x", "--seed", str(10**23)).exit_code == 2
    assert not (tmp_path / "x").exists()
