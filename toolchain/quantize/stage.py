"""`trtbuild quantize`: a TensorRT-LLM checkpoint -> a quantized one, plus (optionally) its quality report.

Round-to-nearest weight quantization (W8A16 per channel, W4A16 per group, FP8 per tensor, mlp.fc and mlp.gate
sharing one FP8 weight scale); AWQ scale and clip searches (awq.py); SmoothQuant migration at a fixed α or α searched
per layer, then INT8 weights per channel (smoothquant.py); INT8/FP8 activation and FP8 KV-cache scales from
calibration maxima, INT8 KV-cache scales from a clip search below the maximum (calibrate.py). Embeddings are never
quantized, lm_head only when not excluded, a mixture of experts' router never; its stacked experts are quantized
expert by expert by the weight-only methods, and by fp8, AWQ and SmoothQuant with routed calibration (experts.py,
calibrate.py).

Each method is a module of methods/ (the registry: plan, prepare, quantize, dequantize, export); one driver runs
them all, one decoder layer at a time. Memory: a streamable method (w8a16, w4a16) holds one source tensor at a time
(the calibration a KV cache needs adds one layer's float weights); the others hold one layer's float weights, the
calibration hidden states and the quantized layers so far. --eval-data then compares the written checkpoint with
the float one, loaded only for that.
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from toolchain import console
from toolchain.atomic import atomic_dir
from toolchain.checkpoint.convert import freed_memory_returned
from toolchain.checkpoint.hf import TOKENIZER_FILES
from toolchain.checkpoint.safetensors_io import SafetensorsWriter, TensorInfo, read_header, read_tensor
from toolchain.checkpoint.spec import ExpertsFFN, ModelSpec, spec_of
from toolchain.checkpoint.trtllm import (
    CONFIG_NAME,
    ModelConfig,
    QuantConfig,
    rank_file,
    read_config,
    write_config,
)
from toolchain.errors import UserError
from toolchain.manifest import StageRecord, sha256_file
from toolchain.quality import QualityReport, compare
from toolchain.quantize import FORMATS, experts
from toolchain.quantize.calibrate import (
    MIN_EXPERT_TOKENS,
    Calibration,
    LayerwiseCalibration,
    check_ffns,
    sample_windows,
)
from toolchain.quantize.fake import load_quantized
from toolchain.quantize.hf_export import check_exportable, write_hf
from toolchain.quantize.methods.base import Context, Layer, QuantMethod
from toolchain.quantize.methods.kv_cache import KvCacheQuant, check_head_size
from toolchain.quantize.methods.registry import KV_CACHES, method
from toolchain.quantize.results import QuantizeResult
from toolchain.quantize.scheme import DEFAULT_EXCLUDE, excluded, quantizable, routers
from toolchain.quantize.smoothquant import Alpha
from toolchain.reference.model import ReferenceModel
from toolchain.text import tokenize


@dataclass(frozen=True)
class QuantizeOptions:
    method: str
    kv_cache: str = "none"
    group_size: int = 128
    calib_data: Path | None = None
    calib_samples: int = 64
    calib_seq_len: int = 256
    seed: int = 0
    exclude: tuple[str, ...] = DEFAULT_EXCLUDE
    sq_alpha: Alpha = 0.5  # or "auto": searched per group of linears (smoothquant.py)
    format: str = "trtllm"  # or "hf": ModelOpt's unified Hugging Face checkpoint (hf_export.py)

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise UserError(f"format {self.format!r} is not supported; choose one of {', '.join(FORMATS)}")
        sizes = method(self.method).group_sizes  # a name the registry does not hold is one clear error
        if self.kv_cache not in KV_CACHES:
            raise UserError(f"kv cache {self.kv_cache!r} is not supported; choose one of {', '.join(KV_CACHES)}")
        if self.group_size not in sizes:  # the method's to declare
            raise UserError(f"group size {self.group_size} is not supported; choose one of {sizes}")
        if self.calib_samples < 1 or self.calib_seq_len < 2:
            raise UserError("calibration needs at least 1 sample of at least 2 tokens")
        if isinstance(self.sq_alpha, str) and self.sq_alpha != "auto":
            raise UserError(f"SmoothQuant alpha {self.sq_alpha!r} is neither a number in [0, 1] nor 'auto'")
        if not isinstance(self.sq_alpha, str) and not 0 <= self.sq_alpha <= 1:
            raise UserError(f"SmoothQuant alpha {self.sq_alpha} is outside [0, 1]; pass a number in [0, 1] or 'auto'")

    @property
    def smoothquant_val(self) -> float:
        """config.json's `smoothquant_val`: the fixed α, or TensorRT-LLM's default 0.5 when α was searched per
        layer (TensorRT-LLM reads it only when it smooths itself; the manifest records each searched α)."""
        return 0.5 if isinstance(self.sq_alpha, str) else self.sq_alpha

    @property
    def quant_method(self) -> QuantMethod:
        return method(self.method)

    @property
    def kv(self) -> KvCacheQuant | None:
        return KV_CACHES[self.kv_cache]

    @property
    def needs_calibration(self) -> bool:
        return self.quant_method.needs_calibration or self.kv is not None


def parse_sq_alpha(text: str) -> Alpha:
    """`--sq-alpha` / a recipe's `sq_alpha`: a number in [0, 1] or 'auto' (range checked by QuantizeOptions)."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return float(text)
    except ValueError:
        raise UserError(f"--sq-alpha {text!r} is neither a number in [0, 1] nor 'auto'") from None


