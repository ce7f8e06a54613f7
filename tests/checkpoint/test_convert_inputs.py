"""Hugging Face model folders that used to break conversion (a reviewer's and a fuzzer's): hub cache symlinks convert;
bad config values, files that are not files, damaged safetensors headers and pickles are refused in one line naming
the file, with exit 1 and nothing written."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import (
    NOT_A_FILE_ERRORS,
    convert_fails,
    deadline,
    edit_config,
    not_a_file,
    nothing_written,
    one_line_error,
)
from safetensors.torch import load_file


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


def test_an_absurd_layer_count_is_refused_before_a_split_is_planned(
    cli: Any, make_llama: Any, tmp_path: Path
) -> None:  # the split's checks walk the layers: the cheap count guard must come first (not a MemoryError)
    hf = make_llama()
    edit_config(hf, num_hidden_layers=10**9)
    line = convert_fails(cli, hf, tmp_path / "out", "--tp", "2")
    assert "num_hidden_layers 1000000000 but the checkpoint holds only" in line


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


@pytest.mark.parametrize("kind", sorted(NOT_A_FILE_ERRORS))
def test_convert_refuses_a_config_that_is_not_a_file(kind: str, cli: Any, make_llama: Any, tmp_path: Path) -> None:
    hf = make_llama()
    not_a_file(hf / "config.json", kind)
    out = tmp_path / "ckpt"
    with deadline(60):
        line = one_line_error(cli("convert", hf, "-o", out))
    assert f"{hf / 'config.json'}: " in line and NOT_A_FILE_ERRORS[kind] in line
    nothing_written(out)


@pytest.mark.parametrize("kind", ["dev-zero", "fifo"])
def test_convert_refuses_a_tokenizer_file_that_is_not_a_file(
    kind: str, cli: Any, make_llama: Any, tmp_path: Path
) -> None:
    hf = make_llama()
    not_a_file(hf / "tokenizer.json", kind)
    out = tmp_path / "ckpt"
    with deadline(60):
        line = one_line_error(cli("convert", hf, "-o", out))
    assert "tokenizer.json: not a regular file" in line and "pass the tokenizer file itself" in line
    nothing_written(out)
