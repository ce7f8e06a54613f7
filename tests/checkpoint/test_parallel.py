"""Tensor and pipeline parallel checkpoints: ranks merge back to the TP=1 tensors exactly, the TP forward with
summed row-parallel partials reproduces the TP=1 logits, and the bytes do not depend on --workers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import convert_fails, edit_weights, one_line_error
from models import save_random
from safetensors.torch import load_file

from toolchain.checkpoint.convert import convert
from toolchain.checkpoint.sharding import stage_layers
from toolchain.checkpoint.trtllm import read_config
from toolchain.reference.model import ReferenceModel
from toolchain.reference.parallel import merge_ranks, tp_logits

# vocab 97 is odd: lm_head and the embedding get padded; kv_heads 2 with tp 4 replicates KV heads.
CASES = [(2, 1), (4, 1), (2, 2), (1, 3), (4, 2)]


@pytest.mark.parametrize(("tp", "pp"), CASES)
def test_ranks_merge_to_the_single_rank_tensors(tp: int, pp: int, make_llama: Any, tmp_path: Path) -> None:
    hf = make_llama(num_hidden_layers=3, attention_bias=True, mlp_bias=True)
    convert(hf, tmp_path / "one")
    convert(hf, tmp_path / "many", tp=tp, pp=pp)
    single = load_file(str(tmp_path / "one" / "rank0.safetensors"))
    merged = merge_ranks(tmp_path / "many")
    assert merged.keys() == single.keys()
    for name, tensor in single.items():
        assert torch.equal(merged[name], tensor), name
    cfg = read_config(tmp_path / "many")
    assert cfg.mapping.world_size == tp * pp and cfg.use_parallel_embedding == (tp > 1)
    assert sorted(p.name for p in (tmp_path / "many").glob("rank*.safetensors")) == sorted(
        f"rank{r}.safetensors" for r in range(tp * pp)
    )


def test_pipeline_stages_hold_their_layers_renumbered(make_llama: Any, tmp_path: Path) -> None:
    convert(make_llama(num_hidden_layers=3), tmp_path / "ck", pp=2)
    first, last = (set(load_file(str(tmp_path / "ck" / f"rank{r}.safetensors"))) for r in (0, 1))
    assert "transformer.vocab_embedding.weight" in first and "lm_head.weight" not in first
    assert (
        "lm_head.weight" in last
        and "transformer.ln_f.weight" in last
        and "transformer.vocab_embedding.weight" not in last
    )
    assert {n.split(".")[2] for n in first if n.startswith("transformer.layers.")} == {"0", "1"}
    assert {n.split(".")[2] for n in last if n.startswith("transformer.layers.")} == {"0"}
    assert [list(r) for r in stage_layers(5, 3)] == [[0, 1], [2, 3], [4]]


@pytest.mark.parametrize(
    ("arch", "tp", "overrides"),
    [("llama", 2, {}), ("llama", 4, {}), ("qwen2", 2, {}), ("qwen3", 2, {}), ("gpt2", 2, {}), ("gpt2", 4, {})],
)
def test_tp_forward_reproduces_single_rank_logits(
    arch: str, tp: int, overrides: dict[str, Any], make_llama: Any, tmp_path: Path
) -> None:
    hf = make_llama(**overrides) if arch == "llama" else save_random(tmp_path / "hf", arch, **overrides)
    convert(hf, tmp_path / "one")
    convert(hf, tmp_path / "tp", tp=tp)
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(3))
    expected = ReferenceModel.from_checkpoint(tmp_path / "one", torch.float64).forward(ids)
    got = tp_logits(tmp_path / "tp", ids, torch.float64)
    assert (expected - got).abs().max().item() < 1e-10


def test_stories260k_tp2_forward(stories: Path, tmp_path: Path) -> None:
    convert(stories, tmp_path / "one")
    convert(stories, tmp_path / "tp", tp=2)
    ids = torch.randint(0, 512, (1, 64), generator=torch.Generator().manual_seed(0))
    expected = ReferenceModel.from_checkpoint(tmp_path / "one", torch.float64).forward(ids)
    assert (expected - tp_logits(tmp_path / "tp", ids, torch.float64)).abs().max().item() < 1e-10


def test_workers_do_not_change_a_byte(make_llama: Any, tmp_path: Path) -> None:
    hf = make_llama(num_hidden_layers=3)
    for workers in (1, 3, 8):
        convert(hf, tmp_path / f"w{workers}", tp=2, pp=2, workers=workers)
    for rank in range(4):
        name = f"rank{rank}.safetensors"
        blobs = {(tmp_path / f"w{w}" / name).read_bytes() for w in (1, 3, 8)}
        assert len(blobs) == 1, name
    assert len({(tmp_path / f"w{w}" / "config.json").read_bytes() for w in (1, 3, 8)}) == 1


def test_tp_that_does_not_divide_lists_valid_sizes(cli: Any, make_llama: Any, tmp_path: Path) -> None:
    hf = make_llama()  # 8 heads, 2 KV heads, intermediate 96
    line = one_line_error(cli("convert", hf, "-o", tmp_path / "out", "--tp", "3"))
    assert "tensor-parallel size 3 (--tp, convert.tp) does not divide" in line and "valid: 1, 2, 4, 8" in line
    line = one_line_error(cli("convert", hf, "-o", tmp_path / "out", "--pp", "5"))
    assert "pipeline-parallel size 5 (--pp, convert.pp) exceeds num_hidden_layers 2" in line


def test_mismatch_in_one_layer_only(cli: Any, make_llama: Any, tmp_path: Path) -> None:
    hf = make_llama(num_hidden_layers=3)

    def shrink(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.2.mlp.up_proj.weight"] = t["model.layers.2.mlp.up_proj.weight"][:80].clone()

    edit_weights(hf, shrink)
    line = convert_fails(cli, hf, tmp_path / "out")
    assert "model.layers.2.mlp.up_proj.weight has shape [80, 64]" in line and "[96, 64]" in line


def test_two_shards_holding_the_same_tensor(cli: Any, make_llama: Any, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    hf = make_llama()
    tensors = load_file(str(hf / "model.safetensors"))
    save_file({"model.norm.weight": tensors["model.norm.weight"]}, str(hf / "extra.safetensors"))
    line = convert_fails(cli, hf, tmp_path / "out")
    assert "model.norm.weight" in line and "duplicate" in line


def test_gpt2_position_embedding_is_split_like_the_vocabulary(tmp_path: Path) -> None:
    hf = save_random(tmp_path / "hf", "gpt2", n_positions=63)
    convert(hf, tmp_path / "tp", tp=2)
    ranks = [load_file(str(tmp_path / "tp" / f"rank{r}.safetensors")) for r in range(2)]
    assert [r["transformer.position_embedding.weight"].shape[0] for r in ranks] == [32, 32]
    full = load_file(str(hf / "model.safetensors"))["transformer.wpe.weight"]
    assert torch.equal(merge_ranks(tmp_path / "tp")["transformer.position_embedding.weight"], full)


def test_reference_from_a_multi_rank_checkpoint_merges(make_llama: Any, tmp_path: Path) -> None:
    hf = make_llama(num_hidden_layers=3)
    convert(hf, tmp_path / "one")
    convert(hf, tmp_path / "many", tp=2, pp=3)
    ids = torch.arange(20)[None]
    one = ReferenceModel.from_checkpoint(tmp_path / "one").forward(ids)
    assert torch.equal(ReferenceModel.from_checkpoint(tmp_path / "many").forward(ids), one)


def test_full_disk_is_one_line(cli: Any, make_llama: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    import toolchain.checkpoint.safetensors_io as sio

    def full(self: Any, data: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "out"))

    monkeypatch.setattr(sio.SafetensorsWriter, "_put", full)
    line = one_line_error(cli("convert", make_llama(), "-o", tmp_path / "out"))
    assert "No space left on device" in line
    assert not (tmp_path / "out").exists()


def test_build_refuses_a_sharded_checkpoint_on_tensorrt_plainly(make_llama: Any, cli: Any, tmp_path: Path) -> None:
    # a sharded checkpoint builds one graph per rank (tests/parallel/test_build.py); TensorRT cannot run them yet
    convert(make_llama(num_hidden_layers=2), tmp_path / "tp2", tp=2)
    message = one_line_error(cli("build", tmp_path / "tp2", "-o", tmp_path / "engine", "--backend", "tensorrt"))
    assert "a 2-rank checkpoint" in message and "collective" in message
    assert "--backend onnxruntime" in message
    assert not (tmp_path / "engine").exists()
