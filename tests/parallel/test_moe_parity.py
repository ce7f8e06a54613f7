"""Mixture-of-experts engines split over ranks (issue 27, slice D): experts parallel (--moe-ep) and expert tensor
parallel (moe_tp = tp / moe_ep), each rank's CPU engine run as a thread (ThreadComm), must give the TP=1 engine's
logits: every rank routes every token over all experts, computes its own experts at its slice of their width, and
one AllReduce after the MoE node sums the ranks' parts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from models import GPT_OSS, MIXTRAL, QWEN3_MOE, TPB, save_random
from worlds import run_threads

from toolchain.checkpoint.convert import convert
from toolchain.engine import moe_split
from toolchain.engine.api import EngineSpec, open_engine, rank_dir
from toolchain.engine.build import BuildOptions, build_engine
from toolchain.engine.collectives import ThreadComm
from toolchain.engine.contract import Batch
from toolchain.engine.ort_backend import OrtEngine

OPTS = BuildOptions(backend="onnxruntime", tokens_per_block=TPB, max_batch_size=4)
# float32 logits of these tiny models are a few units; a rank sums its experts' (and its width slice's) products
# and the all-reduce adds the ranks' parts in another order than the TP=1 MoE, which moves the logits by float32
# rounding (a few 1e-6); 1e-5 is the bound slice A's dense parity uses for the same reason
TOLERANCE = 1e-5
PROMPTS = ([3, 17, 45, 2, 88, 60, 9, 31, 5], [70, 12, 44, 1, 96])
TABLES = ([5, 2, 7, 11], [0, 9, 3])
DECODE = ([8, 50, 61], [24, 90, 13])


def steps(engine: Any) -> list[np.ndarray]:
    """A prefill of both prompts (every row's logits), then three decode steps of both, in one pool."""
    pool = engine.new_kv_cache(12)
    out = [engine.forward(Batch.from_sequences(list(PROMPTS), [0, 0], list(TABLES), all_logits=True), pool)]
    for step in range(len(DECODE[0])):
        new = [[d[step]] for d in DECODE]
        out.append(engine.forward(Batch.from_sequences(new, [len(p) + step for p in PROMPTS], list(TABLES)), pool))
    return out


CASES = {  # arch, config, tp, moe_ep
    "mixtral-ep2": ("mixtral", MIXTRAL, 2, 2),  # 4 of 8 experts per rank
    "mixtral-moe-tp2": ("mixtral", MIXTRAL, 2, 1),  # every expert, half its width
    "mixtral-tp4-ep2": ("mixtral", MIXTRAL, 4, 2),  # two expert groups of two width halves
    "qwen3-moe-ep2": ("qwen3_moe", QWEN3_MOE, 2, 2),  # sparse, dense, sparse layers; q/k norms
    "gpt-oss-moe-tp2": ("gpt_oss", GPT_OSS, 2, 1),  # expert biases (added once: moe-TP rank 0), router bias
    "gpt-oss-ep2": ("gpt_oss", GPT_OSS, 2, 2),
}


@pytest.mark.parametrize("name", CASES)
def test_split_experts_match_the_tp1_engine(name: str, tmp_path: Path) -> None:
    arch, config, tp, moe_ep = CASES[name]
    hf = save_random(tmp_path / "hf", arch, **config)
    convert(hf, tmp_path / "one")
    convert(hf, tmp_path / "split", tp=tp, moe_ep=moe_ep)
    build_engine(tmp_path / "one", tmp_path / "engine1", OPTS)
    build_engine(tmp_path / "split", tmp_path / "engine", OPTS)
    want = steps(open_engine(tmp_path / "engine1"))
    spec = EngineSpec.from_dir(tmp_path / "engine")

    def rank_main(comm: ThreadComm) -> list[np.ndarray]:
        return steps(OrtEngine(spec.for_rank(comm.rank), threads=1, comm=comm))

    got = run_threads(rank_main, tp, timeout_s=30)
    for r in range(tp):
        for step, (g, w) in enumerate(zip(got[r], want, strict=True)):
            assert g.shape == w.shape, (r, step)
            assert np.abs(g - w).max() <= TOLERANCE, (r, step, np.abs(g - w).max())
            assert (g.argmax(-1) == w.argmax(-1)).all(), (r, step)

    # each rank's MoE nodes hold its own experts at its width, each followed by one AllReduce over the tp group
    per_rank = 8 // moe_ep
    for r in range(tp):
        graph = onnx.load(rank_dir(tmp_path / "engine", r) / "model.onnx", load_external_data=False).graph
        moes = [n for n in graph.node if n.op_type == "MoE"]
        assert moes
        for node in moes:
            attrs = moe_split.attrs_of(node)
            assert (attrs.expert_offset, attrs.num_local_experts) == ((r % moe_ep) * per_rank, per_rank)
            (reduce,) = [n for n in graph.node if node.output[0] in n.input]
            assert reduce.op_type == "AllReduce" and reduce.domain == "trtbuild"
