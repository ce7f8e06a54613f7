"""What `build_engine` hands back: where the engine is, what built it, its limits and its files."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class BuildResult:
    engine_dir: str
    backend: str  # the backend that built it (what `auto` chose)
    dtype: str  # the engine's compute dtype
    limits: dict[str, int]  # build_config.json's limits, max_blocks_per_seq included
    outputs: list[dict[str, Any]]  # the manifest's file entries: path, size, sha256
    wall_time_s: float

    @classmethod
    def of(cls, engine_dir: Path, build_config: dict[str, Any], manifest: dict[str, Any]) -> BuildResult:
        """From what the build wrote: build_config.json's content and the engine's manifest."""
        config, files = build_config, manifest["outputs"]
        return cls(
            str(engine_dir.resolve()),
            config["backend"],
            config["dtype"],
            config["limits"],
            files,
            manifest["wall_time_s"],
        )

    def to_json(self) -> dict[str, Any]:
        """The `--json` output (and the summary a recipe run keeps)."""
        return asdict(self)

    def lines(self) -> list[str]:
        limits = self.limits
        return [
            f"built -> {self.engine_dir}",
            f"  backend {self.backend}, {self.dtype}, batch <= {limits['max_batch_size']}, tokens/call <= "
            f"{limits['max_num_tokens']}, seq <= {limits['max_seq_len']}, {limits['tokens_per_block']} tokens/block",
            f"  {len(self.outputs)} files, {sum(e['size'] for e in self.outputs):,} B, {self.wall_time_s:.2f} s",
        ]
