"""The engine backends, one `Backend` each, in one registry: what a backend accepts, how `build` finishes an engine
for it, and how an engine is opened through it. The CLI's and the recipe's `--backend` / `build.backend` choices,
`BuildOptions` and `open_engine` all read `BACKENDS`; "auto" is resolved here and nowhere else.

A new backend is one `Backend(...)` below plus its own module(s): build.py and api.py ask the object, they do not
branch on names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from toolchain import console
from toolchain.engine.geometry import TOKENS_PER_BLOCK
from toolchain.errors import UserError
from toolchain.manifest import StageRecord, package_version

if TYPE_CHECKING:  # the CLI reads CHOICES at start-up: torch, onnx and the backends' modules load on use
    import torch

    from toolchain.engine.api import Engine, EngineSpec, Limits

AUTO = "auto"  # a choice, not a backend: the first of AUTO_ORDER that can build here

# (model.onnx, engine dir, limits, num_layers, KV block shape) -> the build section of build_config.json
PlanFn = Callable[[Path, Path, "Limits", int, tuple[int, ...]], dict[str, Any]]


@dataclass(frozen=True)
class Backend:
    """One way to build and run an engine."""

    name: str
    tokens_per_block: tuple[int, ...]  # the KV block sizes its attention kernels take
    tokens_per_block_why: str  # said when a requested block size is not among them
    compute_dtype: str | None  # the engine's activations (a torch dtype's name); None: the checkpoint's dtype
    unavailable: Callable[[], str | None]  # None when it can build here, else why not
    plan: PlanFn | None  # what it builds beside model.onnx (a TensorRT plan); None: the ONNX graph is the engine
    compatibility: Callable[[], dict[str, Any] | None]  # what the built engine is tied to (build_config.json)
    runtime_version: Callable[[], str | None]  # the `onnxruntime` package version that built it, where relevant
    open: Callable[[EngineSpec], Engine]
    experts_why_not: str | None = None  # None when it runs the trtbuild::MoE op, else why not

    def engine_dtype(self, checkpoint_dtype: torch.dtype) -> torch.dtype:
        import torch

        dtype: torch.dtype = getattr(torch, self.compute_dtype) if self.compute_dtype else checkpoint_dtype
        return dtype

    def check_tokens_per_block(self, tokens_per_block: int) -> None:
        if tokens_per_block not in self.tokens_per_block:
            raise UserError(f"--tokens-per-block {tokens_per_block}: {self.tokens_per_block_why}")


def _open_onnxruntime(spec: EngineSpec) -> Engine:
    from toolchain.engine.ort_backend import OrtEngine

    if spec.backend != ONNXRUNTIME.name:
        console.warn(f"{spec.engine_dir}: running the TensorRT engine's ONNX graph on the CPU")
    return OrtEngine(spec)


def _tensorrt_unavailable() -> str | None:
    from toolchain.engine import tensorrt_backend

    return tensorrt_backend.available()


def _tensorrt_plan(
    model: Path, out: Path, limits: Limits, num_layers: int, kv_block: tuple[int, ...]
) -> dict[str, Any]:
    from toolchain.engine import tensorrt_backend

    return tensorrt_backend.build_plan(model, out, limits, num_layers, kv_block)


def _tensorrt_versions() -> dict[str, Any]:
    from toolchain.engine import tensorrt_backend

    return tensorrt_backend.versions()


def _open_tensorrt(spec: EngineSpec) -> Engine:
    if spec.backend != TENSORRT.name or spec.compatibility is None:
        raise UserError(
            f"{spec.engine_dir} was built for {spec.backend}, it has no TensorRT plan; rebuild it with "
            "`trtbuild build --backend tensorrt` on a GPU machine, or run it with --backend onnxruntime"
        )
    from toolchain.engine import tensorrt_backend
    from toolchain.engine.tensorrt_runtime import TrtEngine

    here = tensorrt_backend.versions()
    if here.get("tensorrt") is not None:  # without TensorRT, TrtEngine says what is missing instead
        tensorrt_backend.check_compatible(dict(spec.compatibility), here)

    return TrtEngine(spec)


TENSORRT = Backend(
    name="tensorrt",
    tokens_per_block=(16, 32, 64),  # the CUDA plugin's block sizes (plugins/)
    tokens_per_block_why="the CUDA plugin supports 16, 32 or 64",
    compute_dtype=None,
    unavailable=_tensorrt_unavailable,
    plan=_tensorrt_plan,
    compatibility=_tensorrt_versions,
    runtime_version=lambda: None,
    open=_open_tensorrt,
    # the MoE op runs as split plugins (engine/moe_split.py); fp8 / int8 expert inputs are refused at build
    experts_why_not=None,
)
ONNXRUNTIME = Backend(
    name="onnxruntime",
    tokens_per_block=TOKENS_PER_BLOCK,
    tokens_per_block_why="choose a power of two up to 128",
    compute_dtype="float32",  # ONNX Runtime's CPU kernels lack bf16 (and much of fp16)
    unavailable=lambda: None,
    plan=None,
    compatibility=lambda: None,
    runtime_version=lambda: package_version("onnxruntime"),
    open=_open_onnxruntime,
)
BACKENDS: dict[str, Backend] = {b.name: b for b in (TENSORRT, ONNXRUNTIME)}
AUTO_ORDER = (TENSORRT, ONNXRUNTIME)  # "auto": the first if it can build here, else the second (always can)
CHOICES = (AUTO, *BACKENDS)  # what --backend and a recipe's build.backend accept


def by_name(name: str) -> Backend:
    if name not in BACKENDS:
        raise UserError(f"backend {name!r} is not supported; choose one of {', '.join(sorted(BACKENDS))}")
    return BACKENDS[name]


def choose(requested: str, record: StageRecord, experts: int = 0, kv_cache: str | None = None) -> Backend:
    """The backend a build uses: the requested one if it can build here, else (auto) the first of AUTO_ORDER that
    can, the fallback said on stderr and in the manifest. `experts`: the model's mixture-of-experts layers;
    `kv_cache`: the checkpoint's KV cache quantization name; auto never picks a backend that cannot run them, and
    one asked for by name is refused before anything is exported."""
    if requested != AUTO:
        backend = BACKENDS[requested]
        reason = backend.unavailable() or _no_experts(backend, experts) or _no_kv(backend, kv_cache)
        if reason:
            raise UserError(
                f"--backend {backend.name}: {reason}; use --backend onnxruntime (or auto) to build the CPU engine"
            )
        return backend
    preferred, fallback = AUTO_ORDER
    reason = preferred.unavailable() or _no_experts(preferred, experts) or _no_kv(preferred, kv_cache)
    if not reason:
        return preferred
    note = f"TensorRT backend unavailable ({reason}): building the CPU engine (ONNX Runtime)"
    console.warn(note)
    record.warnings.append(note)
    return fallback


def _no_kv(backend: Backend, kv_cache: str | None) -> str | None:
    """An NVFP4 KV cache: only the CPU engine's reference KVCacheWrite quantizes it (no Triton kernel variant
    does: plugins/kernels/common.py check_types)."""
    if kv_cache != "nvfp4" or backend is AUTO_ORDER[-1]:
        return None
    return "an NVFP4 KV cache has no TensorRT kernel (only the CPU engine's KVCacheWrite quantizes it)"


def _no_experts(backend: Backend, experts: int) -> str | None:
    if not experts or backend.experts_why_not is None:
        return None
    return f"the model has {experts} mixture-of-experts layers and {backend.experts_why_not}"
