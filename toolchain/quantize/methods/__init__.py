"""The quantization methods, one module each (w8a16.py, w4a16.py, w4a16_awq.py, w8a8_sq.py, fp8.py; KV caches in
kv_cache.py); base.py is what a method is, registry.py looks them up by CLI name and by config.json's names.

This file is the one list of them, importable without torch: the CLI's and the recipe's choices come from it."""

from __future__ import annotations

from typing import NamedTuple

GROUP_SIZES = (32, 64, 128)  # the `--group-size` values a method accepts unless its line below says otherwise
DEFAULT_GROUP_SIZE = 128


class Entry(NamedTuple):
    where: str  # the class implementing it: "module:Class" under methods/
    phrase: str  # the CLI's phrase for it
    group_sizes: tuple[int, ...] = GROUP_SIZES  # what `--group-size` / a recipe's quantize.group_size may be


# CLI name -> its entry: the one line a new method adds
METHODS_INDEX: dict[str, Entry] = {
    "w8a16": Entry("w8a16:W8A16", "int8 weights per channel"),
    "w4a16": Entry("w4a16:W4A16", "int4 per group"),
    "w4a16_awq": Entry("w4a16_awq:W4A16Awq", "int4 with AWQ scales"),
    "w8a8_sq": Entry("w8a8_sq:W8A8SQ", "SmoothQuant int8 weights and activations"),
    "fp8": Entry("fp8:FP8", "E4M3 weights and activations"),
}
METHOD_NAMES = tuple(METHODS_INDEX)
METHODS_HELP = "; ".join(f"{name}: {entry.phrase}" for name, entry in METHODS_INDEX.items())
# every group size some method accepts: the CLI's and the recipe's choices (each method then checks its own)
GROUP_SIZE_CHOICES = tuple(sorted({size for entry in METHODS_INDEX.values() for size in entry.group_sizes}))
KV_CACHE_NAMES = ("none", "int8", "fp8")  # "none": a float cache; the others are kv_cache.py's
