"""Safetensors at the byte level: a validating header reader, a positioned tensor reader and a streaming writer.

The `safetensors` package memory-maps a file to read it (`safe_open`), and every page it touches counts towards
the process's RSS; it writes only a whole dict held in memory. Conversion must not hold the model in memory, so
we use neither: `read_header` validates the header (one line naming the damage), `read_tensor` reads one tensor
with `pread` into a fresh buffer, and the writer lays out the header from the planned names/shapes/dtypes first
and then streams each tensor's bytes. Format (huggingface/safetensors
README): u64 little-endian header length N, N bytes of JSON header {name: {dtype, shape, data_offsets}},
optional "__metadata__" of str->str, then the data buffer; offsets are relative to the buffer start.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from toolchain.errors import UserError

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024  # the safetensors library's own limit
_WRITEBACK_MIN = 4 << 20


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as a safetensors header declares it."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    file_offset: int = 0  # absolute position of the first byte in the file

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def read_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and validate the header of `path`; raise a one-line UserError on a damaged file."""
    size = path.stat().st_size
    fix = "the file is damaged or incomplete; re-download or re-export it"
    with path.open("rb") as f:
        raw_len = f.read(8)
        if len(raw_len) < 8:
            raise UserError(f"{path}: only {size} bytes, too short for a safetensors header; {fix}")
        (n,) = struct.unpack("<Q", raw_len)
        if n > _MAX_HEADER or 8 + n > size:
            raise UserError(f"{path}: header length {n} goes beyond the file's {size} bytes; {fix}")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UserError(f"{path}: header is not valid JSON ({e}); {fix}") from e
    if not isinstance(header, dict):
        raise UserError(f"{path}: header is not a JSON object; {fix}")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise UserError(f"{path}: '__metadata__' must be a JSON object of strings; {fix}")
    infos: dict[str, TensorInfo] = {}
    data_len = size - 8 - n
    for name, entry in header.items():
        try:
            dtype = DTYPES[entry["dtype"]]
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(o) for o in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise UserError(f"{path}: tensor {name!r} has a malformed or unsupported header entry {entry}") from e
        info = TensorInfo(name, dtype, shape, 8 + n + begin)
        if end - begin != info.nbytes or begin < 0:
            raise UserError(f"{path}: tensor {name!r} offsets {begin}..{end} do not match shape {list(shape)}; {fix}")
        if end > data_len:
            raise UserError(
                f"{path}: truncated: tensor {name!r} ends at byte {end} of the data but the file holds "
                f"{data_len}; {fix}"
            )
        infos[name] = info
    _check_layout(path, infos, 8 + n, size, fix)
    return infos, {str(k): str(v) for k, v in metadata.items()}


def _check_layout(path: Path, infos: dict[str, TensorInfo], data_start: int, size: int, fix: str) -> None:
    """Tensors must tile the data buffer exactly, as the safetensors library requires: no overlap, no gap."""
    position = data_start
    for info in sorted(infos.values(), key=lambda i: (i.file_offset, i.nbytes)):
        if info.file_offset != position:
            raise UserError(f"{path}: tensor {info.name!r} overlaps another or leaves a gap (invalid offsets); {fix}")
        position += info.nbytes
    if position != size:
        raise UserError(f"{path}: {size - position} bytes after the last tensor; {fix}")


def read_tensor(file: io.BufferedReader, info: TensorInfo) -> torch.Tensor:
    """Read one tensor with positioned reads into a fresh buffer: memory use is that tensor, nothing more
    (an mmap'ed file would count every page touched so far towards the process's RSS), and `pread` keeps no
    shared file position, so worker threads can read from one handle at once."""
    buf = torch.empty(info.nbytes, dtype=torch.uint8)
    view = buf.numpy().data.cast("B")
    done = 0
    while done < info.nbytes:  # the kernel returns at most ~2 GiB per call
        n = os.preadv(file.fileno(), [view[done:]], info.file_offset + done)
        if n == 0:
            raise UserError(
                f"{file.name}: tensor {info.name} could not be read in full; the file changed or is damaged"
            )
        done += n
    return buf.view(info.dtype).reshape(info.shape)


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class SafetensorsWriter:
    """Write a safetensors file tensor by tensor, in the order of the planned `infos`."""

    def __init__(self, path: Path, infos: list[TensorInfo], metadata: dict[str, str] | None = None) -> None:
        self._path = path
        self._pending = list(infos)
        header: dict[str, object] = {}
        if metadata:
            header["__metadata__"] = dict(sorted(metadata.items()))
        offset = 0
        for info in infos:
            header[info.name] = {
                "dtype": DTYPE_NAMES[info.dtype],
                "shape": list(info.shape),
                "data_offsets": [offset, offset + info.nbytes],
            }
            offset += info.nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # align the data buffer to 8 bytes, as the library does
        self._file: BinaryIO = path.open("wb")
        # Hash while writing, so the manifest need not read the file back.
        self._digest = hashlib.sha256()
        self._put(struct.pack("<Q", len(blob)) + blob)

    def _put(self, data: bytes | memoryview) -> None:
        self._digest.update(data)
        start = self._file.tell()
        self._file.write(data)
        if len(data) >= _WRITEBACK_MIN and hasattr(os, "posix_fadvise"):
            # Start writing this tensor to disk now (Linux begins writeback of dirty pages on DONTNEED), so
            # the fsync at close has little left to wait for and the page cache does not fill with the model.
            # Whole pages inside this tensor's bytes only: the pages it shares with its neighbours are left alone.
            self._file.flush()
            first = -(-start // _PAGE) * _PAGE
            last = (start + len(data)) // _PAGE * _PAGE
            if last > first:
                os.posix_fadvise(self._file.fileno(), first, last - first, os.POSIX_FADV_DONTNEED)

    @property
    def sha256(self) -> str:
        return self._digest.hexdigest()

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if not self._pending:
            raise RuntimeError(f"{self._path}: tensor {name} written but none are left in the plan")
        info = self._pending.pop(0)
        assert name == info.name, f"write order: expected {info.name}, got {name}"
        assert tensor.dtype == info.dtype and tuple(tensor.shape) == info.shape, (
            f"{name}: planned {info.dtype}{list(info.shape)}, got {tensor.dtype}{list(tensor.shape)}"
        )
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        self._put(flat.numpy().data)

    def close(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        if self._pending:
            raise RuntimeError(f"{self._path}: {len(self._pending)} planned tensors were never written")

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self._file.close()
