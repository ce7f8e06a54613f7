"""Ahead-of-time compilation of the Triton plugin kernels (toolchain/plugins/kernels) to the PTX TensorRT's
`aot_impl` takes and a cubin per SM, with no GPU and no driver (the triton wheel ships ptxas): `compile_kernel` for
one plugin instance (TensorRT's registration calls it at engine build with the build GPU's SM),
`compile_variants` for the matrix `trtbuild plugins compile` checks on every SM.

The PTX is Triton's with its hidden scratch parameters taken off the entry (toolchain/plugins/ptx.py) and the PTX
ISA version set per SM (PTX_ISA: the oldest that knows the SM, so a driver is never asked to JIT a newer ISA than
the GPU itself needs); the cubin and the reported registers, spills and shared memory are ptxas' on that stripped
PTX, with Triton's own ptxas flags. Results are cached on disk by a hash of everything that shapes them.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import re
import subprocess
import tempfile
import time
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field, replace
from multiprocessing import get_context
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

from toolchain.engine.ops import AttentionAttrs, MoEAttrs
from toolchain.errors import UserError
from toolchain.plugins import ptx as ptxtext

if TYPE_CHECKING:
    from toolchain.plugins.kernels.moe import Stage

# a plugin instance's attributes: an attention op's, a MoE stage's, or the MoE op's own (its routing sort)
Attrs: TypeAlias = "AttentionAttrs | Stage | MoEAttrs"

KERNEL_DIR = Path(__file__).resolve().parent / "kernels"

# The PTX ISA version per SM: the first ISA that knows the SM's target (sm_90a: 8.0, CUDA 12.0; sm_100a: 8.6 and
# sm_120a: 8.7, CUDA 12.8), and never below 8.0. A driver JIT-compiles PTX only up to its own CUDA version's ISA
# (an r535 driver, CUDA 12.2, refuses .version 8.8), and Triton's default is its ptxas' newest (8.8 for sm_80-89 with
# ptxas 12.9, 9.4 for sm_90+ with ptxas 13.4: a CUDA 13.4 driver). So sm_80-90 PTX loads on any CUDA 12 driver
# (what TensorRT 10 needs anyway), Blackwell PTX on any driver that runs Blackwell. ptxas checks every
# instruction against the declared version, so a kernel that needs a newer ISA fails here, not on a GPU.
PTX_ISA = {80: 80, 86: 80, 89: 80, 90: 80, 100: 86, 120: 87}
ARCHS = tuple(f"sm_{cap}" for cap in PTX_ISA)

# Every pointer argument is declared 16-byte aligned (Triton's tt.divisibility), as Triton's own launcher declares
# any pointer it finds so aligned (torch's allocations always are): without it every global load is a scalar 2-byte
# one (measured: the sm_90 attention kernel's 80 ld.global.b16 become 10 ld.global.v4), and the PTX TensorRT runs
# would not be the code the GPU check ran. TensorRT's tensors are 256-byte aligned (its allocations, and the
# addresses setTensorAddress accepts); the plugins' inputs and outputs are whole tensors, never offset views.
POINTER_ALIGNMENT = 16


def cache_dir() -> Path:
    """$XDG_CACHE_HOME/trtbuild/plugins (~/.cache/trtbuild/plugins): shared by the CLI, the engine build and the
    tests, so a kernel compiled once is not compiled again."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trtbuild" / "plugins"


def capability(arch: str | int) -> int:
    """sm_90 / "90" / 90 -> 90; anything else is refused in one line naming the supported SMs."""
    text = str(arch).strip()
    m = re.fullmatch(r"(?:sm_)?(\d{2,3})", text)
    if not m or int(m.group(1)) not in PTX_ISA:
        why = "is not of the form sm_XX" if not m else "is not supported"
        raise UserError(
            f"--arch {text} {why}: the Triton kernels compile for {', '.join(ARCHS)} "
            "(the SMs triton 3.9's ptxas and the PTX_ISA table in toolchain/plugins/compile.py know)"
        )
    return int(m.group(1))


