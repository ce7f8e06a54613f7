"""The registry: one instance of every weight method and KV cache quantization, by CLI name and by the name
config.json stores. The quantize stage, the fake-quant reference and the ONNX export look methods up here; a name
or a quant_algo that is not here is refused, never taken for another."""

from __future__ import annotations

import importlib
from typing import TypeVar

from toolchain.errors import UserError
from toolchain.quantize.methods import IMPORTED_INDEX, KV_CACHE_NAMES, METHODS_INDEX
from toolchain.quantize.methods.base import QuantMethod
from toolchain.quantize.methods.kv_cache import FP8_KV, INT8_KV, NVFP4_KV, KvCacheQuant

T = TypeVar("T")


def _load(name: str, where: str) -> QuantMethod:
    module, cls = where.split(":")
    method: QuantMethod = getattr(importlib.import_module(f"toolchain.quantize.methods.{module}"), cls)(name)
    return method


METHODS: dict[str, QuantMethod] = {name: _load(name, entry.where) for name, entry in METHODS_INDEX.items()}
KV_CACHES: dict[str, KvCacheQuant | None] = {kv.name if kv else "none": kv for kv in (None, INT8_KV, FP8_KV, NVFP4_KV)}
assert tuple(KV_CACHES) == KV_CACHE_NAMES, "methods/__init__.py lists the KV caches kv_cache.py defines"
# read from pre-quantized checkpoints, not made by `quantize` (methods/__init__.py IMPORTED_INDEX)
IMPORTED: dict[str, QuantMethod] = {name: _load(name, entry.where) for name, entry in IMPORTED_INDEX.items()}
_BY_ALGO = {m.quant_algo: m for m in (*METHODS.values(), *IMPORTED.values())}
assert len(_BY_ALGO) == len(METHODS) + len(IMPORTED), "two methods claim one quant_algo"
_KV_BY_ALGO = {kv.quant_algo: kv for kv in KV_CACHES.values() if kv is not None}


def method(name: str) -> QuantMethod:
    if name not in METHODS:
        raise UserError(f"method {name!r} is not supported; choose one of {', '.join(METHODS)}")
    return METHODS[name]


def _lookup(table: dict[str, T], field: str, algo: str | None, source: str) -> T | None:
    if algo is None:
        return None
    if algo not in table:
        raise UserError(
            f"{source}: quantization.{field} {algo!r} is not supported; supported: {', '.join(table)} (or null); "
            "re-quantize the float checkpoint with `trtbuild quantize`"
        )
    return table[algo]


def by_algo(algo: str | None, source: str = "config.json") -> QuantMethod | None:
    """The method of a checkpoint's quantization.quant_algo; None for an unquantized one (null)."""
    return _lookup(_BY_ALGO, "quant_algo", algo, source)


def kv_by_algo(algo: str | None, source: str = "config.json") -> KvCacheQuant | None:
    """The KV cache quantization of a checkpoint's quantization.kv_cache_quant_algo; None for a float cache."""
    return _lookup(_KV_BY_ALGO, "kv_cache_quant_algo", algo, source)
