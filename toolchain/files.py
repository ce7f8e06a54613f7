"""Reading the user's small files (JSON configs, manifests, recipes, tokenizer files, traces) safely.

A path can name something that is not a file: a FIFO (a read waits forever), a symlink to /dev/zero (a read
never ends), a directory. And a file can be far larger than its kind ever is. Both are refused before the file
is read, by `read_text_capped` and `read_bytes_capped`; `check_regular` does the same for a file another library
(transformers) will read. The limits are generous per kind: they stop runaway reads, not real files.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from pathlib import Path

from toolchain.errors import UserError

MiB = 1 << 20
JSON_LIMIT = 64 * MiB  # config.json, build_config.json, manifest.json, safetensors indexes
TOKENIZER_LIMIT = 256 * MiB  # tokenizer.json runs to tens of MB for large vocabularies
RECIPE_LIMIT = 1 * MiB  # a YAML recipe is a few KB; PyYAML parses about 1 MB/s, so this bounds parsing too
TRACE_LIMIT = 1024 * MiB  # request traces (CSV/JSONL): a week of Azure requests is hundreds of MB
TEXT_LIMIT: int | None = None  # datasets and prompt files: any size, but regular files only

# Files transformers may read from a tokenizer directory (AutoTokenizer reads config.json for the model type).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "generation_config.json",
)

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _size(n: int) -> str:
    return f"{n / MiB:.1f} MiB" if n >= MiB else f"{n} bytes"


def _refuse(path: Path, mode: int, what: str) -> UserError:
    kind = next((name for test, name in _KINDS if test(mode)), "not a plain file")
    via = f" through a symlink to {os.path.realpath(path)}" if path.is_symlink() else ""
    return UserError(f"{path}: not a regular file ({kind}{via}); pass the {what} file itself")


def _check(path: Path, st: os.stat_result, limit: int | None, what: str) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise _refuse(path, st.st_mode, what)
    if limit is not None and st.st_size > limit:
        raise UserError(
            f"{path}: {_size(st.st_size)}, over the {_size(limit)} limit for a {what}; is this the right file?"
        )


def check_regular(path: Path, limit: int | None, what: str) -> None:
    """Refuse `path` unless it is a regular file (symlinks followed) of at most `limit` bytes.
    FileNotFoundError propagates, for the caller to word."""
    _check(path, path.stat(), limit, what)


def check_present(paths: Iterable[Path], limit: int | None, what: str) -> None:
    """`check_regular` on each of `paths` that exists (a dangling symlink counts as existing, and is refused)."""
    for path in paths:
        if os.path.lexists(path):
            try:
                check_regular(path, limit, what)
            except FileNotFoundError as e:
                raise UserError(f"{path}: a symlink to {os.path.realpath(path)}, which does not exist") from e


def check_tokenizer_dir(directory: Path) -> None:
    """Check the files transformers will read from `directory` before it is handed them."""
    check_present((directory / n for n in (*TOKENIZER_FILES, "config.json")), TOKENIZER_LIMIT, "tokenizer")


def read_bytes_capped(path: Path, limit: int | None, what: str) -> bytes:
    """The bytes of `path`, refused before reading if it is not a regular file or is over `limit` bytes.
    FileNotFoundError propagates, for the caller to word."""
    # O_NONBLOCK: opening a FIFO for reading must not wait for a writer before we can refuse it.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        _check(path, os.fstat(fd), limit, what)
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as f:
        data = f.read() if limit is None else f.read(limit + 1)  # a file that grew since fstat still stops
    if limit is not None and len(data) > limit:
        raise UserError(f"{path}: over the {_size(limit)} limit for a {what}; is this the right file?")
    return data


def read_text_capped(path: Path, limit: int | None, what: str) -> str:
    """`read_bytes_capped`, decoded as UTF-8 with newlines translated as `Path.read_text` does; bytes that are
    not UTF-8 are a user error."""
    data = read_bytes_capped(path, limit, what)
    try:
        return data.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text (byte {e.start}); is this the right file?") from e
