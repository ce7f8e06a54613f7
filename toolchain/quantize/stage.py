"""`trtbuild quantize`: a TensorRT-LLM checkpoint -> a quantized one, plus (optionally) its quality report.

Round-to-nearest weight quantization (W8A16 per channel, W4A16 per group, FP8 per tensor, mlp.fc and mlp.gate
sharing one FP8 weight scale); AWQ scale and clip searches (awq.py); SmoothQuant migration at a fixed α or α searched
per layer, then INT8 weights per channel (smoothquant.py); INT8/FP8 activation and FP8 KV-cache scales from
calibration maxima, INT8 KV-cache scales from a clip search below the maximum (calibrate.py). Embeddings are never
quantized, lm_head only when not excluded.

Memory: w8a16 / w4a16 with no KV cache and no --eval-data stream, one tensor in memory at a time; the methods that
calibrate go layer by layer (one layer's float weights, the calibration hidden states, and the quantized model so
far). Both are byte-identical to the in-memory path, which --eval-data still takes (it needs the whole float
model as the reference).
"""

from __future__ import annotations

import dataclasses
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from toolchain import console
from toolchain.atomic import atomic_dir
from toolchain.checkpoint.convert import return_freed_memory
from toolchain.checkpoint.hf import TOKENIZER_FILES
from toolchain.checkpoint.spec import spec_of
from toolchain.checkpoint.safetensors_io import SafetensorsWriter, TensorInfo, read_header, read_tensor
from toolchain.checkpoint.trtllm import (
    CONFIG_NAME,
    ModelConfig,
    QuantConfig,
    load_rank,
    rank_file,
    read_config,
    write_config,
)
from toolchain.errors import UserError
from toolchain.evaluate.quality import QualityReport, compare
from toolchain.evaluate.text import tokenize
from toolchain.manifest import StageRecord, sha256_file
from toolchain.quantize.awq import AwqChoice, quantize_awq, search_group, shared_input_groups
from toolchain.quantize.calibrate import Calibration, Observer, calibrate, kv_cache_clip, sample_windows
from toolchain.quantize.core import (
    FP8_E4M3_MAX,
    pack_int4,
    quantize_fp8,
    quantize_groupwise,
    quantize_per_channel,
)
from toolchain.quantize.fake import load_quantized
from toolchain.quantize.scheme import (
    DEFAULT_EXCLUDE,
    GROUP_SIZES,
    KV_CACHE,
    KV_MAXBOUND,
    METHODS,
    excluded,
    quantizable,
)
from toolchain.quantize.smoothquant import Alpha, AlphaChoice, smooth_layer
from toolchain.reference.model import Hooks, ReferenceModel


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

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise UserError(f"method {self.method!r} is not supported; choose one of {', '.join(METHODS)}")
        if self.kv_cache not in KV_CACHE:
            raise UserError(f"kv cache {self.kv_cache!r} is not supported; choose one of {', '.join(KV_CACHE)}")
        if self.group_size not in GROUP_SIZES:
            raise UserError(f"group size {self.group_size} is not supported; choose one of {GROUP_SIZES}")
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
    def needs_calibration(self) -> bool:
        return self.method in ("fp8", "w4a16_awq", "w8a8_sq") or self.kv_cache != "none"


