"""plugins/gpu_check.py without a GPU: its CPU mode end to end (a subprocess under TRITON_INTERPRET=1, its JSON),
and its checking logic on stand-in kernels — the reference ops pass it, a planted stale-slot read and a write into
a slot no sequence owns fail it."""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from toolchain.engine import ops
from toolchain.engine.ops import AttentionAttrs
from toolchain.plugins import launch
from toolchain.plugins.kernels import KERNELS, common

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "plugins" / "gpu_check.py"


def _gpu_check() -> Any:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_cpu_mode_reports_every_part(tmp_path: Path) -> None:
    """`gpu_check.py --cpu`: part (a) on the small vectors through the interpreted kernels, (b)-(d) skipped with the
    reason; the exit status is the verdict, and the verdict is every case's. ~3 s."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "--cpu", "--out", str(tmp_path)], capture_output=True, text=True, env=env,
        timeout=300,
    )  # fmt: skip
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    gc = _gpu_check()
    assert report["mode"] == "cpu" and sorted(report["native"]) == sorted(gc.CPU_CASES), res.stderr[-2000:]
    for name, r in report["native"].items():
        assert "error" not in r, (name, r.get("error"))
        within = max(r["q_err_over_tol"], r["pool_err_over_tol"], r["out_err_over_tol"]) <= 1.0
        assert r["pass"] == (within and r["unowned_slots_untouched"]), name
    assert report["passed"] == all(r["pass"] for r in report["native"].values())
    assert res.returncode == (0 if report["passed"] else 1), res.stderr[-2000:]
    assert report["passed"], {name: r for name, r in report["native"].items() if not r["pass"]}
    for part in ("aot", "sanitizer", "timing"):
        assert report[part] == {"skipped": "needs a CUDA GPU (--cpu run)"}, part
    md = (tmp_path / "gpu-check.md").read_text()
    assert all(name in md for name in gc.CPU_CASES) and "aot: skipped — needs a CUDA GPU" in md


@pytest.fixture(scope="module")
def gc() -> Any:
    return _gpu_check()


def _with(gc: Any, monkeypatch: pytest.MonkeyPatch, write: Any, attend: Any, name: str) -> dict[str, Any]:
    monkeypatch.setattr(gc.kv_write, "kv_cache_write", write)
    monkeypatch.setattr(gc.attention, "paged_attention", attend)
    case = gc.load_case(next(p for p in gc.VECTORS if p.stem == name))
    result: dict[str, Any] = gc.check_native(case, gc.run_native(case, "cpu"))
    return result


def _reference_write(a: Any, qkv: Any, *rest: Any) -> Any:
    return ops.kv_cache_write(a, qkv, *rest).to(qkv.dtype)  # fp32 inside, as the kernels compute


def _reference_attention(a: Any, q: Any, *rest: Any) -> Any:
    return ops.paged_attention(a, q, *rest).to(q.dtype)


@pytest.mark.parametrize("name", ["f16-hd64-gqa4-mixed", "bf16-int8kv-hd64-mha-tpb64", "f16-fp8kv-hd128-gqa8"])
def test_the_reference_passes_the_check(gc: Any, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    r = _with(gc, monkeypatch, _reference_write, _reference_attention, name)
    assert r["pass"], r


def test_a_stale_slot_read_fails_the_check(gc: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Attention one position too far reads the poisoned slot after each sequence's last token."""

    def stale(a: Any, q: Any, pos: Any, *rest: Any) -> Any:
        return _reference_attention(a, q, pos + 1, *rest)

    r = _with(gc, monkeypatch, _reference_write, stale, "f16-hd64-gqa4-mixed")
    assert not r["pass"] and r["out_err_over_tol"] > 1, r


