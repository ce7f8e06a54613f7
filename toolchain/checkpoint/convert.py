"""`convert`: a Hugging Face checkpoint -> a TensorRT-LLM checkpoint, streamed tensor by tensor.

Everything that can be checked without reading tensor data is checked before anything is written: the
architecture, the config, that every tensor the family needs is present with the shape the config implies,
and that no source tensor is left unconsumed. Then each output tensor is read, fused, cast, checked for
NaN/Inf and appended to the rank file, so memory stays at a few tensors, never the model.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from toolchain import console
from toolchain.atomic import atomic_dir
from toolchain.checkpoint import registry
from toolchain.checkpoint.hf import SAFETENSORS_INDEX, HFCheckpoint, TensorReader
from toolchain.checkpoint.safetensors_io import SafetensorsWriter, TensorInfo
from toolchain.checkpoint.trtllm import DTYPES, ModelConfig, rank_file, write_config
from toolchain.errors import UserError
from toolchain.manifest import StageRecord

DTYPE_CHOICES = ("auto", *DTYPES)
_SHOW = 5  # names listed in an error before "... and N more"


@dataclass(frozen=True)
class OutputTensor:
    """One tensor of the rank file: its name, the HF tensors it is made of (concatenated on dim 0)."""

    name: str
    sources: tuple[str, ...]
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ConversionPlan:
    architecture: str
    config: ModelConfig
    tensors: tuple[OutputTensor, ...]


def _listing(names: list[str]) -> str:
    more = f" ... and {len(names) - _SHOW} more" if len(names) > _SHOW else ""
    return ", ".join(names[:_SHOW]) + more


def resolve_dtype(requested: str, ckpt: HFCheckpoint, source_dtype: str | None) -> str:
    if requested not in DTYPE_CHOICES:
        raise UserError(f"dtype {requested!r} not supported; choose one of {', '.join(DTYPE_CHOICES)}")
    if requested != "auto":
        return requested
    if source_dtype:
        return source_dtype
    # No dtype in config.json: take what the weights are stored in.
    stored = {info.dtype for info in ckpt.tensors.values()}
    for name, dtype in DTYPES.items():
        if dtype in stored:
            return name
    return "float32"


def plan_conversion(ckpt: HFCheckpoint, dtype: str = "auto") -> ConversionPlan:
    source = str(ckpt.root / "config.json")
    arch, family = registry.family_for(ckpt.config, source)
    source_dtype = ckpt.config.get("torch_dtype", ckpt.config.get("dtype"))
    cfg = family.config_from_hf(
        ckpt.config, resolve_dtype(dtype, ckpt, source_dtype if source_dtype in DTYPES else None), source
    )
    available = set(ckpt.tensors)
    if cfg.num_hidden_layers > len(available):  # every layer has tensors: a cheap guard before building tables
        raise UserError(
            f"{source}: num_hidden_layers {cfg.num_hidden_layers} but the checkpoint holds only "
            f"{len(available)} tensors; fix config.json"
        )
    table = family.weight_table(cfg, available)
    expected = family.source_shapes(cfg, available)

    used = {src for _, srcs in table for src in srcs}
    missing = sorted(used - available)
    if missing:
        raise UserError(
            f"{ckpt.root}: {len(missing)} tensor(s) the {arch} config requires are missing: {_listing(missing)}; "
            "the weights do not match config.json (num_hidden_layers, biases, tie_word_embeddings)"
        )
    for name in sorted(used):
        got, want = ckpt.tensors[name].shape, expected[name]
        if got != want:
            raise UserError(
                f"{ckpt.files[name]}: tensor {name} has shape {list(got)} but config.json implies {list(want)}; "
                "fix config.json (sizes, heads, head_dim) or use the matching weights"
            )
    leftovers = sorted(n for n in available - used if not any(p.fullmatch(n) for p in family.DROPPED))
    if leftovers:
        raise UserError(
            f"{ckpt.root}: {len(leftovers)} tensor(s) not consumed by the {arch} converter: {_listing(leftovers)}; "
            "this checkpoint has parts the converter does not know (wrong architecture in config.json?)"
        )
    tensors = []
    for dst, srcs in table:
        first = ckpt.tensors[srcs[0]].shape
        rows = sum(ckpt.tensors[s].shape[0] for s in srcs)
        tensors.append(OutputTensor(dst, srcs, (rows, *first[1:])))
    tensors.sort(key=lambda t: t.name)
    return ConversionPlan(arch, cfg, tuple(tensors))


def _check_values(name: str, where: Path, out_name: str, tensor: torch.Tensor, dtype: torch.dtype) -> None:
    """Refuse NaN/Inf and values the target dtype cannot hold. `aminmax` propagates NaN and allocates nothing,
    and casting is monotonic, so the two extremes decide for the whole tensor."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return
    lo, hi = torch.aminmax(tensor)
    if not (torch.isfinite(lo) and torch.isfinite(hi)):
        bad = int((~torch.isfinite(tensor)).sum())
        raise UserError(
            f"{where}: tensor {name} has {bad} NaN/Inf value(s); the model would produce NaN logits. "
            "Fix or re-export the checkpoint"
        )
    if not (torch.isfinite(lo.to(dtype)) and torch.isfinite(hi.to(dtype))):
        peak = max(abs(lo.item()), abs(hi.item()))
        raise UserError(
            f"{where}: tensor {name} (-> {out_name}) overflows {str(dtype).removeprefix('torch.')} "
            f"(max |value| {peak:.3g}); choose --dtype bfloat16 or float32"
        )