def parse_sq_alpha(text: str) -> Alpha:
    """`--sq-alpha` / a recipe's `sq_alpha`: a number in [0, 1] or 'auto' (range checked by QuantizeOptions)."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return float(text)
    except ValueError:
        raise UserError(f"--sq-alpha {text!r} is neither a number in [0, 1] nor 'auto'") from None


def _fp8_shared_amax(weights: dict[str, torch.Tensor], linears: list[str]) -> dict[str, torch.Tensor]:
    """max |w| of mlp.fc and mlp.gate together, for each layer where both are quantized: TensorRT-LLM fuses the two
    into one GEMM with one per-tensor scale, max(gate scale, fc scale), re-quantizing the FP8 weights to it
    (`fuse_gate_mlp`, tensorrt_llm/models/modeling_utils.py); ModelOpt's export gives both that max amax up front
    (`preprocess_linear_fusion`, modelopt/torch/export/quant_utils.py). Computed before any of them is quantized."""
    shared: dict[str, torch.Tensor] = {}
    for fc in [p for p in linears if p.endswith(".mlp.fc")]:
        gate = fc.removesuffix(".fc") + ".gate"
        if gate in linears:
            amax = torch.maximum(weights[f"{fc}.weight"].abs().amax(), weights[f"{gate}.weight"].abs().amax())
            shared[fc] = shared[gate] = amax
    return shared


def _fp8_partner(prefix: str) -> str | None:
    if prefix.endswith(".mlp.fc"):
        return prefix.removesuffix(".fc") + ".gate"
    if prefix.endswith(".mlp.gate"):
        return prefix.removesuffix(".gate") + ".fc"
    return None


def _quantize_linear(
    opts: QuantizeOptions,
    prefix: str,
    weight: torch.Tensor,
    calib: Calibration,
    dtype: torch.dtype,
    awq: AwqChoice | None = None,
    fp8_amax: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """One linear's tensors; `awq` is its AWQ search result (w4a16_awq only, see `_awq_choices`); `fp8_amax` the
    weight amax an FP8 linear shares with its fused partner (`_fp8_shared_amax`)."""
    if opts.method == "w8a16":
        codes, scale = quantize_per_channel(weight)
        return {f"{prefix}.weight": codes, f"{prefix}.weights_scaling_factor": scale}
    if opts.method == "w8a8_sq":  # `weight` is already smoothed, and the calibration maxima updated to match
        codes, scale = quantize_per_channel(weight)
        act = calib.input_amax[prefix] / 127
        return {
            f"{prefix}.weight": codes,
            f"{prefix}.weights_scaling_factor": scale,
            f"{prefix}.activation_scaling_factor": torch.tensor([act if act > 0 else 1.0], dtype=torch.float32),
        }
    if opts.method in ("w4a16", "w4a16_awq"):
        if weight.shape[0] % 2:
            raise UserError(f"{prefix}: {weight.shape[0]} output channels; int4 packing needs an even number")
        if opts.method == "w4a16_awq":
            assert awq is not None, f"{prefix}: AWQ quantizes with its search's choice"
            codes, scale = quantize_awq(weight, awq, opts.group_size)
            return {
                f"{prefix}.weight": pack_int4(codes),
                f"{prefix}.weights_scaling_factor": scale,
                f"{prefix}.prequant_scaling_factor": (1 / awq.scale).to(dtype),
            }
        pad = -weight.shape[1] % opts.group_size  # zero input channels: exact whatever the input
        codes, scale = quantize_groupwise(F.pad(weight.float(), (0, pad)), opts.group_size)
        return {f"{prefix}.weight": pack_int4(codes), f"{prefix}.weights_scaling_factor": scale}
    codes, scale = quantize_fp8(weight, fp8_amax)
    partner = _fp8_partner(prefix) if fp8_amax is not None else None  # fused: one activation scale too (the max)
    act = max(calib.input_amax[prefix], calib.input_amax.get(partner, 0.0) if partner else 0.0) / FP8_E4M3_MAX
    return {
        f"{prefix}.weight": codes,
        f"{prefix}.weights_scaling_factor": scale,
        f"{prefix}.activation_scaling_factor": torch.tensor([act if act > 0 else 1.0], dtype=torch.float32),
    }


def _awq_choices(
    opts: QuantizeOptions, weights: dict[str, torch.Tensor], prefixes: list[str], calib: Calibration, dtype: torch.dtype
) -> dict[str, AwqChoice]:
    """AWQ's searches for `prefixes`, linears that read one input sharing one scale vector (awq.py)."""
    if opts.method != "w4a16_awq":
        return {}
    choices: dict[str, AwqChoice] = {}
    for group in shared_input_groups(prefixes):
        x, mean_abs = calib.input_sample[group[0]], calib.mean_abs(group[0])
        choices.update(search_group({p: weights[f"{p}.weight"] for p in group}, x, mean_abs, opts.group_size, dtype))
    return choices


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


def _calibration(
    source: Path, opts: QuantizeOptions, model: ReferenceModel | None
) -> tuple[Calibration, dict[str, Any]]:
    if model is None or not opts.needs_calibration:
        return Calibration(), {}
    windows, info = _windows(source, opts)
    return calibrate(model, windows), info


