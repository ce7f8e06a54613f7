"""GPU check of the CUDA plugins (`make gpu-check`; one script, a few minutes on an H200, through the device tool).

1. compile plugins/attention.cu with NVRTC for this GPU's SM;
2. replay every test vector (tests/vectors/*.npz) through the kernels — KV write, then attention both in one pass
   and split over 3 key ranges + the LSE reduce — and compare with the reference outputs stored in the vector:
   ||gpu - ref|| / ||ref|| < 1e-2 for q, the attention output and the written pool; the blocks no sequence owns
   untouched; every output element written (outputs are poisoned with NaN first) and no NaN anywhere;
3. compute-sanitizer memcheck and racecheck on one small case (this script re-run under the tool);
4. time decode attention at batch 64 x context 4096 x 32 query / 8 KV heads x head_dim 128 and at batch 1 x 32K,
   fp16, against the card's measured device-to-device copy bandwidth and torch's scaled_dot_product_attention on
   the same data; KV bytes read / time = achieved bandwidth.

Kernel names, grids, block size and the scalar arguments in order come from toolchain/plugins/launch.py, the
description TensorRT's registration (toolchain/plugins/tensorrt_registration.py) launches from, so this check runs
the launches a TensorRT engine would make (plus the split-K variant, described there too).

Writes gpu-check.json and gpu-check.md to --out (default $OUT or .), prints the table last.
Runs standalone from a checkout (`python3 plugins/gpu_check.py`: the repository root goes on sys.path).
Needs: torch with CUDA, cuda-bindings, NVRTC (the GPU image has all three), rich; no TensorRT.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from toolchain.engine.ops import AttentionAttrs  # noqa: E402
from toolchain.plugins import launch  # noqa: E402

VECTORS = sorted((ROOT / "tests" / "vectors").glob("*.npz"))
ACTIVATION = {short: name for name, short in launch.ACTIVATIONS.items()}  # "f16" -> "float16"


class Kernels:
    def __init__(self, cubin: Path):
        import torch
        from cuda.bindings import driver

        self.torch, self.driver = torch, driver
        torch.cuda.init()
        torch.empty(1, device="cuda")  # the primary context, current on this thread
        err, self.module = driver.cuModuleLoadData(cubin.read_bytes())
        assert int(err) == 0, f"cuModuleLoadData: {err}"
        self.functions: dict[str, Any] = {}

    def launch(self, name: str, grid: tuple[int, int, int], args: list[tuple[Any, Any]]) -> None:
        driver = self.driver
        if name not in self.functions:
            err, fn = driver.cuModuleGetFunction(self.module, name.encode())
            assert int(err) == 0, f"{name}: {err}"
            self.functions[name] = fn
        values = tuple(a for a, _ in args)
        types = tuple(t for _, t in args)
        stream = self.torch.cuda.current_stream().cuda_stream
        threads = launch.BLOCK_THREADS
        (err,) = driver.cuLaunchKernel(self.functions[name], *grid, threads, 1, 1, 0, stream, (values, types), 0)
        assert int(err) == 0, f"launch {name}: {err}"


def ptr(t: Any) -> tuple[int, Any]:
    return (t.data_ptr(), ctypes.c_void_p)


def i32(v: int) -> tuple[int, Any]:
    return (int(v), ctypes.c_int)


def run_case(k: Kernels, v: dict[str, np.ndarray], splits: int, dev: str = "cuda") -> dict[str, Any]:
    """One vector through the kernels (`dev` other than cuda only for tests/plugins/test_plugins.py, which records the
    launches on CPU with a stand-in for Kernels)."""
    torch = k.torch
    meta = json.loads(str(v["attrs"]))
    act, kv = meta["activation"], meta["kv"]
    half = {"f16": torch.float16, "bf16": torch.bfloat16}
    store = {"f16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.uint8, "int8": torch.int8}
    qkv = torch.from_numpy(v["qkv"].copy()).view(half[act]).to(dev)
    pos, ctx, new, tables = (
        torch.from_numpy(v[n]).to(dev) for n in ("position_ids", "context_lens", "new_lens", "block_tables")
    )
    pool = torch.from_numpy(v["kv_in"].copy()).to(dev)
    pool = pool.view(store[kv]) if kv in ("f16", "bf16") else pool
    before = pool.clone()
    attrs = AttentionAttrs(**{name: value for name, value in meta.items() if name not in ("activation", "kv")})
    activation = ACTIVATION[act]
    t, heads, hd = qkv.shape[0], attrs.num_heads, attrs.head_size
    num_blocks, tpb = pool.shape[1], attrs.tokens_per_block
    q = torch.full((t, launch.output_width(attrs)), float("nan"), dtype=half[act], device=dev)
    out = torch.full((t, launch.output_width(attrs)), float("nan"), dtype=half[act], device=dev)
    dims = (t, ctx.numel(), tables.shape[1], num_blocks)  # num_tokens, num_seqs, max_blocks, num_blocks
    inputs = [ptr(qkv), ptr(pos), ptr(ctx), ptr(new), ptr(tables), ptr(pool)]
    scalars = [i32(x) for x in launch.kv_write_scalars(attrs, *dims)]
    k.launch(launch.kv_write_kernel(attrs, activation), launch.kv_write_grid(t), [*inputs, *scalars, ptr(q)])
    inputs[0] = ptr(q)
    scalars = [i32(x) for x in launch.attention_scalars(attrs, *dims)]
    if splits == 1:
        name = launch.attention_kernel(attrs, activation)
        k.launch(name, launch.attention_grid(attrs, t), [*inputs, *scalars, ptr(out)])
    else:
        part_o = torch.full((t * heads * splits * hd,), float("nan"), device=dev)
        part_ml = torch.full((t * heads * splits * 2,), float("nan"), device=dev)
        k.launch(
            launch.attention_split_kernel(attrs, activation),
            launch.attention_split_grid(attrs, t, splits),
            [*inputs, *scalars, i32(splits), ptr(part_o), ptr(part_ml)],
        )
        k.launch(
            launch.reduce_kernel(activation),
            (t * heads, 1, 1),
            [ptr(part_o), ptr(part_ml), i32(t), i32(heads), i32(hd), i32(splits), ptr(out)],
        )
    if dev == "cuda":
        torch.cuda.synchronize()

    def rel(a: Any, b: np.ndarray) -> float:
        ref = torch.from_numpy(np.asarray(b, dtype=np.float32))
        return float((a.float().cpu() - ref).norm() / ref.norm().clamp_min(1e-12))

    scale = attrs.kv_scale

    def dequant(p: Any) -> Any:
        if kv == "fp8":
            return p.cpu().view(torch.float8_e4m3fn).float() * scale
        if kv == "int8":
            return p.cpu().float() * scale
        return p.cpu().float()

    ref_pool = torch.from_numpy(v["kv_ref"].copy())
    ref_pool = ref_pool.view(store[kv]) if kv in ("f16", "bf16") else ref_pool
    owned = torch.zeros(num_blocks, dtype=torch.bool)
    for s in range(ctx.numel()):
        used = -(-(int(v["context_lens"][s]) + int(v["new_lens"][s])) // tpb)
        owned[torch.from_numpy(v["block_tables"][s, :used]).long()] = True
    untouched = bool(torch.equal(pool[:, ~owned.to(dev)].cpu(), before[:, ~owned.to(dev)].cpu()))
    return {
        "q_rel": rel(q, v["q_ref"]),
        "out_rel": rel(out, v["out_ref"]),
        "pool_rel": float((dequant(pool) - dequant(ref_pool)).norm() / dequant(ref_pool).norm().clamp_min(1e-12)),
        "finite": bool(torch.isfinite(q).all() and torch.isfinite(out).all()),
        "untouched_blocks_kept": untouched,
    }


def timing(
    k: Kernels, batch: int, context: int, heads: int = 32, kvh: int = 8, hd: int = 128, tpb: int = 16
) -> dict[str, Any]:
    """Decode (one new token per sequence) attention over `context` cached tokens, fp16 activations and KV."""
    torch = k.torch
    dev = "cuda"
    per_seq = context // tpb
    num_blocks = batch * per_seq
    gen = torch.Generator(device=dev).manual_seed(0)
    pool = torch.randn((1, num_blocks, 2, kvh, tpb, hd), device=dev, generator=gen, dtype=torch.float16)
    order = torch.randperm(num_blocks, device=dev, generator=gen).to(torch.int32)
    tables = order.view(batch, per_seq).contiguous()
    q = torch.randn((batch, heads * hd), device=dev, dtype=torch.float16, generator=gen)
    out = torch.empty_like(q)
    pos = torch.full((batch,), context - 1, dtype=torch.int32, device=dev)
    ctx = pos.clone()
    new = torch.ones(batch, dtype=torch.int32, device=dev)
    kv_bytes = batch * context * kvh * hd * 2 * 2
    attrs = AttentionAttrs(
        layer=0, num_heads=heads, num_kv_heads=kvh, head_size=hd, tokens_per_block=tpb, kv_cache_dtype="float16"
    )
    scalars = [i32(x) for x in launch.attention_scalars(attrs, batch, batch, per_seq, num_blocks)]
    args = [ptr(q), ptr(pos), ptr(ctx), ptr(new), ptr(tables), ptr(pool), *scalars]

    def events(fn: Any, reps: int = 20) -> float:
        for _ in range(3):
            fn()
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        return float(np.median(times))

    results: dict[str, Any] = {"batch": batch, "context": context, "kv_bytes": kv_bytes}
    best = None
    for splits in (1, 2, 4, 8, 16, 32, 64):
        if splits > 1 and batch * kvh * splits > 8 * 132 * 4:
            break
        part_o = torch.empty(batch * heads * splits * hd, device=dev)
        part_ml = torch.empty(batch * heads * splits * 2, device=dev)

        def run(splits: int = splits, part_o: Any = part_o, part_ml: Any = part_ml) -> None:
            if splits == 1:
                k.launch(
                    launch.attention_kernel(attrs, "float16"), launch.attention_grid(attrs, batch), [*args, ptr(out)]
                )
            else:
                k.launch(
                    launch.attention_split_kernel(attrs, "float16"),
                    launch.attention_split_grid(attrs, batch, splits),
                    [*args, i32(splits), ptr(part_o), ptr(part_ml)],
                )
                k.launch(
                    launch.reduce_kernel("float16"),
                    (batch * heads, 1, 1),
                    [ptr(part_o), ptr(part_ml), i32(batch), i32(heads), i32(hd), i32(splits), ptr(out)],
                )

        seconds = events(run)
        results[f"splits_{splits}_s"] = seconds
        if best is None or seconds < best[1]:
            best = (splits, seconds)
    assert best is not None
    results["best_splits"], results["plugin_s"] = best
    results["plugin_gb_s"] = kv_bytes / best[1] / 1e9
    # the same data, dense, through torch's SDPA (one query per sequence)
    keys = pool[0, :, 0][tables.long()].permute(0, 2, 1, 3, 4).reshape(batch, kvh, context, hd)
    values = pool[0, :, 1][tables.long()].permute(0, 2, 1, 3, 4).reshape(batch, kvh, context, hd)
    query = q.view(batch, heads, 1, hd)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    results["sdpa_s"] = events(lambda: sdpa(query, keys, values, enable_gqa=True))
    results["sdpa_gb_s"] = kv_bytes / results["sdpa_s"] / 1e9
    # `out` holds the last variant run; every variant computes the same function
    ref = sdpa(query.float(), keys.float(), values.float(), enable_gqa=True).view(batch, heads * hd)
    results["rel_err_vs_fp32_sdpa"] = float((out.float() - ref).norm() / ref.norm())
    return results


def copy_bandwidth(torch: Any) -> float:
    src = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * src.numel() * 10 / (time.perf_counter() - start) / 1e9  # bytes read + written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    ap.add_argument("--case", help="run one vector only (used under compute-sanitizer)")
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--no-sanitizer", action="store_true")
    args = ap.parse_args()
    import torch

    from toolchain.plugins.compile import compile_plugins

    major, minor = torch.cuda.get_device_capability()
    arch = f"sm_{major}{minor}"
    build = compile_plugins((arch,), ROOT / "plugins" / "build")[0]
    kernels = Kernels(build.cubin)
    report: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "arch": arch, "cases": {}}
    vectors = [p for p in VECTORS if args.case in (None, p.stem)]
    ok = True
    for path in vectors:
        data = dict(np.load(path))
        for splits in (1, 3):
            r = run_case(kernels, data, splits)
            passed = r["finite"] and r["untouched_blocks_kept"] and max(r["q_rel"], r["out_rel"], r["pool_rel"]) < 1e-2
            report["cases"][f"{path.stem}/splits{splits}"] = {**r, "pass": passed}
            ok &= passed
    if args.case:
        print(json.dumps(report["cases"], indent=2))
        sys.exit(0 if ok else 1)
    if not args.no_sanitizer:
        small = VECTORS[0].stem
        for tool in ("memcheck", "racecheck"):
            cmd = [
                "compute-sanitizer",
                "--tool",
                tool,
                "--error-exitcode",
                "9",
                sys.executable,
                __file__,
                "--case",
                small,
                "--no-timing",
                "--no-sanitizer",
            ]
            try:
                res = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
                tail = (res.stdout + res.stderr)[-1500:]
                report[f"sanitizer_{tool}"] = {"exit": res.returncode, "tail": tail}
            except (OSError, subprocess.TimeoutExpired) as e:
                report[f"sanitizer_{tool}"] = {"exit": None, "tail": str(e)}
    if not args.no_timing:
        report["copy_gb_s"] = copy_bandwidth(torch)
        report["timing"] = [timing(kernels, 64, 4096), timing(kernels, 1, 32768)]
        for t in report["timing"]:
            t["pct_of_copy"] = 100 * t["plugin_gb_s"] / report["copy_gb_s"]
    report["all_vectors_pass"] = ok
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu-check.json").write_text(json.dumps(report, indent=2))
    lines = [
        f"GPU {report['gpu']} ({arch}); vectors: {'all pass' if ok else 'FAILURES'}",
        "",
        "| case | q rel | out rel | pool rel | untouched | pass |",
        "|---|---:|---:|---:|---|---|",
    ]
    for name, r in report["cases"].items():
        lines.append(
            f"| {name} | {r['q_rel']:.2e} | {r['out_rel']:.2e} | {r['pool_rel']:.2e} | "
            f"{r['untouched_blocks_kept']} | {r['pass']} |"
        )
    for tool in ("memcheck", "racecheck"):
        if f"sanitizer_{tool}" in report:
            lines.append(f"\ncompute-sanitizer {tool}: exit {report[f'sanitizer_{tool}']['exit']}")
    if "timing" in report:
        lines += [
            "",
            f"device-to-device copy: {report['copy_gb_s']:.0f} GB/s (read + written)",
            "",
            "| shape | splits | plugin ms | plugin GB/s | % of copy | SDPA ms | SDPA GB/s | rel err |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for t in report["timing"]:
            lines.append(
                f"| batch {t['batch']} x {t['context']} | {t['best_splits']} | {1e3 * t['plugin_s']:.3f} | "
                f"{t['plugin_gb_s']:.0f} | {t['pct_of_copy']:.0f} % | {1e3 * t['sdpa_s']:.3f} | "
                f"{t['sdpa_gb_s']:.0f} | {t['rel_err_vs_fp32_sdpa']:.1e} |"
            )
    (args.out / "gpu-check.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