def _check_held_out(opts: QuantizeOptions, eval_data: Path | None) -> None:
    """The quality report is only worth something on text the calibration did not see."""
    calib = opts.calib_data
    if (
        eval_data is None
        or calib is None
        or not opts.needs_calibration
        or not calib.is_file()
        or not eval_data.is_file()
    ):
        return
    if calib.resolve() == eval_data.resolve() or (
        calib.stat().st_size == eval_data.stat().st_size and sha256_file(calib) == sha256_file(eval_data)
    ):
        raise UserError(
            f"--calib-data and --eval-data are the same text ({eval_data}); evaluate on held-out text, "
            "e.g. calibrate on WikiText-2 valid.txt and evaluate on test.txt"
        )


def _windows(source: Path, opts: QuantizeOptions) -> tuple[torch.Tensor, dict[str, Any]]:
    if opts.calib_data is None:
        raise UserError(
            f"--method {opts.method} / --kv-cache {opts.kv_cache} needs calibration text: pass --calib-data"
        )
    tokens = tokenize(opts.calib_data, source)
    windows = sample_windows(tokens, opts.calib_samples, opts.calib_seq_len, opts.seed)
    console.info(f"calibrating on {windows.shape[0]} samples x {opts.calib_seq_len} tokens from {opts.calib_data}")
    info = {
        "file": str(opts.calib_data.resolve()),
        "sha256": sha256_file(opts.calib_data),
        "samples": windows.shape[0],
        "seq_len": opts.calib_seq_len,
        "seed": opts.seed,
    }
    return windows, info


@dataclass(frozen=True)
class _Deferred:
    """Tensors the writer makes when it reaches the first of them, reading their source tensor then: a tensor kept
    as it is, or a streamable method's linear (`infos`: its plan)."""

    infos: dict[str, TensorInfo]
    make: Callable[[Callable[[str], torch.Tensor]], dict[str, torch.Tensor]]


Planned = dict[str, torch.Tensor | _Deferred]  # every output tensor's name -> its value, or what makes it


def _as_is(name: str, info: TensorInfo) -> _Deferred:
    return _Deferred({name: TensorInfo(name, info.dtype, info.shape)}, lambda read: {name: read(name)})


