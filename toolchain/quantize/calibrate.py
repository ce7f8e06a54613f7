"""Calibration: run sample windows of text through the reference forward, one decoder layer at a time
(`LayerwiseCalibration`, what the quantize stage drives), and record, per linear layer, the
largest |input| overall and per input channel (activation scales, SmoothQuant), the mean |input| per channel over
every calibration token and a bounded sample of input rows spread evenly over all of them (AWQ's searches), and per
attention layer the largest |k| and |v| as the KV cache stores them (after rotary) with a bounded sample of token
rows of k and v (the INT8 KV scale's clip search). Only running statistics and bounded row samples are kept, never
all activations.

A mixture of experts is calibrated ROUTED: each expert's fc input (the normed hidden states) and proj input (its
activated intermediate) are observed over only the tokens the router sent to it (`RoutedStats`, through the
reference forward's `expert_input` hook), with per-expert token counts. An expert that received fewer than
MIN_EXPERT_TOKENS tokens takes the layer's statistics over all routed tokens instead (for fc that is every token,
each being routed to top-k experts): a maximum over a handful of rows is a noisy underestimate, and an activation
scale set by it would saturate the tokens calibration did not send there; the layer's maximum bounds every
expert's input the calibration saw (a coarser step for that expert, no clipping). The counts and the experts that
fell back go into the quantize result and the manifest (`RoutedStats.summary`). For AWQ's and SmoothQuant's searches
each expert also keeps a bounded sample of its routed rows (`RowSample`, at most EXPERT_SAMPLE_ROWS, spread evenly
over all of them), and the layer one of the union of its routed rows (at most SAMPLE_ROWS: for fc, every token, each
k times), which an expert that fell back searches on instead. Memory, per stacked linear of the layer being
calibrated (the samples are dropped once it is quantized): E x EXPERT_SAMPLE_ROWS + SAMPLE_ROWS rows of its input
width in float64 — Qwen3-30B-A3B (128 experts, hidden 2048, expert width 768): 0.60 GB for fc, 0.23 GB for proj.

The forward runs in float64 (`CALIB_DTYPE`), whatever the checkpoint's dtype, so that the statistics do not depend
on the machine: a float32 forward's sums follow the CPU's matmul kernels (AVX2 and AVX-512 add in different orders),
and their last bits decided the scales, so the bytes of a calibrated checkpoint changed with the CPU. In float64 two
machines differ by ~1e-15 to 1e-13 relative, far below the one rounding to float32 every statistic goes through on
its way into a scale (docs/conversion.md, "Same bytes on any CPU", says what risk is left)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from toolchain.checkpoint.spec import ExpertsFFN, ModelSpec, experts_unsupported
from toolchain.checkpoint.trtllm import ModelConfig
from toolchain.errors import UserError
from toolchain.quantize.core import fake_quant
from toolchain.reference.model import Hooks, ReferenceModel

SAMPLE_ROWS = 4096  # input rows kept per linear for AWQ's searches: bounded, whatever the calibration size
KV_SAMPLE_ROWS = 1024  # token rows of [k | v] kept per attention layer for the INT8 KV scale's clip search
KV_CLIP = tuple(1 - i / 40 for i in range(19))  # INT8 KV clip ratios: 1, 0.975, ..., 0.55
CALIB_BATCH = 8  # calibration windows per forward batch
CALIB_DTYPE = torch.float64  # the calibration forward's and the searches' precision (module docstring)
MIN_EXPERT_TOKENS = 8  # an expert routed fewer calibration tokens takes its layer's statistics (module docstring)
EXPERT_SAMPLE_ROWS = 256  # routed input rows kept per expert and stacked linear for the searches (module docstring)


@dataclass
class RowSample:
    """At most `limit` of the rows offered (`add`), spread evenly over all of them whatever their number (unknown
    in advance: it is an expert's routed count): every row at first; whenever more than `limit` are kept, every
    other one is dropped and the stride doubles, so the sample is always rows 0, stride, 2·stride, ... of all rows
    seen. Deterministic (no random reservoir), so the bytes of a calibrated checkpoint do not depend on a seed."""

    limit: int
    rows: torch.Tensor | None = None
    stride: int = 1
    seen: int = 0

    def add(self, x: torch.Tensor) -> None:
        picked = x[-self.seen % self.stride :: self.stride]  # the rows at a global index ≡ 0 (mod stride)
        self.seen += x.shape[0]
        kept = picked if self.rows is None else torch.cat([self.rows, picked])
        while kept.shape[0] > self.limit:
            kept, self.stride = kept[::2], self.stride * 2
        self.rows = kept


@dataclass
class RoutedStats:
    """One stacked experts' linear's input statistics, per expert over only the tokens routed to it: max |x|, max
    |x_c| per channel, the sum of |x_c| (AWQ's activation means) and the token count."""

    amax: dict[int, float] = field(default_factory=dict)
    channel_amax: dict[int, torch.Tensor] = field(default_factory=dict)
    abs_sum: dict[int, torch.Tensor] = field(default_factory=dict)
    tokens: dict[int, int] = field(default_factory=dict)
    samples: dict[int, RowSample] = field(default_factory=dict)  # each expert's routed rows (AWQ / SmoothQuant)
    layer_sample: RowSample = field(default_factory=lambda: RowSample(SAMPLE_ROWS))  # the union of the routed rows

    def add(self, expert: int, rows: torch.Tensor) -> None:
        self.samples.setdefault(expert, RowSample(EXPERT_SAMPLE_ROWS)).add(rows)
        self.layer_sample.add(rows)
        a = rows.abs()
        peak = a.amax(0)
        self.amax[expert] = max(self.amax.get(expert, 0.0), peak.max().item())
        seen = self.channel_amax.get(expert)
        self.channel_amax[expert] = peak if seen is None else torch.maximum(seen, peak)
        self.abs_sum[expert] = self.abs_sum.get(expert, 0) + a.sum(0)
        self.tokens[expert] = self.tokens.get(expert, 0) + rows.shape[0]

    def counts(self, experts: int) -> list[int]:
        return [self.tokens.get(e, 0) for e in range(experts)]

    def fell_back(self, experts: int) -> list[int]:
        """The experts routed fewer than MIN_EXPERT_TOKENS calibration tokens (zero included)."""
        return [e for e, n in enumerate(self.counts(experts)) if n < MIN_EXPERT_TOKENS]

    def layer_amax(self) -> float:
        """max |x| over every routed row of the layer (fc: every calibration token)."""
        return max(self.amax.values(), default=0.0)

    def input_amax(self, experts: int) -> list[float]:
        """Each expert's max |x|: its own over its routed tokens, the layer's where it fell back."""
        low = set(self.fell_back(experts))
        return [self.layer_amax() if e in low else self.amax[e] for e in range(experts)]

    def mean_abs(self, expert: int) -> torch.Tensor:
        """Mean |x_c| per channel over the expert's routed tokens, the layer's over all routed rows where it fell
        back (AWQ's activation statistic)."""
        if self.tokens.get(expert, 0) < MIN_EXPERT_TOKENS:
            return sum(self.abs_sum.values(), torch.zeros(())) / max(sum(self.tokens.values()), 1)
        return self.abs_sum[expert] / self.tokens[expert]

    def channel_max(self, expert: int) -> torch.Tensor:
        """max |x_c| per channel over the expert's routed tokens, the layer's over all routed rows where it fell back
        (SmoothQuant's activation statistic)."""
        if self.tokens.get(expert, 0) < MIN_EXPERT_TOKENS:
            return torch.stack(list(self.channel_amax.values())).amax(0)
        return self.channel_amax[expert]

    def rows(self, expert: int) -> torch.Tensor:
        """The sample of the expert's routed rows (float64 [rows, in]), the layer's union sample where it fell back
        (the searches' inputs)."""
        low = self.tokens.get(expert, 0) < MIN_EXPERT_TOKENS
        sample = self.layer_sample if low else self.samples[expert]
        assert sample.rows is not None, "rows() of a linear calibration routed no token to"
        return sample.rows

    def drop_samples(self) -> None:
        """Free the row samples once the layer is quantized (the counts and statistics stay, for the manifest)."""
        self.samples.clear()
        self.layer_sample = RowSample(SAMPLE_ROWS)

    def summary(self, experts: int) -> dict[str, Any]:
        return {"tokens": self.counts(experts), "fell_back": self.fell_back(experts)}


@dataclass
class Calibration:
    input_amax: dict[str, float] = field(default_factory=dict)  # linear prefix -> max |x|
    input_channel_amax: dict[str, torch.Tensor] = field(default_factory=dict)  # prefix -> max |x_c| per channel
    kv_amax: dict[str, float] = field(default_factory=dict)  # layer prefix -> max(|k|, |v|)
    input_abs_sum: dict[str, torch.Tensor] = field(default_factory=dict)  # prefix -> sum over tokens of |x_c|
    tokens: dict[str, int] = field(default_factory=dict)
    input_sample: dict[str, torch.Tensor] = field(default_factory=dict)  # prefix -> up to SAMPLE_ROWS rows of x
    sample_every: int = 1  # keep every n-th token's row: `for_tokens` spreads the sample over the whole calibration
    kv_sample: dict[str, torch.Tensor] = field(default_factory=dict)  # layer -> up to KV_SAMPLE_ROWS rows of [k | v]
    kv_tokens: dict[str, int] = field(default_factory=dict)
    kv_sample_every: int = 1
    routed: dict[str, RoutedStats] = field(default_factory=dict)  # stacked experts' linear prefix -> per expert

    @classmethod
    def for_tokens(cls, tokens: int) -> Calibration:
        """Statistics of `tokens` calibration tokens (per linear), the row sample taken evenly across them."""
        return cls(sample_every=max(-(-tokens // SAMPLE_ROWS), 1), kv_sample_every=max(-(-tokens // KV_SAMPLE_ROWS), 1))

    def mean_abs(self, prefix: str) -> torch.Tensor:
        return self.input_abs_sum[prefix] / self.tokens[prefix]


class Observer(Hooks):
    def __init__(self, calibration: Calibration) -> None:
        self.calibration = calibration

    def _record(self, table: dict[str, float], name: str, *tensors: torch.Tensor) -> None:
        for tensor in tensors:
            if not torch.isfinite(tensor).all():
                raise UserError(f"calibration: NaN/Inf in the activations at {name}; check that layer's weights")
            table[name] = max(table.get(name, 0.0), tensor.abs().max().item())

    @staticmethod
    def _sample(kept: torch.Tensor | None, rows: torch.Tensor, counted: int, every: int, limit: int) -> torch.Tensor:
        """`kept` plus this batch's rows at token counted + i ≡ 0 (mod every): one stride over all batches."""
        kept = rows[:0].to(CALIB_DTYPE) if kept is None else kept
        if kept.shape[0] >= limit:
            return kept
        picked = rows[-counted % every :: every]
        return torch.cat([kept, picked[: limit - kept.shape[0]].to(CALIB_DTYPE)])

    def linear_input(self, prefix: str, x: torch.Tensor) -> torch.Tensor:
        c = self.calibration
        self._record(c.input_amax, prefix, x)
        rows = x.reshape(-1, x.shape[-1]).double()
        peak = rows.abs().amax(0)
        seen = c.input_channel_amax.get(prefix)
        c.input_channel_amax[prefix] = peak if seen is None else torch.maximum(seen, peak)
        c.input_abs_sum[prefix] = c.input_abs_sum.get(prefix, 0) + rows.abs().sum(0)
        counted = c.tokens.get(prefix, 0)
        c.tokens[prefix] = counted + rows.shape[0]
        c.input_sample[prefix] = self._sample(c.input_sample.get(prefix), rows, counted, c.sample_every, SAMPLE_ROWS)
        return x

    def expert_input(self, prefix: str, expert: int, x: torch.Tensor) -> torch.Tensor:
        if not torch.isfinite(x).all():
            raise UserError(f"calibration: NaN/Inf in the activations at {prefix}, expert {expert}; check its weights")
        self.calibration.routed.setdefault(prefix, RoutedStats()).add(expert, x.reshape(-1, x.shape[-1]).double())
        return x

    def kv_cache(self, layer: str, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.calibration
        self._record(c.kv_amax, layer, k, v)
        rows = torch.cat([t.transpose(1, 2).flatten(2) for t in (k, v)], -1).flatten(0, 1)  # [tokens, 2·kv dim]
        counted = c.kv_tokens.get(layer, 0)
        c.kv_tokens[layer] = counted + rows.shape[0]
        c.kv_sample[layer] = self._sample(c.kv_sample.get(layer), rows, counted, c.kv_sample_every, KV_SAMPLE_ROWS)
        return k, v


def kv_cache_clip(calibration: Calibration, layer: str) -> float:
    """The INT8 KV cache scale of `layer` is max(|k|, |v|) · r / 127, r on KV_CLIP chosen to minimise the squared
    quantization error of the sampled k and v values (the first of equals): a few large |k| set the max, and
    clipping them a little buys a finer step for all the rest. Percentiles clip far too much (docs/quality.md)."""
    amax, sample = calibration.kv_amax[layer], calibration.kv_sample.get(layer)
    if sample is None or amax <= 0:
        return 1.0
    x = sample.double()
    errors = {r: (fake_quant(x, amax * r / 127, "INT8") - x).pow(2).sum().item() for r in KV_CLIP}
    return min(errors, key=lambda r: errors[r])


def sample_windows(tokens: torch.Tensor, samples: int, seq_len: int, seed: int) -> torch.Tensor:
    """`samples` non-overlapping windows of `seq_len` tokens, chosen by `seed`: [samples, seq_len]."""
    count = tokens.numel() // seq_len
    if count < 1:
        raise UserError(f"calibration text has {tokens.numel()} tokens, fewer than one sample of {seq_len}")
    order = torch.randperm(count, generator=torch.Generator().manual_seed(seed))[: min(samples, count)]
    windows = tokens[: count * seq_len].view(count, seq_len)
    return windows[order.sort().values]


def check_ffns(spec: ModelSpec, where: str = "calibration") -> None:
    """The one place calibration (and a calibrated quantization, `where`) looks at the feed-forward variant. A
    DenseFFN's linears each read every token (`linear_input`); routed experts are observed per expert over their
    own tokens (`expert_input`, `RoutedStats`). Shared experts the reference forward does not run, so a model with
    them is refused here, before any calibration text is read."""
    for ls in spec.layers:
        if isinstance(ls.ffn, ExpertsFFN) and ls.ffn.shared is not None:
            raise experts_unsupported(f"{where}, layer {ls.index}", ls.ffn)


class LayerwiseCalibration:
    """The calibration windows' hidden states carried through the model one decoder layer at a time (in
    `CALIB_DTYPE`), every linear's input and every KV cache observed on the way into `calibration`: the quantize
    stage's driver holds one layer's weights at a time this way (`layer(i, weights)`), and gets the statistics the
    full forward would give. `weights`: the tensors outside the layers, or the whole model's."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], windows: torch.Tensor) -> None:
        self.model = model = ReferenceModel(config, weights, CALIB_DTYPE, widen_lazily=True)
        check_ffns(model.spec)
        self.calibration = Calibration.for_tokens(windows.numel())
        self.observer = Observer(self.calibration)
        model.hooks = self.observer
        self.batches = [model.embed(windows[s : s + CALIB_BATCH]) for s in range(0, windows.shape[0], CALIB_BATCH)]

    def layer(self, i: int, weights: dict[str, torch.Tensor] | None = None) -> None:
        """Run decoder layer i on every batch; `weights`, its tensors, are in the model only meanwhile (None: the
        model holds them already)."""
        model, weights = self.model, weights or {}
        model.w.update(weights)  # widened to CALIB_DTYPE where used, one tensor at a time
        self.batches = [(model.layer(h, i, positions), positions) for h, positions in self.batches]
        for n in weights:
            del model.w[n]

    def finish(self) -> Calibration:
        """Observe lm_head's input, as the full forward would, and take the hooks off the model."""
        for h, _ in self.batches:
            self.observer.linear_input("lm_head", self.model.final_norm(h))
        self.model.hooks = Hooks()
        return self.calibration
