"""`convert` without torch (issue 26, the 1 GB MoE's memory figure): the CLI process never imports torch, its casts
round as torch's `Tensor.to` does bit for bit, and convert's tensors in flight, the one being written included, stay
within the largest one (docs/conversion.md, "Mixture-of-experts layers")."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import toolchain.checkpoint.convert as convert_mod
from toolchain.checkpoint.convert import _cast, _prefetched, convert
from toolchain.checkpoint.hf import HFCheckpoint
from toolchain.checkpoint.safetensors_io import NUMPY_DTYPES

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from convert import model_config, qwen3_moe_tensors  # noqa: E402  (bench/convert.py's Qwen3-MoE, as transformers saves it)

TORCH = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns, to compare floats exactly (-0.0 from 0.0 too)."""
    return tensor.view({2: torch.int16, 4: torch.int32}[tensor.element_size()])


_CONVERT = """
import sys
from toolchain.cli import main
sys.argv = ["trtbuild", "convert", *sys.argv[1:]]
try:
    main()
except SystemExit as e:
    assert not e.code, e.code
print(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers")))
"""


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """bench/convert.py's Qwen3-MoE at a small size, in float32: 2 layers of 4 experts, the router, q/k norms."""
    out = tmp_path_factory.mktemp("moe")
    sizes = dict(hidden=64, heads=4, kv_heads=2, vocab=97, layers=2, experts=4, top_k=2, moe_intermediate=32)
    args = argparse.Namespace(**sizes, intermediate=96, moe=True)
    gen = torch.Generator().manual_seed(0)
    tensors = {info.name: torch.randn(info.shape, generator=gen) * 0.02 for info in qwen3_moe_tensors(args)}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({**model_config(args), "torch_dtype": "float32"}))
    return out


def test_convert_never_imports_torch_and_casts_as_torch_does(tiny_moe: Path, tmp_path: Path) -> None:
    """A float32 Qwen3-MoE (stacked experts, q/k norms, the float32 router) converted to bfloat16 in a fresh process,
    as `trtbuild convert` runs: torch is never imported; and (here, in this process) as it is and to float16: every
    tensor equals torch's cast of the float32 conversion, bit for bit (the router stays float32)."""
    cmd = [sys.executable, "-c", _CONVERT, str(tiny_moe), "-o", str(tmp_path / "bfloat16"), "--dtype", "bfloat16"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == "[]"  # no torch, no transformers module
    convert(tiny_moe, tmp_path / "float32")
    convert(tiny_moe, tmp_path / "float16", dtype="float16")
    full = load_file(tmp_path / "float32" / "rank0.safetensors")
    assert sum(n.endswith("mlp.router.weight") for n in full) == 2
    assert full["transformer.layers.0.mlp.fc.weight"].shape == (4, 64, 64)
    for dtype in ("bfloat16", "float16"):
        cast = load_file(tmp_path / dtype / "rank0.safetensors")
        assert cast.keys() == full.keys()
        for name, tensor in full.items():
            want = tensor if name.endswith("mlp.router.weight") else tensor.to(getattr(torch, dtype))
            assert cast[name].dtype == want.dtype and torch.equal(_bits(cast[name]), _bits(want)), name


def _float32_near_every_rounding_boundary() -> np.ndarray[Any, Any]:
    """float32 bit patterns where a cast to bfloat16 or float16 decides: for every bfloat16 value, the dropped 16 bits
    just below, at and above the tie; for every float16-sized prefix (19 bits), the same for the dropped 13 bits;
    and 2^20 random patterns (float16's subnormals drop more bits). NaNs left out: convert refuses them."""
    rng = np.random.default_rng(0)
    high = np.arange(1 << 16, dtype=np.uint32) << 16
    bf16_ties = (high[:, None] | np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], np.uint32)).ravel()
    prefix = np.arange(1 << 19, dtype=np.uint32) << 13
    f16_ties = (prefix[:, None] | np.array([0, 0xFFF, 0x1000, 0x1001, 0x1FFF], np.uint32)).ravel()
    random = rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint64).astype(np.uint32)
    x = np.concatenate([bf16_ties, f16_ties, random]).view(np.float32)
    return x[~np.isnan(x)]


