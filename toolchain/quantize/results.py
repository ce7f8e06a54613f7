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

    def to_json(self) -> dict[str, Any]:
        """The `--json` output (and the summary a recipe run keeps)."""
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
        }

    def lines(self) -> list[str]:
        lines = [
            f"quantized -> {self.output_dir}",
            f"  {self.quant_algo} (group {self.group_size}), kv cache {self.kv_cache_quant_algo or 'unquantized'}, "
            f"{self.quantized_modules} modules, {self.wall_time_s:.2f} s",
        ]
        if self.quality:
            lines += ["  " + line for line in self.quality.lines()]
        return lines
