"""The Engine API: what the runtime, `generate`, `eval`, `bench` and `serve` hold in their hands.

`open_engine(DIR)` reads the engine directory's build_config.json ONCE into a frozen `EngineSpec` (limits, KV pool
geometry, vocabulary, dtype, backend, quantization, compatibility record), checks that the engine may run here,
and opens it through the one backend registry (backends.py). Everything downstream asks the spec; nothing re-derives an
engine fact from graph attributes or re-reads the JSON.

An `Engine` runs one packed batch (contract.py) against a KV pool it made with `new_kv_cache` and returns the
logits rows `batch.logits_index` asks for, float32 [num_outputs, vocab_size], on the host.

A multi-rank engine (issue 27: tensor / pipeline parallel, world_size > 1) has one top-level build_config.json whose
`mapping` and `ranks` keys (written only when world_size > 1, so single-rank engines stay byte-identical) describe
each rank's layers and KV pool; rank r's graph lives in `rank_dir(ENGINE, r)`. `EngineSpec.for_rank(r)` is the
spec a rank opens its own graph with. `open_trusted` hands such an engine to toolchain/parallel/launch.py, which
starts (or, under torchrun, joins) one process per rank and returns rank 0's facade.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch

from toolchain.checkpoint import trtllm
from toolchain.engine.backends import by_name
from toolchain.engine.contract import CONTRACT_VERSION, KV_DTYPES, Batch
from toolchain.engine.geometry import TOKENS_PER_BLOCK, blocks_for, kv_block_shape
from toolchain.errors import UserError
from toolchain.files import JSON_LIMIT, check_tokenizer_dir, read_bytes_capped, read_text_capped
from toolchain.integrity import check_engine

BUILD_CONFIG = "build_config.json"
MODEL_NAME = "model.onnx"
MANIFEST_NAME = "manifest.json"
INT32_MAX = (1 << 31) - 1  # the engine's shape and index inputs are int32 (contract.py)


@dataclass(frozen=True)
class Limits:
    """What the engine was built for: the optimization profile's maxima and the KV pool's default size."""

    max_batch_size: int
    max_num_tokens: int
    max_seq_len: int
    tokens_per_block: int
    num_blocks: int
    workspace_bytes: int = 4 << 30

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_num_tokens", "max_seq_len", "tokens_per_block", "num_blocks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= INT32_MAX:
                raise ValueError(f"limits.{name} is {value!r}; expected an integer from 1 to {INT32_MAX}")
        if self.tokens_per_block not in TOKENS_PER_BLOCK:
            raise ValueError(f"limits.tokens_per_block is {self.tokens_per_block}; expected a power of two up to 128")
        if self.max_seq_len < 2:
            raise ValueError(f"limits.max_seq_len is {self.max_seq_len}; a prompt and one new token need at least 2")
        if (
            isinstance(self.workspace_bytes, bool)
            or not isinstance(self.workspace_bytes, int)
            or self.workspace_bytes < 0
        ):
            raise ValueError(f"limits.workspace_bytes is {self.workspace_bytes!r}; expected a non-negative integer")

    @property
    def max_blocks_per_seq(self) -> int:
        return blocks_for(self.max_seq_len, self.tokens_per_block)

    def to_json(self) -> dict[str, int]:
        """build_config.json's `limits`: the fields, then max_blocks_per_seq (derived, written for readers)."""
        return {**asdict(self), "max_blocks_per_seq": self.max_blocks_per_seq}


@dataclass(frozen=True)
class KVCacheSpec:
    """The pool's geometry: [num_layers, blocks, 2, kv_heads, tokens_per_block, head_size] of `dtype`."""

    dtype: str  # a key of contract.KV_DTYPES
    num_layers: int
    num_kv_heads: int
    tokens_per_block: int
    head_size: int

    def __post_init__(self) -> None:
        if self.dtype not in KV_DTYPES:
            raise ValueError(f"KV cache dtype {self.dtype!r}; expected one of {', '.join(KV_DTYPES)}")

    @property
    def block_shape(self) -> tuple[int, int, int, int]:
        return kv_block_shape(self.num_kv_heads, self.tokens_per_block, self.head_size)

    @property
    def storage_dtype(self) -> torch.dtype:
        """fp8 pools are held as their bytes (uint8): torch cannot zero or index float8 on every device."""
        return torch.uint8 if self.dtype == "fp8" else KV_DTYPES[self.dtype]

    def pool_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (self.num_layers, num_blocks, *self.block_shape)

    def bytes_per_block(self) -> int:
        per = torch.empty((), dtype=self.storage_dtype).element_size()
        return self.num_layers * int(np.prod(self.block_shape)) * per


