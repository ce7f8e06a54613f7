"""The TensorRT runtime backend on a machine without TensorRT or a GPU: opening a TensorRT engine fails with one
clear line; against a fake `tensorrt` (the CPU standing in for the GPU) TrtEngine registers the plugins before it
deserializes, binds every contract tensor by name with the batch's shapes and data, binds the KV pool once per pool
and returns what the engine wrote; a plan whose I/O differs from the contract is refused naming the tensor."""

from __future__ import annotations

import ctypes
import enum
import json
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import toolchain.plugins
from toolchain.engine import moe_split, tensorrt_backend
from toolchain.engine.api import EngineSpec, open_engine
from toolchain.engine.collectives import COLLECTIVE_OPS
from toolchain.engine.contract import CONTRACT_VERSION, INPUTS, OUTPUTS, Batch
from toolchain.engine.tensorrt_runtime import TrtEngine
from toolchain.errors import UserError
from toolchain.inspect import describe
from toolchain.manifest import StageRecord

H200 = {"tensorrt": "10.13.0", "sm": "90", "gpu": "NVIDIA H200", "driver": "570", "cuda": "12.8"}
VOCAB, TPB, BLOCKS = 11, 4, 8
# every plugin the registration registers; attention with sinks (a seventh input) is a plugin of its own
PLUGINS = (
    {"trtbuild::KVCacheWrite", "trtbuild::PagedAttention", "trtbuild::PagedAttentionSinks"}
    | {f"trtbuild::{op}" for op in moe_split.SPLIT_OPS}  # MoE's: MoESort and the fc / proj stages, four each
    | {f"trtbuild::{op}" for op in COLLECTIVE_OPS}  # multi-rank engines' collectives (issue 27)
)


def write_engine_dir(path: Path) -> Path:
    """A TensorRT engine directory as build.py writes one; a float32 pool, so that the fake can write into it."""
    limits = {"max_batch_size": 4, "max_num_tokens": 16, "max_seq_len": 32, "tokens_per_block": TPB}
    config = {
        "contract_version": CONTRACT_VERSION,
        "backend": "tensorrt",
        "dtype": "float16",
        "architecture": "LlamaForCausalLM",
        "vocab_size": VOCAB,
        "num_layers": 2,
        "quantization": {"quant_algo": None},
        "limits": {**limits, "num_blocks": BLOCKS},
        "kv_cache": {"dtype": "float32", "block_shape": [2, 2, TPB, 8]},
        "compatibility": H200,
    }
    path.mkdir()
    (path / "build_config.json").write_text(json.dumps(config))
    (path / tensorrt_backend.PLAN_NAME).write_bytes(b"plan bytes")
    StageRecord("build").write(path)  # its manifest, as build.py writes it
    return path


def test_a_tensorrt_engine_without_tensorrt_fails_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine_dir = write_engine_dir(tmp_path / "e")
    with pytest.raises(UserError) as refused:  # no TensorRT here: say what is missing, not "10.13.0 vs None"
        open_engine(engine_dir, "tensorrt")
    assert "\n" not in str(refused.value) and "--backend onnxruntime" in str(refused.value)
    monkeypatch.setattr(tensorrt_backend, "versions", lambda: H200)  # as if this were the H200 it was built on
    reason = tensorrt_backend.available()
    assert reason  # stubs only, or no tensorrt at all, and no GPU
    with pytest.raises(UserError) as refused:
        open_engine(engine_dir, "tensorrt")
    assert str(refused.value) == (
        f"{engine_dir}: cannot run its TensorRT plan here: {reason}; run its model.onnx on the CPU with "
        "--backend onnxruntime"
    )


def test_inspect_says_the_tensorrt_runtime_is_not_verified_on_a_gpu(tmp_path: Path, cli: Any) -> None:
    engine_dir = write_engine_dir(tmp_path / "e")
    for note in (
        "Triton kernels (PTX) in the plan, executed in CI by Triton's interpreter; not yet timed on a GPU",
        "the TensorRT runtime backend is not verified on a GPU yet",
    ):
        assert note in describe(engine_dir)["engine"]["plugins"]
        assert note in " ".join(cli("inspect", engine_dir).stdout.split())  # rich may wrap the line


class IOMode(enum.Enum):
    INPUT = 1
    OUTPUT = 2


CONTRACT_IO = {**dict.fromkeys(INPUTS, IOMode.INPUT), **dict.fromkeys(OUTPUTS, IOMode.OUTPUT)}


def at(address: int, shape: tuple[int, ...], ctype: Any) -> np.ndarray:
    """The memory TensorRT would be handed, as an array (a CPU address here)."""
    return np.ctypeslib.as_array(ctypes.cast(address, ctypes.POINTER(ctype)), shape)


