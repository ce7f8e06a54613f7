"""GPU check of the Triton plugin kernels (`make gpu-check`: one script for a lent H200 / H100 with torch, Triton
and cuda-python, no TensorRT; `--cpu`: the same parts (a) on CPU under Triton's interpreter, for CI).

(a) native: every vector of tests/vectors/*.npz (inputs only) through the kernels' entry points on CUDA tensors
    (toolchain/plugins/kernels: kv_cache_write, then paged_attention), against the reference ops
    (toolchain/engine/ops.py) in float64 on CPU. The pool's slots no sequence owns are poisoned first (NaN; int8,
    which has none: 127) and must come back bit-identical; a kernel reading one shows as NaN or a mismatch.
    Tolerances from the dtype: q and a float pool within one rounding (eps = 2^-10 fp16, 2^-7 bf16) of the
    float64 value, plus eps / 16 of the largest value (fp32 rotary's error is relative to its operands); an int8
    pool within one code (scale), fp8 within one e4m3 step (2^-3 relative, 2^-9 * scale near 0); the attention
    output within 4 eps x max |V| of float64 attention over the kernel's own q and pool.
(b) ahead of time, as TensorRT runs it: the PTX of toolchain.plugins.compile.compile_kernel (hidden scratch
    parameters stripped) loaded with cuModuleLoadData and launched with cuLaunchKernel with launch.py's argument
    list (input pointers, int32 scalars, output pointer), grid, block and shared memory; results must equal (a)'s
    bit for bit (same code, same options).
(c) compute-sanitizer memcheck and racecheck on one case (this script re-run under the tool), when the tool is on
    PATH or in /usr/local/cuda/bin.
(d) decode attention timed with CUDA events (warmup, median): batch 64 x 4096 context x 32 q / 8 KV heads x head
    128, fp16 and fp8 pools, and batch 1 x 32K; against torch's scaled_dot_product_attention (dense K/V,
    enable_gqa) on the same data in the same run; KV bytes read / time against the card's measured
    device-to-device copy bandwidth.

Writes gpu-check.json and gpu-check.md to --out (default $OUT or .); exits 1 on any mismatch or failure.
Runs standalone from a checkout (the repository root goes on sys.path).
"""

from __future__ import annotations

import os
import sys

if "--cpu" in sys.argv:  # Triton picks the interpreter when @triton.jit decorates: before any kernel import
    os.environ["TRITON_INTERPRET"] = "1"

import argparse
import ctypes
import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from toolchain.engine import ops  # noqa: E402
from toolchain.engine.ops import AttentionAttrs  # noqa: E402
from toolchain.plugins import launch  # noqa: E402
from toolchain.plugins.kernels import attention, kv_write  # noqa: E402

VECTORS = sorted((ROOT / "tests" / "vectors").glob("*.npz"))
CPU_CASES = ("f16-hd8-generic-stories", "f16-int8kv-hd64-linear-window", "f16-fp8kv-hd128-gqa8")  # small, no bf16
SANITIZED_CASE = "f16-hd64-gqa4-mixed"
ACT = {"f16": torch.float16, "bf16": torch.bfloat16}
POOL = {"f16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.uint8, "int8": torch.int8}
KV_NAME = {"f16": "float16", "bf16": "bfloat16", "fp8": "fp8", "int8": "int8"}
EPS = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}
POISON = {torch.float16: float("nan"), torch.bfloat16: float("nan"), torch.uint8: 0x7F, torch.int8: 127}


# --- cases --------------------------------------------------------------------------------------------------------


def load_case(path: Path) -> dict[str, Any]:
    """A vector's inputs: attrs, activation dtype, qkv, the batch tensors and the pool before the call."""
    v = dict(np.load(path))
    meta = json.loads(str(v["attrs"]))
    act, kv = meta.pop("activation"), meta.pop("kv")
    a = AttentionAttrs(**meta)
    pool = torch.from_numpy(v["kv_in"].copy())
    if kv in ("f16", "bf16"):
        pool = pool.view(POOL[kv])
    return {
        "name": path.stem,
        "attrs": a,
        "dtype": ACT[act],
        "qkv": torch.from_numpy(v["qkv"].copy()).view(ACT[act]),
        "batch": [torch.from_numpy(v[n].copy()) for n in ("position_ids", "context_lens", "new_lens", "block_tables")],
        "pool": pool,
    }


