"""Typed reads of Hugging Face config.json values, each failing with the file, the key, the value and the fix.

config.json is user input: a string where a number belongs, a NaN epsilon or a fractional head count must stop
the conversion with one clear line, not a traceback or a silently broken checkpoint.
"""

from __future__ import annotations

import math
from typing import Any

from toolchain.errors import UserError

_MISSING = object()


def _get(hf: dict[str, Any], key: str, default: Any) -> Any:
    value = hf.get(key, default)
    return default if value is None and default is not _MISSING else value


def positive_int(hf: dict[str, Any], key: str, source: str, default: Any = _MISSING) -> int:
    value = _get(hf, key, default)
    if value is _MISSING:
        raise UserError(f"{source}: required key '{key}' is missing; add it (a positive integer)")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise UserError(f"{source}: '{key}' must be a positive integer, got {value!r}; fix config.json")
    return value


def positive_float(hf: dict[str, Any], key: str, source: str, default: Any = _MISSING) -> float:
    value = _get(hf, key, default)
    if value is _MISSING:
        raise UserError(f"{source}: required key '{key}' is missing; add it (a positive number)")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise UserError(f"{source}: '{key}' must be a finite positive number, got {value!r}; fix config.json")
    return float(value)


def boolean(hf: dict[str, Any], key: str, source: str, default: bool = False) -> bool:
    value = _get(hf, key, default)
    if not isinstance(value, bool):
        raise UserError(f"{source}: '{key}' must be true or false, got {value!r}; fix config.json")
    return value