class FakeContext:
    """Records the calls; 'runs' by reading the bound inputs, bumping the pool's first value, writing logits."""

    def __init__(self, calls: list[tuple[Any, ...]]) -> None:
        self.calls = calls
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.addresses: dict[str, int] = {}
        self.seen: list[dict[str, np.ndarray]] = []
        self.profile_blocks = BLOCKS  # the plan's profile pins the pool (tensorrt_backend._profile_shapes)

    def set_input_shape(self, name: str, shape: tuple[int, ...]) -> bool:
        self.calls.append(("shape", name, shape))
        self.shapes[name] = shape
        return name != "kv_cache" or shape[1] == self.profile_blocks

    def set_tensor_address(self, name: str, address: int) -> bool:
        self.calls.append(("address", name, address))
        self.addresses[name] = address
        return True

    def execute_async_v3(self, stream_handle: int) -> bool:
        self.calls.append(("execute", stream_handle))
        ints = {n: at(self.addresses[n], self.shapes[n], ctypes.c_int32).copy() for n in INPUTS if n != "kv_cache"}
        self.seen.append(ints)
        at(self.addresses["kv_cache"], (1,), ctypes.c_float)[0] += 1
        rows = self.shapes["logits_index"][0]
        at(self.addresses["logits"], (rows, VOCAB), ctypes.c_float)[:] = np.arange(rows * VOCAB).reshape(rows, VOCAB)
        return True


class FakeStream:
    cuda_stream = 7

    def __init__(self, calls: list[tuple[Any, ...]]) -> None:
        self.calls = calls

    def synchronize(self) -> None:
        self.calls.append(("synchronize",))


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.SimpleNamespace]:
    """A fake `tensorrt` (and `tensorrt.plugin`) in sys.modules; the plugin registration module imported afresh
    against it and removed afterwards."""
    state = types.SimpleNamespace(io=dict(CONTRACT_IO), registered=[], deserialized=[], contexts=[], calls=[])

    def decorator(name: str) -> Any:
        def record(fn: Any) -> Any:
            state.registered.append(name)
            return fn

        return record

    class Logger:
        WARNING = 2

        def __init__(self, severity: int) -> None:
            pass

    class Runtime:
        def __init__(self, logger: object) -> None:
            pass

        def deserialize_cuda_engine(self, plan: bytes) -> Any:
            state.deserialized.append((plan, set(state.registered)))
            return types.SimpleNamespace(
                num_io_tensors=len(state.io),
                get_tensor_name=lambda i: list(state.io)[i],
                get_tensor_mode=lambda name: state.io[name],
                create_execution_context=lambda: state.contexts.append(FakeContext(state.calls)) or state.contexts[-1],
            )

    plugin = types.ModuleType("tensorrt.plugin")
    for name in ("register", "autotune", "aot_impl", "impl"):
        setattr(plugin, name, decorator)
    for name in ("TensorDesc", "Tensor", "KernelLaunchParams", "SymIntExprs", "AutoTuneCombination"):  # annotations
        setattr(plugin, name, type(name, (), {}))
    trt = types.ModuleType("tensorrt")
    members = {"Runtime": Runtime, "Logger": Logger, "TensorIOMode": IOMode, "plugin": plugin}
    for name, value in {**members, "float16": "float16", "bfloat16": "bfloat16"}.items():
        setattr(trt, name, value)
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setitem(sys.modules, "tensorrt.plugin", plugin)
    monkeypatch.setattr(tensorrt_backend, "available", lambda: None)
    module = tensorrt_backend.PLUGIN_MODULE
    monkeypatch.delitem(sys.modules, module, raising=False)
    yield state
    sys.modules.pop(module, None)  # imported against the fake: never leave it for another test
    vars(toolchain.plugins).pop(module.rsplit(".", 1)[1], None)


@pytest.fixture
def spec(tmp_path: Path) -> EngineSpec:
    return EngineSpec.from_dir(write_engine_dir(tmp_path / "e"))


def test_no_gpu_or_no_plan_is_one_clear_line(fake: Any, spec: EngineSpec, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match=r"sees no CUDA device .*; run its model.onnx on the CPU with --backend onnx"):
        TrtEngine(spec)
    (spec.engine_dir / tensorrt_backend.PLAN_NAME).unlink()
    with pytest.raises(UserError, match=r"no engine\.plan; rebuild the engine with `trtbuild build --backend tensor"):
        TrtEngine(spec, device="cpu", stream=FakeStream([]))
    assert fake.deserialized == []


