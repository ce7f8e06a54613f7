"""The TensorRT runtime backend: an engine directory's engine.plan run behind the `Engine` protocol (api.py).

One execution context on one CUDA stream. Tensors are bound by name from the I/O contract (contract.py): per call
the batch's int32 arrays are copied to the GPU and their shapes set, and a float32 logits buffer [num_outputs,
vocab] is allocated; the KV pool, a torch CUDA tensor from `new_kv_cache`, is bound once per pool, because the
plugins update it in place and nothing copies it per step. Engine facts come from the spec (build_config.json); the
plan is only checked to expose exactly the contract's tensors.

`tensorrt` and the GPU are touched only when an engine is opened. Not yet verified on a GPU (docs/engine.md,
"Running a TensorRT engine"). One engine serves one caller at a time: its context holds the last call's shapes.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

import numpy as np
import torch

from toolchain.engine import tensorrt_backend
from toolchain.engine.api import EngineSpec, StepTokens
from toolchain.engine.contract import CONTRACT_VERSION, INPUTS, OUTPUTS, Batch
from toolchain.errors import UserError

if TYPE_CHECKING:
    import tensorrt as trt

CPU_FIX = "run its model.onnx on the CPU with --backend onnxruntime"
REBUILD = "rebuild the engine with `trtbuild build --backend tensorrt`"
LOGITS_DTYPE: torch.dtype = getattr(torch, OUTPUTS["logits"][0])


class Stream(Protocol):
    """What the engine needs of a CUDA stream (a torch.cuda.Stream has it): its handle, and waiting for it."""

    @property
    def cuda_stream(self) -> int: ...

    def synchronize(self) -> None: ...


def missing(device: torch.device) -> str | None:
    """None when a TensorRT plan can run here on `device`, else what is missing."""
    reason = tensorrt_backend.available()
    if reason is None and device.type == "cuda" and not torch.cuda.is_available():
        reason = f"PyTorch {torch.__version__} sees no CUDA device (a CPU-only build of torch?)"
    return reason


def check_io(engine: trt.ICudaEngine, plan: Path) -> None:
    """The plan's I/O tensors must be exactly the contract's, each in its direction."""
    import tensorrt as trt

    words = {trt.TensorIOMode.INPUT: "input", trt.TensorIOMode.OUTPUT: "output"}
    expected = {**dict.fromkeys(INPUTS, trt.TensorIOMode.INPUT), **dict.fromkeys(OUTPUTS, trt.TensorIOMode.OUTPUT)}
    names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
    found = {name: engine.get_tensor_mode(name) for name in names}
    problems = [f"no {words[mode]} {name!r}" for name, mode in expected.items() if name not in found]
    problems += [
        f"{name!r} is an {words.get(found[name], str(found[name]))}, the contract says {words[mode]}"
        for name, mode in expected.items()
        if name in found and found[name] != mode
    ]
    problems += [f"unexpected tensor {name!r}" for name in names if name not in expected]
    if problems:
        raise UserError(
            f"{plan}: its I/O tensors do not match the engine I/O contract {CONTRACT_VERSION} "
            f"({'; '.join(problems)}); {REBUILD}"
        )


def deserialize(plan: Path) -> trt.ICudaEngine:
    """The plan as an engine, our plugins registered first (the plan names them; TensorRT looks them up)."""
    import tensorrt as trt

    importlib.import_module(tensorrt_backend.PLUGIN_MODULE)
    runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))  # the engine keeps its runtime alive
    engine = runtime.deserialize_cuda_engine(plan.read_bytes())
    if engine is None:
        raise UserError(f"{plan}: TensorRT could not deserialize this plan (see its log above); {REBUILD}")
    check_io(engine, plan)
    return engine


class TrtEngine:
    """Run an engine directory's engine.plan on a GPU (the `Engine` protocol of api.py). `device` and `stream`
    default to the current CUDA device and a new stream; tests pass others."""

    def __init__(self, spec: EngineSpec, device: str = "cuda", stream: Stream | None = None) -> None:
        self.spec = spec
        self.vocab_size = spec.vocab_size
        self.tokens_per_block = spec.limits.tokens_per_block
        self.device = torch.device(device)
        reason = missing(self.device)
        if reason:
            raise UserError(f"{spec.engine_dir}: cannot run its TensorRT plan here: {reason}; {CPU_FIX}")
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())  # tensors say cuda:N, never cuda
        plan = spec.engine_dir / tensorrt_backend.PLAN_NAME
        if not plan.is_file():
            raise UserError(f"{spec.engine_dir}: no {tensorrt_backend.PLAN_NAME}; {REBUILD}, or {CPU_FIX}")
        self._engine = deserialize(plan)
        self._context = self._engine.create_execution_context()
        if self._context is None:
            raise UserError(f"{plan}: TensorRT could not create an execution context (GPU memory full?, see its log)")
        if stream is None:
            stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]  # unannotated in torch
        self._stream = stream
        self._pool: tuple[int, tuple[int, ...]] | None = None  # (address, shape) of the pool bound now

    def new_kv_cache(self, num_blocks: int) -> torch.Tensor:
        """A zeroed pool of `num_blocks` blocks on the GPU (fp8 pools are held as their bytes, uint8)."""
        limit = self.spec.limits.num_blocks
        if not 1 <= num_blocks <= limit:
            raise ValueError(f"a KV pool of {num_blocks} blocks; this TensorRT plan was built for at most {limit}")
        kv = self.spec.kv_cache
        return torch.zeros(kv.pool_shape(num_blocks), dtype=kv.storage_dtype, device=self.device)

    def forward(self, batch: Batch, kv_cache: torch.Tensor) -> np.ndarray:
        with self._on_stream():
            logits, inputs = self._enqueue(batch, kv_cache)
        self._stream.synchronize()
        del inputs
        return logits.cpu().numpy()

    def forward_tokens(self, batch: Batch, kv_cache: torch.Tensor, sampled: Sequence[int]) -> StepTokens:
        """Greedy ids reduced on the GPU; only the sampled rows' logits cross to the host."""
        rows = list(sampled)
        with self._on_stream():
            logits, inputs = self._enqueue(batch, kv_cache)
            greedy = logits.argmax(dim=1).to("cpu", non_blocking=True)
            picked = logits[rows].to("cpu", non_blocking=True) if rows else None  # an all-greedy step copies no row
        self._stream.synchronize()
        del inputs
        host = picked.numpy() if picked is not None else None
        return StepTokens(greedy.numpy(), {row: host[j] for j, row in enumerate(rows)} if host is not None else {})

    def _enqueue(self, batch: Batch, kv_cache: torch.Tensor) -> tuple[torch.Tensor, list[Any]]:
        """Bind and enqueue one batch on the engine's stream -> (logits on the GPU, the inputs to keep alive until
        the stream is synchronized: TensorRT reads them asynchronously)."""
        self._check(batch, kv_cache)
        self._bind_pool(kv_cache)
        inputs = [self._bind_input(name, array) for name, array in batch.feeds().items()]
        logits = torch.empty((len(batch.logits_index), self.vocab_size), dtype=LOGITS_DTYPE, device=self.device)
        self._set_address("logits", logits)
        if not self._context.execute_async_v3(self._stream.cuda_stream):
            raise RuntimeError(f"{self.spec.engine_dir}: TensorRT could not enqueue the engine (see its log)")
        return logits, inputs

    def _check(self, batch: Batch, kv_cache: torch.Tensor) -> None:
        kv = self.spec.kv_cache
        blocks = kv_cache.shape[1] if kv_cache.dim() > 1 else 0
        dtype = kv.storage_dtype
        if (tuple(kv_cache.shape), kv_cache.dtype, kv_cache.device) != (kv.pool_shape(blocks), dtype, self.device):
            raise ValueError(
                f"KV pool {tuple(kv_cache.shape)} {kv_cache.dtype} on {kv_cache.device}; this engine needs "
                f"[*, blocks] {dtype} on {self.device}: make it with new_kv_cache"
            )
        if not kv_cache.is_contiguous():
            raise ValueError("KV pool is not contiguous; the plugins address it as one dense array")
        batch.check(self.tokens_per_block)
        batch.check_blocks(blocks, self.tokens_per_block)

    def _on_stream(self) -> AbstractContextManager[Any]:
        if self.device.type != "cuda":
            return nullcontext()
        stream = cast(torch.cuda.Stream, self._stream)
        stream.wait_stream(torch.cuda.current_stream(self.device))  # the pool's zeroing and the caller's writes first
        return torch.cuda.stream(stream)

    def _bind_pool(self, kv_cache: torch.Tensor) -> None:
        """Bind the pool only when it is another tensor: the plugins write it in place, at this one address."""
        key = (kv_cache.data_ptr(), tuple(kv_cache.shape))
        if key != self._pool:
            self._set_shape("kv_cache", kv_cache)
            self._set_address("kv_cache", kv_cache)
            self._pool = key

    def _bind_input(self, name: str, array: np.ndarray) -> torch.Tensor:
        host = np.ascontiguousarray(array, dtype=np.dtype(INPUTS[name][0]))
        tensor = torch.from_numpy(host).to(self.device, non_blocking=True)
        self._set_shape(name, tensor)
        self._set_address(name, tensor)
        return tensor

    def _set_shape(self, name: str, tensor: torch.Tensor) -> None:
        if not self._context.set_input_shape(name, tuple(tensor.shape)):
            lim = self.spec.limits
            raise ValueError(
                f"{name} of shape {tuple(tensor.shape)} is outside the TensorRT plan's optimization profile (built "
                f"for up to {lim.max_batch_size} sequences, {lim.max_num_tokens} tokens, {lim.max_blocks_per_seq} "
                f"blocks per sequence, a pool of {lim.num_blocks} blocks)"
            )

    def _set_address(self, name: str, tensor: torch.Tensor) -> None:
        if not self._context.set_tensor_address(name, tensor.data_ptr()):
            raise RuntimeError(f"{self.spec.engine_dir}: TensorRT refused the address of {name} (see its log)")