@dataclass(frozen=True)
class CompiledKernel:
    """One kernel variant for one SM: the PTX TensorRT loads (hidden parameters stripped), its cubin, resources."""

    op: str
    name: str  # the PTX entry's name (TensorRT's aot_impl kernel name)
    arch: str
    activation: str
    ptx: str
    cubin: bytes
    registers: int
    spill_stores: int
    spill_loads: int
    shared_bytes: int  # dynamic shared memory per block (Triton's metadata.shared): the launch must pass it
    static_shared_bytes: int  # ptxas' smem (0 for Triton kernels: their shared memory is all dynamic)
    stack_bytes: int
    num_warps: int
    threads: int  # block threads: num_warps * 32 (the PTX's .reqntid)
    params: list[str]  # the entry's parameter types in order, e.g. "u64 ptr", "u32"
    ptx_version: str
    triton_version: str
    ptxas_version: str
    key: str
    cached: bool = False
    compile_s: float = 0.0

    @property
    def shared(self) -> int:
        """Triton's name (metadata.shared) for shared_bytes: the launch's dynamic shared memory."""
        return self.shared_bytes

    @property
    def spills(self) -> int:
        return self.spill_stores + self.spill_loads


def _check_compilable(op: str) -> Any:
    from toolchain.plugins.kernels import COMPILED, COMPILED_FUNCTIONS

    if op not in COMPILED:
        raise UserError(f"kernel op {op!r} is not one of {', '.join(COMPILED)}")
    fn = COMPILED_FUNCTIONS[op]
    from triton.runtime.jit import JITFunction

    if not isinstance(fn, JITFunction) or os.environ.get("TRITON_INTERPRET", "0").lower() not in ("", "0", "false"):
        raise UserError(
            "TRITON_INTERPRET is set in this process: the kernels were decorated as interpreted functions, which "
            "triton.compile cannot compile to PTX; run the compile in a process without TRITON_INTERPRET "
            "(the tests do it in a subprocess)"
        )
    return fn


@functools.cache
def _ptxas(cap: int) -> tuple[str, str]:
    """(path, version line) of the ptxas Triton itself uses for this SM (ptxas-blackwell from sm_90 on)."""
    from triton.backends.nvidia.compiler import get_ptxas

    tool = get_ptxas(cap)
    return tool.path, str(tool.version)


def _source_digest() -> str:
    """The kernels package's sources and this compiler's own (its flags and PTX_ISA shape the output too)."""
    h = hashlib.sha256()
    for path in [*sorted(KERNEL_DIR.glob("*.py")), Path(__file__), Path(ptxtext.__file__)]:
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def _options(module: Any, cap: int) -> dict[str, Any]:
    from toolchain.plugins.kernels import common

    return {"num_warps": module.NUM_WARPS, **common.OPTIONS, "ptx_version": PTX_ISA[cap]}


def _alignment(signature: dict[str, str]) -> dict[tuple[int], list[list[Any]]]:
    """ASTSource's attrs: POINTER_ALIGNMENT on every pointer parameter."""
    return {(i,): [["tt.divisibility", POINTER_ALIGNMENT]] for i, t in enumerate(signature.values()) if t[0] == "*"}


def _key(op: str, attrs: Attrs, activation: str, cap: int, digest: str) -> str:
    import triton

    from toolchain.plugins.kernels import COMPILED

    module = COMPILED[op]
    what = {
        "sources": digest,
        "triton": triton.__version__,
        "ptxas": _ptxas(cap)[1],
        "op": op,
        "activation": activation,
        "signature": module.signature(attrs, activation),
        "constexprs": module.constexprs(attrs, activation),
        "arch": cap,
        "options": _options(module, cap),
        "alignment": POINTER_ALIGNMENT,
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=repr).encode()).hexdigest()[:20]


def _paths(out_dir: Path, op: str, cap: int, key: str) -> dict[str, Path]:
    """The cache entry's files: .ptx (what TensorRT loads), .cubin, .json (the record; written last)."""
    return {ext: out_dir / f"{op}-sm_{cap}-{key}{ext}" for ext in (".ptx", ".cubin", ".json")}