def _quantize_layerwise(
    source: Path, cfg: ModelConfig, opts: QuantizeOptions, chosen: set[str], windows: torch.Tensor
) -> tuple[dict[str, torch.Tensor], Calibration, dict[str, AwqChoice], dict[str, AlphaChoice]]:
    """Calibrate and quantize one decoder layer at a time: the calibration windows' hidden states go through
    layer i (its float weights the only ones in memory), its statistics are recorded, and its linears are
    quantized at once. Same statistics, same order, same bytes as calibrating the whole model first."""
    path = source / rank_file(0)
    header, _ = read_header(path)
    layers = {
        i: sorted(n for n in header if n.startswith(f"transformer.layers.{i}.")) for i in range(cfg.num_hidden_layers)
    }
    in_layers = {n for names in layers.values() for n in names}
    calib = Calibration.for_tokens(windows.numel())
    awq: dict[str, AwqChoice] = {}
    alphas: dict[str, AlphaChoice] = {}
    with path.open("rb") as f, torch.no_grad():

        def load(names: list[str]) -> dict[str, torch.Tensor]:
            return {n: read_tensor(f, header[n]) for n in names}

        out = load(sorted(set(header) - in_layers))  # embeddings, final norm, lm_head
        model = ReferenceModel(
            cfg, {n: t for n, t in out.items() if "embedding" in n or n.startswith("transformer.ln_f")}
        )
        model.hooks = Observer(calib)
        batches = [model.embed(windows[s : s + 8]) for s in range(0, windows.shape[0], 8)]  # calibrate()'s batches
        for i in range(cfg.num_hidden_layers):
            layer = load(layers[i])
            model.w.update({n: t.to(model.dtype) for n, t in layer.items()})
            batches = [(model.layer(h, i, rope), rope) for h, rope in batches]
            for n in layer:
                del model.w[n]
            prefix = f"transformer.layers.{i}"
            if opts.method == "w8a8_sq":
                prequant, searched = smooth_layer(layer, model.spec.layers[i], calib, opts.sq_alpha, chosen)
                layer.update({f"{p}.prequant_scaling_factor": s.to(cfg.torch_dtype) for p, s in prequant.items()})
                alphas.update(searched)
            linears = sorted(p for p in chosen if p.startswith(f"{prefix}."))
            awq.update(_awq_choices(opts, layer, linears, calib, cfg.torch_dtype))
            shared = _fp8_shared_amax(layer, linears) if opts.method == "fp8" else {}
            for linear in linears:
                weight = layer[f"{linear}.weight"]
                layer.update(
                    _quantize_linear(opts, linear, weight, calib, cfg.torch_dtype, awq.get(linear), shared.get(linear))
                )
            for linear in [p for p in calib.input_sample if p.startswith(f"{prefix}.")]:
                del calib.input_sample[linear]  # this layer's row samples are spent (AWQ's searches used them)
            out.update(layer)
        for h, _ in batches:  # lm_head's input, as the full forward would have observed it
            model.hooks.linear_input("lm_head", model.final_norm(h))
        model.hooks = Hooks()
        if "lm_head" in chosen:
            awq.update(_awq_choices(opts, out, ["lm_head"], calib, cfg.torch_dtype))
            weight = out["lm_head.weight"]
            out.update(_quantize_linear(opts, "lm_head", weight, calib, cfg.torch_dtype, awq.get("lm_head")))
    return out, calib, awq, alphas


