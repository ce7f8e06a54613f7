"""Experts split over ranks (issue 27, slice D): expert parallelism (moe_ep) and expert tensor parallelism
(moe_tp = tp / moe_ep) in the checkpoint, as TensorRT-LLM's MixtureOfExperts holds them (sharding.py's docstring).
The ranks merged back must be the unsplit checkpoint exactly, and each rank must hold the slice the mapping says."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from models import GPT_OSS, MIXTRAL, QWEN3_MOE, save_random

from toolchain.checkpoint.convert import convert
from toolchain.checkpoint.trtllm import load_rank, read_config
from toolchain.errors import UserError
from toolchain.parallel.mapping import RankMapping
from toolchain.reference.parallel import merge_ranks

CASES = {"mixtral": MIXTRAL, "qwen3_moe": QWEN3_MOE, "gpt_oss": GPT_OSS}


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """Each MoE family: (its HF dir, its unsplit checkpoint)."""
    root = tmp_path_factory.mktemp("moe_sharding")
    out = {}
    for arch, config in CASES.items():
        hf = save_random(root / arch / "hf", arch, **config)
        convert(hf, root / arch / "one")
        out[arch] = (hf, root / arch / "one")
    return out


@pytest.mark.parametrize(
    ("arch", "tp", "moe_ep"),
    [
        ("mixtral", 2, 2),
        ("mixtral", 2, 1),
        ("mixtral", 4, 2),
        ("qwen3_moe", 2, 2),
        ("gpt_oss", 2, 2),
        ("gpt_oss", 2, 1),
    ],
)
def test_experts_split_and_merge_back_exactly(
    hf_models: dict[str, tuple[Path, Path]], tmp_path: Path, arch: str, tp: int, moe_ep: int
) -> None:
    hf, one = hf_models[arch]
    split = tmp_path / "split"
    convert(hf, split, tp=tp, moe_ep=moe_ep)
    cfg = read_config(split)
    assert (cfg.mapping.tp_size, cfg.mapping.moe_ep_size, cfg.mapping.moe_tp_size) == (tp, moe_ep, tp // moe_ep)
    full, merged = load_rank(one), merge_ranks(split)
    assert sorted(merged) == sorted(full)
    for name, tensor in full.items():
        assert merged[name].dtype == tensor.dtype, name
        assert torch.equal(merged[name], tensor), name

    # every rank holds its experts (RankMapping.ep_experts) and its slice of each expert's width
    p = "transformer.layers.0.mlp"
    fc, proj = full[f"{p}.fc.weight"], full[f"{p}.proj.weight"]
    experts, inter = fc.shape[0], proj.shape[2]
    width = inter // (tp // moe_ep)
    for rank in RankMapping(cfg.mapping, 0).ranks():
        local = load_rank(split, rank.rank)
        mine = rank.ep_experts(experts)
        assert len(mine) == experts // moe_ep
        cols = slice(rank.moe_tp_rank * width, (rank.moe_tp_rank + 1) * width)
        up, gate = fc[mine.start : mine.stop].chunk(2, dim=1)
        assert torch.equal(local[f"{p}.fc.weight"], torch.cat([up[:, cols], gate[:, cols]], dim=1))
        assert torch.equal(local[f"{p}.proj.weight"], proj[mine.start : mine.stop, :, cols])
        assert torch.equal(local[f"{p}.router.weight"], full[f"{p}.router.weight"])  # replicated
        if f"{p}.proj.bias" in full:  # gpt-oss: added once per expert, by moe-TP rank 0 of its group
            bias = full[f"{p}.proj.bias"][mine.start : mine.stop]
            want = bias if rank.moe_tp_rank == 0 else torch.zeros_like(bias)
            assert torch.equal(local[f"{p}.proj.bias"], want)
            assert torch.equal(local[f"{p}.router.bias"], full[f"{p}.router.bias"])


def test_expert_splits_that_do_not_divide_are_refused_naming_the_valid_sizes(
    hf_models: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    hf, _ = hf_models["mixtral"]
    with pytest.raises(UserError, match=r"expert-parallel size 3 \(--moe-ep\) at tp 2 does not split this model's "
                       r"experts \(8 experts of width 48: .*valid --moe-ep at tp 2: 1, 2$"):  # fmt: skip
        convert(hf, tmp_path / "ep3", tp=2, moe_ep=3)
    six = save_random(tmp_path / "six", "mixtral", **{**MIXTRAL, "num_local_experts": 6})
    with pytest.raises(UserError, match=r"valid --moe-ep at tp 4: 1, 2$"):  # 6 experts do not split in 4 groups
        convert(six, tmp_path / "six-ep4", tp=4, moe_ep=4)
    with pytest.raises(UserError, match=r"--moe-ep 2 \(expert parallelism\) needs a mixture-of-experts model; use 1"):
        convert(save_random(tmp_path / "dense", "qwen3"), tmp_path / "dense-ep2", tp=2, moe_ep=2)
    assert not any((tmp_path / d).exists() for d in ("ep3", "six-ep4", "dense-ep2"))
