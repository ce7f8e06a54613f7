"""`convert`: a Hugging Face checkpoint -> a TensorRT-LLM checkpoint, streamed tensor by tensor.

Everything that can be checked without reading tensor data is checked before anything is written: the
architecture, the config, the parallel split, that every tensor the family needs is present with the shape
the config implies, and that no source tensor is left unconsumed. Then, per pipeline stage, each output
tensor is read once, checked for NaN/Inf, fused, cast, split for every tensor-parallel rank and appended to
that rank's file. Memory stays at the tensors in flight (the one being written and those made ahead, together
within the largest tensor's bytes, plus its split copies), never the model; the files are byte-identical
whatever the number of workers.

Tensors are numpy arrays (bfloat16 through ml_dtypes) and casts round as torch's `Tensor.to` does, so the bytes
are torch's while the process never imports torch (about 230 MiB of RSS for its import alone, a quarter of a
1 GB model; docs/conversion.md). Only pickle checkpoints (`--allow-pickle`) load torch.
"""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
import math
import shutil
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from toolchain import console
from toolchain.atomic import atomic_dir
from toolchain.checkpoint import mxfp4, prequant, registry
from toolchain.checkpoint.hf import SAFETENSORS_INDEX, HFCheckpoint, TensorReader
from toolchain.checkpoint.prequant.dequantized import dequantized
from toolchain.checkpoint.safetensors_io import (
    FLOAT_CODES,
    NUMPY_DTYPES,
    TORCH_NAMES,
    SafetensorsWriter,
    TensorInfo,
    code_of,
)
from toolchain.checkpoint.sharding import Rule, check_parallel, kept_name, local_name, shard, shard_shape, stage_layers
from toolchain.checkpoint.spec import ExpertsFFN, spec_of
from toolchain.checkpoint.trtllm import DTYPES, Mapping, ModelConfig, QuantConfig, rank_file, write_config
from toolchain.errors import UserError
from toolchain.manifest import StageRecord

DTYPE_CHOICES = ("auto", *DTYPES)
_SHOW = 5  # names listed in an error before "... and N more"
_PIECE = 1 << 20  # elements of a bfloat16 / float8 tensor widened to float32 at a time by `_extremes`
Array = np.ndarray[Any, Any]


@dataclass(frozen=True)
class OutputTensor:
    """One tensor of a pipeline stage: its local name, how it is made, its full (unsplit) shape."""

    name: str
    rule: Rule
    shape: tuple[int, ...]
    made: prequant.Made | None = None  # a pre-quantized checkpoint's tensor, made by its format's reader


@dataclass(frozen=True)
class ConversionPlan:
    architecture: str
    config: ModelConfig
    stages: tuple[tuple[OutputTensor, ...], ...]  # per pipeline stage, sorted by name
    quantization_source: dict[str, Any] | None = None  # a pre-quantized checkpoint's producer (prequant.Format)
    warnings: tuple[str, ...] = ()  # what a pre-quantized checkpoint's reading does other than exactly

    @property
    def num_tensors(self) -> int:
        return sum(len(s) for s in self.stages)


def _listing(names: list[str]) -> str:
    more = f" ... and {len(names) - _SHOW} more" if len(names) > _SHOW else ""
    return ", ".join(names[:_SHOW]) + more


def resolve_dtype(requested: str, ckpt: HFCheckpoint) -> str:
    if requested not in DTYPE_CHOICES:
        raise UserError(f"dtype {requested!r} not supported; choose one of {', '.join(DTYPE_CHOICES)}")
    if requested != "auto":
        return requested
    declared = ckpt.config.get("torch_dtype", ckpt.config.get("dtype"))
    if declared in DTYPES:
        return str(declared)
    stored = {info.code for info in ckpt.tensors.values()}  # no dtype in config.json: what the weights hold
    return next((name for name, code in DTYPES.items() if code in stored), "float32")


