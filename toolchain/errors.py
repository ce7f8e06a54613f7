"""The one user-facing error type.

A `UserError` is something the user can fix (a path, a key, a value, a file). The CLI prints its message as a
single line on stderr and exits 1; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

from pathlib import Path


class UserError(Exception):
    """A problem with the user's input. The message names the file/key/value and the fix."""

    exit_code = 1  # the CLI's exit status for it (README: exit codes); a subclass may have its own

    def __init__(self, message: str) -> None:
        # One line, always: multi-line messages break CI log greps and the one-line contract.
        super().__init__(" ".join(message.split("\n")))


def read_utf8(path: Path) -> str:
    """A user's text file (dataset, prompts, keys) of any size; bytes that are not UTF-8, and paths that are not
    regular files (a FIFO, /dev/zero), are user errors. Files of a bounded kind use files.read_text_capped."""
    from toolchain.files import TEXT_LIMIT, read_text_capped  # files.py imports UserError from here

    return read_text_capped(path, TEXT_LIMIT, "text")
