"""`trtbuild plugins compile`: the CUDA sources in plugins/ -> PTX and cubin per target SM, through NVRTC
(cuda-python's `cuda.bindings.nvrtc`; no GPU needed), with each kernel's registers, spills and shared memory from
ptxas' verbose report. Results are cached by a hash of the source, the options and the NVRTC version.

Each source goes in behind a `#line 1 "plugins/NAME.cu"` directive, so NVRTC's errors and warnings (and the PTX's
line info) name the file and line they come from."""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from toolchain import console
from toolchain.errors import UserError

PLUGIN_DIR = Path(__file__).resolve().parents[2] / "plugins"
SOURCES = ("attention.cu",)
ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90")
MIN_SM = 80  # the kernels convert to and from bf16 with PTX cvt, which ptxas takes from sm_80 on
OPTIONS = ("-std=c++17", "--use_fast_math", "-lineinfo")

_RESOURCES = re.compile(
    r"Compiling entry function '(?P<name>\w+)' for '(?P<arch>sm_\d+)'.*?"
    r"(?P<spill_stores>\d+) bytes spill stores, (?P<spill_loads>\d+) bytes spill loads.*?"
    r"Used (?P<registers>\d+) registers(?:, used \d+ barriers)?(?:, (?P<smem>\d+) bytes smem)?",
    re.S,
)


@dataclass(frozen=True)
class KernelResources:
    name: str
    registers: int
    spill_stores: int
    spill_loads: int
    shared_bytes: int


@dataclass(frozen=True)
class ArchBuild:
    arch: str
    ptx: Path
    cubin: Path
    kernels: list[KernelResources]
    warnings: list[str]
    cached: bool


def _nvrtc() -> Any:
    try:
        from cuda.bindings import nvrtc
    except ImportError as e:
        raise UserError(
            "NVRTC is not installed: pip install 'cuda-bindings>=13,<14' 'nvidia-cuda-nvrtc>=13,<14'"
        ) from e
    return nvrtc


def _check(result: tuple[Any, ...], what: str, log: str = "") -> Any:
    err = result[0]
    if int(err) != 0:
        raise UserError(f"NVRTC {what} failed ({err.name}){': ' + log.strip().splitlines()[0] if log.strip() else ''}")
    return result[1] if len(result) > 1 else None


def nvrtc_version() -> str:
    result = _nvrtc().nvrtcVersion()
    _check(result, "version")
    return f"{result[1]}.{result[2]}"


def supported_archs() -> list[str]:
    """The SMs the plugins compile for with this NVRTC: every real SM it knows from MIN_SM on."""
    result = _nvrtc().nvrtcGetSupportedArchs()
    _check(result, "supported archs")
    return [f"sm_{a}" for a in result[1] if a >= MIN_SM]


def check_archs(archs: tuple[str, ...]) -> None:
    """Refuse, in one line naming the supported SMs, any target below MIN_SM or unknown to this NVRTC."""
    supported = supported_archs()
    for arch in archs:
        if arch not in supported:
            why = "is not of the form sm_XX" if not re.fullmatch(r"sm_\d{2,3}", arch) else "is not supported"
            raise UserError(
                f"--arch {arch} {why}: the plugins compile for sm_{MIN_SM} and newer; with NVRTC {nvrtc_version()}: "
                f"{', '.join(supported)}"
            )


def _source() -> bytes:
    """The plugin sources as one NVRTC program, each behind a #line directive naming its file."""
    parts = [f'#line 1 "plugins/{name}"\n'.encode() + (PLUGIN_DIR / name).read_bytes() for name in SOURCES]
    return b"\n".join(parts)


def _program_name() -> str:
    return f"plugins/{SOURCES[0]}" if len(SOURCES) == 1 else "plugins/*.cu"