def _check_sources(ckpt: HFCheckpoint, arch: str, rules: list[Rule], expected: dict[str, tuple[int, ...]]) -> None:
    available = set(ckpt.tensors)
    used = {src for rule in rules for src in rule.srcs}
    missing = sorted(used - available)
    if missing:
        raise UserError(
            f"{ckpt.root}: {len(missing)} tensor(s) the {arch} config requires are missing: {_listing(missing)}; "
            "the weights do not match config.json (num_hidden_layers, biases, tie_word_embeddings)"
        )
    for rule in rules:
        if rule.packing == "mxfp4":
            mxfp4.check_sources(ckpt, rule.srcs)
    for name in sorted(used):
        got, want = ckpt.tensors[name].shape, expected[name]
        if got != want:
            raise UserError(
                f"{ckpt.files[name]}: tensor {name} has shape {list(got)} but config.json implies {list(want)}; "
                "fix config.json (sizes, heads, head_dim) or use the matching weights"
            )


def plan_conversion(
    ckpt: HFCheckpoint,
    dtype: str = "auto",
    tp: int = 1,
    pp: int = 1,
    moe_ep: int = 1,
    dequantize: bool = False,
    layers: Sequence[int] | None = None,
) -> ConversionPlan:
    """`layers`: keep only these decoder layers, renumbered 0..n-1 (a stand-in draft model for speculative
    decoding, issue 30); the other layers' tensors are read by nobody, by design."""
    source = str(ckpt.root / "config.json")
    arch, family = registry.family_for(ckpt.config, source)
    cfg = family.config_from_hf(ckpt.config, resolve_dtype(dtype, ckpt), source)
    if layers is not None:
        check_layer_selection(layers, cfg, tp, pp, moe_ep, prequant.detect(ckpt), source)
    available = set(ckpt.tensors)
    if cfg.num_hidden_layers > len(available):  # every layer has tensors: a cheap guard before any per-layer list
        raise UserError(
            f"{source}: num_hidden_layers {cfg.num_hidden_layers} but the checkpoint holds only "
            f"{len(available)} tensors; fix config.json"
        )
    check_parallel(cfg, tp, pp, source, moe_ep)
    cfg = dataclasses.replace(cfg, mapping=Mapping.for_parallel(tp, pp, moe_ep), use_parallel_embedding=tp > 1)
    fmt = prequant.detect(ckpt)
    if dequantize and fmt is None:
        raise UserError(f"{source}: --dequantize, but the checkpoint is not pre-quantized; drop the flag")
    if fmt is not None:
        if (tp, pp, moe_ep) != (1, 1, 1):  # multi-rank engines come from unquantized checkpoints (issue 27, D1)
            raise UserError(
                f"{source}: a pre-quantized checkpoint ({fmt.name}) converts at tp=1 pp=1 only (got tp={tp} "
                f"pp={pp} moe_ep={moe_ep}); split engines come from float checkpoints"
            )
        cfg = dataclasses.replace(cfg, quantization=fmt.quantization())
    shapes = family.source_shapes(cfg, available)
    rules, made = _prequantized(fmt, family.weight_table(cfg, available), cfg)
    read = {src for m in made for src in m.srcs}  # the producer's tensors, KV scales included, even where dropped
    if fmt is not None:  # the linears the producer left float, listed as our quantize stage lists them
        cfg = dataclasses.replace(cfg, quantization=_with_excluded(cfg, made))
    if dequantize:  # the float detour, when asked: each quantized linear's float weight, nothing quantized
        made = dequantized(made, cfg, shapes)
        cfg = dataclasses.replace(cfg, quantization=QuantConfig())
    _check_sources(ckpt, arch, rules, shapes)
    used = {src for rule in rules for src in rule.srcs} | read
    if layers is not None:  # the dropped layers' rules go, their sources counted as consumed above
        rules = [dataclasses.replace(r, dst=n) for r in rules if (n := kept_name(r.dst, layers)) is not None]
        cfg = _subset_config(cfg, layers)
    leftovers = sorted(n for n in available - used if not any(p.fullmatch(n) for p in family.DROPPED))
    if leftovers:
        raise UserError(
            f"{ckpt.root}: {len(leftovers)} tensor(s) not consumed by the {arch} converter: {_listing(leftovers)}; "
            "this checkpoint has parts the converter does not know (wrong architecture in config.json?)"
        )
    stages = []
    for p, layers in enumerate(stage_layers(cfg.num_hidden_layers, pp)):
        stage = []
        for rule in rules:
            name = local_name(rule.dst, layers, first=p == 0, last=p == pp - 1)
            if name is not None:
                stage.append(OutputTensor(name, rule, _full_shape(ckpt, rule)))
        stage.extend(OutputTensor(m.name, Rule(m.name, m.srcs), m.shape, m) for m in made)  # tp = pp = 1 only
        stages.append(tuple(sorted(stage, key=lambda t: t.name)))
    source_record = {**fmt.source(), **({"dequantized": True} if dequantize else {})} if fmt else None
    return ConversionPlan(arch, cfg, tuple(stages), source_record, tuple(fmt.warnings if fmt else ()))


