"""Safetensors at the byte level: a validating header reader, a positioned tensor reader and a streaming writer.

The `safetensors` package memory-maps a file to read it (`safe_open`), and every page it touches counts towards
the process's RSS; it writes only a whole dict held in memory. Conversion must not hold the model in memory, so
we use neither: `read_header` validates the header (one line naming the damage), `read_tensor` reads one tensor
with `pread` into a fresh buffer, and the writer lays out the header from the planned names/shapes/dtypes first
and then streams each tensor's bytes. Format (huggingface/safetensors
README): u64 little-endian header length N, N bytes of JSON header {name: {dtype, shape, data_offsets}},
optional "__metadata__" of str->str, then the data buffer; offsets are relative to the buffer start.

Tensors are numpy arrays here (`read_array`; ml_dtypes supplies bfloat16 and float8, which numpy lacks), so that
`convert` runs without importing torch, whose import alone costs about 230 MiB of RSS; `read_tensor` and the
torch dtypes of `TensorInfo.dtype` are the same bytes seen as torch tensors, for the stages that compute in torch.
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
from typing import TYPE_CHECKING, Any, BinaryIO

import ml_dtypes
import numpy as np

from toolchain.errors import UserError

if TYPE_CHECKING:
    import torch

# The safetensors dtype codes we read and write -> torch's name for the dtype, and numpy's dtype.
TORCH_NAMES: dict[str, str] = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}
NUMPY_DTYPES: dict[str, np.dtype[Any]] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
FLOAT_CODES = ("F64", "F32", "F16", "BF16", "F8_E4M3")
_CODES = {dtype: code for code, dtype in NUMPY_DTYPES.items()} | {name: code for code, name in TORCH_NAMES.items()}
_MAX_HEADER = 100 * 1024 * 1024  # the safetensors library's own limit
_WRITEBACK_MIN = 4 << 20


def code_of(dtype: torch.dtype | np.dtype[Any] | str) -> str:
    """The safetensors code ("BF16") of a torch dtype, a numpy dtype, torch's dtype name ("bfloat16") or a code."""
    key = dtype if isinstance(dtype, np.dtype) else str(dtype).removeprefix("torch.")
    code = key if isinstance(key, str) and key in TORCH_NAMES else _CODES.get(key)
    if code is None:
        raise ValueError(f"dtype {dtype} has no safetensors code; supported: {', '.join(TORCH_NAMES.values())}")
    return code


def torch_dtype(code: str) -> torch.dtype:
    import torch  # only the stages that compute in torch ask

    dtype: torch.dtype = getattr(torch, TORCH_NAMES[code])
    return dtype


@dataclass(frozen=True, init=False)
class TensorInfo:
    """One tensor as a safetensors header declares it. Made from any dtype `code_of` takes; `code` is the
    safetensors dtype, `dtype` the torch one (torch is imported on first use), `numpy_dtype` numpy's."""

    name: str
    code: str
    shape: tuple[int, ...]
    file_offset: int = 0  # absolute position of the first byte in the file

    def __init__(
        self, name: str, dtype: torch.dtype | np.dtype[Any] | str, shape: tuple[int, ...], file_offset: int = 0
    ) -> None:
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "code", code_of(dtype))
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "file_offset", file_offset)

    @property
    def dtype(self) -> torch.dtype:
        return torch_dtype(self.code)

    @property
    def numpy_dtype(self) -> np.dtype[Any]:
        return NUMPY_DTYPES[self.code]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.numpy_dtype.itemsize


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
            dtype = entry["dtype"]
            if dtype not in TORCH_NAMES:
                raise KeyError(dtype)
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


def read_array(file: io.BufferedReader, info: TensorInfo) -> np.ndarray[Any, Any]:
    """Read one tensor with positioned reads into a fresh buffer: memory use is that tensor, nothing more
    (an mmap'ed file would count every page touched so far towards the process's RSS), and `pread` keeps no
    shared file position, so worker threads can read from one handle at once."""
    buf = np.empty(info.nbytes, dtype=np.uint8)
    view = buf.data.cast("B")
    done = 0
    while done < info.nbytes:  # the kernel returns at most ~2 GiB per call
        n = os.preadv(file.fileno(), [view[done:]], info.file_offset + done)
        if n == 0:
            raise UserError(
                f"{file.name}: tensor {info.name} could not be read in full; the file changed or is damaged"
            )
        done += n
    return buf.view(info.numpy_dtype).reshape(info.shape)


def read_tensor(file: io.BufferedReader, info: TensorInfo) -> torch.Tensor:
    """`read_array` as a torch tensor over the same buffer."""
    import torch

    data = read_array(file, TensorInfo(info.name, "U8", (info.nbytes,), info.file_offset))
    return torch.from_numpy(data).view(info.dtype).reshape(info.shape)


def as_array(tensor: torch.Tensor) -> np.ndarray[Any, Any]:
    """A CPU torch tensor's bytes as a numpy array of its dtype (bfloat16 and float8 through ml_dtypes), no copy."""
    code = code_of(tensor.dtype)
    raw = tensor.detach().contiguous().reshape(-1).view(torch_dtype("U8")).numpy()
    return raw.view(NUMPY_DTYPES[code]).reshape(tuple(tensor.shape))


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
                "dtype": info.code,
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

    def write(self, name: str, tensor: torch.Tensor | np.ndarray[Any, Any]) -> None:
        """Append `tensor` (a numpy array or a CPU torch tensor) as the next planned tensor."""
        if not self._pending:
            raise RuntimeError(f"{self._path}: tensor {name} written but none are left in the plan")
        info = self._pending.pop(0)
        assert name == info.name, f"write order: expected {info.name}, got {name}"
        array = tensor if isinstance(tensor, np.ndarray) else as_array(tensor)
        assert array.dtype == info.numpy_dtype and array.shape == info.shape, (
            f"{name}: planned {info.code}{list(info.shape)}, got {array.dtype}{list(array.shape)}"
        )
        self._put(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)

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