def _materialize(out: OutputTensor, reader: TensorReader, dtype: torch.dtype) -> torch.Tensor:
    parts = [reader.get(s) for s in out.sources]
    for name, part in zip(out.sources, parts, strict=True):
        _check_values(name, reader.file_of(name), out.name, part, dtype)
    tensor = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
    return tensor.to(dtype).contiguous()


def write_rank(path: Path, plan: ConversionPlan, reader: TensorReader) -> str:
    """Stream the planned tensors into `path`; returns the file's sha256."""
    dtype = plan.config.torch_dtype
    infos = [TensorInfo(t.name, dtype, t.shape) for t in plan.tensors]
    with (
        SafetensorsWriter(path, infos, {"format": "pt"}) as writer,
        console.progress(f"writing {path.name}", len(infos)) as advance,
    ):
        for out in plan.tensors:
            writer.write(out.name, _materialize(out, reader, dtype))
            advance(1)
    return writer.sha256


@contextmanager
def _cancel_on_error(record: StageRecord) -> Iterator[None]:
    try:
        yield
    except BaseException:
        record.cancel()  # do not make a failure or Ctrl-C wait for gigabytes of input hashing
        raise


def convert(
    model_dir: Path,
    out_dir: Path,
    dtype: str = "auto",
    force: bool = False,
    allow_pickle: bool = False,
    record: StageRecord | None = None,
) -> dict[str, Any]:
    """Convert `model_dir` into `out_dir` (atomically). Returns the summary printed by the CLI."""
    ckpt = HFCheckpoint.open(model_dir, allow_pickle=allow_pickle)
    plan = plan_conversion(ckpt, dtype)
    record = record or StageRecord("convert")
    if not ckpt.has_tokenizer():
        msg = f"{model_dir}: no tokenizer (tokenizer.json / tokenizer.model); the engine will lack one"
        console.warn(msg)
        record.warnings.append(msg)
    console.info(f"converting {plan.architecture} from {model_dir} ({plan.config.dtype}, {len(plan.tensors)} tensors)")
    with atomic_dir(out_dir, force, inputs=(model_dir,)) as tmp, _cancel_on_error(record):
        index = [ckpt.root / SAFETENSORS_INDEX] if (ckpt.root / SAFETENSORS_INDEX).is_file() else []
        record.add_inputs(ckpt.root, [ckpt.root / "config.json", *ckpt.weight_files, *index, *ckpt.tokenizer_files()])
        write_config(tmp, plan.config)
        rank_path = tmp / rank_file(0)
        with ckpt.reader() as reader:
            record.known_sha256[rank_path.resolve()] = write_rank(rank_path, plan, reader)
        for path in ckpt.tokenizer_files():
            shutil.copyfile(path, tmp / path.name)
        record.details.update(
            architecture=plan.architecture,
            dtype=plan.config.dtype,
            num_tensors=len(plan.tensors),
            num_parameters=sum(math.prod(t.shape) for t in plan.tensors),
            model_dir=str(model_dir.resolve()),
        )
        manifest = record.write(tmp)
    return {
        "output_dir": str(out_dir.resolve()),
        "architecture": plan.architecture,
        "dtype": plan.config.dtype,
        "num_tensors": len(plan.tensors),
        "num_parameters": record.details["num_parameters"],
        "outputs": manifest["outputs"],
        "warnings": record.warnings,
        "wall_time_s": manifest["wall_time_s"],
    }