def check_layer_selection(
    layers: Sequence[int], cfg: ModelConfig, tp: int, pp: int, moe_ep: int, fmt: object, source: str
) -> None:
    """`--layers`: a strictly increasing list of existing decoder layers, at tp = pp = 1, from a float checkpoint,
    of a family whose per-layer config fields we know how to subset (`layer_types`)."""
    n = cfg.num_hidden_layers
    shown = ",".join(map(str, layers))
    if not layers:
        raise UserError(f"--layers is empty; name the decoder layers to keep, e.g. --layers 0,1,2 (of 0..{n - 1})")
    bad = [i for i in layers if not 0 <= i < n]
    if bad:
        raise UserError(f"--layers {shown}: layer {bad[0]} does not exist ({source} has layers 0..{n - 1})")
    for a, b in itertools.pairwise(layers):
        if b <= a:
            raise UserError(
                f"--layers {shown}: {b} after {a}; list each layer once, in increasing order (they keep their order)"
            )
    if (tp, pp, moe_ep) != (1, 1, 1):
        raise UserError(
            f"--layers {shown} with tp={tp} pp={pp} moe_ep={moe_ep}: a layer selection converts at tp=1 pp=1 only "
            "(a draft model is a single-rank engine)"
        )
    if fmt is not None:
        name = getattr(fmt, "name", "pre-quantized")
        raise UserError(
            f"--layers {shown}: {source} is pre-quantized ({name}); select layers of a float checkpoint, or convert "
            "with --dequantize first"
        )
    for key, value in cfg.family_fields.items():
        pattern_only = key == "_sliding_window_pattern" and "layer_types" not in cfg.family_fields
        if pattern_only or (key not in _PER_LAYER and isinstance(value, list)):
            raise UserError(
                f"--layers {shown}: {cfg.architecture}'s per-layer field {key!r} cannot be subset by trtbuild; "
                "convert every layer of this model"
            )


def _subset_config(cfg: ModelConfig, layers: Sequence[int]) -> ModelConfig:
    fields = dict(cfg.family_fields)
    if isinstance(fields.get("layer_types"), list):  # one entry per layer; Gemma 3's pattern no longer holds
        fields["layer_types"] = [fields["layer_types"][i] for i in layers]
        fields.pop("_sliding_window_pattern", None)
    if isinstance(fields.get("mlp_only_layers"), list):  # layer numbers: the kept ones, renumbered
        fields["mlp_only_layers"] = [layers.index(i) for i in fields["mlp_only_layers"] if i in layers]
    return dataclasses.replace(cfg, num_hidden_layers=len(layers), family_fields=fields)


