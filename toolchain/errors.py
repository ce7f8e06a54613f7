"""The one user-facing error type.

A `UserError` is something the user can fix (a path, a key, a value, a file). The CLI prints its message as a
single line on stderr and exits 1; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

from pathlib import Path


class UserError(Exception):
    """A problem with the user's input. The message names the file/key/value and the fix."""

    def __init__(self, message: str) -> None:
        # One line, always: multi-line messages break CI log greps and the one-line contract.
        super().__init__(" ".join(message.split("\n")))


def read_utf8(path: Path) -> str:
    """A user's text file (config, recipe, manifest, dataset); bytes that are not UTF-8 are a user error."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text (byte {e.start}); is this the right file?") from e