def _streamed(qm: QuantMethod, prefix: str, info: TensorInfo, ctx: Context) -> _Deferred:
    if experts.stacked(info.shape):  # a mixture of experts' [E, out, in]: each expert quantized by itself
        planned = experts.plan(qm, prefix, info.shape, ctx)
        return _Deferred(planned, lambda read: experts.quantize(qm, prefix, read(f"{prefix}.weight"), ctx))
    return _Deferred(qm.plan(prefix, info.shape, ctx), lambda read: qm.quantize(prefix, read(f"{prefix}.weight"), ctx))


def _quantize_layer(qm: QuantMethod, layer: Layer, ctx: Context, header: dict[str, TensorInfo], out: Planned) -> Any:
    """Quantize one unit's linears into `out`; returns the method's per-linear choices (for the manifest)."""
    if qm.streamable:
        for prefix in layer.linears:
            made = _streamed(qm, prefix, header[f"{prefix}.weight"], ctx)
            out.update(dict.fromkeys(made.infos, made))
        return {}
    # a mixture of experts' stacked [E, out, in] linears are searched expert by expert on their routed calibration
    # (experts.py), not by the method's per-layer work on dense linears
    stacked = {p for p in layer.linears if experts.stacked(tuple(layer.tensors[f"{p}.weight"].shape))}
    dense = [p for p in layer.linears if p not in stacked]
    prepared = qm.prepare(dataclasses.replace(layer, linears=dense, chosen=layer.chosen - stacked), ctx)
    searched: dict[str, Any] = {}
    for prefix in layer.linears:
        weight = layer.tensors[f"{prefix}.weight"]
        if prefix in stacked:
            tensors, choices = experts.quantize_with_choices(qm, prefix, weight, ctx)
            layer.tensors.update(tensors)
            searched.update({prefix: choices} if choices else {})
        else:
            layer.tensors.update(qm.quantize(prefix, weight, ctx, prepared.get(prefix)))
    out.update(layer.tensors)
    return {**prepared, **searched} if qm.details_key else {}


def _outside_layers(spec: ModelSpec) -> list[str]:
    """The tensors the calibration forward reads besides the layers' (lm_head's input is the final norm's output):
    the vocabulary embedding, the learned position embedding where there is one, the final norm."""
    norm = spec.final_norm
    return [
        "transformer.vocab_embedding.weight",
        *(["transformer.position_embedding.weight"] if spec.learned_positions else []),
        f"{norm.name}.weight",
        *([f"{norm.name}.bias"] if norm.has_bias else []),
    ]


def _quantize_layerwise(
    source: Path,
    cfg: ModelConfig,
    spec: ModelSpec,
    opts: QuantizeOptions,
    chosen: set[str],
    windows: torch.Tensor | None,
) -> tuple[Planned, Calibration, dict[str, Any]]:
    """Every method, one decoder layer at a time. With calibration (`windows`), the windows' hidden states go
    through layer i (its float weights the only ones in memory), its statistics are recorded, and the method
    prepares and quantizes its linears at once: same statistics, same order, same bytes as calibrating the whole
    model first. A streamable method's linears, and every tensor left as it is, are only planned here: the writer
    reads (and quantizes) each when it reaches it. Returns the output, the statistics and the method's choices."""
    qm = opts.quant_method
    path = source / rank_file(0)
    header, _ = read_header(path)
    out: Planned = {n: _as_is(n, info) for n, info in header.items()}
    choices: dict[str, Any] = {}
    with path.open("rb") as f, torch.no_grad():

        def load(names: list[str]) -> dict[str, torch.Tensor]:
            return {n: read_tensor(f, header[n]) for n in names}

        run: LayerwiseCalibration | None = None
        if windows is not None:
            run = LayerwiseCalibration(cfg, load(_outside_layers(spec)), windows)
        calib = run.calibration if run else Calibration()
        ctx = Context(opts.group_size, cfg.torch_dtype, opts.sq_alpha, calib)
        for ls in spec.layers:
            names = sorted(n for n in header if n.startswith(f"{ls.prefix}."))
            layer = load(names) if run or not qm.streamable else {}
            if run:
                run.layer(ls.index, layer)
            linears = [p for p in ls.linears() if p in chosen]
            choices.update(_quantize_layer(qm, Layer(ls.prefix, layer, linears, chosen, ls), ctx, header, out))
            for linear in ls.linears():
                calib.input_sample.pop(linear, None)  # this layer's row samples are spent (AWQ's searches used them)
                if linear in calib.routed:
                    calib.routed[linear].drop_samples()
        if run:
            run.finish()
        if "lm_head" in chosen:
            head = load(["lm_head.weight"]) if not qm.streamable else {}
            choices.update(_quantize_layer(qm, Layer("lm_head", head, ["lm_head"], chosen, None), ctx, header, out))
    return out, calib, choices


