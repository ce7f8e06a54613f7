"""Atomic output directories: write into a temporary sibling, rename into place only when complete.

An interrupted run (exception, Ctrl-C, SIGTERM) leaves no directory under the final name, and no parent
directories it created; a hard kill can leave only a hidden `.NAME.tmp-*` sibling, which never looks like a
finished artifact. A failed `--force` run leaves the previous output as it was.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from toolchain.errors import UserError
from toolchain.manifest import MANIFEST_NAME, is_artifact


def check_output_dir(out: Path, force: bool, inputs: tuple[Path, ...] = ()) -> None:
    """Refuse outputs that would clobber something: an existing dir without --force, or one holding an input."""
    out = out.resolve()
    for src in inputs:
        src = src.resolve()
        if out == src or out in src.parents or src in out.parents:
            raise UserError(f"output dir {out} overlaps input {src}; choose an output outside the input")
    if not out.exists():
        return
    if not out.is_dir():
        raise UserError(f"output path {out} exists and is not a directory; remove it or choose another -o")
    if not force:
        raise UserError(f"output dir {out} already exists; pass --force to replace it or choose another -o")
    if any(out.iterdir()) and not is_artifact(out):
        # --force replaces our own artifacts, never an arbitrary directory such as $HOME.
        raise UserError(
            f"output dir {out} exists and is not a trtbuild artifact (no valid {MANIFEST_NAME}); "
            "refusing to replace it even with --force; choose another -o"
        )


@contextmanager
def atomic_dir(out: Path, force: bool, inputs: tuple[Path, ...] = ()) -> Iterator[Path]:
    """Yield a fresh temporary directory that becomes `out` when the block finishes without error."""
    out = out.resolve()
    check_output_dir(out, force, inputs)
    created = [p for p in (out.parent, *out.parent.parents) if not p.exists()]
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    except OSError as e:
        _remove_empty(created)
        raise UserError(f"cannot create output dir {out}: {e.strerror or e}; choose another -o") from e
    try:
        yield tmp
        _replace(tmp, out)
    except OSError as e:  # disk full, permissions, a file vanishing under us: the environment, not a bug
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_empty(created)
        where = e.filename or out
        raise UserError(f"{where}: {e.strerror or e}; nothing was written to {out} (free space or fix access)") from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_empty(created)
        raise


def _remove_empty(created: list[Path]) -> None:
    for path in created:  # deepest first
        try:
            path.rmdir()
        except OSError:
            return


def _replace(tmp: Path, out: Path) -> None:
    os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
    if not out.exists():
        os.replace(tmp, out)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    os.replace(out, old / out.name)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)