def _write(path: Path, data: bytes) -> None:
    """Write through a temporary sibling and rename: a concurrent reader of the cache sees all or nothing."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would keep the cache from other users of a shared --out
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _run_ptxas(ptx: str, cap: int, name: str, fp_fusion: bool) -> tuple[bytes, ptxtext.PtxasReport]:
    """The cubin of the stripped PTX and ptxas' report on it, with the flags of Triton's make_cubin (line info,
    no FMA contraction unless enabled, --regAllocOptLevel=2) for Triton's target name (sm_90a ...)."""
    from triton.backends.nvidia.compiler import sm_arch_from_capability

    path, _ = _ptxas(cap)
    with tempfile.TemporaryDirectory(prefix="trtbuild-ptxas-") as tmp:
        src, out = Path(tmp) / f"{name}.ptx", Path(tmp) / f"{name}.cubin"
        src.write_text(ptx)
        cmd = [path, "-lineinfo", *([] if fp_fusion else ["--fmad=false"]), "-v", "--regAllocOptLevel=2"]
        cmd += [f"--gpu-name={sm_arch_from_capability(cap)}", str(src), "-o", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
        log = proc.stdout + proc.stderr
        if proc.returncode != 0:
            first = next((line for line in log.splitlines() if "error" in line.lower()), log.strip()[:300])
            raise UserError(f"ptxas refused kernel {name} for sm_{cap}: {first}")
        return out.read_bytes(), ptxtext.parse_ptxas(log, name)


def compile_kernel(
    op: str, attrs: Attrs, activation: str, arch: str | int, out_dir: Path | None = None
) -> CompiledKernel:
    """Kernel `op` (a toolchain.plugins.kernels.COMPILED key) for one plugin instance's attributes and activation
    dtype on one SM: from the cache under `out_dir` (default cache_dir()) when an identical compile is there."""
    fn = _check_compilable(op)
    cap = capability(arch)
    from toolchain.plugins.kernels import COMPILED

    module = COMPILED[op]
    module.check(attrs, activation)
    key = _key(op, attrs, activation, cap, _source_digest())
    out_dir = out_dir or cache_dir()
    paths = _paths(out_dir, op, cap, key)
    if all(p.is_file() for p in paths.values()):
        meta = json.loads(paths[".json"].read_text())
        return CompiledKernel(**meta, ptx=paths[".ptx"].read_text(), cubin=paths[".cubin"].read_bytes(), cached=True)

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    start = time.perf_counter()
    signature = module.signature(attrs, activation)
    constexprs = module.constexprs(attrs, activation)
    options = _options(module, cap)
    source = ASTSource(fn, signature, constexprs, _alignment(signature))
    compiled = triton.compile(source, target=GPUTarget("cuda", cap, 32), options=options)
    md = compiled.metadata
    name = md.name
    for what, size in (("global", md.global_scratch_size), ("profile", md.profile_scratch_size)):
        if size:
            raise ptxtext.ScratchError(
                f"kernel {name} ({op}, {activation}, sm_{cap}) needs {size} bytes of {what} scratch memory, which "
                "TensorRT's ahead-of-time launch cannot pass; change the kernel so Triton allocates none"
            )
    num_params = sum(1 for t in signature.values() if t != "constexpr")
    stripped = ptxtext.strip_hidden_params(compiled.asm["ptx"], num_params)
    cubin, report = _run_ptxas(stripped, cap, name, bool(options.get("enable_fp_fusion", False)))
    _, params = ptxtext.entry(stripped)
    kernel = CompiledKernel(
        op=op,
        name=name,
        arch=f"sm_{cap}",
        activation=activation,
        ptx=stripped,
        cubin=cubin,
        registers=report.registers,
        spill_stores=report.spill_stores,
        spill_loads=report.spill_loads,
        shared_bytes=int(md.shared or 0),
        static_shared_bytes=report.static_shared_bytes,
        stack_bytes=report.stack_bytes,
        num_warps=int(md.num_warps),
        threads=int(md.num_warps) * 32,
        params=[str(p) for p in params],
        ptx_version=ptxtext.version(stripped),
        triton_version=triton.__version__,
        ptxas_version=_ptxas(cap)[1],
        key=key,
        compile_s=round(time.perf_counter() - start, 3),
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    _write(paths[".ptx"], stripped.encode())
    _write(paths[".cubin"], cubin)
    meta = {k: v for k, v in asdict(kernel).items() if k not in ("ptx", "cubin", "cached")}
    _write(paths[".json"], json.dumps(meta, indent=2).encode())  # last: its presence means the entry is whole
    return kernel


@dataclass(frozen=True)
class Variant:
    """One plugin instance `plugins compile` compiles on every SM: a name, the activation dtype, the attributes,
    the kernels (ops) compiled for it: both attention-pool kernels of an AttentionAttrs, the MoE kernel of a
    moe.Stage, the routing sort of a MoEAttrs."""

    name: str
    activation: str
    attrs: Attrs = field(compare=False)
    ops: tuple[str, ...] = ("KVCacheWrite", "PagedAttention")


_STANDARD = AttentionAttrs(layer=0, num_heads=32, num_kv_heads=8, head_size=128, tokens_per_block=32)
"""A Llama-3-8B-like layer: 32 heads, 8 KV heads, head size 128, 32 tokens per block."""
_SHORT = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "int8": "int8", "fp8": "fp8"}


def _variant(name: str, activation: str, pool: str, base: AttentionAttrs = _STANDARD, **changes: Any) -> Variant:
    pool_name = f"{_SHORT[activation]}-{_SHORT[pool]}"
    attrs = replace(base, kv_cache_dtype=pool, kv_scale=0.02 if pool in ("int8", "fp8") else 1.0, **changes)
    return Variant(f"{pool_name}-{name}" if name else pool_name, activation, attrs)


_QWEN3_MOE = MoEAttrs(number_of_experts=128, top_k=8, expert_hidden_size=2048, expert_inter_size=768)
"""A Qwen3-30B-A3B-like MoE layer: 128 experts, top 8, hidden 2048, expert intermediate 768, SwiGLU."""


def _moe_variants(name: str, activation: str, attrs: MoEAttrs) -> tuple[Variant, ...]:
    from toolchain.plugins.kernels import moe

    short = _SHORT[activation]
    return tuple(Variant(f"{short}-moe-{name}-{s}", activation, moe.Stage(attrs, s), (moe.OP,)) for s in moe.STAGES)


def _sort_variant(name: str, attrs: MoEAttrs) -> Variant:
    """The routing sort of a MoE layer: int32 ids only, so one variant serves every activation dtype."""
    from toolchain.plugins.kernels import moe_sort

    return Variant(f"moe-{name}-sort", "float16", attrs, (moe_sort.OP,))


def _variants() -> tuple[Variant, ...]:
    stories = AttentionAttrs(layer=0, num_heads=8, num_kv_heads=4, head_size=8, tokens_per_block=16)
    llama3: dict[str, Any] = {"rotary_scaling_type": "llama3", "rotary_scaling_factor": 8.0, "rotary_base": 500000.0}
    linear: dict[str, Any] = {"rotary_scaling_type": "linear", "rotary_scaling_factor": 4.0}
    gpt2: dict[str, Any] = {"rotary_style": "none"}
    # fp32 activations are left out: TensorRT's registration serves fp16 and bf16 only (the interpreter and the GPU
    # check run the fp32 path), and they cost as much to compile as any two other variants
    return (
        *(_variant("", act, pool) for act in ("float16", "bfloat16") for pool in (act, "int8", "fp8")),
        _variant("d64-t16-linear", "bfloat16", "int8", head_size=64, tokens_per_block=16, **linear),
        # a head size that is not a power of two (the masked tail of BLOCK_D); GPT-2's learned positions (no
        # rotary) and one query head per KV head
        _variant("d96-t64-mha-norope", "float16", "fp8", num_kv_heads=32, head_size=96, tokens_per_block=64, **gpt2),
        # stories260K's geometry, with a sliding window
        _variant("d8-window", "float16", "float16", stories, sliding_window=64),
        # Llama 3.1's scaled rotary, a sliding window, Gemma's q_scaling
        _variant("llama3-window", "bfloat16", "bfloat16", sliding_window=4096, q_scaling=1.5, **llama3),
        *(v for act in ("float16", "bfloat16") for v in _moe_variants("qwen3", act, _QWEN3_MOE)),
        # a small layer: sizes that are not powers of two (masked tails), biases, gelu, a router bias (gpt-oss-like)
        *_moe_variants(
            "small-bias-gelu",
            "float16",
            MoEAttrs(8, 2, 96, 40, activation="gelu", use_bias=1, router_bias=1, router_norm="topk_softmax"),
        ),
        # gpt-oss-20b: YaRN rotary (head size 64, its attention factor), the clamped SwiGLU experts
        _variant("d64-yarn", "bfloat16", "bfloat16", num_heads=64, head_size=64, **_GPT_OSS_YARN),
        # gpt-oss-20b's attention sinks (a seventh input, float32 per head) on its alternating layers: the
        # 128-token window, and a full layer on an fp8 pool
        _variant("d64-sinks-window128", "bfloat16", "bfloat16", **_GPT_OSS_ATTENTION, sliding_window=128, sinks=1),
        _variant("d64-sinks", "bfloat16", "fp8", **_GPT_OSS_ATTENTION, sinks=1),
        *_moe_variants("gpt-oss", "bfloat16", _GPT_OSS_MOE),
        # the routing sort (one program): 128 experts top 8, gpt-oss-20b's 32 top 4, 8 experts top 2
        _sort_variant("qwen3", _QWEN3_MOE),
        _sort_variant("gpt-oss", _GPT_OSS_MOE),
        _sort_variant("small", MoEAttrs(8, 2, 96, 40)),
    )


_GPT_OSS_YARN: dict[str, Any] = {
    "rotary_scaling_type": "yarn",
    "rotary_scaling_factor": 32.0,
    "rotary_base": 150000.0,
    "rotary_original_max_positions": 4096,
    "rotary_truncate": 0,
    "rotary_attention_factor": 0.1 * math.log(32.0) + 1.0,
}
_GPT_OSS_ATTENTION: dict[str, Any] = {"num_heads": 64, "head_size": 64, **_GPT_OSS_YARN}  # 8 KV heads: _STANDARD's
_GPT_OSS_MOE = MoEAttrs(
    32, 4, 2880, 2880, "topk_softmax", use_bias=1, router_bias=1, swiglu_alpha=1.702, swiglu_beta=1.0, swiglu_limit=7.0
)


VARIANTS = _variants()
"""Every activation x pool TensorRT serves on a standard layer, and the shapes and options that take other code
paths: head sizes 64, 96 (not a power of two) and 8, 16 and 64 tokens per block, sliding windows, rotary styles and
scalings, MHA, attention sinks."""


@dataclass(frozen=True)
class Job:
    op: str
    variant: str
    activation: str
    attrs: Attrs
    arch: str


def jobs(archs: Iterable[str], variants: Iterable[Variant] = VARIANTS) -> list[Job]:
    return [Job(op, v.name, v.activation, v.attrs, arch) for arch in archs for v in variants for op in v.ops]


def _run_job(job: Job, out_dir: Path) -> CompiledKernel:
    return compile_kernel(job.op, job.attrs, job.activation, job.arch, out_dir)


def compile_variants(
    archs: Iterable[str],
    out_dir: Path | None = None,
    jobs_n: int | None = None,
    variants: Iterable[Variant] = VARIANTS,
) -> list[tuple[Job, CompiledKernel]]:
    """Every kernel of every variant on every SM in `archs`, in that order. What the cache lacks compiles in
    `jobs_n` worker processes (default: the CPU count; spawned, each imports Triton once)."""
    archs = [f"sm_{capability(a)}" for a in archs]  # every --arch checked before anything compiles
    out_dir = out_dir or cache_dir()
    todo = jobs(archs, variants)
    results: dict[int, CompiledKernel] = {}
    missing = []
    for i, job in enumerate(todo):
        try:
            kernel = _cached(job, out_dir)
        except FileNotFoundError:
            missing.append(i)
            continue
        results[i] = kernel
    workers = min(jobs_n or os.cpu_count() or 1, len(missing))
    if workers <= 1:
        for i in missing:
            results[i] = _run_job(todo[i], out_dir)
    elif missing:
        with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
            futures = {pool.submit(_run_job, todo[i], out_dir): i for i in missing}
            for future in as_completed(futures):
                results[futures[future]] = future.result()
    return [(job, results[i]) for i, job in enumerate(todo)]


def _cached(job: Job, out_dir: Path) -> CompiledKernel:
    """The cached compile of `job`, or FileNotFoundError (checked in this process: no worker needed for it)."""
    _check_compilable(job.op)
    cap = capability(job.arch)
    key = _key(job.op, job.attrs, job.activation, cap, _source_digest())
    if not all(p.is_file() for p in _paths(out_dir, job.op, cap, key).values()):
        raise FileNotFoundError(key)
    return compile_kernel(job.op, job.attrs, job.activation, job.arch, out_dir)


def summary(results: list[tuple[Job, CompiledKernel]], out_dir: Path) -> dict[str, Any]:
    """The --json record: per SM, per variant, per kernel its resources; totals."""
    import triton

    archs: dict[str, dict[str, dict[str, Any]]] = {}
    for job, k in results:
        entry = {
            **{f: getattr(k, f) for f in ("name", "registers", "spill_stores", "spill_loads", "spills")},
            **{f: getattr(k, f) for f in ("shared_bytes", "static_shared_bytes", "stack_bytes", "threads")},
            **{f: getattr(k, f) for f in ("num_warps", "params", "ptx_version", "cached", "compile_s", "key")},
        }
        files = _paths(out_dir, k.op, capability(k.arch), k.key)
        entry |= {"ptx": str(files[".ptx"]), "cubin": str(files[".cubin"])}
        archs.setdefault(job.arch, {}).setdefault(job.variant, {})[job.op] = entry
    kernels = [k for _, k in results]
    return {
        "triton": triton.__version__,
        "ptxas": sorted({k.ptxas_version for k in kernels}),
        "out": str(out_dir),
        "variants": {v.name: {"activation": v.activation, **asdict(v.attrs)} for v in VARIANTS},
        "archs": archs,
        "kernels": len(kernels),
        "compiled": sum(not k.cached for k in kernels),
        "compile_s": round(sum(k.compile_s for k in kernels if not k.cached), 1),
        "spills": sum(k.spills for k in kernels),
    }