def test_a_write_outside_the_owned_slots_fails_the_check(gc: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    def spill(a: Any, qkv: Any, pos: Any, ctx: Any, new: Any, tables: Any, pool: Any) -> Any:
        q = _reference_write(a, qkv, pos, ctx, new, tables, pool)
        pool[a.layer, -1].zero_()  # the last block: a spare nobody owns in this vector
        return q

    r = _with(gc, monkeypatch, spill, _reference_attention, "f16-hd64-gqa4-mixed")
    assert not r["pass"] and not r["unowned_slots_untouched"], r


class FakeDriver:
    """cuda-python's driver calls the AOT path makes, recorded (every call succeeds: error code 0)."""

    class CUfunction_attribute:
        CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def cuModuleLoadData(self, image: bytes) -> tuple[int, str]:
        self.calls.append(("load", image))
        return 0, "module"

    def cuModuleGetFunction(self, module: str, name: bytes) -> tuple[int, str]:
        self.calls.append(("function", name))
        return 0, "fn"

    def cuFuncSetAttribute(self, fn: str, attr: int, value: int) -> tuple[int]:
        self.calls.append(("attribute", attr, value))
        return (0,)

    def cuLaunchKernel(self, fn: str, *dims_and_args: Any) -> tuple[int]:
        self.calls.append(("launch", *dims_and_args))
        return (0,)


@pytest.mark.parametrize(("op", "shared"), [("KVCacheWrite", 0), ("PagedAttention", 64 * 1024)])
def test_aot_launch_passes_what_tensorrt_passes(gc: Any, op: str, shared: int) -> None:
    """The GPU check's ahead-of-time launch: the stripped PTX loaded, its entry found by name, launched with the
    grid, 32 * NUM_WARPS threads and the compile's shared memory (opted in above 48 KB), and the arguments input
    pointers, int32 scalars, output pointer — TensorRT's order — as pointers and C ints."""
    a = AttentionAttrs(layer=1, num_heads=4, num_kv_heads=2, head_size=24, tokens_per_block=16, kv_cache_dtype="fp8",
                       kv_scale=0.25)  # fmt: skip
    name = launch.kernel_name(op)
    types_ = [".u64" if t.startswith("*") else ".u32" for _, t in launch.parameters(op, a, "float16")]
    params = ",\n".join(f"\t.param {t} {name}_param_{i}" for i, t in enumerate(types_))
    ptx = f".visible .entry {name}(\n{params}\n)\n.reqntid 128\n{{\n\tret;\n}}\n"
    compiled = {"name": name, "ptx": ptx, "shared": shared}
    driver = FakeDriver()
    aot = gc.AotKernels("sm_90", compile_kernel=lambda *args: type("K", (), compiled), driver=driver)
    aot.stream = lambda: "stream"
    first = 5 * (4 + 2 * 2) * 24 if op == "KVCacheWrite" else 5 * 4 * 24
    tensors = [torch.zeros(first).view(5, -1).half(), torch.zeros(5, dtype=torch.int32),
               torch.zeros(3, dtype=torch.int32), torch.ones(3, dtype=torch.int32),
               torch.zeros(3, 4, dtype=torch.int32), torch.zeros(2, 9, 2, 2, 16, 24, dtype=torch.uint8),
               torch.zeros(5, 96).half()]  # fmt: skip
    aot.launch(op, a, "float16", tensors)
    kinds = [c[0] for c in driver.calls]
    assert kinds == ["load", "function", *(["attribute"] if shared > 48 * 1024 else []), "launch"]
    assert driver.calls[0][1] == ptx.encode() + b"\0" and driver.calls[1][1] == name.encode()
    _, gx, gy, gz, bx, by, bz, smem, stream, (values, ctypes_), extra = driver.calls[-1]
    assert [gx, gy, gz] == list(KERNELS[op].grid(a, 5)) and [bx, by, bz] == [32 * KERNELS[op].NUM_WARPS, 1, 1]
    assert smem == shared and stream == "stream" and extra == 0
    scalars = [5, 3, 4, 9, a.layer, common.float_bits(a.kv_scale)]
    assert list(values) == [t.data_ptr() for t in tensors[:6]] + scalars + [tensors[6].data_ptr()]
    assert list(ctypes_) == [ctypes.c_void_p] * 6 + [ctypes.c_int] * 6 + [ctypes.c_void_p]