# the family config's per-layer fields `--layers` subsets: gpt-oss / Gemma 3 / Qwen windows' `layer_types`, MoE
# families' dense layers (moe.py); any other list-valued family field is refused (check_layer_selection)
_PER_LAYER = ("layer_types", "mlp_only_layers")


def _with_excluded(cfg: ModelConfig, made: list[prequant.Made]) -> QuantConfig:
    """cfg's quantization with exclude_modules: every linear the format did not store quantized, and the embedding
    (TensorRT-LLM reads a null list as "every linear quantized")."""
    suffix = ".weights_scaling_factor"
    quantized = {m.name.removesuffix(suffix) for m in made if m.name.endswith(suffix)}
    linears = {p for layer in spec_of(cfg).layers for p in layer.linears()} | {"lm_head"}
    excluded = sorted(linears - quantized | {"transformer.vocab_embedding"})
    return dataclasses.replace(cfg.quantization, exclude_modules=excluded)


def _prequantized(
    fmt: prequant.Format | None, rules: list[Rule], cfg: ModelConfig
) -> tuple[list[Rule], list[prequant.Made]]:
    """The family's rules less the weights a pre-quantized checkpoint stores quantized, and the tensors of our
    layout its format makes instead (with its KV cache scales)."""
    if fmt is None:
        return rules, []
    kept: list[Rule] = []
    made: list[prequant.Made] = []
    for rule in rules:
        replaced = fmt.linear(rule) if rule.dst.endswith(".weight") and not rule.experts else None
        if replaced is None:
            kept.append(rule)
        else:
            made.extend(replaced)
    made.extend(fmt.extras(cfg))
    names = [m.name for m in made] + [r.dst for r in kept]
    assert len(names) == len(set(names)), "a format made a tensor twice or one a float rule also makes"
    return kept, made


