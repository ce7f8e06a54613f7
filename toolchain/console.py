"""Where output goes: results on stdout, logs, warnings and progress bars on stderr."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

err = Console(stderr=True, highlight=False, soft_wrap=True)


def info(message: str) -> None:
    err.print(message, markup=False)


def warn(message: str) -> None:
    err.print(f"warning: {message}", style="yellow", markup=False)


@contextmanager
def progress(description: str, total: int) -> Iterator[Callable[[int], None]]:
    """A progress bar on stderr (only drawn on a terminal); yields `advance(n)`."""
    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=True,
        disable=not err.is_terminal,
    )
    with bar:
        task = bar.add_task(description, total=total)

        def advance(n: int = 1) -> None:
            bar.advance(task, n)

        yield advance
