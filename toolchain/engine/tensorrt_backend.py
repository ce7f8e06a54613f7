"""The TensorRT backend: engine graph (model.onnx) -> serialized TensorRT plan, built strongly typed with one
optimization profile from the build limits, a workspace limit, a persistent timing cache, and the engine
inspector's per-layer JSON saved beside the plan.

`tensorrt` is imported only here and only when asked for; without it (or without a GPU) `available()` says why
and `build_plan` raises a one-line UserError. The plugin ops (trtbuild::KVCacheWrite, trtbuild::PagedAttention)
must be registered with TensorRT before parsing (toolchain/plugins/tensorrt_registration.py); without that module
this backend says so instead of failing inside the parser.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any

import onnx

from toolchain.engine import moe_split
from toolchain.engine.api import Limits
from toolchain.engine.contract import PLUGIN_DOMAIN
from toolchain.engine.onnx_fields import complete_plugin_fields
from toolchain.engine.ops import MOE_OP
from toolchain.errors import UserError
from toolchain.manifest import gpu_info

PLUGIN_MODULE = "toolchain.plugins.tensorrt_registration"  # registers the trtbuild plugins via tensorrt.plugin
PLAN_NAME = "engine.plan"
LAYERS_NAME = "layers.json"
TIMING_CACHE_NAME = "timing.cache"


def available() -> str | None:
    """None when a TensorRT build can run here, else the reason it cannot."""
    try:
        trt_module = importlib.import_module("tensorrt")
    except ImportError:
        return "TensorRT is not installed (pip install 'trtbuild[gpu]' on a machine with a CUDA GPU)"
    if not hasattr(trt_module, "Builder"):
        return "the installed `tensorrt` is only type stubs, not the library"
    if gpu_info()["name"] is None:
        return "no CUDA GPU is visible (nvidia-smi found none)"
    try:
        importlib.import_module(PLUGIN_MODULE)
    except ImportError:
        return "the trtbuild TensorRT plugins are not available (toolchain/plugins/tensorrt_registration.py is missing)"
    return None


def versions() -> dict[str, Any]:
    """What a plan is tied to: TensorRT version, GPU name and SM, driver and CUDA versions."""
    try:
        version: str | None = importlib.import_module("tensorrt").__version__
    except (ImportError, AttributeError):
        version = None
    gpu = gpu_info()
    return {
        "tensorrt": version,
        "gpu": gpu["name"],
        "sm": gpu["sm"],
        "driver": gpu["driver_version"],
        "cuda": gpu["cuda_version"],
    }


def check_compatible(recorded: dict[str, Any], current: dict[str, Any]) -> None:
    """A plan runs only where it was built: same TensorRT version and SM (and so GPU family)."""
    for key in ("tensorrt", "sm"):
        if recorded.get(key) != current.get(key):
            raise UserError(
                f"engine built with {key} {recorded.get(key)} ({recorded.get('gpu')}), this machine has "
                f"{current.get(key)} ({current.get('gpu')}); rebuild the engine here with `trtbuild build`"
            )


def _profile_shapes(
    limits: Limits, num_layers: int, kv_block: tuple[int, ...]
) -> dict[str, tuple[tuple[int, ...], ...]]:
    """min / opt / max per dynamic input, from the build limits."""
    b, t, blocks = limits.max_batch_size, limits.max_num_tokens, limits.max_blocks_per_seq
    pool = (num_layers, limits.num_blocks, *kv_block)
    return {
        "input_ids": ((1,), (max(1, t // 2),), (t,)),
        "position_ids": ((1,), (max(1, t // 2),), (t,)),
        "context_lens": ((1,), (max(1, b // 2),), (b,)),
        "new_lens": ((1,), (max(1, b // 2),), (b,)),
        "block_tables": ((1, 1), (max(1, b // 2), blocks), (b, blocks)),
        "logits_index": ((1,), (max(1, b // 2),), (t,)),
        # the runtime may size its pool below the build's (eval, tests): any block count up to the built one
        "kv_cache": ((num_layers, 1, *kv_block), pool, pool),
    }


def refuse_moe(graph: onnx.ModelProto, onnx_path: Path) -> None:
    """What the MoE op's TensorRT plugins cannot run (engine/moe_split.py: the experts' fp8 / int8 input
    quantization), in one line before TensorRT is needed, instead of a parser or plugin failure."""
    for node in graph.graph.node:
        if node.domain == PLUGIN_DOMAIN and node.op_type == MOE_OP:
            try:
                moe_split.refuse(moe_split.attrs_of(node), node.name.split("/")[0])
            except UserError as e:
                raise UserError(f"--backend tensorrt: {onnx_path}: {e}") from e


def build_plan(
    onnx_path: Path,
    out_dir: Path,
    limits: Limits,
    num_layers: int,
    kv_block: tuple[int, ...],
    cache_dir: Path | None = None,
) -> dict[str, Any]:
    """Build and write engine.plan, layers.json and the timing cache; returns build facts for the manifest."""
    refuse_moe(onnx.load(str(onnx_path), load_external_data=False), onnx_path)
    reason = available()
    if reason:
        raise UserError(f"--backend tensorrt: {reason}; use --backend onnxruntime (or auto) to build the CPU engine")
    import tensorrt as trt

    importlib.import_module(PLUGIN_MODULE)
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    # plugin fields the graph omits at their default (ops.OMITTED_AT) are filled in memory: tensorrt.plugin takes
    # every field positionally and has no defaults; external weights are found beside onnx_path
    graph = complete_plugin_fields(onnx.load(str(onnx_path), load_external_data=False))
    if not parser.parse(graph.SerializeToString(), str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise UserError(f"{onnx_path}: TensorRT's ONNX parser failed: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, limits.workspace_bytes)
    config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED
    profile = builder.create_optimization_profile()
    for name, (low, opt, high) in _profile_shapes(limits, num_layers, kv_block).items():
        profile.set_shape(name, trt.Dims(list(low)), trt.Dims(list(opt)), trt.Dims(list(high)))
    config.add_optimization_profile(profile)
    facts = versions()
    cache_path = (cache_dir or _cache_dir()) / f"timing-trt{facts['tensorrt']}-sm{facts['sm']}.cache"
    cache = config.create_timing_cache(cache_path.read_bytes() if cache_path.is_file() else b"")
    if not config.set_timing_cache(cache, ignore_mismatch=False):
        raise UserError(f"{cache_path}: TensorRT refused this timing cache; delete it and build again")
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise UserError(f"{onnx_path}: TensorRT could not build an engine (see the TensorRT log above)")
    (out_dir / PLAN_NAME).write_bytes(bytes(memoryview(plan)))
    cache_path.parent.mkdir(parents=True, exist_ok=True)
    partial = cache_path.with_suffix(f".tmp-{os.getpid()}")
    partial.write_bytes(bytes(memoryview(config.get_timing_cache().serialize())))
    os.replace(partial, cache_path)  # persistent across builds, replaced atomically
    engine = trt.Runtime(logger).deserialize_cuda_engine(bytes(memoryview(plan)))
    inspector = engine.create_engine_inspector()
    (out_dir / LAYERS_NAME).write_text(inspector.get_engine_information(trt.LayerInformationFormat.JSON))
    return {"plan": PLAN_NAME, "layers": LAYERS_NAME, "timing_cache": str(cache_path), **facts}


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trtbuild"
