"""The quantization methods, one module each (w8a16.py, w4a16.py, w4a16_awq.py, w8a8_sq.py, fp8.py; KV caches in
kv_cache.py); base.py is what a method is, registry.py looks them up by CLI name and by config.json's names.

This file is the one list of them, importable without torch: the CLI's and the recipe's choices come from it."""

from __future__ import annotations

# CLI name -> the class implementing it ("module:Class" under methods/), and the CLI's phrase for it
METHODS_INDEX: dict[str, tuple[str, str]] = {
    "w8a16": ("w8a16:W8A16", "int8 weights per channel"),
    "w4a16": ("w4a16:W4A16", "int4 per group"),
    "w4a16_awq": ("w4a16_awq:W4A16Awq", "int4 with AWQ scales"),
    "w8a8_sq": ("w8a8_sq:W8A8SQ", "SmoothQuant int8 weights and activations"),
    "fp8": ("fp8:FP8", "E4M3 weights and activations"),
}
METHOD_NAMES = tuple(METHODS_INDEX)
METHODS_HELP = "; ".join(f"{name}: {phrase}" for name, (_, phrase) in METHODS_INDEX.items())
KV_CACHE_NAMES = ("none", "int8", "fp8")  # "none": a float cache; the others are kv_cache.py's