def _write(path: Path, data: bytes) -> None:
    """Write through a temporary sibling and rename: a concurrent reader of the cache sees all or nothing."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _compile_one(source: bytes, name: str, options: list[str]) -> tuple[bytes, str]:
    """(PTX or cubin bytes, log) for one NVRTC program; cubin when the options target a real sm_XX."""
    nvrtc = _nvrtc()
    prog = _check(nvrtc.nvrtcCreateProgram(source, name.encode(), 0, [], []), "create")
    try:
        opts = [o.encode() for o in options]
        err = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)[0]
        # NVRTC writes into the buffer it is given: always a fresh bytearray. (`b" " * size` is the interpreter's
        # cached one-byte object when size is 1 — an empty log — and NVRTC's NUL then turns every b" " in the
        # process into b"\x00": seen here corrupting the padding of safetensors headers written afterwards.)
        size = _check(nvrtc.nvrtcGetProgramLogSize(prog), "log size")
        buf = bytearray(size)
        nvrtc.nvrtcGetProgramLog(prog, buf)
        log = bytes(buf).rstrip(b"\x00 ").decode(errors="replace")
        if int(err) != 0:
            raise UserError(f"{name}: compilation failed for {options[0].split('=')[-1]}:\n{log}")
        real = any(o.startswith("--gpu-architecture=sm_") for o in options)
        if real:
            size = _check(nvrtc.nvrtcGetCUBINSize(prog), "cubin size")
            out = bytearray(size)
            nvrtc.nvrtcGetCUBIN(prog, out)
        else:
            size = _check(nvrtc.nvrtcGetPTXSize(prog), "ptx size")
            out = bytearray(size)
            nvrtc.nvrtcGetPTX(prog, out)
        return bytes(out), log
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def parse_resources(log: str) -> list[KernelResources]:
    """Per-kernel resource lines of `--ptxas-options=-v`."""
    kernels = []
    for block in re.split(r"(?=ptxas info\s*: Compiling entry function)", log):
        m = _RESOURCES.search(block)
        if m:
            kernels.append(
                KernelResources(
                    name=m["name"],
                    registers=int(m["registers"]),
                    spill_stores=int(m["spill_stores"]),
                    spill_loads=int(m["spill_loads"]),
                    shared_bytes=int(m["smem"] or 0),
                )
            )
    return sorted(kernels, key=lambda k: k.name)


def _warnings(log: str) -> list[str]:
    return [line.strip() for line in log.splitlines() if "warning" in line.lower() and "ptxas info" not in line]


def compile_plugins(archs: tuple[str, ...] = ARCHS, out_dir: Path | None = None) -> list[ArchBuild]:
    check_archs(archs)
    out_dir = out_dir or PLUGIN_DIR / "build"
    out_dir.mkdir(parents=True, exist_ok=True)
    source, name = _source(), _program_name()
    version = nvrtc_version()
    builds = []
    for arch in archs:
        key = hashlib.sha256(source + repr((arch, OPTIONS, version)).encode()).hexdigest()[:16]
        ptx, cubin, meta = (out_dir / f"plugins-{arch}-{key}{ext}" for ext in (".ptx", ".cubin", ".json"))
        if meta.is_file() and ptx.is_file() and cubin.is_file():
            info = json.loads(meta.read_text())
            kernels = [KernelResources(**k) for k in info["kernels"]]
            builds.append(ArchBuild(arch, ptx, cubin, kernels, info["warnings"], cached=True))
            continue
        console.info(f"compiling {', '.join(SOURCES)} for {arch} (NVRTC {version})")
        compute = arch.replace("sm_", "compute_")
        ptx_bytes, ptx_log = _compile_one(source, name, [f"--gpu-architecture={compute}", *OPTIONS])
        cubin_bytes, log = _compile_one(source, name, [f"--gpu-architecture={arch}", *OPTIONS, "--ptxas-options=-v"])
        kernels = parse_resources(log)
        warnings = sorted(set(_warnings(ptx_log) + _warnings(log)))
        _write(ptx, ptx_bytes.rstrip(b"\x00 "))
        _write(cubin, cubin_bytes)
        _write(meta, json.dumps({"kernels": [asdict(k) for k in kernels], "warnings": warnings}, indent=2).encode())
        builds.append(ArchBuild(arch, ptx, cubin, kernels, warnings, cached=False))
    return builds


def summary(builds: list[ArchBuild]) -> dict[str, Any]:
    return {
        "nvrtc": nvrtc_version(),
        "sources": list(SOURCES),
        "archs": {
            b.arch: {
                "ptx": str(b.ptx),
                "cubin": str(b.cubin),
                "cached": b.cached,
                "warnings": b.warnings,
                "kernels": [asdict(k) for k in b.kernels],
            }
            for b in builds
        },
        "spills": sum(k.spill_stores + k.spill_loads for b in builds for k in b.kernels),
        "warnings": sum(len(b.warnings) for b in builds),
    }
