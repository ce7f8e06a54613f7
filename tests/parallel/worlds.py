"""Helpers of the multi-rank tests (issue 27): ranks as threads of this process (`run_threads`), and a random model
converted unsplit and split over ranks (`sharded_checkpoint`). A module, not a
conftest.py: tests import the top-level tests/conftest.py by name, which a second conftest would shadow."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from conftest import save_random_llama
from models import save_random

from toolchain.checkpoint.convert import convert
from toolchain.engine.collectives import ThreadComm, ThreadWorld

RankFn = Callable[[ThreadComm], Any]


def run_threads(fn: RankFn, world_size: int, timeout_s: float = 5.0, ranks: tuple[int, ...] | None = None) -> list[Any]:
    """fn(comm) on every rank (or only `ranks`: the others never arrive), each in its own thread; the results in
    rank order (None for ranks not run). A rank's exception is raised here, the lowest rank's first."""
    world = ThreadWorld(world_size, timeout_s)
    run = tuple(range(world_size)) if ranks is None else ranks
    results: list[Any] = [None] * world_size
    errors: dict[int, BaseException] = {}

    def main(rank: int) -> None:
        try:
            results[rank] = fn(world.comm(rank))
        except BaseException as e:
            errors[rank] = e

    threads = [threading.Thread(target=main, args=(r,), daemon=True) for r in run]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s * 4 + 5)
        assert not t.is_alive(), f"{t.name} still running: a collective without a timeout"
    if errors:
        raise errors[min(errors)]
    return results


def sharded_checkpoint(root: Path, arch: str, tp: int, pp: int, moe_ep: int = 1, **overrides: Any) -> tuple[Path, Path]:
    """A random `arch` model ("llama" or a models.save_random family) converted unsplit and over tp x pp ranks
    (a mixture of experts: its experts over moe_ep of the tp ranks): -> (the TP=1 checkpoint, the split one)."""
    hf = save_random_llama(root / "hf", **overrides) if arch == "llama" else save_random(root / "hf", arch, **overrides)
    one, split = root / "one", root / f"tp{tp}pp{pp}"
    convert(hf, one)
    convert(hf, split, tp=tp, pp=pp, moe_ep=moe_ep)
    return one, split
