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
    "nvfp4": Entry("nvfp4:NVFP4", "FP4 E2M1 weights and activations, E4M3 scales per 16, a float32 global scale"),
    "mxfp8": Entry("mxfp8:MXFP8", "E4M3 weights and activations, power-of-two (E8M0) scales per 32"),
    "w4a8_awq": Entry("w4a8_awq:W4A8Awq", "int4 weights with AWQ scales, FP8 activations"),
}
# Methods a pre-quantized checkpoint's layout needs (checkpoint/prequant/) that `quantize --method` does not offer
# (yet): looked up by quant_algo only. A method moves to METHODS_INDEX when `quantize` can make it.
IMPORTED_INDEX: dict[str, Entry] = {
    "fp8_pc_pt": Entry("fp8_pc_pt:FP8PerChannelPerToken", "E4M3 weights per channel, activations per token"),
    "fp8_dynamic": Entry("fp8_pc_pt:FP8Dynamic", "E4M3 weights per tensor, activations per tensor at run time"),
    "fp8_block": Entry("fp8_block:FP8Block", "E4M3 weights per 128x128 block, activations per 1x128 at run time"),
    "w4a16_gptq": Entry("w4a16_gptq:W4A16Gptq", "int4 per group with zero points (GPTQ, AWQ GEMM)"),
}
METHOD_NAMES = tuple(METHODS_INDEX)
METHODS_HELP = "; ".join(f"{name}: {entry.phrase}" for name, entry in METHODS_INDEX.items())
# every group size some method accepts: the CLI's and the recipe's choices (each method then checks its own)
GROUP_SIZE_CHOICES = tuple(sorted({size for entry in METHODS_INDEX.values() for size in entry.group_sizes}))
KV_CACHE_NAMES = ("none", "int8", "fp8", "nvfp4")  # "none": a float cache; the others are kv_cache.py's
