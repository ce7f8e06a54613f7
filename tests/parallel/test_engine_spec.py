"""build_config.json of a multi-rank engine (issue 27): `mapping` and `ranks` written only when world_size > 1,
read back and checked against the mapping, each rank's own spec (`for_rank`), and the refusal to open one whose rank
graphs are missing."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from toolchain.checkpoint.trtllm import Mapping
from toolchain.engine.api import BUILD_CONFIG, EngineSpec, KVCacheSpec, Limits, RankSpec, open_trusted, rank_dir
from toolchain.errors import UserError


def _spec(engine_dir: Path) -> EngineSpec:
    """A TP=2 x PP=2 engine of a 6-layer model with 4 KV heads: 2 KV heads and 3 layers per rank."""
    kv = KVCacheSpec("float32", 6, 4, 16, 8)
    ranks = tuple(
        RankSpec(r, r % 2, r // 2, (3 * (r // 2), 3 * (r // 2) + 3), KVCacheSpec("float32", 3, 2, 16, 8))
        for r in range(4)
    )
    single = EngineSpec(
        engine_dir, "onnxruntime", "float32", "float32", "LlamaForCausalLM", 64, Limits(2, 64, 64, 16, 8), kv
    )
    return replace(single, mapping=Mapping.for_parallel(2, 2), ranks=ranks)


def test_single_rank_config_has_no_rank_keys(tmp_path: Path) -> None:
    single = replace(_spec(tmp_path), mapping=Mapping(), ranks=())
    config = single.write(tmp_path)
    assert "mapping" not in config and "ranks" not in config  # single-rank engines stay byte-identical
    read = EngineSpec.from_dir(tmp_path)
    assert (read.mapping, read.ranks, read.world_size, read.rank) == (Mapping(), (), 1, None)


def test_multi_rank_config_round_trips(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    written = spec.write(tmp_path)
    assert written["mapping"]["tp_size"] == 2 and written["mapping"]["pp_size"] == 2
    assert written["ranks"][3] == {
        "rank": 3, "tp_rank": 1, "pp_rank": 1, "layers": [3, 6],
        "kv_cache": {"block_shape": [2, 2, 16, 8], "pool_shape": [3, 8, 2, 2, 16, 8]},
    }  # fmt: skip
    read = EngineSpec.from_dir(tmp_path)
    assert (read.mapping, read.ranks, read.rank, read.world_size) == (spec.mapping, spec.ranks, None, 4)


def test_for_rank_is_the_ranks_own_dir_and_pool(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    r2 = spec.for_rank(2)
    assert r2.engine_dir == rank_dir(tmp_path, 2) == tmp_path / "rank2"
    assert (r2.rank, r2.num_layers, r2.kv_cache.num_kv_heads) == (2, 3, 2)
    assert r2.manifest_sha256 == spec.manifest_sha256  # the engine's identity is the whole engine's
    with pytest.raises(ValueError, match=r"ranks 0 \.\. 3"):
        spec.for_rank(4)


def _rewrite(tmp_path: Path, edit: Any) -> None:
    config = _spec(tmp_path).write(tmp_path)
    edit(config)
    (tmp_path / BUILD_CONFIG).write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: c["ranks"].pop(), "3 ranks for a mapping of world_size 4"),
        (lambda c: c["ranks"][1].update(tp_rank=0), r"ranks\[1\] \(rank, tp_rank, pp_rank, block_shape\) disagrees"),
        (lambda c: c["ranks"][2].update(layers=[3, 9]), r"ranks\[2\]: layers \[3, 9\]"),
        (lambda c: c["mapping"].update(world_size=3), "world_size 3 != tp_size 2"),
        (lambda c: c.pop("mapping"), "ranks without a mapping"),
        (lambda c: c["mapping"].update(moe_tp_size=1), "moe_tp_size 1 \\* moe_ep_size 1 != tp_size 2"),
    ],
)
def test_malformed_rank_config_is_refused(tmp_path: Path, edit: Any, message: str) -> None:
    _rewrite(tmp_path, edit)
    with pytest.raises(UserError, match=message):
        EngineSpec.from_dir(tmp_path)


def test_opening_a_multi_rank_engine_without_its_rank_graphs_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"a 4-rank engine \(tp=2, pp=2\) without rank0/model.onnx, rank1/model.onnx"):
        open_trusted(_spec(tmp_path))