def slot_masks(case: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """(owned, written) over the pool's [layers, blocks, 2, kv_heads, tpb, head] elements: slots holding a
    sequence's tokens (cached or new) in the op's layer, and the slots of the new tokens."""
    a, pool = case["attrs"], case["pool"]
    _, ctx, new, tables = case["batch"]
    slots = torch.zeros(pool.shape[0], pool.shape[1], pool.shape[4], dtype=torch.bool)
    written = torch.zeros_like(slots)
    tpb = a.tokens_per_block
    for s in range(ctx.numel()):
        c, n = int(ctx[s]), int(new[s])
        for p in range(c + n):
            block = int(tables[s, p // tpb])
            slots[a.layer, block, p % tpb] = True
            written[a.layer, block, p % tpb] = p >= c
    shape = (pool.shape[0], pool.shape[1], 1, 1, pool.shape[4], 1)
    return slots.view(shape).expand(pool.shape), written.view(shape).expand(pool.shape)


def decoded(pool: torch.Tensor, a: AttentionAttrs) -> torch.Tensor:
    """The pool's values in float64 (codes times the scale for int8 / fp8)."""
    if a.kv_cache_dtype == "fp8":
        return pool.view(torch.float8_e4m3fn).double() * a.kv_scale
    if a.kv_cache_dtype == "int8":
        return pool.double() * a.kv_scale
    return pool.double()


def pool_tolerance(ref: torch.Tensor, a: AttentionAttrs, act: torch.dtype) -> torch.Tensor:
    if a.kv_cache_dtype == "int8":
        return torch.full_like(ref, a.kv_scale * 1.0001)
    if a.kv_cache_dtype == "fp8":
        return ref.abs() * 2.0**-3 + 2.0**-9 * a.kv_scale
    return rounding_tolerance(ref, act)


def rounding_tolerance(ref: torch.Tensor, act: torch.dtype) -> torch.Tensor:
    """One rounding to `act` (eps |ref|), plus eps / 16 of the largest |ref|: the kernel's fp32 rotary differs from
    float64 relative to its operands, not to a result that cancels to near 0 (angle error ~ position * 2^-24)."""
    return ref.abs() * EPS[act] + EPS[act] / 16 * float(ref.abs().max()) + 2.0**-24


def worst(got: torch.Tensor, ref: torch.Tensor, tol: torch.Tensor) -> tuple[float, bool]:
    """(max |got - ref| / tol, all within): NaN in got counts as outside."""
    d = (got.double() - ref).abs() / tol
    d = torch.where(torch.isnan(d), torch.full_like(d, float("inf")), d)
    m = float(d.max()) if d.numel() else 0.0
    return m, m <= 1.0


def run_native(case: dict[str, Any], device: str) -> dict[str, torch.Tensor]:
    """The entry points on `device`, the pool poisoned outside its owned slots; results back on CPU."""
    a = case["attrs"]
    owned, _ = slot_masks(case)
    pool = case["pool"].clone()
    pool[~owned] = torch.tensor(POISON[pool.dtype]).to(pool.dtype)
    before = pool.clone()
    batch = [t.to(device) for t in case["batch"]]
    pool_dev = pool.to(device)
    q = kv_write.kv_cache_write(a, case["qkv"].to(device), *batch, pool_dev)
    out = attention.paged_attention(a, q, *batch, pool_dev)
    if device == "cuda":
        torch.cuda.synchronize()
    return {"before": before, "q": q.cpu(), "pool": pool_dev.cpu(), "out": out.cpu()}


def check_native(case: dict[str, Any], got: dict[str, torch.Tensor]) -> dict[str, Any]:
    a, act = case["attrs"], case["dtype"]
    owned, written = slot_masks(case)
    ref_pool = case["pool"].clone()
    q_ref = ops.kv_cache_write(a, case["qkv"].double(), *case["batch"], ref_pool)
    q_ratio, q_ok = worst(got["q"], q_ref, rounding_tolerance(q_ref, act))
    ref_vals = decoded(ref_pool[written], a)
    pool_ratio, pool_ok = worst(decoded(got["pool"][written], a), ref_vals, pool_tolerance(ref_vals, a, act))
    kept = bool(torch.equal(got["pool"][~written].view(torch.uint8), got["before"][~written].view(torch.uint8)))
    # attention over the kernel's own q and pool (its poison replaced by the reference's zeros: never read)
    pool_in = got["pool"].clone()
    pool_in[~owned] = case["pool"][~owned]
    out_ref = ops.paged_attention(a, got["q"].double(), *case["batch"], pool_in)
    vmax = float(decoded(pool_in[owned], a).abs().max())
    out_ratio, out_ok = worst(got["out"], out_ref, torch.full_like(out_ref, 4 * EPS[act] * max(vmax, 1e-30)))
    return {
        "q_err_over_tol": q_ratio,
        "pool_err_over_tol": pool_ratio,
        "out_err_over_tol": out_ratio,
        "unowned_slots_untouched": kept,
        "pass": q_ok and pool_ok and out_ok and kept,
    }


# --- (b) the ahead-of-time path through the CUDA driver -----------------------------------------------------------


def _driver() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError:
        from cuda import cuda as driver  # cuda-python < 12.6
    return driver


def _ok(result: Any, what: str) -> Any:
    err = result[0] if isinstance(result, tuple) else result
    if int(err) != 0:
        raise RuntimeError(f"{what}: {err}")
    return result[1] if isinstance(result, tuple) and len(result) > 1 else None


class AotKernels:
    """Stripped PTX per (op, attrs, activation), loaded and launched through the driver API, as TensorRT does."""

    def __init__(self, arch: str, compile_kernel: Any = None, driver: Any = None):
        if compile_kernel is None:
            from toolchain.plugins.compile import compile_kernel
        self.compile_kernel, self.arch, self.driver = compile_kernel, arch, driver or _driver()
        self.loaded: dict[Any, Any] = {}

    def stream(self) -> Any:
        return self.driver.CUstream(torch.cuda.current_stream().cuda_stream)

    def launch(self, op: str, a: AttentionAttrs, activation: str, tensors: list[torch.Tensor]) -> dict[str, Any]:
        """tensors: the op's 6 inputs and its output, on CUDA; launched on torch's current stream."""
        d = self.driver
        key = (op, a, activation)
        if key not in self.loaded:
            k = self.compile_kernel(op, a, activation, self.arch)
            launch.check_ptx(op, a, activation, k.ptx)  # exactly TensorRT's argument list, scratch stripped
            module = _ok(d.cuModuleLoadData(k.ptx.encode() + b"\0"), "cuModuleLoadData")
            fn = _ok(d.cuModuleGetFunction(module, k.name.encode()), f"cuModuleGetFunction {k.name}")
            if k.shared > 48 * 1024:  # above the default limit a launch needs the opt-in (Triton's launcher does it)
                attr = d.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
                _ok(d.cuFuncSetAttribute(fn, attr, k.shared), "cuFuncSetAttribute")
            self.loaded[key] = (module, fn, k)
        _, fn, k = self.loaded[key]
        *inputs, out = tensors
        dims = launch.batch_dims(inputs[0].shape, inputs[3].shape, inputs[4].shape, inputs[5].shape)
        plan = launch.describe(op, a, dims, int(k.shared))
        assert plan.kernel == k.name, (plan.kernel, k.name)
        values = [t.data_ptr() for t in inputs] + [int(s) for s in plan.scalars] + [out.data_ptr()]
        types_ = [ctypes.c_void_p] * len(inputs) + [ctypes.c_int] * len(plan.scalars) + [ctypes.c_void_p]
        stream = self.stream()
        gx, gy, gz = (int(g) for g in plan.grid)
        args = (tuple(values), tuple(types_))
        _ok(d.cuLaunchKernel(fn, gx, gy, gz, plan.block_x, 1, 1, plan.shared_mem, stream, args, 0), "cuLaunchKernel")
        return {"kernel": plan.kernel, "grid": [gx, gy, gz], "block_x": plan.block_x, "shared_mem": plan.shared_mem}


def check_aot(aot: AotKernels, case: dict[str, Any], native: dict[str, torch.Tensor]) -> dict[str, Any]:
    a = case["attrs"]
    activation = str(case["dtype"]).removeprefix("torch.")
    batch = [t.cuda() for t in case["batch"]]
    pool = native["before"].cuda()
    width = launch.output_width(a)
    q = torch.full((case["qkv"].shape[0], width), float("nan"), dtype=case["dtype"], device="cuda")
    w = aot.launch("KVCacheWrite", a, activation, [case["qkv"].cuda(), *batch, pool, q])
    out = torch.full_like(q, float("nan"))
    p = aot.launch("PagedAttention", a, activation, [native["q"].cuda(), *batch, native["pool"].cuda(), out])
    torch.cuda.synchronize()

    def same(x: torch.Tensor, y: torch.Tensor) -> bool:
        return bool(torch.equal(x.cpu().view(torch.uint8), y.view(torch.uint8)))

    result = {"q_bitwise": same(q, native["q"]), "pool_bitwise": same(pool, native["pool"]),
              "out_bitwise": same(out, native["out"]), "launches": [w, p]}  # fmt: skip
    result["pass"] = result["q_bitwise"] and result["pool_bitwise"] and result["out_bitwise"]
    return result


# --- (c) compute-sanitizer ----------------------------------------------------------------------------------------


def sanitizer() -> str | None:
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    fallback = Path("/usr/local/cuda/bin/compute-sanitizer")
    return str(fallback) if fallback.is_file() else None


def run_sanitizer(tool_path: str, out: Path) -> dict[str, Any]:
    results = {}
    for tool in ("memcheck", "racecheck"):
        cmd = [tool_path, "--tool", tool, "--error-exitcode", "9", sys.executable, __file__, "--case", SANITIZED_CASE,
               "--native-only", "--out", str(out / f"sanitizer-{tool}")]  # fmt: skip
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            results[tool] = {"exit": res.returncode, "tail": (res.stdout + res.stderr)[-1500:]}
        except (OSError, subprocess.TimeoutExpired) as e:
            results[tool] = {"exit": None, "tail": str(e)}
        results[tool]["pass"] = results[tool]["exit"] == 0
    return results


# --- (d) timings --------------------------------------------------------------------------------------------------


def events(fn: Any, reps: int = 20, inner: int = 5) -> float:
    """Median seconds per call over `reps` timings of `inner` back-to-back calls, after a warmup."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / inner)
    return float(np.median(times))


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (GB/s)."""
    src = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    seconds = events(lambda: dst.copy_(src), reps=10, inner=2)
    return 2 * src.numel() / seconds / 1e9


def timing(batch: int, context: int, kv: str, heads: int = 32, kvh: int = 8, hd: int = 128, tpb: int = 64) -> Any:
    """Decode attention (one new token per sequence after `context` cached ones) through the native entry point."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    per_seq = -(-(context + 1) // tpb)
    num_blocks = batch * per_seq
    dense = torch.randn((num_blocks, 2, kvh, tpb, hd), device="cuda", generator=gen, dtype=torch.float16)
    scale = float(dense.abs().max()) / 448.0 if kv == "fp8" else 1.0
    if kv == "fp8":
        stored = (dense.float() / scale).to(torch.float8_e4m3fn)
        dense = (stored.float() * scale).half()  # SDPA gets the values the kernel decodes
        pool = stored.view(torch.uint8)[None]
    else:
        pool = dense[None]
    tables = torch.randperm(num_blocks, device="cuda", generator=gen).to(torch.int32).view(batch, per_seq)
    q = torch.randn((batch, heads * hd), device="cuda", dtype=torch.float16, generator=gen)
    ctx = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    new = torch.ones(batch, dtype=torch.int32, device="cuda")
    a = AttentionAttrs(layer=0, num_heads=heads, num_kv_heads=kvh, head_size=hd, tokens_per_block=tpb,
                       kv_cache_dtype="fp8" if kv == "fp8" else "float16", kv_scale=scale)  # fmt: skip
    args = (q, ctx.clone(), ctx, new, tables, pool)  # position of the new token = context
    plugin_s = events(lambda: attention.paged_attention(a, *args))
    out = attention.paged_attention(a, *args)
    # the same data, dense: [batch, kv heads, context + 1, head]
    rows = tables.long()
    k = dense[:, 0][rows].permute(0, 2, 1, 3, 4).reshape(batch, kvh, per_seq * tpb, hd)[:, :, : context + 1]
    v = dense[:, 1][rows].permute(0, 2, 1, 3, 4).reshape(batch, kvh, per_seq * tpb, hd)[:, :, : context + 1]
    query = q.view(batch, heads, 1, hd)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    sdpa_s = events(lambda: sdpa(query, k, v, enable_gqa=True))
    ref = sdpa(query.float(), k.float(), v.float(), enable_gqa=True).reshape(batch, heads * hd)
    elem = 1 if kv == "fp8" else 2
    kv_bytes = 2 * batch * (context + 1) * kvh * hd * elem
    return {
        "batch": batch, "context": context, "pool": kv, "tokens_per_block": tpb,
        "kv_bytes": kv_bytes, "plugin_s": plugin_s, "plugin_gb_s": kv_bytes / plugin_s / 1e9,
        "sdpa_s": sdpa_s, "sdpa_kv_bytes": 2 * batch * (context + 1) * kvh * hd * 2,
        "rel_err_vs_fp32_sdpa": float((out.float() - ref).norm() / ref.norm()),
    }  # fmt: skip


# --- report -------------------------------------------------------------------------------------------------------


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# GPU check: {report['device']} ({report['arch']}) — {'PASS' if report['passed'] else 'FAIL'}", ""]
    lines += ["| case | q | pool | out | unowned kept | aot bitwise | pass |", "|---|---:|---:|---:|---|---|---|"]
    for name, r in report["native"].items():
        aot = report["aot"].get(name, {}) if isinstance(report["aot"], dict) else {}
        lines.append(
            f"| {name} | {r['q_err_over_tol']:.2f} | {r['pool_err_over_tol']:.2f} | {r['out_err_over_tol']:.2f} "
            f"| {r['unowned_slots_untouched']} | {aot.get('pass', '-')} | {r['pass']} |"
        )
    lines.append("\n(errors as a fraction of the dtype's tolerance: ≤ 1 passes)")
    for part in ("aot", "sanitizer", "timing"):
        if isinstance(report[part], dict) and "skipped" in report[part]:
            lines.append(f"\n{part}: skipped — {report[part]['skipped']}")
    if isinstance(report["sanitizer"], dict) and "memcheck" in report["sanitizer"]:
        for tool, r in report["sanitizer"].items():
            lines.append(f"\ncompute-sanitizer {tool}: exit {r['exit']}")
    if isinstance(report["timing"], list):
        lines += ["", f"device-to-device copy: {report['copy_gb_s']:.0f} GB/s", "",
                  "| batch x context | pool | plugin µs | GB/s | % of copy | SDPA µs | rel err vs fp32 SDPA |",
                  "|---|---|---:|---:|---:|---:|---:|"]  # fmt: skip
        for t in report["timing"]:
            lines.append(
                f"| {t['batch']} x {t['context']} | {t['pool']} | {t['plugin_s'] * 1e6:.1f} | {t['plugin_gb_s']:.0f} "
                f"| {t['pct_of_copy']:.0f} | {t['sdpa_s'] * 1e6:.1f} | {t['rel_err_vs_fp32_sdpa']:.1e} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    ap.add_argument("--cpu", action="store_true", help="part (a) on CPU under TRITON_INTERPRET=1, small cases only")
    ap.add_argument("--case", action="append", help="only these vectors (by name)")
    ap.add_argument("--native-only", action="store_true", help="part (a) only (used under compute-sanitizer)")
    ap.add_argument("--no-timing", action="store_true")
    args = ap.parse_args()
    gpu = not args.cpu
    if gpu and not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device visible to torch; on a machine without one, run with --cpu")
    names = args.case or (CPU_CASES if args.cpu else [p.stem for p in VECTORS])
    unknown = sorted(set(names) - {p.stem for p in VECTORS})
    if unknown:
        sys.exit(f"gpu_check: unknown case(s) {', '.join(unknown)}; choose from {', '.join(p.stem for p in VECTORS)}")
    cases = [load_case(p) for p in VECTORS if p.stem in names]
    if gpu:
        major, minor = torch.cuda.get_device_capability()
        device, arch = torch.cuda.get_device_name(), f"sm_{major}{minor}"
    else:
        device, arch = "CPU (Triton interpreter)", "interpreter"
    import triton

    report: dict[str, Any] = {"device": device, "arch": arch, "triton": triton.__version__, "torch": torch.__version__,
                              "mode": "cpu" if args.cpu else "gpu", "native": {}}  # fmt: skip
    natives = {}
    for case in cases:
        t0 = time.perf_counter()
        try:
            natives[case["name"]] = run_native(case, "cuda" if gpu else "cpu")
            report["native"][case["name"]] = check_native(case, natives[case["name"]])
        except Exception as e:  # one broken case must not hide the others' results
            nan = float("nan")
            report["native"][case["name"]] = {
                "error": f"{type(e).__name__}: {e}", "pass": False, "q_err_over_tol": nan, "pool_err_over_tol": nan,
                "out_err_over_tol": nan, "unowned_slots_untouched": False,
            }  # fmt: skip
        report["native"][case["name"]]["seconds"] = time.perf_counter() - t0
    ok = all(r["pass"] for r in report["native"].values())
    why_not = "needs a CUDA GPU (--cpu run)" if not gpu else "--native-only" if args.native_only else None
    if why_not:
        report["aot"] = {"skipped": why_not}
    else:
        try:
            aot = AotKernels(arch)
            report["aot"] = {c["name"]: check_aot(aot, c, natives[c["name"]]) for c in cases if c["name"] in natives}
        except Exception as e:
            report["aot"] = {"error": f"{type(e).__name__}: {e}", "pass": False}
        ok &= all(r["pass"] for r in report["aot"].values()) if "error" not in report["aot"] else False
    tool = sanitizer() if not why_not else None
    if why_not:
        report["sanitizer"] = {"skipped": why_not}
    elif tool is None:
        report["sanitizer"] = {"skipped": "compute-sanitizer is neither on PATH nor in /usr/local/cuda/bin"}
    else:
        report["sanitizer"] = run_sanitizer(tool, args.out)
        ok &= all(r["pass"] for r in report["sanitizer"].values())
    if why_not or args.no_timing:
        report["timing"] = {"skipped": why_not or "--no-timing"}
    else:
        report["copy_gb_s"] = copy_bandwidth()
        report["timing"] = [timing(64, 4096, "float16"), timing(64, 4096, "fp8"), timing(1, 32768, "float16")]
        for t in report["timing"]:
            t["pct_of_copy"] = 100 * t["plugin_gb_s"] / report["copy_gb_s"]
    report["passed"] = ok
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu-check.json").write_text(json.dumps(report, indent=2))
    text = markdown(report)
    (args.out / "gpu-check.md").write_text(text)
    print(text)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
