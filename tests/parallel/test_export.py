"""The graph of one rank (issue 27, slice A): where the collectives sit and with which fields (TensorRT-LLM's
AllReduce: group, type_id, strategy / config / fusion_op 0, counter numbering them, eps / affine / bias / scale 0),
the pipeline stages' Send / Recv and their ranks, the local geometry (heads, KV heads, stage layers), and a
single-rank mapping exporting exactly today's bytes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import onnx
import pytest
import torch
from onnx import helper, numpy_helper
from worlds import sharded_checkpoint

from toolchain.checkpoint.trtllm import Mapping, ModelConfig, load_rank, read_config
from toolchain.engine.collectives import ALL_GATHER_OP, ALL_REDUCE_OP, RECV_OP, SEND_OP, TYPE_IDS
from toolchain.engine.contract import ATTENTION_OP, PLUGIN_DOMAIN
from toolchain.engine.export import HIDDEN_STATES, export_model
from toolchain.errors import UserError
from toolchain.parallel.mapping import RankMapping

TPB = 4


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("export")
    out = {}
    for name, arch, tp, pp, overrides in (
        ("llama-tp2", "llama", 2, 1, {"num_hidden_layers": 3}),
        ("llama-pp2", "llama", 1, 2, {"num_hidden_layers": 3}),
        ("llama-tp2-pp2", "llama", 2, 2, {"num_hidden_layers": 3}),
        ("gpt2-tp2", "gpt2", 2, 1, {}),
        ("qwen3-tp2", "qwen3", 2, 1, {}),
    ):
        out[name] = sharded_checkpoint(root / name, arch, tp, pp, **overrides)[1]
    return out


def export(ckpt: Path, rank: int, dtype: torch.dtype = torch.float32) -> onnx.ModelProto:
    cfg = read_config(ckpt)
    return export_model(cfg, load_rank(ckpt, rank), dtype, TPB, f"rank{rank}", RankMapping(cfg.mapping, rank))


def plugins(model: onnx.ModelProto, op: str) -> list[tuple[onnx.NodeProto, dict[str, Any]]]:
    found = [n for n in model.graph.node if n.domain == PLUGIN_DOMAIN and n.op_type == op]
    return [(n, {a.name: helper.get_attribute_value(a) for a in n.attribute}) for n in found]


def producer(model: onnx.ModelProto, name: str) -> onnx.NodeProto:
    return next(n for n in model.graph.node if name in n.output)


def consumers(model: onnx.ModelProto, name: str) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if name in n.input]


def pool_dims(model: onnx.ModelProto) -> list[int | str]:
    pool = next(i for i in model.graph.input if i.name == "kv_cache")
    return [d.dim_value or d.dim_param for d in pool.type.tensor_type.shape.dim]


@pytest.mark.parametrize("rank", [0, 1])
def test_tp2_graph_has_2l_plus_1_all_reduces_and_one_all_gather(ckpts: dict[str, Path], rank: int) -> None:
    model = export(ckpts["llama-tp2"], rank)
    layers = 3
    reduces = plugins(model, ALL_REDUCE_OP)
    assert len(reduces) == 2 * layers + 1  # the embedding, then per layer attention.dense and mlp.proj
    for counter, (_, attrs) in enumerate(reduces):
        assert attrs == {
            "group": [0, 1], "type_id": TYPE_IDS["float32"], "strategy": 0, "config": 0, "fusion_op": 0,
            "counter": counter, "eps": 0.0, "affine": 0, "bias": 0, "scale": 0,
        }  # fmt: skip
    # each row-parallel Gemm feeds an all-reduce, in layer order
    fed = [producer(model, n.input[0]).name for n, _ in reduces[1:]]
    assert fed == [
        f"transformer.layers.{i}.{p}.out/Gemm" for i in range(layers) for p in ("attention.dense", "mlp.proj")
    ]
    (gather, attrs), *more = plugins(model, ALL_GATHER_OP)
    assert not more and attrs == {"group": [0, 1], "type_id": 0, "axis": -1}
    assert producer(model, gather.input[0]).name == "lm_head.out/Gemm"
    (cut,) = consumers(model, gather.output[0])  # 97 rows padded to 98 over 2 ranks: cut back before the logits
    assert cut.op_type == "Slice"
    ends = next(t for t in model.graph.initializer if t.name == cut.input[2])
    assert numpy_helper.to_array(ends).tolist() == [97]
    assert [d.dim_value for d in model.graph.output[0].type.tensor_type.shape.dim][1] == 97
    # 8 heads / 2 KV heads over 2 ranks: 4 and 1 per rank, every layer in the pool
    assert pool_dims(model)[:4] == [3, "num_blocks", 2, 1]
    _, attention = plugins(model, ATTENTION_OP)[0]
    assert (attention["num_heads"], attention["num_kv_heads"]) == (4, 1)
    lm_head = next(t for t in model.graph.initializer if t.name == "lm_head.weight")
    assert list(lm_head.dims) == [49, 64]


def test_row_bias_is_added_once_after_the_all_reduce(ckpts: dict[str, Path]) -> None:
    """GPT-2: dense and proj carry a bias, kept whole on every rank and added after the sum."""
    model = export(ckpts["gpt2-tp2"], 1)
    for prefix in ("transformer.layers.0.attention.dense", "transformer.layers.1.mlp.proj"):
        gemm = producer(model, f"{prefix}.out")
        assert gemm.input[1:] == [f"{prefix}.weight"]  # no bias in the Gemm
        (reduce,) = consumers(model, gemm.output[0])
        assert reduce.op_type == ALL_REDUCE_OP
        (add,) = consumers(model, reduce.output[0])
        assert add.op_type == "Add" and add.input[1] == f"{prefix}.bias"


def test_vocab_parallel_embedding_sums_tokens_and_positions_in_one_all_reduce(ckpts: dict[str, Path]) -> None:
    model = export(ckpts["gpt2-tp2"], 1)
    reduces = plugins(model, ALL_REDUCE_OP)
    assert len(reduces) == 2 * 2 + 1
    first, _ = reduces[0]
    add = producer(model, first.input[0])
    assert add.op_type == "Add" and add.input == [
        "transformer.vocab_embedding.masked",
        "transformer.position_embedding.masked",
    ]
    # rank 1's rows start at 49 (97 tokens padded to 98) and 32 (64 positions)
    starts = {t.name: numpy_helper.to_array(t).item() for t in model.graph.initializer if t.name.endswith(".start")}
    assert starts == {"transformer.vocab_embedding.start": 49, "transformer.position_embedding.start": 32}


def test_qk_norm_splits_the_local_heads(ckpts: dict[str, Path]) -> None:
    cfg = read_config(ckpts["qwen3-tp2"])
    model = export(ckpts["qwen3-tp2"], 0)
    sizes = next(t for t in model.graph.initializer if t.name == "transformer.layers.0.qkv_sizes")
    d = cfg.head_size
    assert numpy_helper.to_array(sizes).tolist() == [4 * d, 1 * d, 1 * d]


def test_pp2_stages_send_and_receive(ckpts: dict[str, Path]) -> None:
    first, last = export(ckpts["llama-pp2"], 0), export(ckpts["llama-pp2"], 1)
    (send, attrs), *more = plugins(first, SEND_OP)
    assert not more and attrs == {"tgt_rank": 1, "type_id": 0} and not plugins(first, RECV_OP)
    assert send.output == [HIDDEN_STATES] and [o.name for o in first.graph.output] == [HIDDEN_STATES]
    assert pool_dims(first)[0] == 2 and "lm_head.weight" not in {t.name for t in first.graph.initializer}
    (recv, attrs), *more = plugins(last, RECV_OP)
    assert not more and attrs == {"src_rank": 0, "type_id": 0} and not plugins(last, SEND_OP)
    assert producer(last, recv.input[0]).op_type == "ConstantOfShape"  # `like`: [num_tokens, hidden] zeros
    assert [o.name for o in last.graph.output] == ["logits"]
    assert pool_dims(last)[0] == 1 and "transformer.vocab_embedding.weight" not in {
        t.name for t in last.graph.initializer
    }
    # the stage's layer 2 is layer 0 of its file and of its pool
    assert [a["layer"] for _, a in plugins(last, ATTENTION_OP)] == [0]
    assert [a["layer"] for _, a in plugins(first, ATTENTION_OP)] == [0, 1]
    assert not plugins(first, ALL_REDUCE_OP) and not plugins(last, ALL_GATHER_OP)  # tp 1: no tp collectives


def test_tp2_pp2_ranks_talk_to_their_own_peers(ckpts: dict[str, Path]) -> None:
    graphs = [export(ckpts["llama-tp2-pp2"], r, torch.float16) for r in range(4)]
    fp16 = TYPE_IDS["float16"]
    assert [a for _, a in plugins(graphs[1], SEND_OP)] == [{"tgt_rank": 3, "type_id": fp16}]
    assert [a for _, a in plugins(graphs[2], RECV_OP)] == [{"src_rank": 0, "type_id": fp16}]
    assert [a for _, a in plugins(graphs[3], RECV_OP)] == [{"src_rank": 1, "type_id": fp16}]
    # stage 0: the embedding and 2 layers' reduces over [0, 1]; stage 1: 1 layer's over [2, 3] and the gather
    assert [a["group"] for _, a in plugins(graphs[0], ALL_REDUCE_OP)] == [[0, 1]] * 5
    assert [(a["group"], a["counter"]) for _, a in plugins(graphs[3], ALL_REDUCE_OP)] == [([2, 3], 0), ([2, 3], 1)]
    assert [a["group"] for _, a in plugins(graphs[2], ALL_GATHER_OP)] == [[2, 3]]
    assert all(a["type_id"] == fp16 for g in graphs for op in (ALL_REDUCE_OP, ALL_GATHER_OP) for _, a in plugins(g, op))


def test_a_single_rank_mapping_exports_the_same_bytes(ckpts: dict[str, Path]) -> None:
    one = ckpts["llama-tp2"].parent / "one"
    cfg, weights = read_config(one), load_rank(one, 0)
    plain = export_model(cfg, weights, torch.float32, TPB)
    ranked = export_model(cfg, weights, torch.float32, TPB, rank=RankMapping(Mapping(), 0))
    assert plain.SerializeToString(deterministic=True) == ranked.SerializeToString(deterministic=True)


def _cfg_weights(ckpt: Path, rank: int) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    return read_config(ckpt), load_rank(ckpt, rank)


def test_a_rank_file_missing_a_tensor_is_refused_naming_the_rank(ckpts: dict[str, Path]) -> None:
    cfg, weights = _cfg_weights(ckpts["llama-tp2-pp2"], 3)
    del weights["lm_head.weight"]
    with pytest.raises(UserError, match=r"rank3: lm_head\.weight missing, which rank 3 \(tp rank 1, pp rank 1\)"):
        export_model(cfg, weights, torch.float32, TPB, "rank3", RankMapping(cfg.mapping, 3))


def test_a_tensor_of_another_stage_is_refused(ckpts: dict[str, Path]) -> None:
    cfg, weights = _cfg_weights(ckpts["llama-pp2"], 1)
    weights["transformer.vocab_embedding.weight"] = torch.zeros(97, 64)  # the first stage's, in the last's file
    with pytest.raises(UserError, match=r"rank1: transformer\.vocab_embedding\.weight not used"):
        export_model(cfg, weights, torch.float32, TPB, "rank1", RankMapping(cfg.mapping, 1))