def quantize_checkpoint(
    source: Path,
    out_dir: Path,
    opts: QuantizeOptions,
    eval_data: Path | None = None,
    eval_tokens: int = 50_000,
    force: bool = False,
    record: StageRecord | None = None,
    stream: bool | None = None,
) -> dict[str, Any]:
    """`stream` (default: when possible): round-to-nearest without calibration or evaluation reads, quantizes and
    writes one tensor at a time, so peak memory is one weight, not the model."""
    _check_held_out(opts, eval_data)
    cfg = read_config(source)
    return_freed_memory()  # freed per-layer tensors go back to the OS instead of staying in malloc's arenas
    if cfg.quantization.quant_algo or cfg.quantization.kv_cache_quant_algo:
        raise UserError(f"{source} is already quantized ({cfg.quantization.quant_algo}); quantize the unquantized one")
    if cfg.mapping.world_size != 1:
        raise UserError(f"{source} has {cfg.mapping.world_size} ranks; quantize a tp=1 pp=1 checkpoint")
    can_stream = opts.method in ("w8a16", "w4a16") and opts.kv_cache == "none" and eval_data is None
    layerwise = opts.needs_calibration and eval_data is None and stream is not False
    stream = can_stream if stream is None else stream and can_stream
    rank_path = source / rank_file(0)
    weights: dict[str, torch.Tensor] = {}
    if stream or layerwise:
        if not rank_path.is_file():
            raise UserError(f"{rank_path} not found; is {source} a converted checkpoint (trtbuild convert)?")
        header, _ = read_header(rank_path)
        linears = quantizable(header)
    else:
        weights = load_rank(source, 0)
        linears = quantizable(weights)
    chosen = [p for p in linears if not excluded(p, opts.exclude)]
    model: ReferenceModel | None = None
    if layerwise:
        windows, calib_info = _windows(source, opts)
        out, calib, awq, alphas = _quantize_layerwise(source, cfg, opts, set(chosen), windows)
    else:
        # the float reference (a float32 copy of the weights) only when calibration or evaluation needs it
        model = ReferenceModel(cfg, weights) if opts.needs_calibration or eval_data else None
        calib, calib_info = _calibration(source, opts, model)
        out = weights  # quantized in place: each float weight is released once its codes replace it
        awq = {} if stream else _awq_choices(opts, out, chosen, calib, cfg.torch_dtype)
        alphas = {}
    if opts.method == "w8a8_sq" and not layerwise:
        for i in range(cfg.num_hidden_layers):
            prequant, searched = smooth_layer(out, spec_of(cfg).layers[i], calib, opts.sq_alpha, set(chosen))
            out.update({f"{p}.prequant_scaling_factor": s.to(cfg.torch_dtype) for p, s in prequant.items()})
            alphas.update(searched)
    todo = [] if stream or layerwise else chosen  # the streaming paths have quantized already
    shared = _fp8_shared_amax(out, todo) if opts.method == "fp8" else {}
    for prefix in todo:
        weight = out[f"{prefix}.weight"]
        out.update(_quantize_linear(opts, prefix, weight, calib, cfg.torch_dtype, awq.get(prefix), shared.get(prefix)))
    kv_algo = KV_CACHE[opts.kv_cache]
    kv_clip: dict[str, float] = {}
    if kv_algo:
        for layer, amax in calib.kv_amax.items():
            if kv_algo == "INT8":  # FP8's error is relative to each value: clipping buys nothing (docs/quality.md)
                kv_clip[layer] = kv_cache_clip(calib, layer)
            scale = amax * kv_clip.get(layer, 1.0) / KV_MAXBOUND[kv_algo]
            out[f"{layer}.attention.kv_cache_scaling_factor"] = torch.tensor([scale if scale > 0 else 1.0])
    quant = QuantConfig(
        quant_algo=METHODS[opts.method],
        kv_cache_quant_algo=kv_algo,
        group_size=opts.group_size,
        smoothquant_val=opts.smoothquant_val,
        pre_quant_scale=opts.method in ("w4a16_awq", "w8a8_sq"),
        exclude_modules=sorted(set(linears) - set(chosen) | {"transformer.vocab_embedding"}),
    )
    qcfg = dataclasses.replace(cfg, quantization=quant)
    record = record or StageRecord("quantize")
    record.details.update(
        method=opts.method,
        quant_algo=quant.quant_algo,
        kv_cache_quant_algo=kv_algo,
        group_size=opts.group_size,
        smoothquant_alpha=opts.sq_alpha if opts.method == "w8a8_sq" else None,
        quantized_modules=len(chosen),
        calibration=calib_info or None,
    )
    if kv_clip:  # per layer: the INT8 KV scale's clip ratio r (scale = max(|k|, |v|) · r / 127)
        record.details["kv_cache_clip"] = dict(sorted(kv_clip.items()))
    if alphas:  # per linear (--sq-alpha auto): the searched α, its output error relative to α = 0.5's
        record.details["smoothquant"] = {prefix: choice.summary() for prefix, choice in sorted(alphas.items())}
    if awq:  # per linear: α, output error vs round-to-nearest, mean clip ratio, share of groups clipped
        record.details["awq"] = {prefix: choice.summary() for prefix, choice in sorted(awq.items())}
    with atomic_dir(out_dir, force, inputs=(source,)) as tmp:
        record.add_inputs(source, [source / CONFIG_NAME, source / rank_file(0)])
        write_config(tmp, qcfg)
        if stream:
            _write_streaming(rank_path, tmp / rank_file(0), opts, set(chosen), cfg.torch_dtype)
        else:
            infos = [TensorInfo(n, t.dtype, tuple(t.shape)) for n, t in sorted(out.items())]
            with SafetensorsWriter(tmp / rank_file(0), infos, {"format": "pt"}) as writer:
                for name, tensor in sorted(out.items()):
                    writer.write(name, tensor.contiguous())
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copyfile(source / name, tmp / name)
        report = _quality(source, tmp, model, eval_data, eval_tokens) if model and eval_data else None
        if report:
            record.details["quality"] = report.to_dict()
        manifest = record.write(tmp)
    return {
        "output_dir": str(out_dir.resolve()),
        "quant_algo": quant.quant_algo,
        "kv_cache_quant_algo": kv_algo,
        "group_size": opts.group_size,
        "quantized_modules": len(chosen),
        "calibration": calib_info or None,
        "quality": report.to_dict() if report else None,
        "outputs": manifest["outputs"],
        "wall_time_s": manifest["wall_time_s"],
    }