@freed_memory_returned()  # freed per-layer tensors go back to the OS instead of staying in malloc's arenas
def quantize_checkpoint(
    source: Path,
    out_dir: Path,
    opts: QuantizeOptions,
    eval_data: Path | None = None,
    eval_tokens: int = 50_000,
    force: bool = False,
    record: StageRecord | None = None,
) -> QuantizeResult:
    _check_held_out(opts, eval_data)
    cfg = read_config(source)
    if cfg.quantization.quant_algo or cfg.quantization.kv_cache_quant_algo:
        raise UserError(f"{source} is already quantized ({cfg.quantization.quant_algo}); quantize the unquantized one")
    if cfg.mapping.world_size != 1:
        raise UserError(f"{source} has {cfg.mapping.world_size} ranks; quantize a tp=1 pp=1 checkpoint")
    qm, kv = opts.quant_method, opts.kv
    check_head_size(kv, cfg.head_size, f"{source / CONFIG_NAME}")
    rank_path = source / rank_file(0)
    if not rank_path.is_file():
        raise UserError(f"{rank_path} not found; is {source} a converted checkpoint (trtbuild convert)?")
    header, _ = read_header(rank_path)
    spec = spec_of(cfg)
    if any(isinstance(ls.ffn, ExpertsFFN) for ls in spec.layers):  # a method experts.py does not know: refused now
        experts.check_method(qm, next(p for p in quantizable(spec) if p.endswith(".mlp.fc")))
    if opts.needs_calibration:
        check_ffns(spec, "quantization")
    linears = quantizable(spec)
    missing = sorted(p for p in linears if f"{p}.weight" not in header)
    if missing:
        raise UserError(f"{rank_path}: {missing[0]}.weight missing; config.json's model needs it (re-run convert)")
    chosen = [p for p in linears if not excluded(p, opts.exclude)]
    if opts.format == "hf":  # refused before any quantization: what ModelOpt's layout cannot hold
        planned = QuantConfig(qm.quant_algo, kv.quant_algo if kv else None, opts.group_size)
        check_exportable(dataclasses.replace(cfg, quantization=planned), str(source), chosen)
    windows, calib_info = _windows(source, opts) if opts.needs_calibration else (None, {})
    out, calib, choices = _quantize_layerwise(source, cfg, spec, opts, set(chosen), windows)
    kv_tensors, kv_clip = kv.scales(calib) if kv else ({}, {})
    out.update(kv_tensors)
    quant = QuantConfig(
        quant_algo=qm.quant_algo,
        kv_cache_quant_algo=kv.quant_algo if kv else None,
        group_size=opts.group_size,
        smoothquant_val=opts.smoothquant_val,
        pre_quant_scale=qm.pre_quant_scale,
        exclude_modules=sorted(set(linears) - set(chosen) | {"transformer.vocab_embedding"} | set(routers(spec))),
    )
    qcfg = dataclasses.replace(cfg, quantization=quant)
    record = record or StageRecord("quantize")
    record.details.update(
        method=opts.method,
        quant_algo=quant.quant_algo,
        kv_cache_quant_algo=quant.kv_cache_quant_algo,
        group_size=opts.group_size,
        smoothquant_alpha=opts.sq_alpha if qm.uses_sq_alpha else None,
        quantized_modules=len(chosen),
        calibration=calib_info or None,
    )
    routed = {p: st.summary(header[f"{p}.weight"].shape[0]) for p, st in sorted(calib.routed.items())}
    if routed:  # per stacked experts' linear: tokens routed to each expert in calibration, and who fell back
        record.details["routed_calibration"] = {
            "min_tokens": MIN_EXPERT_TOKENS,
            "fallback": "the layer's statistics over all routed tokens",
            "linears": routed,
        }
    if kv_clip:  # per layer: the INT8 KV scale's clip ratio r (scale = max(|k|, |v|) · r / 127)
        record.details["kv_cache_clip"] = dict(sorted(kv_clip.items()))
    if choices and qm.details_key:  # per linear: what the method's per-layer searches chose (methods/)
        record.details[qm.details_key] = {prefix: choice.summary() for prefix, choice in sorted(choices.items())}
    with atomic_dir(out_dir, force, inputs=(source,)) as tmp:
        record.add_inputs(source, [source / CONFIG_NAME, source / rank_file(0)])
        ckpt = tmp / ".trtllm" if opts.format == "hf" else tmp  # hf: our checkpoint first, rewritten below
        ckpt.mkdir(exist_ok=True)
        write_config(ckpt, qcfg)
        _write(rank_path, ckpt / rank_file(0), out)
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copyfile(source / name, tmp / name)
        report = _quality(source, ckpt, eval_data, eval_tokens) if eval_data else None
        if report:
            record.details["quality"] = report.to_dict()
        if opts.format == "hf":
            record.details["format"] = {"name": "hf", "layout": "modelopt unified HF", "files": write_hf(ckpt, tmp)}
            shutil.rmtree(ckpt)
        manifest = record.write(tmp)
    return QuantizeResult(
        output_dir=str(out_dir.resolve()),
        quant_algo=quant.quant_algo,
        kv_cache_quant_algo=quant.kv_cache_quant_algo,
        group_size=opts.group_size,
        quantized_modules=len(chosen),
        calibration=calib_info or None,
        quality=report,
        routed_calibration=record.details.get("routed_calibration"),
        outputs=manifest["outputs"],
        wall_time_s=manifest["wall_time_s"],
    )