def _full_shape(ckpt: HFCheckpoint, rule: Rule) -> tuple[int, ...]:
    if rule.packing:
        return packed_shape(rule, ckpt.tensors[rule.srcs[0]].shape)
    shapes = [ckpt.tensors[s].shape for s in rule.srcs]
    if rule.transpose:
        shapes = [tuple(reversed(s)) for s in shapes]
    rows = sum(s[0] for s in shapes)
    if rule.experts:
        return (rule.experts, rows // rule.experts, *shapes[0][1:])
    return (rows, *shapes[0][1:])


def _gated(rule: Rule) -> bool:
    """Whether a MoE tensor's experts are gated (fc = [up; gate]: each half splits on its own under moe-TP)."""
    return not isinstance(rule.ffn, ExpertsFFN) or rule.ffn.gated


def _dtype(out: OutputTensor, dtype: np.dtype[Any]) -> np.dtype[Any]:
    """The tensor's dtype in the checkpoint: a pre-quantized tensor's own, its rule's own (a MoE router's float32),
    else the checkpoint's."""
    if out.made is not None:
        return NUMPY_DTYPES[code_of(out.made.dtype)]
    return NUMPY_DTYPES[DTYPES[out.rule.dtype]] if out.rule.dtype else dtype


def _cast(array: Array, dtype: np.dtype[Any]) -> Array:
    """`array` in `dtype`, rounded as torch's `Tensor.to` rounds it (to nearest, ties to even): float64 goes to a
    narrower float through float32, as torch's BFloat16 and Half take a float (numpy would round once, directly);
    every other cast rounds once in both (tests/checkpoint/test_convert_numpy.py compares them bit for bit)."""
    if array.dtype == dtype:
        return array
    if array.dtype == np.float64 and dtype.itemsize < 4:
        array = array.astype(np.float32)
    with np.errstate(over="ignore"):  # overflow to infinity is refused by _check_values before it is written
        return array.astype(dtype)


def _extremes(array: Array) -> tuple[float, float]:
    """The smallest and largest value, NaN if any is NaN (a NaN never compares, so min/max propagate it). numpy
    reduces ml_dtypes' bfloat16 / float8 element by element, ~20x slower than float32, so those are widened to
    float32 (exactly) a piece at a time."""
    if array.dtype.kind == "f":
        return float(array.min()), float(array.max())
    rows = array.reshape(1, -1) if array.ndim < 2 else array
    step = max(1, _PIECE // max(1, math.prod(rows.shape[1:])))
    los, his = [], []
    for start in range(0, rows.shape[0], step):
        piece = rows[start : start + step].astype(np.float32)
        los.append(piece.min())
        his.append(piece.max())
    return float(np.min(los)), float(np.max(his))


def _check_values(name: str, where: Path, out_name: str, tensor: Array, dtype: np.dtype[Any]) -> None:
    """Refuse NaN/Inf and values the target dtype cannot hold. Casting is monotonic, so the two extremes decide
    for the whole tensor."""
    if code_of(tensor.dtype) not in FLOAT_CODES or tensor.size == 0:
        return
    lo, hi = _extremes(tensor)
    if not (math.isfinite(lo) and math.isfinite(hi)):
        bad = int(tensor.size - np.count_nonzero(np.isfinite(tensor.astype(np.float32))))
        raise UserError(
            f"{where}: tensor {name} has {bad} NaN/Inf value(s); the model would produce NaN logits. "
            "Fix or re-export the checkpoint"
        )
    extremes = _cast(np.array([lo, hi]).astype(tensor.dtype), dtype)  # lo, hi are values of tensor.dtype: exact
    if not np.isfinite(extremes.astype(np.float32)).all():
        raise UserError(
            f"{where}: tensor {name} (-> {out_name}) overflows {TORCH_NAMES[code_of(dtype)]} "
            f"(max |value| {max(abs(lo), abs(hi)):.3g}); choose --dtype bfloat16 or float32"
        )


def _materialize(out: OutputTensor, reader: TensorReader, dtype: np.dtype[Any]) -> Array:
    """Read the rule's sources, check, fuse, cast."""
    dtype = _dtype(out, dtype)
    if out.made is not None:
        return _made(out.made, reader, dtype)
    if out.rule.packing:
        return _unpacked(out, reader, dtype)
    if out.rule.experts:
        return _stacked(out, reader, dtype)
    parts = [reader.get(s) for s in out.rule.srcs]
    if out.rule.transpose:
        parts = [p.T for p in parts]
    for name, part in zip(out.rule.srcs, parts, strict=True):
        _check_values(name, reader.file_of(name), out.name, part, dtype)
    if len({p.dtype for p in parts}) > 1:  # torch.cat's promotion of floats: float64 if any, else float32
        wide = np.float64 if any(p.dtype == np.float64 for p in parts) else np.float32
        parts = [p.astype(wide) for p in parts]
    tensor = parts[0] if len(parts) == 1 else np.concatenate(parts)
    if out.rule.offset:
        tensor = tensor.astype(np.float32) + np.float32(out.rule.offset)
    if out.rule.halves_swapped:
        half = -(-tensor.shape[0] // 2)  # torch.chunk(2)'s first half
        tensor = np.concatenate([tensor[half:], tensor[:half]])
    return np.ascontiguousarray(_cast(tensor, dtype))


def _made(made: prequant.Made, reader: TensorReader, dtype: np.dtype[Any]) -> Array:
    """A pre-quantized tensor as its format makes it, checked like any other (NaN scales, codes that decode to
    NaN) and held to the shape and dtype the plan promised the writer."""
    tensor = made.make(reader)
    where = reader.file_of(made.srcs[0]) if made.srcs else Path(".")
    if tensor.shape != made.shape or tensor.dtype != dtype:
        raise AssertionError(f"{made.name}: made {tensor.dtype}{list(tensor.shape)}, planned {dtype}{list(made.shape)}")
    _check_values(made.srcs[0] if made.srcs else made.name, where, made.name, tensor, dtype)
    return np.ascontiguousarray(tensor)


def _stacked(out: OutputTensor, reader: TensorReader, dtype: np.dtype[Any]) -> Array:
    """A mixture-of-experts tensor [experts, rows, ...], filled one source tensor at a time: memory is the stacked
    result plus one expert's tensor, never every expert's sources at once."""
    tensor = np.empty(out.shape, dtype=dtype)
    per_expert = len(out.rule.srcs) // out.rule.experts
    row = 0
    for i, name in enumerate(out.rule.srcs):
        expert, slot = divmod(i, per_expert)
        row = 0 if slot == 0 else row
        part = reader.get(name)
        _check_values(name, reader.file_of(name), out.name, part, dtype)
        tensor[expert, row : row + part.shape[0]] = _cast(part, dtype)
        row += part.shape[0]
        del part
    return tensor


def packed_shape(rule: Rule, source: tuple[int, ...]) -> tuple[int, ...]:
    """The output shape of a packed rule from its first source's shape (MXFP4 blocks: [E, out, in / 32, 16])."""
    if rule.packing == "mxfp4":
        return (*source[:-2], source[-2] * 2 * source[-1])
    return (*source[:-2], source[-1], source[-2]) if rule.transpose else source


def _unpacked(out: OutputTensor, reader: TensorReader, dtype: np.dtype[Any]) -> Array:
    """A packed experts tensor (Rule.packing), written expert by expert: memory is the source as stored (MXFP4: a
    quarter of the bfloat16 size) plus the result and one expert's float32 copy."""
    rule = out.rule
    sources = [reader.get(s) for s in rule.srcs]
    tensor = np.empty(out.shape, dtype=dtype)
    for e in range(out.shape[0]):
        if rule.packing == "mxfp4":
            part = mxfp4.dequantize_array(sources[0][e], sources[1][e])
        else:
            part = sources[0][e].T if rule.transpose else sources[0][e]
        _check_values(rule.srcs[0], reader.file_of(rule.srcs[0]), out.name, part, dtype)
        if rule.interleaved:  # even rows the gate, odd the up -> [up; gate]
            part = np.concatenate([part[1::2], part[0::2]])
        tensor[e] = _cast(part, dtype)
        del part
    return tensor


def _prefetched(items: tuple[OutputTensor, ...], make: Any, workers: int, cost: Any) -> Iterator[Array]:
    """make(item) for each item, in order, computed ahead in up to `workers` threads (numpy's copies and casts and
    the file reads release the GIL). Memory: the tensors made ahead and the one the caller holds (it asks for the
    next only once it has let go of it) together never exceed the largest single one (`cost` in bytes), so small
    tensors are pipelined and a large one is made and written alone: a MoE layer's stacked experts, the largest
    tensors, are never two at once."""
    budget = max((cost(item) for item in items), default=0)
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="convert") as pool:
        queue: deque[tuple[Future[Array], int]] = deque()
        in_flight = 0  # bytes submitted and not yet let go of by the caller
        try:
            for item in items:
                while queue and (len(queue) >= workers or in_flight + cost(item) > budget):
                    future, size = queue.popleft()
                    yield future.result()
                    del future  # the caller asks for the next: the tensor it held is free
                    in_flight -= size
                queue.append((pool.submit(make, item), cost(item)))
                in_flight += cost(item)
            while queue:
                future, size = queue.popleft()
                yield future.result()
                del future
        finally:
            for future, _ in queue:
                future.cancel()


def _cost(reader: TensorReader, dtype: np.dtype[Any], out: OutputTensor) -> int:
    """Bytes held while making `out`: its sources as read, plus the result when fusing, casting or transposing
    makes a new tensor."""
    dtype = _dtype(out, dtype)
    if out.made is not None or out.rule.packing:  # the sources whole and the result
        return math.prod(out.shape) * dtype.itemsize + sum(reader.nbytes(s) for s in out.rule.srcs)
    if out.rule.experts:  # the stacked result and one source at a time
        return math.prod(out.shape) * dtype.itemsize + max(reader.nbytes(s) for s in out.rule.srcs)
    read = sum(reader.nbytes(s) for s in out.rule.srcs)
    copies = len(out.rule.srcs) > 1 or out.rule.transpose or out.rule.halves_swapped
    copies = copies or any(reader.dtype(s) != dtype for s in out.rule.srcs)
    return read + (math.prod(out.shape) * dtype.itemsize if copies else 0)


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (glibc's malloc.h)
# What glibc's own dynamic thresholds grow to on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX = 4 MiB * sizeof(long); the trim
# threshold follows at twice the mmap threshold). Setting either stops that growth for good, so these are the
# closest a process can come back to its default behaviour.
_GROWN_MMAP_THRESHOLD = 32 << 20
_returning = 0  # depth of nested freed_memory_returned()


@contextmanager
def freed_memory_returned() -> Iterator[None]:
    """Inside: glibc serves allocations of 4 MiB and more with mmap, so freed tensors go back to the OS at once (its
    default threshold grows with use, up to 32 MiB, after which freed tensors stay in per-thread arenas and RSS climbs
    with the number of workers). On leaving the outermost one: the thresholds glibc's own growth reaches, so the rest
    of the process does not pay a page fault per large temporary: an engine run after convert in one pipeline (a
    `trtbuild run` recipe, bench/engine.py) decoded at batch 32 at half speed while the 4 MiB setting outlived the
    conversion (docs/performance.md). A no-op where glibc is absent."""
    global _returning
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:  # yielded outside the except: the body's own errors must not chain to a missing libc
        yield
        return
    if _returning == 0:
        mallopt(_M_MMAP_THRESHOLD, 4 << 20)
    _returning += 1
    try:
        yield
    finally:
        _returning -= 1
        if _returning == 0:
            mallopt(_M_MMAP_THRESHOLD, _GROWN_MMAP_THRESHOLD)
            mallopt(_M_TRIM_THRESHOLD, 2 * _GROWN_MMAP_THRESHOLD)


def write_stage(
    out_dir: Path, plan: ConversionPlan, stage: int, reader: TensorReader, workers: int, advance: Any
) -> dict[Path, str]:
    """Write the TP rank files of one pipeline stage; returns their sha256 by path."""
    cfg, dtype = plan.config, plan.config.numpy_dtype
    tp = cfg.mapping.tp_size
    tensors = plan.stages[stage]
    infos = [TensorInfo(o.name, _dtype(o, dtype), shard_shape(o.shape, o.rule.split, cfg, tp, o.name)) for o in tensors]
    paths = [out_dir / rank_file(cfg.mapping.rank(t, stage)) for t in range(tp)]
    with ExitStack() as stack:
        writers = [stack.enter_context(SafetensorsWriter(path, infos, {"format": "pt"})) for path in paths]
        made = _prefetched(tensors, lambda o: _materialize(o, reader, dtype), workers, partial(_cost, reader, dtype))
        for out in tensors:
            full = next(made)  # not zip(tensors, made): zip holds the last tuple it made while it makes the next
            for t, writer in enumerate(writers):
                writer.write(out.name, shard(full, out.rule.split, cfg, tp, t, out.name, _gated(out.rule)))
            del full  # before the next tensor is made
            advance(1)
        assert next(made, None) is None
    return {path.resolve(): writer.sha256 for path, writer in zip(paths, writers, strict=True)}


@dataclass(frozen=True)
class ConvertResult:
    """What `convert` wrote: the checkpoint's shape and its files as the manifest lists them."""

    output_dir: str
    architecture: str
    dtype: str
    tp_size: int
    pp_size: int
    num_tensors: int
    num_parameters: int
    outputs: list[dict[str, Any]]  # the manifest's file entries: path, size, sha256
    warnings: list[str]
    wall_time_s: float

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def lines(self) -> list[str]:
        return [
            f"converted {self.architecture} -> {self.output_dir}",
            f"  dtype {self.dtype}, tp={self.tp_size} pp={self.pp_size}, {self.num_tensors} tensors, "
            f"{self.num_parameters:,} parameters, "
            f"{self.wall_time_s:.2f} s",
            *(f"  {e['path']}  {e['size']:,} B  sha256 {e['sha256'][:16]}" for e in self.outputs),
        ]


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
    tp: int = 1,
    pp: int = 1,
    workers: int = 1,
    record: StageRecord | None = None,
    moe_ep: int = 1,
    dequantize: bool = False,
    layers: Sequence[int] | None = None,
) -> ConvertResult:
    """Convert `model_dir` into `out_dir` (atomically). Returns the summary printed by the CLI. `dequantize`: a
    pre-quantized checkpoint becomes a float one (each quantized linear's weight as its method dequantizes it)."""
    if workers < 1:
        raise UserError(f"--workers must be at least 1 (got {workers})")
    ckpt = HFCheckpoint.open(model_dir, allow_pickle=allow_pickle)
    plan = plan_conversion(ckpt, dtype, tp, pp, moe_ep, dequantize, layers)
    record = record or StageRecord("convert")
    for msg in plan.warnings:
        console.warn(msg)
        record.warnings.append(msg)
    if not ckpt.has_tokenizer():
        msg = f"{model_dir}: no tokenizer (tokenizer.json / tokenizer.model); the engine will lack one"
        console.warn(msg)
        record.warnings.append(msg)
    cfg = plan.config
    console.info(
        f"converting {plan.architecture} from {model_dir} ({cfg.dtype}, tp={tp} pp={pp}, "
        f"{plan.num_tensors} tensors, {workers} worker(s))"
    )
    with freed_memory_returned(), atomic_dir(out_dir, force, inputs=(model_dir,)) as tmp, _cancel_on_error(record):
        index = [ckpt.root / SAFETENSORS_INDEX] if (ckpt.root / SAFETENSORS_INDEX).is_file() else []
        record.add_inputs(ckpt.root, [ckpt.root / "config.json", *ckpt.weight_files, *index, *ckpt.tokenizer_files()])
        write_config(tmp, cfg)
        with ckpt.reader() as reader, console.progress("writing rank files", plan.num_tensors) as advance:
            for stage in range(pp):
                record.known_sha256.update(write_stage(tmp, plan, stage, reader, workers, advance))
        for path in ckpt.tokenizer_files():
            shutil.copyfile(path, tmp / path.name)
        record.details.update(
            architecture=plan.architecture,
            dtype=cfg.dtype,
            tp_size=tp,
            pp_size=pp,
            **({"moe_ep_size": moe_ep} if moe_ep != 1 else {}),
            workers=workers,
            num_tensors=plan.num_tensors,
            num_parameters=sum(math.prod(t.shape) for stage in plan.stages for t in stage),
            model_dir=str(model_dir.resolve()),
            **({"quantization_source": plan.quantization_source} if plan.quantization_source else {}),
            **(
                {
                    "layers": list(layers),
                    "note": f"a stand-in draft model made of layers {list(layers)} of "
                    f"{ckpt.config.get('num_hidden_layers')} of {model_dir.resolve()}",
                }
                if layers is not None
                else {}
            ),
        )
        manifest = record.write(tmp)
    return ConvertResult(
        output_dir=str(out_dir.resolve()),
        architecture=plan.architecture,
        dtype=cfg.dtype,
        tp_size=tp,
        pp_size=pp,
        num_tensors=plan.num_tensors,
        num_parameters=record.details["num_parameters"],
        outputs=manifest["outputs"],
        warnings=record.warnings,
        wall_time_s=manifest["wall_time_s"],
    )
