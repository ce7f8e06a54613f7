"""Opening a multi-rank engine: starting (or, under torchrun, joining) one process per rank and handing the caller
rank 0's facade, an `Engine` like any other. Slice B of issue 27 fills it; until then a multi-rank engine is
refused here, the one place `open_trusted` sends it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from toolchain.errors import UserError

if TYPE_CHECKING:
    from toolchain.engine.api import Engine, EngineSpec


def open_ranks(spec: EngineSpec, backend: str | None = None) -> Engine:
    m = spec.mapping
    raise UserError(
        f"{spec.engine_dir}: a {m.world_size}-rank engine (tp={m.tp_size}, pp={m.pp_size}); running multi-rank "
        "engines is not implemented yet (issue 27: toolchain/parallel/launch.py, slice B)"
    )