def rank_dir(engine_dir: Path, rank: int) -> Path:
    """Where rank `rank` of a multi-rank engine keeps its graph (model.onnx, a TensorRT plan)."""
    return engine_dir / f"rank{rank}"


@dataclass(frozen=True)
class RankSpec:
    """One rank of a multi-rank engine: its place in the mapping, its stage's layers [start, stop) and its KV pool
    (its local KV heads, its stage's layers)."""

    rank: int
    tp_rank: int
    pp_rank: int
    layers: tuple[int, int]
    kv_cache: KVCacheSpec

    def to_json(self, num_blocks: int) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "tp_rank": self.tp_rank,
            "pp_rank": self.pp_rank,
            "layers": list(self.layers),
            "kv_cache": {
                "block_shape": list(self.kv_cache.block_shape),
                "pool_shape": list(self.kv_cache.pool_shape(num_blocks)),
            },
        }


@dataclass(frozen=True)
class EngineSpec:
    """Everything known about an engine before running it, read once from build_config.json."""

    engine_dir: Path
    backend: str  # what built it: onnxruntime | tensorrt
    dtype: str  # activations inside the engine
    checkpoint_dtype: str
    architecture: str
    vocab_size: int
    limits: Limits
    kv_cache: KVCacheSpec
    quantization: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    compatibility: Mapping[str, Any] | None = None  # TensorRT, GPU, SM, driver, CUDA of a TensorRT build
    onnxruntime: str | None = None
    manifest_sha256: str | None = None  # of the engine dir's manifest.json: the engine's identity
    build: Mapping[str, Any] | None = None  # what the backend's build step reports (a TensorRT plan's build)
    # issue 27: how the engine is split over ranks (world_size 1: today's single-rank engine), each rank's part, and
    # which rank this spec is for (None: the whole engine, whose kv_cache is the unsplit model's)
    mapping: trtllm.Mapping = field(default_factory=trtllm.Mapping)
    ranks: tuple[RankSpec, ...] = ()
    rank: int | None = None

    @property
    def world_size(self) -> int:
        return self.mapping.world_size

    def for_rank(self, rank: int) -> EngineSpec:
        """The spec rank `rank` opens its own graph with: its directory, its KV pool."""
        if not 0 <= rank < len(self.ranks):
            raise ValueError(f"rank {rank}: this engine has ranks 0 .. {len(self.ranks) - 1}")
        part = self.ranks[rank]
        return replace(self, engine_dir=rank_dir(self.engine_dir, rank), kv_cache=part.kv_cache, rank=rank)

    @property
    def num_layers(self) -> int:
        return self.kv_cache.num_layers

    @property
    def quant_algo(self) -> str:
        return str(self.quantization.get("quant_algo") or "none")

    def to_config(self) -> dict[str, Any]:
        """The build_config.json object (key order as written since contract 2)."""
        return {
            "contract_version": CONTRACT_VERSION,
            "backend": self.backend,
            "dtype": self.dtype,
            "checkpoint_dtype": self.checkpoint_dtype,
            "architecture": self.architecture,
            "vocab_size": self.vocab_size,
            "num_layers": self.num_layers,
            "quantization": dict(self.quantization),
            "limits": self.limits.to_json(),
            "kv_cache": {
                "dtype": self.kv_cache.dtype,
                "block_shape": list(self.kv_cache.block_shape),
                "pool_shape": list(self.kv_cache.pool_shape(self.limits.num_blocks)),
            },
            "compatibility": dict(self.compatibility) if self.compatibility is not None else None,
            "onnxruntime": self.onnxruntime,
            "build": dict(self.build) if self.build else None,
            **self._ranks_config(),
        }

    def _ranks_config(self) -> dict[str, Any]:
        """`mapping` and `ranks`, only for a multi-rank engine (single-rank engines' config is unchanged)."""
        if self.world_size == 1:
            return {}
        return {
            "mapping": asdict(self.mapping),
            "ranks": [r.to_json(self.limits.num_blocks) for r in self.ranks],
        }

    def write(self, engine_dir: Path) -> dict[str, Any]:
        """Write build_config.json into `engine_dir`; -> the object written (the build manifest records it too)."""
        config = self.to_config()
        (engine_dir / BUILD_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        return config

    @classmethod
    def from_dir(cls, engine_dir: Path) -> EngineSpec:
        path = engine_dir / BUILD_CONFIG
        try:
            config: dict[str, Any] = json.loads(read_text_capped(path, JSON_LIMIT, "build config"))
        except (FileNotFoundError, NotADirectoryError) as e:
            raise UserError(
                f"{engine_dir} is not an engine directory (no {BUILD_CONFIG}); build one with `trtbuild build`"
            ) from e
        except json.JSONDecodeError as e:
            raise UserError(f"{path}: not valid JSON ({e}); rebuild the engine with `trtbuild build`") from e
        if not isinstance(config, dict) or config.get("contract_version") != CONTRACT_VERSION:
            found = config.get("contract_version") if isinstance(config, dict) else None
            raise UserError(
                f"{path}: engine I/O contract {found}, this trtbuild speaks {CONTRACT_VERSION}; rebuild the engine"
            )
        try:
            return cls._parse(engine_dir, config)
        except KeyError as e:
            raise UserError(f"{path}: key {e} is missing; rebuild the engine with `trtbuild build`") from e
        except (TypeError, ValueError) as e:
            raise UserError(f"{path}: malformed build config ({e}); rebuild the engine with `trtbuild build`") from e

    @classmethod
    def _parse(cls, engine_dir: Path, config: dict[str, Any]) -> EngineSpec:
        lim = config["limits"]
        if not isinstance(lim, dict):
            raise ValueError(f"limits is {type(lim).__name__}; expected an object")
        limits = Limits(  # Limits checks each is an integer in range, naming the key
            max_batch_size=lim["max_batch_size"],
            max_num_tokens=lim["max_num_tokens"],
            max_seq_len=lim["max_seq_len"],
            tokens_per_block=lim["tokens_per_block"],
            num_blocks=lim["num_blocks"],
            workspace_bytes=lim.get("workspace_bytes", 4 << 30),
        )
        shape = config["kv_cache"]["block_shape"]
        if not isinstance(shape, list) or len(shape) != 4 or not all(_positive(d) for d in shape):
            raise ValueError(f"kv_cache.block_shape is {shape!r}; expected 4 positive integers")
        two, kv_heads, tpb, head_size = shape
        if two != 2 or tpb != limits.tokens_per_block:
            raise ValueError(f"kv_cache.block_shape {shape} disagrees with the limits")
        for key in ("num_layers", "vocab_size"):
            if not _positive(config[key]):
                raise ValueError(f"{key} is {config[key]!r}; expected a positive integer")
        kv = KVCacheSpec(str(config["kv_cache"]["dtype"]), config["num_layers"], kv_heads, tpb, head_size)
        manifest = engine_dir / MANIFEST_NAME
        mapping, ranks = _parse_ranks(config, kv)
        return cls(
            engine_dir=engine_dir,
            backend=str(config["backend"]),
            dtype=str(config["dtype"]),
            checkpoint_dtype=str(config.get("checkpoint_dtype", config["dtype"])),
            architecture=str(config["architecture"]),
            vocab_size=config["vocab_size"],
            limits=limits,
            kv_cache=kv,
            quantization=MappingProxyType(dict(config.get("quantization") or {})),
            compatibility=MappingProxyType(dict(config["compatibility"])) if config.get("compatibility") else None,
            onnxruntime=config.get("onnxruntime"),
            manifest_sha256=_sha256(manifest),
            build=MappingProxyType(dict(config["build"])) if config.get("build") else None,
            mapping=mapping,
            ranks=ranks,
        )


def _parse_ranks(config: dict[str, Any], kv: KVCacheSpec) -> tuple[trtllm.Mapping, tuple[RankSpec, ...]]:
    """build_config.json's `mapping` and `ranks` (absent: a single-rank engine), each rank checked against the
    mapping (RankMapping's numbering) and the model's KV geometry."""
    from toolchain.parallel.mapping import RankMapping

    if "mapping" not in config:
        if "ranks" in config:
            raise ValueError("ranks without a mapping")
        return trtllm.Mapping(), ()
    if not isinstance(config["mapping"], dict) or not isinstance(config["ranks"], list):
        raise ValueError("mapping must be an object and ranks a list")
    mapping = trtllm.Mapping.from_dict(config["mapping"])  # checks world_size = tp_size * pp_size
    if mapping.world_size == 1 or len(config["ranks"]) != mapping.world_size:
        raise ValueError(
            f"{len(config['ranks'])} ranks for a mapping of world_size {mapping.world_size} (expected > 1)"
        )
    ranks = []
    for r, entry in enumerate(config["ranks"]):
        try:
            where = RankMapping(mapping, r)
        except UserError as e:
            raise ValueError(str(e)) from e
        start, stop = entry["layers"]
        two, kv_heads, tpb, head_size = entry["kv_cache"]["block_shape"]
        found = (entry["rank"], entry["tp_rank"], entry["pp_rank"], two, tpb, head_size)
        if found != (r, where.tp_rank, where.pp_rank, 2, kv.tokens_per_block, kv.head_size):
            raise ValueError(
                f"ranks[{r}] (rank, tp_rank, pp_rank, block_shape) disagrees with the mapping and kv_cache"
            )
        if not (_positive(stop - start) and start >= 0 and stop <= kv.num_layers and _positive(kv_heads)):
            raise ValueError(f"ranks[{r}]: layers {[start, stop]} / {kv_heads} KV heads out of range")
        local = KVCacheSpec(kv.dtype, stop - start, kv_heads, tpb, head_size)
        ranks.append(RankSpec(r, where.tp_rank, where.pp_rank, (start, stop), local))
    return mapping, tuple(ranks)


def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= INT32_MAX


def _sha256(manifest: Path) -> str | None:
    try:
        return hashlib.sha256(read_bytes_capped(manifest, JSON_LIMIT, "manifest")).hexdigest()
    except FileNotFoundError:
        return None


class Engine(Protocol):
    """One engine, opened: the runtime drives any backend through exactly this. A multi-rank engine's rank-0 facade
    (toolchain/parallel/engine.py) adds `health() -> str | None` (why a rank is down, or None) and `close()` (stop
    the ranks); single-rank engines have neither, so callers reach them with getattr."""

    spec: EngineSpec
    vocab_size: int
    tokens_per_block: int

    def new_kv_cache(self, num_blocks: int) -> torch.Tensor:
        """A zeroed pool of `num_blocks` blocks, where this backend runs (host memory, or the GPU)."""
        ...

    def forward(self, batch: Batch, kv_cache: torch.Tensor) -> np.ndarray:
        """Run one packed batch; the new tokens' K/V land in `kv_cache` in place. -> logits [outputs, vocab]."""
        ...

    def forward_tokens(self, batch: Batch, kv_cache: torch.Tensor, sampled: Sequence[int]) -> StepTokens:
        """`forward` for the runtime: every output row's greedy token, reduced where the logits live (on the GPU
        for TensorRT: a batch of 256 x 32000 float32 logits is 33 MB that need not cross to the host), and the full
        logits of the `sampled` output rows only (temperature > 0, sampled on the host)."""
        ...


class StepTokens(NamedTuple):
    greedy: np.ndarray  # [outputs] int64: the argmax of each logits row (first index among equal maxima)
    rows: dict[int, np.ndarray]  # output row -> its logits [vocab], for the rows asked for


def tokens_on_host(logits: np.ndarray, sampled: Sequence[int]) -> StepTokens:
    """`Engine.forward_tokens` for backends whose logits are on the host already (the CPU engine, test fakes)."""
    return StepTokens(logits.argmax(axis=1), {i: logits[i] for i in sampled})


def trusted_spec(engine_dir: Path) -> EngineSpec:
    """The spec of an engine whose files are exactly what its manifest lists (integrity.check_engine: exit 4)."""
    if (engine_dir / BUILD_CONFIG).is_file():  # else from_dir says it is no engine dir, and how to make one
        check_engine(engine_dir)
    return EngineSpec.from_dir(engine_dir)


def close_engine(engine: Engine) -> None:
    """Stop what an opened engine started: a multi-rank engine's ranks (processes, and this process's
    torch.distributed world); single-rank engines have nothing to close."""
    close = getattr(engine, "close", None)
    if close is not None:
        close()


def open_engine(engine_dir: Path, backend: str | None = None) -> Engine:
    """Open `engine_dir` with its own backend, or with `backend` (a TensorRT engine's model.onnx also runs on the
    CPU with backend='onnxruntime'). Its files are checked against its manifest first (integrity.check_engine:
    exit 4 on a mismatch); a TensorRT plan is checked against this machine before it is deserialized."""
    return open_trusted(trusted_spec(engine_dir), backend)


def open_trusted(spec: EngineSpec, backend: str | None = None) -> Engine:
    """`open_engine` for a spec `trusted_spec` already gave (the engine checked once, not once per step)."""
    if spec.world_size > 1 and spec.rank is None:
        from toolchain.parallel.launch import open_ranks

        return open_ranks(spec, backend)
    return by_name(backend or spec.backend).open(spec)


def load_tokenizer(engine_dir: Path) -> Any:
    """The tokenizer the engine was built with (copied into its directory by `build`), through transformers."""
    try:
        from transformers import AutoTokenizer
        from transformers.utils import logging as hf_logging

        check_tokenizer_dir(engine_dir)
        hf_logging.set_verbosity_error()  # type: ignore[no-untyped-call]  # "no chat template" and the like are ours to report, not theirs
        return AutoTokenizer.from_pretrained(engine_dir)
    except (OSError, ValueError, KeyError) as e:
        raise UserError(
            f"{engine_dir}: no usable tokenizer in the engine directory ({type(e).__name__}); build from a model "
            "directory that has tokenizer files, or send token ids"
        ) from e
