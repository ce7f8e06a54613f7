"""Open an engine directory for execution through its backend, after checking it may run here."""

from __future__ import annotations

from pathlib import Path

from toolchain import console
from toolchain.engine import tensorrt_backend
from toolchain.engine.build import MODEL_NAME, read_build_config
from toolchain.engine.ort_backend import OrtEngine
from toolchain.errors import UserError


def load_engine(engine_dir: Path, backend: str | None = None) -> OrtEngine:
    """The engine's own backend unless `backend` says otherwise. A TensorRT engine is checked against this
    machine first (TensorRT version, SM); its model.onnx can always run on the CPU with backend='onnxruntime'."""
    config = read_build_config(engine_dir)
    chosen = backend or config["backend"]
    if chosen == "tensorrt":
        if config["backend"] != "tensorrt":
            raise UserError(f"{engine_dir} was built for {config['backend']}, it has no TensorRT plan; rebuild it")
        tensorrt_backend.check_compatible(config["compatibility"], tensorrt_backend.versions())
        raise UserError(
            f"{engine_dir}: running TensorRT plans needs the TensorRT runtime and our plugins, not available in this "
            "version; pass --backend onnxruntime to run its model.onnx on the CPU"
        )
    if chosen != "onnxruntime":
        raise UserError(f"backend {chosen!r} is not supported; choose tensorrt or onnxruntime")
    if config["backend"] == "tensorrt":
        console.warn(f"{engine_dir}: running the TensorRT engine's ONNX graph on the CPU")
    return OrtEngine(engine_dir / MODEL_NAME)
