"""Before any command trusts an engine, the engine must be exactly what its manifest says it is.

`check_engine(DIR)` is called by everything that opens an engine (`open_engine`: eval, generate, bench, serve, diff
with models; `diff` itself for the change table it reads from the manifests): every file the manifest lists is
re-hashed and compared, a file the manifest does not list is refused, and the manifest is checked against its own
seal (manifest.SEAL). A mismatch raises `IntegrityError`, which the CLI turns into exit code 4 with one line naming the
file and both hashes.

Cost: sha256 of every byte, about 1.0-1.4 GB/s on one core here (bench/verify.py, docs/engine.md), so a 16 GB engine
takes ~11-16 s plus the disk read. Repeated opens are kept cheap without trusting anything that could have changed:
a file's hash is cached (in $XDG_CACHE_HOME/trtbuild/sha256-cache.json) against its device, inode, size, mtime and
ctime in nanoseconds, and re-computed whenever any of them differs. Writing the file changes mtime and ctime;
restoring the mtime (`touch -d`, `os.utime`) changes the ctime, which no user call can set back.
TRTBUILD_HASH_CACHE=0 turns the cache off. The cache is the user's own file: whoever can write it can also write the
engine.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from toolchain.errors import UserError
from toolchain.manifest import MANIFEST_NAME, seal_problem, sha256_file, verify

EXIT_CODE = 4  # cli.py, README: an engine that does not match its manifest
CACHE_MIN_BYTES = 1 << 20  # smaller files are hashed every time: cheaper than the cache's own bookkeeping
_CACHE_ENTRIES = 4096  # the newest entries are kept; an old engine's files are simply hashed again
# A file whose mtime or ctime is this recent is hashed but not cached: on a filesystem with coarse timestamps (FAT's
# 2 s, some NFS) a rewrite within the same tick would keep the stat key (git's "racy" rule, the same cure).
RACY_NS = 3_000_000_000
_checked: dict[str, tuple[list[int], str]] = {}  # this process's hashes by stat key (a run checks stages again)


class IntegrityError(UserError):
    """An engine whose bytes are not the ones its manifest records: refused, exit code 4."""

    exit_code = EXIT_CODE


def _cache_path() -> Path | None:
    if os.environ.get("TRTBUILD_HASH_CACHE", "1") == "0":
        return None
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trtbuild" / "sha256-cache.json"


def _stat_key(path: Path) -> tuple[str, list[int]]:
    st = path.stat()
    return str(path.resolve()), [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


class HashCache:
    """sha256 by (path, device, inode, size, mtime_ns, ctime_ns), loaded once, saved after the check."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.entries: dict[str, Any] = {}
        self.dirty = False
        if path is not None and path.is_file():
            try:
                loaded = json.loads(path.read_text())
                self.entries = loaded if isinstance(loaded, dict) else {}
            except (OSError, ValueError):
                self.entries = {}  # a damaged cache only costs re-hashing

    def sha256(self, path: Path) -> str:
        name, stat = _stat_key(path)
        if stat[2] < CACHE_MIN_BYTES:
            return sha256_file(path)
        seen = _checked.get(name)
        if seen is not None and seen[0] == stat:
            return seen[1]
        hit = self.entries.get(name)
        if (
            self.path is not None
            and isinstance(hit, dict)
            and hit.get("stat") == stat
            and isinstance(hit.get("sha256"), str)
        ):
            return str(hit["sha256"])
        digest = sha256_file(path)
        settled = time.time_ns() - max(stat[3], stat[4]) > RACY_NS
        if _stat_key(path)[1] == stat and settled:  # unchanged while read, and not within a timestamp's tick of now
            _checked[name] = (stat, digest)
            if self.path is not None:
                self.entries.pop(name, None)
                self.entries[name] = {"stat": stat, "sha256": digest}
                self.dirty = True
        return digest

    def save(self) -> None:
        if not self.dirty or self.path is None:
            return
        kept = dict(list(self.entries.items())[-_CACHE_ENTRIES:])
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".sha256-cache.")
            with os.fdopen(fd, "w") as f:
                json.dump(kept, f)
            os.replace(tmp, self.path)
        except OSError:
            pass  # a read-only home: the next open hashes again, nothing else changes


def cached_hasher() -> Callable[[Path], str]:
    """A file's sha256 through this process's memo only (no cache file): for checks that are not an engine's
    (a recipe's cached stages)."""
    return HashCache(None).sha256


def check_engine(engine_dir: Path) -> None:
    """Refuse `engine_dir` (IntegrityError) unless every file is exactly what its manifest lists and the manifest
    is exactly what was written."""
    manifest = engine_dir / MANIFEST_NAME
    if not manifest.is_file() and (manifest.exists() or manifest.is_symlink()):
        raise IntegrityError(f"{manifest}: not a regular file, so nothing proves what this engine is; rebuild it")
    if not manifest.is_file():
        raise IntegrityError(
            f"{engine_dir}: no {MANIFEST_NAME}, so nothing proves what this engine is; rebuild it with `trtbuild build`"
        )
    cache = HashCache(_cache_path())
    try:
        problems = verify(engine_dir, hasher=cache.sha256)
    except UserError as e:  # a manifest that no longer parses: named as the changed file where it once was one
        problem = seal_problem(engine_dir) or str(e)
        raise IntegrityError(f"{engine_dir} does not match its manifest, refusing it: {problem}; rebuild it") from e
    except OSError as e:  # a listed file that cannot be read (permissions, I/O error): not what was recorded either
        raise IntegrityError(f"{engine_dir}: cannot read {e.filename or 'a file'} to check it ({e.strerror})") from e
    finally:
        cache.save()
    if problems:
        more = (
            f" (and {len(problems) - 1} more: `trtbuild verify {engine_dir}` lists them)" if len(problems) > 1 else ""
        )
        raise IntegrityError(
            f"{engine_dir} does not match its manifest, refusing it: {problems[0]}{more}; restore the files or rebuild"
        )
