"""The multi-rank tests' checkpoint helper gives what slices A and B build from: one file per rank and the mapping."""

from __future__ import annotations

from pathlib import Path

from worlds import sharded_checkpoint

from toolchain.checkpoint.trtllm import Mapping, rank_file, read_config


def test_sharded_checkpoint_has_a_file_per_rank(tmp_path: Path) -> None:
    one, split = sharded_checkpoint(tmp_path, "llama", tp=2, pp=2, num_hidden_layers=3)
    assert read_config(one).mapping == Mapping()
    assert read_config(split).mapping == Mapping.for_parallel(2, 2)
    assert sorted(p.name for p in split.glob("rank*.safetensors")) == [rank_file(r) for r in range(4)]
