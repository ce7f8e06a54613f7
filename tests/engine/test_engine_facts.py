"""Each engine fact has one owner: KV geometry (engine/geometry.py), the backends (engine/backends.py), the build
config (EngineSpec), the gates (evaluate/gates.py) and the stage directories (recipe.STAGE_DIRS); the CLI, the
recipe, build, eval and diff read them from there."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from toolchain import cli, pipeline
from toolchain.engine import backends
from toolchain.engine.api import KVCacheSpec, Limits
from toolchain.engine.build import BuildOptions
from toolchain.engine.geometry import TOKENS_PER_BLOCK, blocks_for, kv_block_shape
from toolchain.errors import UserError
from toolchain.evaluate import diff, gates
from toolchain.recipe import STAGE_DIRS, BuildSection, GatesSection, load_recipe, schema


def test_blocks_for_rounds_up_for_ints_and_arrays() -> None:
    assert [blocks_for(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    assert blocks_for(np.array([0, 1, 16, 17]), 16).tolist() == [0, 1, 1, 2]
    assert Limits(1, 1, 33, 16, 1).max_blocks_per_seq == 3


def test_block_shape_is_the_one_kv_spec_and_the_pool_use() -> None:
    kv = KVCacheSpec("float32", num_layers=3, num_kv_heads=2, tokens_per_block=8, head_size=16)
    assert kv.block_shape == kv_block_shape(2, 8, 16) == (2, 2, 8, 16)
    assert kv.pool_shape(5) == (3, 5, 2, 2, 8, 16)


def test_the_backend_choices_come_from_the_registry() -> None:
    assert ("auto", *backends.BACKENDS) == backends.CHOICES
    assert [b.value for b in cli.Backend] == list(backends.CHOICES)
    assert schema()["$defs"]["BuildSection"]["properties"]["backend"]["enum"] == list(backends.CHOICES)
    for backend in backends.BACKENDS.values():
        assert set(backend.tokens_per_block) <= set(TOKENS_PER_BLOCK)
    with pytest.raises(UserError, match="backend 'cuda' is not supported; choose one of auto, tensorrt, onnxruntime"):
        BuildOptions(backend="cuda")
    with pytest.raises(UserError, match="backend 'cuda' is not supported; choose one of onnxruntime, tensorrt"):
        backends.by_name("cuda")


def test_a_backend_says_which_block_sizes_it_takes() -> None:
    backends.ONNXRUNTIME.check_tokens_per_block(1)
    with pytest.raises(UserError, match="--tokens-per-block 8: the CUDA plugin supports 16, 32 or 64"):
        backends.TENSORRT.check_tokens_per_block(8)


def test_the_recipe_takes_the_engines_block_sizes(tmp_path: Path) -> None:
    assert BuildSection(tokens_per_block=128).tokens_per_block == 128
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model:\n  path: m\nbuild:\n  tokens_per_block: 3\n")
    with pytest.raises(UserError) as e:
        load_recipe(recipe)
    line = str(e.value)
    assert "\n" not in line and "build.tokens_per_block: must be one of 1, 2, 4, 8, 16, 32, 64, 128 (got 3)" in line


def test_the_spec_writes_what_it_reads(tmp_path: Path) -> None:
    from toolchain.checkpoint.convert import convert
    from toolchain.checkpoint.tiny import make_tiny_llama
    from toolchain.engine.api import BUILD_CONFIG, EngineSpec
    from toolchain.engine.build import build_engine

    make_tiny_llama(tmp_path / "hf", seed=0)
    convert(tmp_path / "hf", tmp_path / "ckpt")
    build_engine(tmp_path / "ckpt", tmp_path / "engine", BuildOptions(backend="onnxruntime", max_seq_len=64))
    written = (tmp_path / "engine" / BUILD_CONFIG).read_bytes()
    spec = EngineSpec.from_dir(tmp_path / "engine")
    assert spec.to_config() == json.loads(written)
    (tmp_path / "again").mkdir()
    spec.write(tmp_path / "again")
    assert (tmp_path / "again" / BUILD_CONFIG).read_bytes() == written


def test_recipe_gates_are_eval_or_diff_gates() -> None:
    for name in GatesSection.model_fields:
        assert (name in gates.EVAL) != (name in gates.DIFF), name


def test_one_checker_for_both_tables() -> None:
    assert gates.check({"top1_min": 0.9}, {"same_top1": 0.95}, gates.EVAL)[0].passed
    assert not gates.check({"throughput_ratio_min": 1.0}, {"throughput_ratio": None}, gates.DIFF)[0].passed
    with pytest.raises(UserError, match="gate golden_exact_min needs golden_exact, which was not computed"):
        gates.check({"golden_exact_min": 0.5}, {}, gates.EVAL, missing="was not computed")
    with pytest.raises(UserError, match="unknown gate 'x'; choose from kld_mean_max, top1_min"):
        gates.check_limit("x", 1.0, gates.EVAL)
    with pytest.raises(UserError, match=r"gate top1_vs_old_min=2\.0: expected a finite value"):
        gates.check_limit("top1_vs_old_min", 2.0, gates.DIFF)
    assert gates.check_limit("throughput_ratio_min", 2.0, gates.DIFF).needs == "--trace"  # a ratio, not a fraction


def test_stage_dirs_are_defined_once() -> None:
    assert pipeline.STAGE_DIRS is STAGE_DIRS and diff.STAGE_DIRS is STAGE_DIRS
