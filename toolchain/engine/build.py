"""`trtbuild build`: a (quantized) checkpoint -> an engine directory.

ENGINE_DIR/
  model.onnx (+ model.onnx.data)   the engine graph (export.py), what both backends run
  engine.plan, layers.json         the TensorRT plan and its inspector's layer JSON (TensorRT backend only)
  build_config.json                contract version, backend, limits, KV pool geometry, compatibility record
  tokenizer files, manifest.json     from the checkpoint, or from --tokenizer DIR (a ModelOpt export has none)

A checkpoint split over ranks (convert --tp / --pp, issue 27) gives one graph per rank, each exported from its own
rank file alone (one rank in memory at a time), with build_config.json, the tokenizer and manifest.json at the top:

ENGINE_DIR/
  rank{r}/model.onnx                 rank r's graph (export.py: its heads, its stage's layers, collective nodes)
  build_config.json                  adds `mapping` and `ranks` (each rank's layers and KV pool)
  tokenizer files, manifest.json     the manifest hashes every rank's files and records the mapping
"""

from __future__ import annotations

import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import onnx

from toolchain import console
from toolchain.atomic import atomic_dir
from toolchain.checkpoint.hf import TOKENIZER_CORE, TOKENIZER_FILES, has_tokenizer
from toolchain.checkpoint.spec import ExpertsFFN, spec_of
from toolchain.checkpoint.trtllm import CONFIG_NAME, load_rank, rank_file, read_config
from toolchain.engine.api import BUILD_CONFIG, MODEL_NAME, EngineSpec, KVCacheSpec, Limits, RankSpec, rank_dir
from toolchain.engine.backends import AUTO, BACKENDS, CHOICES, Backend, choose
from toolchain.engine.export import check_quantization, export_model, save_model
from toolchain.engine.geometry import TOKENS_PER_BLOCK, blocks_for
from toolchain.engine.results import BuildResult
from toolchain.errors import UserError
from toolchain.files import TOKENIZER_LIMIT, check_present
from toolchain.manifest import StageRecord
from toolchain.parallel.mapping import RankMapping
from toolchain.quantize.methods.registry import kv_by_algo

# The trtbuild::AllReduce / AllGather / Send / Recv plugins are registered (plugins/tensorrt_registration.py) but
# have never run under TensorRT or NCCL (no machine here has either), so multi-rank plans are not built yet
RANKS_ON_TENSORRT = (
    "TensorRT cannot build a multi-rank graph yet (its collective plugins have never run with TensorRT and NCCL)"
)


@dataclass(frozen=True)
class BuildOptions:
    backend: str = "auto"
    max_batch_size: int = 16
    max_num_tokens: int = 2048
    max_seq_len: int = 0  # 0: the model's max_position_embeddings
    tokens_per_block: int = 16

    def __post_init__(self) -> None:
        if self.backend not in CHOICES:
            raise UserError(f"backend {self.backend!r} is not supported; choose one of {', '.join(CHOICES)}")
        if self.tokens_per_block not in TOKENS_PER_BLOCK:
            raise UserError(f"tokens per block {self.tokens_per_block}: choose a power of two up to 128")
        for name in ("max_batch_size", "max_num_tokens"):
            if getattr(self, name) < 1:
                raise UserError(f"{name} must be at least 1")
        if self.max_seq_len < 0:
            raise UserError("max_seq_len must be positive (or 0 for the model's max_position_embeddings)")


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
    world = cfg.mapping.world_size
    if world > 1:
        check_quantization(cfg, world, str(checkpoint / CONFIG_NAME))
    max_seq_len = opts.max_seq_len or cfg.max_position_embeddings
    if max_seq_len > cfg.max_position_embeddings:
        raise UserError(
            f"--max-seq-len {max_seq_len} exceeds the model's max_position_embeddings {cfg.max_position_embeddings}"
        )
    record = record or StageRecord("build")
    tokenizer_paths = tokenizer_files(checkpoint, tokenizer, record)
    experts = sum(isinstance(ls.ffn, ExpertsFFN) for ls in spec_of(cfg, str(checkpoint / CONFIG_NAME)).layers)
    kv = kv_by_algo(cfg.quantization.kv_cache_quant_algo, str(checkpoint / "config.json"))
    if world > 1:
        backend = choose_for_ranks(opts.backend, record, world)
    else:
        backend = choose(opts.backend, record, experts, kv.name if kv else None)
    backend.check_tokens_per_block(opts.tokens_per_block)
    dtype = backend.engine_dtype(cfg.torch_dtype)
    limits = Limits(
        max_batch_size=opts.max_batch_size,
        max_num_tokens=opts.max_num_tokens,
        max_seq_len=max_seq_len,
        tokens_per_block=opts.tokens_per_block,
        # the pool: max_batch_size sequences of max_seq_len
        num_blocks=opts.max_batch_size * blocks_for(max_seq_len, opts.tokens_per_block),
    )
    if world > 1:
        return _build_ranks(checkpoint, out_dir, opts, force, record, tokenizer, tokenizer_paths, backend, limits)
    console.info(
        f"exporting {cfg.architecture} ({cfg.num_hidden_layers} layers) to ONNX in {dtype}".replace("torch.", "")
    )
    weights = load_rank(checkpoint, 0)
    model = export_model(cfg, weights, dtype, opts.tokens_per_block, str(checkpoint / rank_file(0)))
    del weights
    with atomic_dir(out_dir, force, inputs=(checkpoint,)) as tmp:
        record.add_inputs(checkpoint, [checkpoint / CONFIG_NAME, checkpoint / rank_file(0)])
        if tokenizer is not None and tokenizer_paths:
            record.add_inputs(tokenizer, tokenizer_paths)
        save_model(model, tmp / MODEL_NAME)
        del model
        onnx.checker.check_model(str(tmp / MODEL_NAME), full_check=True)  # by path: external data included
        kv = kv_by_algo(cfg.quantization.kv_cache_quant_algo, str(checkpoint / "config.json"))
        kv_cache = KVCacheSpec(
            kv.name if kv else str(dtype).removeprefix("torch."),
            cfg.num_hidden_layers,
            cfg.num_key_value_heads,
            opts.tokens_per_block,
            cfg.head_size,
        )
        build_info = (
            backend.plan(tmp / MODEL_NAME, tmp, limits, cfg.num_hidden_layers, kv_cache.block_shape)
            if backend.plan
            else None
        )
        for path in tokenizer_paths:
            shutil.copyfile(path, tmp / path.name)
        spec = EngineSpec(
            engine_dir=tmp,
            backend=backend.name,
            dtype=str(dtype).removeprefix("torch."),
            checkpoint_dtype=cfg.dtype,
            architecture=cfg.architecture,
            vocab_size=cfg.vocab_size,
            limits=limits,
            kv_cache=kv_cache,
            quantization=asdict(cfg.quantization),
            compatibility=backend.compatibility(),
            onnxruntime=backend.runtime_version(),
            build=build_info,
        )
        config = spec.write(tmp)
        record.details.update(build_config=config)
        manifest = record.write(tmp)
    return BuildResult.of(out_dir, config, manifest)


