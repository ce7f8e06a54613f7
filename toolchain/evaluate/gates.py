"""Gates: a metric's limit that, when crossed, makes `eval`, `diff` or a recipe run exit 3 (a regression, not an
error). Both tables and the one checker live here: `eval` gates an engine against the reference model, `diff` gates
NEW against OLD; a recipe's `eval.gates` holds gates of both (the `*_vs_old` and `golden_same_min` ones run as its
diff stage)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from toolchain.errors import UserError

FRACTIONS = ("same_top1", "golden_same", "golden_exact", "spec_equal", "acceptance_rate")  # in [0, 1]: above is a typo
SPEC_NEEDS = "--golden and a proposer (--ngram or --draft DIR)"  # the speculative replay of the golden prompts


@dataclass(frozen=True)
class Gate:
    metric: str
    direction: str  # max: the metric must stay <= the limit; min: >= the limit
    needs: str  # the option that makes the command compute the metric

    def passes(self, value: float | None, limit: float) -> bool:
        return value is not None and (value <= limit if self.direction == "max" else value >= limit)


EVAL: dict[str, Gate] = {  # `trtbuild eval --gate`: the engine against the reference model
    "kld_mean_max": Gate("kld_mean", "max", "--data"),
    "top1_min": Gate("same_top1", "min", "--data"),
    "ppl_ratio_max": Gate("ppl_ratio", "max", "--data"),
    "golden_exact_min": Gate("golden_exact", "min", "--golden"),
    # issue 30: the golden prompts replayed speculating (engine_eval.spec_golden)
    "spec_equal_min": Gate("spec_equal", "min", SPEC_NEEDS),
    "acceptance_rate_min": Gate("acceptance_rate", "min", SPEC_NEEDS),
}
DIFF: dict[str, Gate] = {  # `trtbuild diff --gate`: NEW against OLD
    "kld_vs_old_max": Gate("kld_mean", "max", "--data"),
    "kld_p99_vs_old_max": Gate("kld_p99", "max", "--data"),
    "top1_vs_old_min": Gate("same_top1", "min", "--data"),
    "ppl_ratio_vs_old_max": Gate("ppl_ratio", "max", "--data"),
    "golden_same_min": Gate("golden_same", "min", "--golden"),
    "throughput_ratio_min": Gate("throughput_ratio", "min", "--trace"),
    "ttft_p90_ratio_max": Gate("ttft_p90_ratio", "max", "--trace"),
    "tpot_p90_ratio_max": Gate("tpot_p90_ratio", "max", "--trace"),
    # issue 30: the golden prompts replayed speculating, each engine's own greedy output the reference. Named apart
    # from eval's spec_equal_min / acceptance_rate_min: a recipe's eval.gates of the same name are the eval stage's
    "new_spec_equal_min": Gate("spec_equal", "min", SPEC_NEEDS),
    "new_acceptance_rate_min": Gate("acceptance_rate", "min", SPEC_NEEDS),
    "acceptance_ratio_vs_old_min": Gate("acceptance_ratio", "min", SPEC_NEEDS),
}


def check_limit(gate: str, limit: float, table: Mapping[str, Gate]) -> Gate:
    """The gate named `gate` in `table`, its limit checked: one line naming the fix otherwise."""
    if gate not in table:
        raise UserError(f"unknown gate {gate!r}; choose from {', '.join(table)}")
    found = table[gate]
    if not math.isfinite(limit) or limit < 0 or (found.metric in FRACTIONS and limit > 1):
        raise UserError(f"gate {gate}={limit}: expected a finite value >= 0 (and <= 1 for a fraction)")
    return found


@dataclass(frozen=True)
class GateResult:
    """One gate checked: its metric's value against its limit. `to_json()`: the reports' and manifests' record."""

    gate: str
    metric: str
    limit: float
    value: float | None  # None: the metric was not computed (the gate fails)
    passed: bool  # "pass" in JSON

    def to_json(self) -> dict[str, Any]:
        return {"gate": self.gate, "metric": self.metric, "limit": self.limit, "value": self.value, "pass": self.passed}


def check(
    gates: Mapping[str, float],
    metrics: Mapping[str, float | None],
    table: Mapping[str, Gate],
    missing: str | None = None,
) -> list[GateResult]:
    """One result per gate. A metric that was not computed fails its gate, or,
    with `missing` (why it would be absent), is an error."""
    results = []
    for gate, limit in gates.items():
        if gate not in table:
            raise UserError(f"unknown gate {gate!r}; choose from {', '.join(table)}")
        metric = table[gate].metric
        value = metrics.get(metric)
        if value is None and missing is not None:
            raise UserError(f"gate {gate} needs {metric}, which {missing}")
        ok = table[gate].passes(value, limit)
        results.append(GateResult(gate, metric, limit, value, ok))
    return results
