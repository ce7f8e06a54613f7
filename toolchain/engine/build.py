"""`trtbuild build`: a (quantized) checkpoint -> an engine directory.

ENGINE_DIR/
  model.onnx (+ model.onnx.data)   the engine graph (export.py), what both backends run
  engine.plan, layers.json         the TensorRT plan and its inspector's layer JSON (TensorRT backend only)
  build_config.json                contract version, backend, limits, KV pool geometry, compatibility record
  tokenizer files, manifest.json     from the checkpoint, or from --tokenizer DIR (a ModelOpt export has none)
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import onnx
import torch

from toolchain import console
from toolchain.atomic import atomic_dir
from toolchain.checkpoint.hf import TOKENIZER_CORE, TOKENIZER_FILES, has_tokenizer
from toolchain.checkpoint.trtllm import CONFIG_NAME, load_rank, rank_file, read_config
from toolchain.engine import tensorrt_backend
from toolchain.engine.api import BUILD_CONFIG, MODEL_NAME, Limits
from toolchain.engine.contract import CONTRACT_VERSION
from toolchain.engine.export import export_model, save_model
from toolchain.engine.results import BuildResult
from toolchain.errors import UserError
from toolchain.files import JSON_LIMIT, TOKENIZER_LIMIT, check_present, read_text_capped
from toolchain.manifest import StageRecord, package_version
from toolchain.quantize.methods.registry import kv_by_algo

BACKENDS = ("auto", "tensorrt", "onnxruntime")
TRT_TOKENS_PER_BLOCK = (16, 32, 64)  # the CUDA plugin's block sizes (plugins/)


@dataclass(frozen=True)
class BuildOptions:
    backend: str = "auto"
    max_batch_size: int = 16
    max_num_tokens: int = 2048
    max_seq_len: int = 0  # 0: the model's max_position_embeddings
    tokens_per_block: int = 16

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise UserError(f"backend {self.backend!r} is not supported; choose one of {', '.join(BACKENDS)}")
        if self.tokens_per_block not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise UserError(f"tokens per block {self.tokens_per_block}: choose a power of two up to 128")
        for name in ("max_batch_size", "max_num_tokens"):
            if getattr(self, name) < 1:
                raise UserError(f"{name} must be at least 1")
        if self.max_seq_len < 0:
            raise UserError("max_seq_len must be positive (or 0 for the model's max_position_embeddings)")


def _choose_backend(requested: str, record: StageRecord) -> str:
    reason = tensorrt_backend.available()
    if requested == "tensorrt" and reason:
        raise UserError(f"--backend tensorrt: {reason}; use --backend onnxruntime (or auto) to build the CPU engine")
    if requested == "auto":
        if reason is None:
            return "tensorrt"
        note = f"TensorRT backend unavailable ({reason}): building the CPU engine (ONNX Runtime)"
        console.warn(note)
        record.warnings.append(note)
        return "onnxruntime"
    return requested


def require_tokenizer(engine_dir: Path) -> None:
    """For the commands that turn text into tokens (eval): one line naming the fix when an engine has none (what
    is not an engine at all is left to the engine's own checks, which say so)."""
    if (engine_dir / BUILD_CONFIG).is_file() and not has_tokenizer(engine_dir):
        raise UserError(
            f"{engine_dir} has no tokenizer ({' / '.join(TOKENIZER_CORE)}); rebuild it with "
            "`trtbuild build CKPT -o ENGINE --tokenizer HF_MODEL_DIR`"
        )


def tokenizer_files(checkpoint: Path, tokenizer: Path | None, record: StageRecord) -> list[Path]:
    """The tokenizer files the engine gets: from `tokenizer` when given (it must hold one), else the checkpoint's
    (none is a warning: eval and text generation will need one)."""
    source = tokenizer or checkpoint
    if tokenizer is not None and not has_tokenizer(tokenizer):
        raise UserError(
            f"--tokenizer {tokenizer}: no {' / '.join(TOKENIZER_CORE)} there; give the Hugging Face model dir the "
            "checkpoint came from"
        )
    if tokenizer is None and not has_tokenizer(checkpoint):
        note = (
            f"{checkpoint} has no tokenizer (a ModelOpt export has none): the engine will lack one, so eval and text "
            "prompts cannot run; add --tokenizer HF_MODEL_DIR"
        )
        console.warn(note)
        record.warnings.append(note)
    paths = [source / name for name in TOKENIZER_FILES]
    check_present(paths, TOKENIZER_LIMIT, "tokenizer")
    return [p for p in paths if p.is_file()]


def build_engine(
    checkpoint: Path,
    out_dir: Path,
    opts: BuildOptions,
    force: bool = False,
    record: StageRecord | None = None,
    tokenizer: Path | None = None,
) -> BuildResult:
    cfg = read_config(checkpoint)
    if cfg.mapping.world_size != 1:
        raise UserError(
            f"{checkpoint} is split over {cfg.mapping.world_size} ranks (tp={cfg.mapping.tp_size}, "
            f"pp={cfg.mapping.pp_size}); engines are single-rank for now: convert again with --tp 1 --pp 1"
        )
    max_seq_len = opts.max_seq_len or cfg.max_position_embeddings
    if max_seq_len > cfg.max_position_embeddings:
        raise UserError(
            f"--max-seq-len {max_seq_len} exceeds the model's max_position_embeddings {cfg.max_position_embeddings}"
        )
    record = record or StageRecord("build")
    tokenizer_paths = tokenizer_files(checkpoint, tokenizer, record)
    backend = _choose_backend(opts.backend, record)
    if backend == "tensorrt" and opts.tokens_per_block not in TRT_TOKENS_PER_BLOCK:
        raise UserError(f"--tokens-per-block {opts.tokens_per_block}: the CUDA plugin supports 16, 32 or 64")
    # ONNX Runtime's CPU kernels lack bf16 (and much of fp16): the CPU engine computes in float32.
    dtype = cfg.torch_dtype if backend == "tensorrt" else torch.float32
    per_seq = -(-max_seq_len // opts.tokens_per_block)
    limits = Limits(
        max_batch_size=opts.max_batch_size,
        max_num_tokens=opts.max_num_tokens,
        max_seq_len=max_seq_len,
        tokens_per_block=opts.tokens_per_block,
        num_blocks=opts.max_batch_size * per_seq,  # the pool: max_batch_size sequences of max_seq_len
    )
    console.info(
        f"exporting {cfg.architecture} ({cfg.num_hidden_layers} layers) to ONNX in {dtype}".replace("torch.", "")
    )
    weights = load_rank(checkpoint, 0)
    model = export_model(cfg, weights, dtype, opts.tokens_per_block, str(checkpoint / rank_file(0)))
    del weights
    build_info: dict[str, Any] = {}
    with atomic_dir(out_dir, force, inputs=(checkpoint,)) as tmp:
        record.add_inputs(checkpoint, [checkpoint / CONFIG_NAME, checkpoint / rank_file(0)])
        if tokenizer is not None and tokenizer_paths:
            record.add_inputs(tokenizer, tokenizer_paths)
        save_model(model, tmp / MODEL_NAME)
        del model
        onnx.checker.check_model(str(tmp / MODEL_NAME), full_check=True)  # by path: external data included
        kv_block = (2, cfg.num_key_value_heads, opts.tokens_per_block, cfg.head_size)
        if backend == "tensorrt":
            build_info = tensorrt_backend.build_plan(tmp / MODEL_NAME, tmp, limits, cfg.num_hidden_layers, kv_block)
        for path in tokenizer_paths:
            shutil.copyfile(path, tmp / path.name)
        kv = kv_by_algo(cfg.quantization.kv_cache_quant_algo, str(checkpoint / "config.json"))
        config = {
            "contract_version": CONTRACT_VERSION,
            "backend": backend,
            "dtype": str(dtype).removeprefix("torch."),
            "checkpoint_dtype": cfg.dtype,
            "architecture": cfg.architecture,
            "vocab_size": cfg.vocab_size,
            "num_layers": cfg.num_hidden_layers,
            "quantization": asdict(cfg.quantization),
            "limits": {**asdict(limits), "max_blocks_per_seq": limits.max_blocks_per_seq},
            "kv_cache": {
                "dtype": kv.name if kv else str(dtype).removeprefix("torch."),
                "block_shape": list(kv_block),
                "pool_shape": [cfg.num_hidden_layers, limits.num_blocks, *kv_block],
            },
            "compatibility": tensorrt_backend.versions() if backend == "tensorrt" else None,
            "onnxruntime": package_version("onnxruntime") if backend == "onnxruntime" else None,
            "build": build_info or None,
        }
        (tmp / BUILD_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        record.details.update(build_config=config)
        manifest = record.write(tmp)
    return BuildResult.of(out_dir, config, manifest)


def read_build_config(engine_dir: Path) -> dict[str, Any]:
    path = engine_dir / BUILD_CONFIG
    if not path.is_file():
        raise UserError(f"{engine_dir} is not an engine directory (no {BUILD_CONFIG}); build one with `trtbuild build`")
    config: dict[str, Any] = json.loads(read_text_capped(path, JSON_LIMIT, "build config"))
    if config.get("contract_version") != CONTRACT_VERSION:
        raise UserError(
            f"{path}: engine I/O contract {config.get('contract_version')}, this trtbuild speaks {CONTRACT_VERSION}; "
            "rebuild the engine"
        )
    return config
