"""Pearson's χ² goodness-of-fit for the speculative-sampling tests, its p-value from torch (scipy is not a
dependency): P(χ²_df ≥ x) = Q(df / 2, x / 2), the regularized upper incomplete gamma function
(`torch.special.gammaincc`)."""

from __future__ import annotations

import torch


def chi2_pvalue(observed: torch.Tensor, expected: torch.Tensor, constraints: int = 1) -> tuple[float, float, int]:
    """(χ², p-value, degrees of freedom) of `observed` counts against `expected` counts (same shape, same total):
    df = cells - `constraints` (1: the total is fixed; one per independent group of cells with its own total)."""
    observed, expected = observed.double().flatten(), expected.double().flatten()
    assert torch.all(expected > 0), "every cell needs an expected count"
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    df = observed.numel() - constraints
    p = float(
        torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(chi2 / 2, dtype=torch.float64))
    )
    return chi2, p, df
