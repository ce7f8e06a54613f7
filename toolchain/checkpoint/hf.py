"""Reading a Hugging Face checkpoint directory: config.json and weights, one tensor at a time.

Weights are found through `model.safetensors.index.json`, else every `*.safetensors` file. Pickle checkpoints
(`*.bin`, `*.pt`, `*.pth`) can run arbitrary code when loaded, so they are refused unless the caller opts in,
and then loaded with `torch.load(weights_only=True)` (the one path here that imports torch). Tensors are handed out
as numpy arrays (safetensors_io).
"""

from __future__ import annotations

import io
import json
import re
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from toolchain.checkpoint.safetensors_io import TensorInfo, as_array, read_array, read_header
from toolchain.errors import UserError
from toolchain.files import JSON_LIMIT, TOKENIZER_LIMIT, check_present, read_text_capped
from toolchain.files import TOKENIZER_FILES as TOKENIZER_FILES  # re-exported: build and quantize copy them

if TYPE_CHECKING:
    import torch

SAFETENSORS_INDEX = "model.safetensors.index.json"
# Weight pickles by Hugging Face's naming; other pickles in a training dir (training_args.bin, optimizer.pt)
# are not weights and are left alone.
PICKLE_PATTERNS = ("pytorch_model*.bin",)
# TOKENIZER_FILES (toolchain/files.py): copied next to the converted weights so later stages (and TensorRT-LLM)
# find the tokenizer.
TOKENIZER_CORE = ("tokenizer.json", "tokenizer.model", "vocab.json")


def load_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(read_text_capped(path, JSON_LIMIT, "JSON config"))
    except FileNotFoundError as e:
        raise UserError(f"{path} not found; a Hugging Face model dir needs its config.json") from e
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from e
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object at the top level")
    return data


def has_tokenizer(directory: Path) -> bool:
    """A tokenizer transformers can load: tokenizer.json, a SentencePiece model or a BPE vocab."""
    return any((directory / name).is_file() for name in TOKENIZER_CORE)


@dataclass
class HFCheckpoint:
    """A Hugging Face model directory, opened lazily: headers are read up front, tensor data on demand."""

    root: Path
    config: dict[str, Any]
    tensors: dict[str, TensorInfo]
    files: dict[str, Path]  # tensor name -> file holding it
    _pickled: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    @classmethod
    def open(cls, root: Path, allow_pickle: bool = False) -> HFCheckpoint:
        if not root.exists():
            raise UserError(f"model dir {root} does not exist; pass the directory holding config.json")
        if not root.is_dir():
            raise UserError(f"model path {root} is not a directory; pass the directory holding config.json")
        config = load_json(root / "config.json")
        weight_files = _safetensors_files(root)
        if weight_files:
            return cls._from_safetensors(root, config, weight_files)
        pickles = sorted(p for pat in PICKLE_PATTERNS for p in root.glob(pat) if p.is_file())
        if not pickles:
            raise UserError(f"{root}: no *.safetensors weights found; is this a Hugging Face model dir?")
        if not allow_pickle:
            raise UserError(
                f"{root}: only pickle weights ({pickles[0].name}); pickle can run code when loaded. "
                "Convert them to safetensors, or pass --allow-pickle if you trust the source"
            )
        return cls._from_pickle(root, config, pickles)

    @classmethod
    def _from_safetensors(cls, root: Path, config: dict[str, Any], paths: list[Path]) -> HFCheckpoint:
        tensors: dict[str, TensorInfo] = {}
        files: dict[str, Path] = {}
        for path in paths:
            infos, _ = read_header(path)
            for name, info in infos.items():
                if name in tensors:
                    raise UserError(f"{path}: tensor {name!r} also in {files[name].name}; remove the duplicate")
                tensors[name] = info
                files[name] = path
        return cls(root, config, tensors, files)

    @classmethod
    def _from_pickle(cls, root: Path, config: dict[str, Any], paths: list[Path]) -> HFCheckpoint:
        pickled: dict[str, torch.Tensor] = {}
        files: dict[str, Path] = {}
        for path in paths:
            state = _load_pickle(path)
            for name, tensor in state.items():
                if name in pickled:
                    raise UserError(f"{path}: tensor {name!r} also in {files[name].name}; remove the duplicate")
                pickled[name] = tensor
                files[name] = path
        tensors = {}
        for name, tensor in pickled.items():
            try:
                tensors[name] = TensorInfo(name, tensor.dtype, tuple(tensor.shape))
            except ValueError as e:
                raise UserError(f"{files[name]}: tensor {name!r}: {e}; re-save it in one of those") from e
        return cls(root, config, tensors, files, pickled)

    @property
    def weight_files(self) -> list[Path]:
        return sorted(set(self.files.values()))

    def tokenizer_files(self) -> list[Path]:
        check_present((self.root / n for n in TOKENIZER_FILES), TOKENIZER_LIMIT, "tokenizer")
        return [self.root / n for n in TOKENIZER_FILES if (self.root / n).is_file()]

    def has_tokenizer(self) -> bool:
        return has_tokenizer(self.root)

    def reader(self) -> TensorReader:
        return TensorReader(self)


class TensorReader:
    """Context manager handing out tensors one at a time from open weight files."""

    def __init__(self, ckpt: HFCheckpoint) -> None:
        self._ckpt = ckpt
        self._stack = ExitStack()
        self._handles: dict[Path, io.BufferedReader] = {}

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def get(self, name: str) -> np.ndarray[Any, Any]:
        if name in self._ckpt._pickled:
            return as_array(self._ckpt._pickled[name])
        path = self._ckpt.files[name]
        if path not in self._handles:
            self._handles[path] = self._stack.enter_context(path.open("rb"))
        return read_array(self._handles[path], self._ckpt.tensors[name])

    def nbytes(self, name: str) -> int:
        return self._ckpt.tensors[name].nbytes

    def dtype(self, name: str) -> np.dtype[Any]:
        return self._ckpt.tensors[name].numpy_dtype

    def file_of(self, name: str) -> Path:
        return self._ckpt.files[name]


def _load_pickle(path: Path) -> dict[str, torch.Tensor]:
    import torch

    def load(mmap: bool) -> Any:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)

    try:
        try:
            state = load(mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            state = load(mmap=False)  # legacy (pre-zipfile) format: no mmap
    except Exception as e:  # torch raises many types for damaged or unsafe pickles
        first = re.sub(r"\x1b\[[0-9;]*m", "", str(e)).strip().splitlines()[0] if str(e).strip() else ""
        raise UserError(f"{path}: cannot load as a weights-only pickle ({type(e).__name__}: {first})") from e
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UserError(f"{path}: not a flat state dict of tensors; re-save it with torch.save(model.state_dict())")
    return state


def _safetensors_files(root: Path) -> list[Path]:
    index = root / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = load_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise UserError(f"{index}: missing or empty 'weight_map'; re-export the checkpoint")
        names = {str(f) for f in weight_map.values()}
        outside = sorted(n for n in names if Path(n).name != n)
        if outside:
            raise UserError(f"{index}: shard {outside[0]!r} is not a file in {root}; shards must sit beside the index")
        paths = sorted(root / n for n in names)
        missing = [p.name for p in paths if not p.is_file()]
        if missing:
            raise UserError(f"{index} lists shard(s) not in {root}: {', '.join(missing)}; download them")
        return paths
    return sorted(p for p in root.glob("*.safetensors") if p.is_file())