def _write(src: Path, dst: Path, out: Planned) -> None:
    """Every output tensor in name order; a deferred one is read (and quantized) from `src` when the writer reaches
    it, and a linear's scales wait in memory for their turn after its codes."""
    plan = {
        name: entry.infos[name] if isinstance(entry, _Deferred) else TensorInfo(name, entry.dtype, tuple(entry.shape))
        for name, entry in out.items()
    }
    header, _ = read_header(src)
    made: dict[str, torch.Tensor] = {}
    with src.open("rb") as f, SafetensorsWriter(dst, [plan[n] for n in sorted(plan)], {"format": "pt"}) as writer:

        def read(name: str) -> torch.Tensor:
            return read_tensor(f, header[name])

        for name in sorted(plan):
            if name not in made:
                entry = out[name]
                made.update(entry.make(read) if isinstance(entry, _Deferred) else {name: entry})
            writer.write(name, made.pop(name).contiguous())


def _quality(source: Path, quantized: Path, eval_data: Path, limit: int) -> QualityReport:
    """The written checkpoint against the float one it was made from, both loaded only now."""
    tokens = tokenize(eval_data, source, max_tokens=limit)
    base = ReferenceModel.from_checkpoint(source)
    window = min(256, base.config.max_position_embeddings)
    if tokens.numel() < window:
        raise UserError(f"{eval_data}: {tokens.numel()} tokens, fewer than one evaluation window of {window}")
    console.info(f"evaluating on {tokens.numel():,} tokens of {eval_data}")
    return compare(base.forward, load_quantized(quantized).forward, tokens, window)