def _planned(opts: QuantizeOptions, prefix: str, info: TensorInfo) -> dict[str, TensorInfo]:
    """The tensors `_quantize_linear` makes of one round-to-nearest linear, without computing them."""
    out_dim, in_dim = info.shape
    if opts.method == "w8a16":
        return {
            f"{prefix}.weight": TensorInfo(f"{prefix}.weight", torch.int8, (out_dim, in_dim)),
            f"{prefix}.weights_scaling_factor": TensorInfo(
                f"{prefix}.weights_scaling_factor", torch.float32, (out_dim,)
            ),
        }
    if out_dim % 2:
        raise UserError(f"{prefix}: {out_dim} output channels; int4 packing needs an even number")
    padded = in_dim + (-in_dim % opts.group_size)
    return {
        f"{prefix}.weight": TensorInfo(f"{prefix}.weight", torch.int8, (out_dim // 2, padded)),
        f"{prefix}.weights_scaling_factor": TensorInfo(
            f"{prefix}.weights_scaling_factor", torch.float32, (out_dim, padded // opts.group_size)
        ),
    }


def _write_streaming(src: Path, dst: Path, opts: QuantizeOptions, chosen: set[str], dtype: torch.dtype) -> None:
    """Same names, order and bytes as the in-memory path, one source tensor in memory at a time."""
    header, _ = read_header(src)
    plan: dict[str, TensorInfo] = {}
    for name, info in header.items():
        prefix = name.removesuffix(".weight")
        if name.endswith(".weight") and prefix in chosen:
            plan.update(_planned(opts, prefix, info))
        else:
            plan[name] = TensorInfo(name, info.dtype, info.shape)
    made: dict[str, torch.Tensor] = {}  # a linear's scales, between its codes and their turn to be written
    with src.open("rb") as f, SafetensorsWriter(dst, [plan[n] for n in sorted(plan)], {"format": "pt"}) as writer:
        for name in sorted(plan):
            if name not in made:
                prefix = name.removesuffix(".weight")
                if name.endswith(".weight") and prefix in chosen:
                    weight = read_tensor(f, header[name])
                    made.update(_quantize_linear(opts, prefix, weight, Calibration(), dtype))
                else:
                    made[name] = read_tensor(f, header[name])
            writer.write(name, made.pop(name).contiguous())


def _quality(source: Path, quantized: Path, base: ReferenceModel, eval_data: Path, limit: int) -> QualityReport:
    tokens = tokenize(eval_data, source, max_tokens=limit)
    window = min(256, base.config.max_position_embeddings)
    if tokens.numel() < window:
        raise UserError(f"{eval_data}: {tokens.numel()} tokens, fewer than one evaluation window of {window}")
    console.info(f"evaluating on {tokens.numel():,} tokens of {eval_data}")
    return compare(base.forward, load_quantized(quantized).forward, tokens, window)
