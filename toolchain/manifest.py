"""The manifest: what went into an artifact, what came out, and with which software and hardware.

Every output directory gets a `manifest.json`. `verify` re-hashes the files it lists.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from toolchain import __version__
from toolchain.errors import UserError
from toolchain.files import JSON_LIMIT, read_bytes_capped, read_text_capped

SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"
# The manifest's own check: sha256 of its JSON text without this key (json.dumps, indent 2), written as its last key.
# It catches a manifest edited or damaged after it was written; it is not a signature (whoever can edit the file can
# recompute it): pin the manifest's sha256 (what `serve` and `diff` show) for that.
SEAL = "manifest_seal_sha256"
PACKAGES = ("torch", "transformers", "safetensors", "onnx", "onnxruntime", "triton")
_CHUNK = 8 << 20


class Cancelled(Exception):
    """Hashing stopped because the stage failed or was interrupted."""


def sha256_file(path: Path, stop: threading.Event | None = None) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            if stop is not None and stop.is_set():
                raise Cancelled(str(path))
            digest.update(chunk)
    return digest.hexdigest()


def file_entry(path: Path, root: Path, sha256: str | None = None) -> dict[str, Any]:
    return {
        "path": path.relative_to(root).as_posix(),
        "size": path.stat().st_size,
        "sha256": sha256 or sha256_file(path),
    }


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _tensorrt_version() -> str | None:
    try:
        return str(importlib.import_module("tensorrt").__version__)
    except Exception:  # absent, or bindings installed without the TensorRT libraries
        return None


def _run(cmd: list[str]) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def gpu_info() -> dict[str, Any]:
    """Name, SM, driver and CUDA version of GPU 0; all null when there is none (not an error)."""
    info: dict[str, Any] = {"name": None, "sm": None, "driver_version": None, "cuda_version": None}
    out = _run(["nvidia-smi", "--query-gpu=name,compute_cap,driver_version", "--format=csv,noheader"])
    if out and out.strip():
        name, cap, driver = (s.strip() for s in out.splitlines()[0].split(","))
        info.update(name=name, sm=cap.replace(".", ""), driver_version=driver)
        header = _run(["nvidia-smi"]) or ""
        if "CUDA Version:" in header:
            info["cuda_version"] = header.split("CUDA Version:")[1].split()[0]
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# The SIMD extensions torch's CPU kernels dispatch on (x86-64: /proc/cpuinfo "flags"; aarch64: "Features"): what
# could make two machines compute differently. Other flags say nothing about the numbers and are left out.
ISA_FLAGS = (
    "sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni",
    "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "asimd", "asimddp", "sve", "sve2", "bf16", "i8mm",
)  # fmt: skip


def _isa_flags() -> list[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                present = set(line.split(":", 1)[1].split())
                return [flag for flag in ISA_FLAGS if flag in present]
    except OSError:
        pass
    return []


def machine() -> dict[str, Any]:
    """What computes the numbers here: CPU model, architecture, its SIMD flags, the kernel set torch dispatches to
    (`torch.backends.cpu.get_cpu_capability()`, which ATEN_CPU_CAPABILITY can lower) and torch's thread count.
    The bytes of every artifact are meant not to depend on any of it (docs/conversion.md); `diff` shows it apart
    from what was built, so that one build made on two machines reads "identical builds, different machines"."""
    torch_cpu: dict[str, Any] = {"cpu_capability": None, "torch_threads": None}
    if "torch" in sys.modules:  # a stage that computed imported torch; one that did not has no kernel set to record
        torch = sys.modules["torch"]
        torch_cpu = {
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "torch_threads": torch.get_num_threads(),
        }
    return {
        "os": platform.platform(),
        "python": platform.python_version(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "arch": platform.machine(),
        "isa": _isa_flags(),
        **torch_cpu,
    }


def _git_commit() -> dict[str, Any]:
    src = Path(__file__).resolve().parent.parent
    # Only a checkout of trtbuild itself: an installed copy inside a user's repo must not record their HEAD.
    top = _run(["git", "-C", str(src), "rev-parse", "--show-toplevel"])
    commit = _run(["git", "-C", str(src), "rev-parse", "HEAD"]) if top and Path(top.strip()) == src else None
    if not commit:
        return {"git_commit": None, "git_dirty": None}
    status = _run(["git", "-C", str(src), "status", "--porcelain", "--untracked-files=no"])
    return {"git_commit": commit.strip(), "git_dirty": bool(status and status.strip())}


def environment() -> dict[str, Any]:
    packages = {name: package_version(name) for name in PACKAGES}
    packages["tensorrt"] = _tensorrt_version()
    return {
        "toolchain": {"version": __version__, **_git_commit()},
        "host": machine(),
        "packages": packages,
        "gpu": gpu_info(),
    }


def peak_rss_bytes() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


@dataclass
class StageRecord:
    """Collects what one stage did; `write` turns it into manifest.json in the stage's directory."""

    stage: str
    command: list[str] = field(default_factory=lambda: list(sys.argv))
    started: float = field(default_factory=time.monotonic)
    inputs: list[dict[str, Any]] = field(default_factory=list)
    recipe: dict[str, Any] | None = None
    recipe_sha256: str | None = None
    details: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    known_sha256: dict[Path, str] = field(default_factory=dict)  # outputs hashed while they were written
    # The run directory (still under its temporary name) this stage is written into: inputs inside it are recorded
    # by their path in it, from a root relative to the stage's own directory, so they name where they will be.
    run_dir: Path | None = None
    _pending: list[Future[dict[str, Any]]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def add_inputs(self, root: Path, paths: list[Path]) -> None:
        """Hash input files in a background thread (hashlib releases the GIL) while the stage works.

        Paths are recorded as given under `root`, not resolved: a Hugging Face cache snapshot is a folder of
        symlinks into blobs/, and what matters is the file the stage read under that name."""
        root = root.absolute()
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hash-inputs")
        for path in sorted(set(paths)):
            self._pending.append(pool.submit(_input_entry, path.absolute(), root, self._stop))
        pool.shutdown(wait=False)  # the queued hashes still run; `write` waits for them, `cancel` stops them

    def cancel(self) -> None:
        """Stop background hashing at once (the stage failed or was interrupted)."""
        self._stop.set()
        for future in self._pending:
            future.cancel()

    def write(self, out_dir: Path) -> dict[str, Any]:
        self.inputs += [self._within_run(future.result(), out_dir) for future in self._pending]
        self._pending.clear()
        outputs = [
            file_entry(p, out_dir, self.known_sha256.get(p.resolve()))
            for p in sorted(out_dir.rglob("*"))
            if p.is_file() and p.relative_to(out_dir).as_posix() != MANIFEST_NAME
        ]
        manifest = {
            "schema_version": SCHEMA_VERSION,
            "stage": self.stage,
            "command": self.command,
            "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "recipe": self.recipe,
            "recipe_sha256": self.recipe_sha256,
            **environment(),
            "details": self.details,
            "warnings": self.warnings,
            "inputs": self.inputs,
            "outputs": outputs,
            "wall_time_s": round(time.monotonic() - self.started, 3),
            "peak_rss_bytes": peak_rss_bytes(),
        }
        write_manifest(out_dir, manifest)
        return manifest

    def _within_run(self, entry: dict[str, Any], out_dir: Path) -> dict[str, Any]:
        """An input inside the run dir as {root: the run dir relative to `out_dir`, path: its path in the run}.
        `out_dir` is a temporary sibling of the stage's final dir, so the relative root holds after the rename."""
        if self.run_dir is None:
            return entry
        run, source = self.run_dir.absolute(), Path(entry["root"]) / entry["path"]
        if run not in source.parents:
            return entry
        root = os.path.relpath(run, out_dir.absolute())
        return {**entry, "root": Path(root).as_posix(), "path": source.relative_to(run).as_posix()}


def _input_entry(path: Path, root: Path, stop: threading.Event) -> dict[str, Any]:
    entry = {"path": path.relative_to(root).as_posix(), "size": path.stat().st_size}
    return {"root": str(root), **entry, "sha256": sha256_file(path, stop)}


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    """`manifest` (a new one, or one read and amended by the stage that owns it) as `directory`'s manifest.json,
    sealed again."""
    manifest[SEAL] = _seal(manifest)
    (directory / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")


def _seal(manifest: dict[str, Any]) -> str:
    body = {k: v for k, v in manifest.items() if k != SEAL}
    return hashlib.sha256(json.dumps(body, indent=2).encode()).hexdigest()


def seal_problem(directory: Path) -> str | None:
    """Why `directory`'s manifest.json is not exactly the text `StageRecord.write` wrote, or None. A manifest written
    before seals existed has none to check (None: its listed files are still checked)."""
    path = directory / MANIFEST_NAME
    raw = read_bytes_capped(path, JSON_LIMIT, "manifest")  # bytes: a CRLF copy is other bytes, another identity
    try:
        data = json.loads(raw)
    except ValueError as e:  # not JSON, or not even UTF-8
        return f"changed: {MANIFEST_NAME} (not valid JSON any more: {e})"
    if not isinstance(data, dict) or SEAL not in data:
        return None
    if data[SEAL] != _seal(data):
        return f"changed: {MANIFEST_NAME} (its seal says sha256 {data[SEAL]}, its content hashes to {_seal(data)})"
    if raw != (json.dumps(data, indent=2) + "\n").encode():
        return f"changed: {MANIFEST_NAME} (same content, other bytes: it was re-formatted or edited)"
    return None


def read_manifest(directory: Path) -> dict[str, Any]:
    path = directory / MANIFEST_NAME
    if not path.is_file():
        raise UserError(f"{path} not found; {directory} is not a trtbuild artifact (or was not finished)")
    try:
        data = json.loads(read_text_capped(path, JSON_LIMIT, "manifest"))
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not a valid JSON manifest ({e})") from e
    if not isinstance(data, dict) or data.get("schema_version") != SCHEMA_VERSION:
        version = data.get("schema_version") if isinstance(data, dict) else None
        raise UserError(f"{path}: not a trtbuild manifest of schema_version {SCHEMA_VERSION} (found {version!r})")
    for key in ("inputs", "outputs"):
        entries = data.get(key)
        if not isinstance(entries, list) or not all(_valid_entry(e) for e in entries):
            raise UserError(f"{path}: '{key}' is missing or malformed; the manifest is damaged, rebuild the artifact")
    return data


def is_artifact(directory: Path) -> bool:
    try:
        read_manifest(directory)
    except UserError:
        return False
    return True


def _valid_entry(entry: Any) -> bool:
    return (
        isinstance(entry, dict)
        and isinstance(entry.get("path"), str)
        and isinstance(entry.get("size"), int)
        and isinstance(entry.get("sha256"), str)
    )


Hasher = Callable[[Path], str]


def verify(directory: Path, check_inputs: bool = False, hasher: Hasher = sha256_file) -> list[str]:
    """Problems found re-hashing `directory` against its manifest (and the manifest against its seal); empty when
    everything matches. `hasher`: how a file's sha256 is had (integrity.HashCache.sha256 skips unchanged files)."""
    seal = seal_problem(directory) if (directory / MANIFEST_NAME).is_file() else None
    manifest = read_manifest(directory)
    problems = ([seal] if seal else []) + _check_files(directory, manifest["outputs"], hasher=hasher)
    listed = {e["path"] for e in manifest["outputs"]} | {MANIFEST_NAME}
    problems += [
        f"unlisted: {p.relative_to(directory).as_posix()}"
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.relative_to(directory).as_posix() not in listed
    ]
    if check_inputs:
        problems += _check_inputs(directory, manifest["inputs"])
        for entry in manifest["outputs"]:  # the stages of a run dir, each with its own manifest and inputs
            nested = directory / entry["path"]
            if nested.name == MANIFEST_NAME and nested.parent != directory and is_artifact(nested.parent):
                problems += _check_inputs(nested.parent, read_manifest(nested.parent)["inputs"])
    return problems


def _check_inputs(directory: Path, entries: list[dict[str, Any]]) -> list[str]:
    """A relative root (an input in the same run dir) is relative to the manifest's own directory."""
    problems = []
    for entry in entries:
        root = Path(str(entry.get("root", "")))
        root = root if root.is_absolute() else Path(os.path.normpath(directory / root))
        problems += _check_files(root, [entry], label="input ")
    return problems


def _check_files(root: Path, entries: list[dict[str, Any]], label: str = "", hasher: Hasher = sha256_file) -> list[str]:
    problems = []
    for entry in entries:
        rel = Path(entry["path"])
        shown = root / rel if label else entry["path"]
        if rel.is_absolute() or ".." in rel.parts:
            problems.append(f"{label}outside the artifact: {entry['path']} (the manifest is damaged or forged)")
        elif not (root / rel).is_file():  # never opened: a FIFO or /dev/zero would block or never end
            gone = not (root / rel).exists() and not (root / rel).is_symlink()
            problems.append(f"{label}missing: {shown}" if gone else f"{label}not a regular file: {shown}")
        elif (size := (root / rel).stat().st_size) != entry["size"]:
            problems.append(f"{label}changed: {shown} ({size:,} B on disk, {entry['size']:,} B in the manifest)")
        elif (found := hasher(root / rel)) != entry["sha256"]:
            problems.append(f"{label}changed: {shown} (sha256 {found} on disk, {entry['sha256']} in the manifest)")
    return problems
