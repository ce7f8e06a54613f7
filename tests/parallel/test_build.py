"""`trtbuild build` of a checkpoint split over ranks (issue 27, slice A): one graph per rank in rank{r}/, each run by
its own CPU engine with ranks as threads (ThreadComm), must give the TP=1 engine's logits; the engine directory's
layout, manifest and integrity check cover every rank's files; what is refused is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import one_line_error
from models import GEMMA3, GPT_OSS, PHI3_TOKENS, QWEN3_MOE, TPB
from worlds import run_threads, sharded_checkpoint

from toolchain.checkpoint.trtllm import CONFIG_NAME, load_rank, read_config
from toolchain.engine.api import BUILD_CONFIG, MODEL_NAME, EngineSpec, open_engine, rank_dir
from toolchain.engine.build import BuildOptions, build_engine
from toolchain.engine.collectives import CollectiveError, ThreadComm
from toolchain.engine.contract import Batch
from toolchain.engine.ort_backend import OrtEngine
from toolchain.errors import UserError
from toolchain.integrity import IntegrityError
from toolchain.manifest import read_manifest
from toolchain.reference.model import ReferenceModel

OPTS = BuildOptions(backend="onnxruntime", tokens_per_block=TPB, max_batch_size=4)
# float32 logits of these tiny models are a few units; a TP rank sums the same products in another order (the
# all-reduce adds per-rank partial sums), which moves them by float32 rounding: ~2e-6 seen, 1e-5 is the bound
TOLERANCE = 1e-5
PROMPTS = ([3, 17, 45, 2, 88, 60, 9, 31, 5], [70, 12, 44, 1, 96])  # 9 and 5 tokens over 4-token blocks
TABLES = ([5, 2, 7, 11], [0, 9, 3])  # shuffled, shared by every rank: rank 0's block manager decides for all
DECODE = ([8, 50, 61], [24, 90, 13])  # three decode steps of both sequences


def steps(engine: Any) -> list[np.ndarray]:
    """A prefill of both prompts in one call (every row's logits), then three decode steps of both, in one pool."""
    pool = engine.new_kv_cache(12)
    out = [engine.forward(Batch.from_sequences(list(PROMPTS), [0, 0], list(TABLES), all_logits=True), pool)]
    for step in range(len(DECODE[0])):
        new = [[d[step]] for d in DECODE]
        ctx = [len(p) + step for p in PROMPTS]
        out.append(engine.forward(Batch.from_sequences(new, ctx, list(TABLES)), pool))
    return out


def run_ranks(spec: EngineSpec) -> list[list[np.ndarray]]:
    def rank_main(comm: ThreadComm) -> list[np.ndarray]:
        return steps(OrtEngine(spec.for_rank(comm.rank), threads=1, comm=comm))

    return run_threads(rank_main, spec.world_size, timeout_s=30)


def engines(root: Path, arch: str, tp: int, pp: int, **overrides: Any) -> tuple[Path, Path]:
    one, split = sharded_checkpoint(root, arch, tp, pp, **overrides)
    build_engine(one, root / "engine1", OPTS)
    build_engine(split, root / "engine", OPTS)
    return root / "engine1", root / "engine"


CASES = {
    "llama-tp2": ("llama", 2, 1, {"num_hidden_layers": 3}),  # 2 KV heads: one per rank
    "llama-tp4-replicated-kv": ("llama", 4, 1, {"num_hidden_layers": 2}),  # 2 KV heads over 4 ranks: each holds 1
    "llama-pp2": ("llama", 1, 2, {"num_hidden_layers": 3}),  # stages of 2 and 1 layers
    "llama-tp2-pp2": ("llama", 2, 2, {"num_hidden_layers": 3}),
    "qwen3-tp2": ("qwen3", 2, 1, {"num_hidden_layers": 2}),  # q/k norms per local head
    "qwen3-pp2": ("qwen3", 1, 2, {"num_hidden_layers": 3}),
    "qwen3-tp2-pp2": ("qwen3", 2, 2, {"num_hidden_layers": 3}),
    "phi3-tp2": ("phi3", 2, 1, {"num_hidden_layers": 2, **PHI3_TOKENS}),  # fused gate_up split by halves
    "gpt2-tp2-pp2": ("gpt2", 2, 2, {"n_layer": 3}),  # learned positions (vocab-parallel too), biases
    "qwen3-moe-pp2": ("qwen3_moe", 1, 2, QWEN3_MOE),  # sparse, dense, sparse layers over two stages
    "gpt-oss-pp3": ("gpt_oss", 1, 3, GPT_OSS),  # a middle stage receives and sends; sinks, windows, YaRN
}


@pytest.mark.parametrize("name", CASES)
def test_rank_engines_match_the_tp1_engine(name: str, tmp_path: Path) -> None:
    arch, tp, pp, overrides = CASES[name]
    one, many = engines(tmp_path, arch, tp, pp, **overrides)
    want = steps(open_engine(one))
    spec = EngineSpec.from_dir(many)
    got = run_ranks(spec)
    hidden = read_config(tmp_path / "one").hidden_size
    for r, part in enumerate(spec.ranks):
        if part.pp_rank < pp - 1:  # a non-last stage's result: the hidden states it sent on
            assert [g.shape for g in got[r]] == [(14, hidden), (2, hidden), (2, hidden), (2, hidden)]
            continue
        for step, (g, w) in enumerate(zip(got[r], want, strict=True)):
            assert g.shape == w.shape, (r, step)
            if tp == 1:  # stages only cut the graph: the same ops on the same values, bit for bit
                assert np.array_equal(g, w), (r, step, np.abs(g - w).max())
            assert np.abs(g - w).max() <= TOLERANCE, (r, step, np.abs(g - w).max())
            assert (g.argmax(-1) == w.argmax(-1)).all(), (r, step)


def test_gemma3_ranks_round_like_the_tp1_engine(tmp_path: Path) -> None:
    """Gemma 3 (sliding and global layers split over stages, sandwich norms, scaled embedding, soft-capped logits
    cut to the vocabulary before the cap): its larger residual stream rounds more in float32 (~2e-5 on TP=1 and
    TP=2 alike), so both engines are held to the float64 forward: the TP=2 x PP=2 one within twice the TP=1 one's
    own float32 error of it."""
    one, many = engines(tmp_path, "gemma3", 2, 2, **GEMMA3)
    ids = [*PROMPTS[0], *DECODE[0]]
    cfg = read_config(tmp_path / "one")
    exact = ReferenceModel(cfg, load_rank(tmp_path / "one", 0), torch.float64).forward(torch.tensor([ids]))[0].numpy()

    def single(engine: Any) -> np.ndarray:
        pool = engine.new_kv_cache(12)
        return engine.forward(Batch.from_sequences([ids], [0], [TABLES[0]], all_logits=True), pool)

    base = np.abs(single(open_engine(one)) - exact).max()
    spec = EngineSpec.from_dir(many)
    got = run_threads(lambda comm: single(OrtEngine(spec.for_rank(comm.rank), 1, comm)), 4, timeout_s=30)
    for r in (2, 3):
        assert np.abs(got[r] - exact).max() <= 2 * base, (r, np.abs(got[r] - exact).max(), base)
        assert (got[r].argmax(-1) == exact.argmax(-1)).all()


@pytest.fixture(scope="module")
def tp2pp2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A TP=2 x PP=2 Llama engine (3 layers: stages of 2 and 1), and its checkpoint."""
    root = tmp_path_factory.mktemp("tp2pp2")
    _, split = sharded_checkpoint(root, "llama", 2, 2, num_hidden_layers=3)
    build_engine(split, root / "engine", OPTS)
    return split, root / "engine"


def test_build_holds_one_rank_in_memory_at_a_time(
    tp2pp2: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import weakref

    import toolchain.engine.build as build

    alive: list[weakref.ref[torch.Tensor]] = []

    def load_rank(directory: Path, rank: int) -> dict[str, torch.Tensor]:
        assert not [r for r in alive if r() is not None], f"rank {rank} loaded while the last rank's tensors live"
        weights = load_rank_file(directory, rank)
        alive[:] = [weakref.ref(t) for t in weights.values()]
        return weights

    load_rank_file = build.load_rank
    monkeypatch.setattr(build, "load_rank", load_rank)
    build_engine(tp2pp2[0], tmp_path / "engine", OPTS)
    assert len(alive) > 0


def test_engine_dir_has_one_graph_per_rank_and_the_mapping(tp2pp2: tuple[Path, Path]) -> None:
    engine = tp2pp2[1]
    assert not (engine / MODEL_NAME).exists()
    assert all((rank_dir(engine, r) / MODEL_NAME).is_file() for r in range(4))
    config = json.loads((engine / BUILD_CONFIG).read_text())
    assert config["mapping"]["tp_size"] == 2 and config["mapping"]["pp_size"] == 2
    layers = [r["layers"] for r in config["ranks"]]
    assert layers == [[0, 2], [0, 2], [2, 3], [2, 3]]
    # 8 heads / 2 KV heads at tp=2: 1 KV head per rank, the stage's layers in its pool
    pools = [r["kv_cache"]["pool_shape"] for r in config["ranks"]]
    assert [(p[0], p[3]) for p in pools] == [(2, 1), (2, 1), (1, 1), (1, 1)]
    manifest = read_manifest(engine)
    paths = {e["path"] for e in manifest["outputs"]}
    assert {f"rank{r}/{MODEL_NAME}" for r in range(4)} <= paths
    assert manifest["details"]["mapping"] == config["mapping"]
    inputs = {Path(e["path"]).name for e in manifest["inputs"]}
    assert {f"rank{r}.safetensors" for r in range(4)} | {CONFIG_NAME} <= inputs
    spec = EngineSpec.from_dir(engine)
    assert spec.for_rank(3).kv_cache.num_layers == 1 and spec.kv_cache.num_layers == 3


def test_a_missing_rank_is_named_by_the_first_collective(tp2pp2: tuple[Path, Path]) -> None:
    spec = EngineSpec.from_dir(tp2pp2[1])

    def rank_main(comm: ThreadComm) -> list[np.ndarray]:
        return steps(OrtEngine(spec.for_rank(comm.rank), threads=1, comm=comm))

    message = r"rank 0: AllReduce of the embedding lookups on group \[0, 1\] failed .*rank \[1\] never arrived"
    with pytest.raises(CollectiveError, match=message):
        run_threads(rank_main, 4, timeout_s=0.5, ranks=(0,))


def test_inspect_shows_the_mapping_and_each_rank(tp2pp2: tuple[Path, Path], cli: Any) -> None:
    engine = tp2pp2[1]
    info = json.loads(cli("inspect", engine, "--json").stdout)["engine"]
    assert info["mapping"] == {"world_size": 4, "tp_size": 2, "pp_size": 2}
    outputs = {e["path"]: e["sha256"] for e in read_manifest(engine)["outputs"]}
    for r, part in enumerate(info["ranks"]):
        assert (part["rank"], part["tp_rank"], part["pp_rank"]) == (r, r % 2, r // 2)
        assert (part["layers"], part["heads"], part["kv_heads"]) == ([[0, 2], [2, 3]][r // 2], 4, 1)
        assert {p: f["sha256"] for p, f in part["files"].items()} == {
            f"rank{r}/{MODEL_NAME}": outputs[f"rank{r}/{MODEL_NAME}"]
        }
    text = cli("inspect", engine).stdout
    assert "mapping       tp 2 x pp 2 = 4 ranks" in text
    assert f"rank 3        tp 1, pp 1: layers 2-2 (1), heads 4, KV heads 1; rank3/{MODEL_NAME} (" in text


def test_a_tampered_rank_graph_fails_verify_and_open(tp2pp2: tuple[Path, Path], cli: Any, tmp_path: Path) -> None:
    import shutil

    engine = tmp_path / "engine"
    shutil.copytree(tp2pp2[1], engine)
    path = rank_dir(engine, 1) / MODEL_NAME
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    result = cli("verify", engine)
    assert result.exit_code != 0 and "rank1/model.onnx" in result.output + result.stderr
    with pytest.raises(IntegrityError, match=r"rank1/model\.onnx"):
        open_engine(engine)


def test_tensorrt_is_refused_and_auto_builds_the_cpu_engine(
    tp2pp2: tuple[Path, Path], cli: Any, tmp_path: Path
) -> None:
    checkpoint = tp2pp2[0]
    line = one_line_error(cli("build", checkpoint, "-o", tmp_path / "trt", "--backend", "tensorrt"))
    assert "a 4-rank checkpoint" in line and "collective" in line and "--backend onnxruntime" in line
    build_engine(checkpoint, tmp_path / "auto", BuildOptions(backend="auto", tokens_per_block=TPB, max_batch_size=4))
    assert EngineSpec.from_dir(tmp_path / "auto").backend == "onnxruntime"
    assert any("4-rank checkpoint: building the CPU engine" in w for w in read_manifest(tmp_path / "auto")["warnings"])


def test_a_quantized_split_checkpoint_is_refused_in_one_line(tp2pp2: tuple[Path, Path], tmp_path: Path) -> None:
    import shutil

    checkpoint = tmp_path / "ckpt"
    shutil.copytree(tp2pp2[0], checkpoint)
    config = json.loads((checkpoint / CONFIG_NAME).read_text())
    config["quantization"]["quant_algo"] = "W8A16"
    (checkpoint / CONFIG_NAME).write_text(json.dumps(config))
    with pytest.raises(
        UserError, match=r"quant_algo W8A16.*split over 4 ranks; multi-rank engines are built from unquantized"
    ):
        build_engine(checkpoint, tmp_path / "engine", OPTS)
    assert not (tmp_path / "engine").exists()


def test_quantize_refuses_a_split_checkpoint(tp2pp2: tuple[Path, Path], cli: Any, tmp_path: Path) -> None:
    line = one_line_error(cli("quantize", tp2pp2[0], "-o", tmp_path / "q", "--method", "w8a16"))
    assert "has 4 ranks" in line and "tp=1 pp=1" in line
