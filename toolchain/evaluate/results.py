"""What `trtbuild eval` hands back: the engine's quality against the reference, golden prompts, gates, and where
the report went."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from toolchain.evaluate.gates import GateResult
from toolchain.evaluate.report import summary_lines
from toolchain.quality import QualityReport

PLOTS = ("kld_histogram", "top1_by_position")  # in report.json; too long for a terminal or a run's summary


@dataclass(frozen=True)
class EvalResult:
    engine_dir: str
    reference: str
    data: str
    window: int
    quality: QualityReport
    golden_exact: float | None  # fraction of golden prompts replayed exactly; None without --golden
    golden_prompts: int
    golden: list[dict[str, Any]]  # per prompt: evaluate.golden.compare's record
    gates: list[GateResult]
    passed: bool
    kld_histogram: dict[str, list[float]]
    top1_by_position: list[float]
    built: dict[str, Any] | None = None  # engine_eval.built: what the engine is (set by run_eval)
    evaluated_with: dict[str, Any] | None = None  # engine_eval.evaluated_with: where it was scored
    report_dir: str | None = None  # set once the report is written
    outputs: list[dict[str, Any]] | None = None  # the report's manifest entries
    speculative: dict[str, Any] | None = None  # engine_eval.spec_golden's record; None without --ngram/--draft

    def to_json(self, plots: bool = True) -> dict[str, Any]:
        """report.json's content (with `report_dir` and `outputs` once written); without the plots for `--json`."""
        out: dict[str, Any] = {
            "engine_dir": self.engine_dir,
            "reference": self.reference,
            "data": self.data,
            "window": self.window,
            "quality": self.quality.to_dict(),
            "golden_exact": self.golden_exact,
            "golden_prompts": self.golden_prompts,
            "golden": self.golden,
            "gates": [g.to_json() for g in self.gates],
            "passed": self.passed,
        }
        if plots:
            out.update(kld_histogram=self.kld_histogram, top1_by_position=self.top1_by_position)
        optional: dict[str, Any] = {"built": self.built, "evaluated_with": self.evaluated_with}
        optional["speculative"] = self.speculative
        optional.update(report_dir=self.report_dir, outputs=self.outputs)
        out.update((k, v) for k, v in optional.items() if v is not None)
        return out

    def lines(self) -> list[str]:
        lines = [f"report -> {self.report_dir} (report.md, report.html, report.json)"]
        return lines + ["  " + line for line in summary_lines(self.to_json(plots=False))]