@pytest.mark.parametrize(
    ("source", "target"),
    [("F32", "BF16"), ("F32", "F16"), ("BF16", "F16"), ("F16", "BF16"), ("BF16", "F32"), ("F16", "F32")],
)
def test_casts_round_as_torch_does(source: str, target: str) -> None:
    """Every bfloat16 and float16 value, and float32 values at every rounding boundary of both (ties to even,
    subnormals, overflow to infinity). Checked once over all 2^32 float32 patterns too (0 differences, under
    ATEN_CPU_CAPABILITY default and the CPU's best); too slow for CI."""
    if source == "F32":
        x = _float32_near_every_rounding_boundary()
    else:
        x = np.arange(1 << 16, dtype=np.uint16).view(NUMPY_DTYPES[source])
        x = x[~np.isnan(x.astype(np.float32))]
    ours = _cast(x, NUMPY_DTYPES[target])
    theirs = _bits(torch.from_numpy(x.view(f"i{x.itemsize}")).view(TORCH[source]).to(TORCH[target])).numpy()
    assert ours.dtype == NUMPY_DTYPES[target]
    assert np.array_equal(ours.view(theirs.dtype), theirs)


def test_float64_rounds_through_float32_as_torch_does() -> None:
    """torch casts float64 to bfloat16 / float16 through float32 (two roundings), numpy directly (one): these values
    tell the two apart, and convert must give torch's."""
    x = np.array([1 + 2**-8 + 2**-30, 1 + 2**-11 + 2**-40, -(1 + 2**-8 + 2**-30), 3.0e38, 70000.0])
    for target in ("BF16", "F16"):
        theirs = torch.from_numpy(x).to(TORCH[target]).float().numpy()
        assert np.array_equal(_cast(x, NUMPY_DTYPES[target]).astype(np.float32), theirs)
        with np.errstate(over="ignore"):
            direct = x.astype(NUMPY_DTYPES[target]).astype(np.float32)
        assert not np.array_equal(direct, theirs)  # numpy's own cast rounds once: it differs


def test_prefetch_holds_at_most_the_largest_tensor() -> None:
    """Two workers, tensors of MoE-like sizes in bytes (a layer's stacked fc 64, its proj 32, small ones between):
    every tensor alive at once, the one the consumer is writing included, sums to at most the largest."""
    sizes = (4, 64, 32, 1, 1, 8, 64, 32, 1, 64, 2, 2)
    alive: dict[int, int] = {}
    peak = 0
    lock = threading.Lock()

    def make(size: int) -> np.ndarray[Any, Any]:
        nonlocal peak
        tensor = np.zeros(size << 10, np.uint8)
        key = id(tensor)
        with lock:
            alive[key] = size
            peak = max(peak, sum(alive.values()))
        weakref.finalize(tensor, forget, key)
        return tensor

    def forget(key: int) -> None:
        with lock:
            del alive[key]

    written = []
    for tensor in _prefetched(sizes, make, 2, lambda size: size):  # type: ignore[arg-type]
        written.append(tensor.size >> 10)
        del tensor  # as write_stage lets go of each tensor before it asks for the next
    assert tuple(written) == sizes
    assert peak <= max(sizes), peak


def test_convert_lets_go_of_each_tensor_before_making_the_next_large_one(
    tiny_moe: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same bound through `convert` itself: the tensors made and not yet let go of (write_stage's loop included,
    which held the last one while the next was made when it zipped names with tensors) stay within the largest
    tensor's cost, the stacked experts, whatever the number of workers."""
    ckpt = HFCheckpoint.open(tiny_moe)
    plan = convert_mod.plan_conversion(ckpt)
    with ckpt.reader() as reader:
        budget = max(convert_mod._cost(reader, plan.config.numpy_dtype, out) for out in plan.stages[0])
    alive: dict[int, int] = {}
    peaks: list[int] = []
    lock = threading.Lock()
    real = convert_mod._materialize

    def forget(key: int) -> None:
        with lock:
            del alive[key]

    def tracked(*args: Any) -> np.ndarray[Any, Any]:
        tensor = real(*args)
        with lock:
            alive[id(tensor)] = tensor.nbytes
            peaks.append(sum(alive.values()))
        weakref.finalize(tensor, forget, id(tensor))
        return tensor

    monkeypatch.setattr(convert_mod, "_materialize", tracked)
    for workers in (1, 2, 4):
        convert_mod.convert(tiny_moe, tmp_path / str(workers), workers=workers)
        assert len(peaks) == len(plan.stages[0]) and max(peaks) <= budget, (workers, max(peaks), budget)
        peaks.clear()