def choose_for_ranks(requested: str, record: StageRecord, world: int) -> Backend:
    """The backend of a multi-rank build: ONNX Runtime (auto picks it, saying why; TensorRT is refused)."""
    cpu = BACKENDS["onnxruntime"]
    if requested == cpu.name:
        return cpu
    if requested != AUTO:
        raise UserError(
            f"--backend {requested}: a {world}-rank checkpoint, and {RANKS_ON_TENSORRT}; "
            "use --backend onnxruntime (or auto)"
        )
    note = f"a {world}-rank checkpoint: building the CPU engine (ONNX Runtime), as {RANKS_ON_TENSORRT}"
    console.warn(note)
    record.warnings.append(note)
    return cpu


def _build_ranks(
    checkpoint: Path,
    out_dir: Path,
    opts: BuildOptions,
    force: bool,
    record: StageRecord,
    tokenizer: Path | None,
    tokenizer_paths: list[Path],
    backend: Backend,
    limits: Limits,
) -> BuildResult:
    """A multi-rank checkpoint's engine: per rank, its file loaded, exported, saved to rank{r}/, checked and
    planned (the backend's plan step, in that rank's directory) before the next rank is loaded."""
    cfg = read_config(checkpoint)
    mapping = cfg.mapping
    dtype = backend.engine_dtype(cfg.torch_dtype)
    kv_dtype = str(dtype).removeprefix("torch.")  # multi-rank checkpoints are unquantized (check_quantization)
    console.info(
        f"exporting {cfg.architecture} ({cfg.num_hidden_layers} layers) to ONNX in {kv_dtype} over "
        f"{mapping.world_size} ranks (tp={mapping.tp_size}, pp={mapping.pp_size})"
    )
    ranks: list[RankSpec] = []
    heads: list[int] = []  # each rank's query heads (`trtbuild inspect`; the pool needs only the KV heads)
    plans: list[Any] = []
    with atomic_dir(out_dir, force, inputs=(checkpoint,)) as tmp:
        record.add_inputs(
            checkpoint, [checkpoint / CONFIG_NAME, *(checkpoint / rank_file(r) for r in range(mapping.world_size))]
        )
        if tokenizer is not None and tokenizer_paths:
            record.add_inputs(tokenizer, tokenizer_paths)
        for where in RankMapping(mapping, 0).ranks():
            r = where.rank
            weights = load_rank(checkpoint, r)
            model = export_model(cfg, weights, dtype, opts.tokens_per_block, str(checkpoint / rank_file(r)), where)
            del weights
            directory = rank_dir(tmp, r)
            directory.mkdir()
            save_model(model, directory / MODEL_NAME)
            del model
            onnx.checker.check_model(str(directory / MODEL_NAME), full_check=True)
            layers = where.layers(cfg.num_hidden_layers)
            kv = KVCacheSpec(kv_dtype, len(layers), where.local_heads(cfg)[1], opts.tokens_per_block, cfg.head_size)
            if backend.plan:
                plans.append(backend.plan(directory / MODEL_NAME, directory, limits, len(layers), kv.block_shape))
            ranks.append(RankSpec(r, where.tp_rank, where.pp_rank, (layers.start, layers.stop), kv))
            heads.append(where.local_heads(cfg)[0])
        for path in tokenizer_paths:
            shutil.copyfile(path, tmp / path.name)
        spec = EngineSpec(
            engine_dir=tmp,
            backend=backend.name,
            dtype=kv_dtype,
            checkpoint_dtype=cfg.dtype,
            architecture=cfg.architecture,
            vocab_size=cfg.vocab_size,
            limits=limits,
            kv_cache=KVCacheSpec(
                kv_dtype, cfg.num_hidden_layers, cfg.num_key_value_heads, opts.tokens_per_block, cfg.head_size
            ),
            quantization=asdict(cfg.quantization),
            compatibility=backend.compatibility(),
            onnxruntime=backend.runtime_version(),
            build={"ranks": plans} if plans else None,
            mapping=mapping,
            ranks=tuple(ranks),
        )
        config = spec.write(tmp)
        record.details.update(build_config=config, mapping=asdict(mapping), rank_heads=heads)
        manifest = record.write(tmp)
    return BuildResult.of(out_dir, config, manifest)
