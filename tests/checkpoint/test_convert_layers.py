"""`convert --layers` (issue 30, D10): a stand-in draft model made of some decoder layers of a model. The reference
is transformers' own model with those layers: the HF checkpoint rewritten (config num_hidden_layers, the kept
layers' tensors renamed 0..n-1), so the renumbering and the dropped tensors are checked against an independent
construction. Refusals name the value."""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import save_random_llama
from models import assert_matches, build, hf_logits, run_alone
from safetensors.torch import load_file, save_file

from tests.prequant.test_refusals import modelopt_nvfp4
from toolchain.checkpoint.convert import convert
from toolchain.manifest import read_manifest

LAYERS = [0, 1, 2, 4]


def hf_with_layers(src: Path, layers: Sequence[int], out: Path) -> Path:
    """`src` (a Llama HF dir) with only `layers`, renumbered, as transformers reads it."""
    out.mkdir()
    for f in src.iterdir():
        if f.is_file() and f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, out / f.name)
    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] = len(layers)
    if config.get("layer_types"):
        config["layer_types"] = [config["layer_types"][i] for i in layers]
    (out / "config.json").write_text(json.dumps(config))
    kept = {}
    for name, tensor in load_file(src / "model.safetensors").items():
        if name.startswith("model.layers."):
            i = int(name.split(".")[2])
            if i not in layers:
                continue
            name = name.replace(f"model.layers.{i}.", f"model.layers.{list(layers).index(i)}.", 1)
        kept[name] = tensor.contiguous()
    save_file(kept, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.slow  # ~2.4 s: convert, build and two transformers forwards
def test_layers_of_stories_match_transformers_with_those_layers(stories: Path, tmp_path: Path) -> None:
    result = convert(stories, tmp_path / "ckpt", layers=LAYERS)
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert config["num_hidden_layers"] == 4
    details = read_manifest(tmp_path / "ckpt")["details"]
    assert details["layers"] == LAYERS and "layers [0, 1, 2, 4] of 5" in details["note"]
    assert result.num_tensors == 3 + 7 * 4  # embedding, final norm, lm_head; 7 per layer (qkv, dense, mlp x3, 2 norms)
    engine = build(tmp_path / "ckpt", tmp_path / "engine")
    assert engine.spec.num_layers == 4
    ids = torch.randint(0, engine.vocab_size, (60,), generator=torch.Generator().manual_seed(4)).tolist()
    got = run_alone(engine, ids)
    # float32 both sides, different kernels and summation order: the engine tests' bound (models.assert_matches)
    assert_matches(got, hf_logits(hf_with_layers(stories, LAYERS, tmp_path / "hf"), ids))
    # the selection matters: layer 3 dropped changes the logits by far more than that bound
    assert np.abs(got - hf_logits(stories, ids)).max() > 1e-2


@pytest.mark.parametrize(
    "layers, words",
    [
        ("0,1,5", ["--layers 0,1,5", "layer 5 does not exist", "0..4"]),
        ("0,1,1", ["--layers 0,1,1", "1 after 1"]),
        ("2,1", ["--layers 2,1", "1 after 2", "increasing"]),
        ("0,x", ["--layers '0,x'", "comma-separated"]),
    ],
)
def test_bad_selections_are_refused_naming_the_value(
    cli: Any, stories: Path, tmp_path: Path, layers: str, words: list[str]
) -> None:
    done = cli("convert", stories, "-o", tmp_path / "ckpt", "--layers", layers)
    assert done.exit_code == 1
    for w in words:
        assert w in done.stderr, done.stderr
    assert not (tmp_path / "ckpt").exists()


def test_split_and_prequantized_checkpoints_are_refused(cli: Any, tmp_path: Path) -> None:
    hf = save_random_llama(tmp_path / "hf", num_hidden_layers=3)
    done = cli("convert", hf, "-o", tmp_path / "a", "--layers", "0,2", "--tp", "2")
    assert done.exit_code == 1 and "--layers 0,2 with tp=2 pp=1" in done.stderr, done.stderr
    done = cli("convert", hf, "-o", tmp_path / "b", "--layers", "0,2", "--pp", "2")
    assert done.exit_code == 1 and "tp=1 pp=2" in done.stderr, done.stderr
    quantized = modelopt_nvfp4(hf, tmp_path / "q")
    done = cli("convert", quantized, "-o", tmp_path / "c", "--layers", "0,2")
    assert done.exit_code == 1 and "pre-quantized" in done.stderr and "--layers 0,2" in done.stderr, done.stderr


def test_gemma3_layers_keep_their_windows(tmp_path: Path) -> None:
    """Gemma 3 (7 layers, layer 5 global, the others sliding): layers 0, 5 and 6 keep their own windows
    (`layer_types` subset; the repeating pattern no longer holds and is dropped), checked against transformers'
    model with those layers over a sequence longer than the window."""
    from models import GEMMA3, save_random

    hf = save_random(tmp_path / "hf", "gemma3", **GEMMA3)
    convert(hf, tmp_path / "ckpt", layers=[0, 5, 6])
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert config["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"]
    assert "_sliding_window_pattern" not in config
    engine = build(tmp_path / "ckpt", tmp_path / "engine")
    ids = torch.randint(0, engine.vocab_size, (20,), generator=torch.Generator().manual_seed(5)).tolist()
    assert_matches(run_alone(engine, ids), hf_logits(hf_with_layers(hf, [0, 5, 6], tmp_path / "hf3"), ids))


def test_moe_dense_layers_are_renumbered(tmp_path: Path) -> None:
    """Qwen3-MoE's dense layers (`mlp_only_layers`, layer numbers) follow the selection: layer 1 of 3 dense, keeping
    layers 1 and 2 makes layer 0 dense and layer 1 sparse; keeping 0 and 2 leaves none dense."""
    from models import QWEN3_MOE, save_random

    from toolchain.checkpoint.trtllm import read_config

    hf = save_random(tmp_path / "hf", "qwen3_moe", **QWEN3_MOE)
    for layers, dense in (([1, 2], [0]), ([0, 2], [])):
        out = tmp_path / f"ckpt-{layers[0]}"
        convert(hf, out, layers=layers)
        cfg = read_config(out)
        assert cfg.num_hidden_layers == 2 and cfg.family_fields["mlp_only_layers"] == dense
        names = set(load_file(out / "rank0.safetensors"))
        # a dense layer has a gated MLP's gate; a sparse one has the router
        for i in range(2):
            assert (f"transformer.layers.{i}.mlp.router.weight" in names) == (i not in dense), (layers, i)


def test_per_layer_fields_are_subset(make_llama: Any, tmp_path: Path) -> None:
    """`layer_types` (gpt-oss, gemma3: which layers slide) follows the selection; other per-layer lists refuse."""
    from toolchain.checkpoint.convert import _subset_config, check_layer_selection
    from toolchain.checkpoint.trtllm import read_config
    from toolchain.errors import UserError

    hf = make_llama(num_hidden_layers=3)
    convert(hf, tmp_path / "ckpt")
    cfg = read_config(tmp_path / "ckpt")
    typed = cfg.__class__(**{**cfg.__dict__, "family_fields": {"layer_types": ["a", "b", "c"]}})
    check_layer_selection([0, 2], typed, 1, 1, 1, None, "x")
    assert _subset_config(typed, [0, 2]).family_fields["layer_types"] == ["a", "c"]
    other = cfg.__class__(**{**cfg.__dict__, "family_fields": {"moe_layers": [1]}})
    with pytest.raises(UserError, match="per-layer field 'moe_layers'"):
        check_layer_selection([0, 2], other, 1, 1, 1, None, "x")
    pattern = cfg.__class__(**{**cfg.__dict__, "family_fields": {"_sliding_window_pattern": 6}})
    with pytest.raises(UserError, match="per-layer field '_sliding_window_pattern'"):  # which layers slide: unknown
        check_layer_selection([0, 2], pattern, 1, 1, 1, None, "x")
