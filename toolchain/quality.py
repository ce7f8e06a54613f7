"""How much quality a model variant lost against its reference, measured the way llama.cpp's
`llama-perplexity --kl-divergence` does: over an evaluation text in windows, per predicted token,
KL(P_reference || P_variant), whether the top-1 token agrees, and Δp = p_variant(observed) - p_reference(observed);
plus perplexity of both and their ratio.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

LogitsFn = Callable[[torch.Tensor], torch.Tensor]  # ids [batch, seq] -> logits [batch, seq, vocab]


@dataclass(frozen=True)
class QualityReport:
    tokens: int
    windows: int
    ppl_reference: float
    ppl_variant: float
    ppl_ratio: float
    kld_mean: float
    kld_p50: float
    kld_p90: float
    kld_p99: float
    kld_max: float
    same_top1: float  # fraction
    dp_mean: float
    dp_rms: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def lines(self) -> list[str]:
        return [
            f"tokens scored      {self.tokens:,} in {self.windows} windows",
            f"PPL(variant)       {self.ppl_variant:.4f}",
            f"PPL(reference)     {self.ppl_reference:.4f}",
            f"PPL ratio          {self.ppl_ratio:.5f}",
            f"mean KLD           {self.kld_mean:.6f}",
            f"KLD p50/p90/p99    {self.kld_p50:.6f} / {self.kld_p90:.6f} / {self.kld_p99:.6f}",
            f"KLD max            {self.kld_max:.6f}",
            f"same top-1         {100 * self.same_top1:.2f} %",
            f"mean / RMS Δp      {100 * self.dp_mean:+.3f} % / {100 * self.dp_rms:.3f} %",
        ]


def token_stats(ref_logits: torch.Tensor, var_logits: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-position statistics in float64 (logits [..., vocab], targets [...])."""
    log_p = torch.log_softmax(ref_logits.double(), dim=-1)
    log_q = torch.log_softmax(var_logits.double(), dim=-1)
    observed_p = log_p.gather(-1, targets[..., None])[..., 0]
    observed_q = log_q.gather(-1, targets[..., None])[..., 0]
    return {
        "nll_ref": -observed_p,
        "nll_var": -observed_q,
        "kld": (log_p.exp() * (log_p - log_q)).sum(-1).clamp_min(0),
        "top1": (ref_logits.argmax(-1) == var_logits.argmax(-1)).double(),
        "dp": observed_q.exp() - observed_p.exp(),
    }


def collect(
    reference: LogitsFn, variant: LogitsFn, tokens: torch.Tensor, window: int, batch: int = 8
) -> dict[str, torch.Tensor]:
    """Per-token statistics [windows, window - 1] over every non-overlapping `window`-token slice of `tokens`
    (each slice's first token is context only)."""
    count = tokens.numel() // window
    if count == 0:
        raise ValueError(f"{tokens.numel()} tokens are fewer than one window of {window}")
    windows = tokens[: count * window].view(count, window)
    parts: dict[str, list[torch.Tensor]] = {}
    for start in range(0, count, batch):
        ids = windows[start : start + batch]
        stats = token_stats(reference(ids)[:, :-1], variant(ids)[:, :-1], ids[:, 1:])
        for key, value in stats.items():
            parts.setdefault(key, []).append(value)
    return {key: torch.cat(values) for key, values in parts.items()}


def summarize(stats: dict[str, torch.Tensor]) -> QualityReport:
    kld, dp = stats["kld"].reshape(-1), stats["dp"].reshape(-1)
    q = torch.quantile(kld.float(), torch.tensor([0.5, 0.9, 0.99])).tolist()
    ppl_ref, ppl_var = math.exp(stats["nll_ref"].mean().item()), math.exp(stats["nll_var"].mean().item())
    return QualityReport(
        tokens=kld.numel(),
        windows=stats["kld"].shape[0],
        ppl_reference=ppl_ref,
        ppl_variant=ppl_var,
        ppl_ratio=ppl_var / ppl_ref,
        kld_mean=kld.mean().item(),
        kld_p50=q[0],
        kld_p90=q[1],
        kld_p99=q[2],
        kld_max=kld.max().item(),
        same_top1=stats["top1"].mean().item(),
        dp_mean=dp.mean().item(),
        dp_rms=dp.pow(2).mean().sqrt().item(),
    )


def compare(reference: LogitsFn, variant: LogitsFn, tokens: torch.Tensor, window: int, batch: int = 8) -> QualityReport:
    """Score every token but the first of each non-overlapping `window`-token slice of `tokens`."""
    return summarize(collect(reference, variant, tokens, window, batch))


def kld_histogram(klds: Sequence[torch.Tensor], bins: int = 24) -> tuple[list[float], list[list[float]]]:
    """Counts of each series over shared log10-spaced bins from 1e-6 to the largest KLD of all (KLD spans decades;
    shared bins let series sit side by side). -> (edges [bins + 1], counts [series][bins])."""
    top = max(max(float(k.max()) for k in klds), 1e-5)
    hi = math.log10(top) + 1e-9  # libm's: numpy's log10 is chosen by CPU (SIMD) and can differ by an ulp
    edges = torch.logspace(-6, hi, bins + 1, dtype=torch.float64).tolist()
    return edges, [torch.histc(k.clamp(1e-6, top).log10(), bins=bins, min=-6, max=hi).tolist() for k in klds]
