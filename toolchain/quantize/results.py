"""What `quantize_checkpoint` hands back: the quantized checkpoint's settings, its files and the quality it cost."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from toolchain.quality import QualityReport


@dataclass(frozen=True)
class QuantizeResult:
    output_dir: str
    quant_algo: str | None
    kv_cache_quant_algo: str | None
    group_size: int
    quantized_modules: int
    calibration: dict[str, Any] | None  # the calibration windows' source, count and sha256; None without one
    quality: QualityReport | None  # against the float checkpoint, with --eval-data
    outputs: list[dict[str, Any]]  # the manifest's file entries: path, size, sha256
    wall_time_s: float
    # mixture of experts calibrated: per stacked linear, the tokens routed to each expert and the experts that fell
    # back to the layer's statistics (calibrate.RoutedStats); None without experts or calibration
    routed_calibration: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        """The `--json` output (and the summary a recipe run keeps)."""
        routed = {"routed_calibration": self.routed_calibration} if self.routed_calibration else {}
        return {
            "output_dir": self.output_dir,
            "quant_algo": self.quant_algo,
            "kv_cache_quant_algo": self.kv_cache_quant_algo,
            "group_size": self.group_size,
            "quantized_modules": self.quantized_modules,
            "calibration": self.calibration,
            "quality": self.quality.to_dict() if self.quality else None,
            "outputs": self.outputs,
            "wall_time_s": self.wall_time_s,
            **routed,  # only a calibrated mixture of experts: a dense model's output keeps its keys
        }

    def lines(self) -> list[str]:
        lines = [
            f"quantized -> {self.output_dir}",
            f"  {self.quant_algo} (group {self.group_size}), kv cache {self.kv_cache_quant_algo or 'unquantized'}, "
            f"{self.quantized_modules} modules, {self.wall_time_s:.2f} s",
        ]
        if self.routed_calibration:
            linears = self.routed_calibration["linears"]
            low = sum(len(r["fell_back"]) for r in linears.values())
            lines.append(
                f"  routed calibration: {len(linears)} experts' linears, {low} expert inputs under "
                f"{self.routed_calibration['min_tokens']} tokens took the layer's statistics"
            )
        if self.quality:
            lines += ["  " + line for line in self.quality.lines()]
        return lines