def test_binds_every_contract_tensor_by_name_and_the_pool_once_per_pool(fake: Any, spec: EngineSpec) -> None:
    engine = TrtEngine(spec, device="cpu", stream=FakeStream(fake.calls))
    assert fake.deserialized == [(b"plan bytes", PLUGINS)]  # registered before TensorRT read the plan
    pool = engine.new_kv_cache(BLOCKS)
    prefill = Batch.from_sequences([[1, 2, 3], [4]], [0, 5], [[0], [1, 2]])
    logits = engine.forward(prefill, pool)
    (context,) = fake.contexts
    assert context.shapes == {**{n: a.shape for n, a in prefill.feeds().items()}, "kv_cache": tuple(pool.shape)}
    assert set(context.addresses) == set(INPUTS) | set(OUTPUTS)
    for name, array in prefill.feeds().items():
        np.testing.assert_array_equal(context.seen[0][name], array, err_msg=name)
    assert logits.dtype == np.float32 and logits.shape == (2, VOCAB)
    np.testing.assert_array_equal(logits, np.arange(2 * VOCAB).reshape(2, VOCAB))
    assert fake.calls[-2:] == [("execute", 7), ("synchronize",)]
    decode = Batch.from_sequences([[5], [6]], [3, 6], [[0], [1, 2]])
    engine.forward(decode, pool)
    assert context.shapes["input_ids"] == (2,)
    pool_calls = [c for c in fake.calls if c[1:2] == ("kv_cache",)]
    assert pool_calls == [("shape", "kv_cache", tuple(pool.shape)), ("address", "kv_cache", pool.data_ptr())]
    assert pool.view(-1)[0] == 2  # both calls wrote the caller's pool, in place
    other = engine.new_kv_cache(BLOCKS)
    engine.forward(decode, other)
    assert context.addresses["kv_cache"] == other.data_ptr()
    assert (pool.view(-1)[0], other.view(-1)[0]) == (2, 1)
    assert len(fake.contexts) == 1


def test_forward_tokens_reduces_where_the_logits_are_and_sends_only_sampled_rows(fake: Any, spec: EngineSpec) -> None:
    engine = TrtEngine(spec, device="cpu", stream=FakeStream(fake.calls))
    pool = engine.new_kv_cache(BLOCKS)
    batch = Batch.from_sequences([[1, 2, 3], [4]], [0, 5], [[0], [1, 2]])
    logits = engine.forward(batch, pool)
    step = engine.forward_tokens(batch, pool, [1])
    np.testing.assert_array_equal(step.greedy, logits.argmax(axis=1))
    assert set(step.rows) == {1}
    np.testing.assert_array_equal(step.rows[1], logits[1])
    assert fake.calls[-2:] == [("execute", 7), ("synchronize",)]
    assert engine.forward_tokens(batch, pool, []).rows == {}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"kv_cache": None}, "no input 'kv_cache'"),
        ({"logits": IOMode.INPUT}, "'logits' is an input, the contract says output"),
        ({"present_kv_cache": IOMode.OUTPUT}, "unexpected tensor 'present_kv_cache'"),
    ],
)
def test_a_plan_whose_io_differs_from_the_contract_is_refused(
    fake: Any, spec: EngineSpec, change: dict[str, IOMode | None], message: str
) -> None:
    fake.io = {n: m for n, m in {**CONTRACT_IO, **change}.items() if m is not None}
    with pytest.raises(UserError, match=f"engine.plan: its I/O tensors do not match .*{message}.*; rebuild"):
        TrtEngine(spec, device="cpu", stream=FakeStream(fake.calls))
    assert fake.contexts == []


def test_bad_pools_and_batches_are_refused(fake: Any, spec: EngineSpec) -> None:
    engine = TrtEngine(spec, device="cpu", stream=FakeStream(fake.calls))
    batch = Batch.from_sequences([[1, 2]], [0], [[0]])
    with pytest.raises(ValueError, match=f"built for at most {BLOCKS}"):
        engine.new_kv_cache(BLOCKS + 1)
    with pytest.raises(ValueError, match="KV pool"):
        engine.forward(batch, engine.new_kv_cache(BLOCKS).half())
    with pytest.raises(ValueError, match="outside the pool"):
        engine.forward(Batch.from_sequences([[1, 2]], [0], [[BLOCKS]]), engine.new_kv_cache(BLOCKS))
    with pytest.raises(ValueError, match=r"kv_cache of shape .* outside the TensorRT plan's optimization profile"):
        engine.forward(batch, engine.new_kv_cache(BLOCKS // 2))
    assert not any(c[0] == "execute" for c in fake.calls)
