"""The producer venvs (llm-compressor, gptqmodel) seen from the tests: where they are, one producer run of
bench/prequant_producers.py as a subprocess — the library never enters trtbuild's process — and our converted
weights dequantized beside the producer's. A test needing a venv that is absent skips naming it and the command
that makes it (`make setup-peers`)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import STORIES, save_random_llama
from safetensors.torch import load_file

from tests.prequant.harness import PARTS_OF, token_rows
from toolchain.checkpoint.trtllm import read_config
from toolchain.quantize.methods.base import Stored, quantized_prefix
from toolchain.quantize.methods.registry import by_algo

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "bench" / "prequant_producers.py"
VENVS = Path(os.environ.get("TRTBUILD_PEERS", Path.home() / ".cache" / "trtbuild-peers")) / "venvs"
# A random Llama whose widths every producer's groups divide (GPTQ G 32 and 128, NVFP4 16, blocks of 64)
MODEL = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}
VOCAB = 512  # stories260K's tokenizer, copied beside it: llm-compressor's oneshot wants a processor
ROWS = {"8": token_rows(VOCAB, 8, 8, seed=3), "32": token_rows(VOCAB, 4, 32, seed=4)}


def producer_python(name: str) -> Path:
    python = VENVS / name / "bin" / "python"
    if not python.is_file():
        pytest.skip(f"producer venv absent: {VENVS / name} (make setup-peers creates it)")
    return python


@dataclass(frozen=True)
class Produced:
    ckpt: Path  # the producer's checkpoint
    dequant: dict[str, torch.Tensor]  # HF linear weight name -> the producer's float32 dequantization
    logits: dict[str, np.ndarray]  # rows name -> reference logits [rows, tokens, vocab]
    meta: dict[str, float | str]
    wall_s: float


def float_model(root: Path) -> Path:
    path = root / "float"
    if not (path / "config.json").is_file():
        save_random_llama(path, vocab_size=VOCAB, **MODEL)
        for f in STORIES.glob("tokenizer*"):
            (path / f.name).write_bytes(f.read_bytes())
    return path


def produce(root: Path, producer: str, variant: str) -> Produced:
    """Run `producer` (its venv) on the random Llama under `root`, once per `root`."""
    python = producer_python(producer)
    if not (STORIES / "tokenizer.json").is_file():
        pytest.skip(f"shared data absent: {STORIES} (the producers need its tokenizer)")
    out = root / f"{producer}-{variant}"
    wall = 0.0
    if not (out / "meta.json").is_file():
        rows = root / "rows.json"
        rows.write_text(json.dumps(ROWS))
        t0 = time.perf_counter()
        done = subprocess.run(
            [str(python), str(WORKER), producer, variant, str(float_model(root)), str(out), str(rows)],
            capture_output=True,
            text=True,
            timeout=900,
            cwd=root,  # gptqmodel writes its logs/ under the working directory
            env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")},
        )
        wall = time.perf_counter() - t0
        assert done.returncode == 0, f"{producer} {variant} failed:\n{done.stderr[-4000:]}"
    return Produced(
        out / "ckpt",
        load_file(str(out / "dequant.safetensors")),
        {name: np.load(out / f"logits_{name}.npy") for name in ROWS},
        json.loads((out / "meta.json").read_text()),
        wall,
    )


# our fused linears -> the HF projections they hold, in row order (checkpoint/llama.py LAYER_TABLE)


def dequantized(out: Path) -> dict[str, torch.Tensor]:
    """Every quantized linear of converted checkpoint `out` as its method dequantizes it, by our prefix."""
    cfg = read_config(out)
    method = by_algo(cfg.quantization.quant_algo, str(out))
    assert method is not None
    raw = load_file(str(out / "rank0.safetensors"))
    got = {}
    for name in raw:
        prefix = quantized_prefix(name)
        if prefix is not None:
            own = {k: v for k, v in raw.items() if k.startswith(f"{prefix}.")}
            got[prefix] = method.dequantize(Stored(prefix, own, 0, cfg.quantization.group_size))
    return got


def hf_weight(weights: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    """The HF projections behind our linear `prefix` (transformer.layers.N.KIND), stacked as we fuse them."""
    _, _, layer, kind = prefix.split(".", 3)
    return torch.cat([weights[f"model.layers.{layer}.{p}.weight"] for p in PARTS_OF[kind]])


def converted(root: Path, producer: str) -> Callable[[str], tuple[Produced, Path]]:
    """variant -> (what `producer` made of it, our conversion of that), each made once per session (a
    session-scoped fixture returns this)."""
    from toolchain.checkpoint.convert import convert

    cache: dict[str, tuple[Produced, Path]] = {}

    def get(variant: str) -> tuple[Produced, Path]:
        if variant not in cache:
            made = produce(root, producer, variant)
            out = root / f"ours-{variant}"
            convert(made.ckpt, out)
            cache[variant] = (made, out)
        return cache[variant]

    return get
