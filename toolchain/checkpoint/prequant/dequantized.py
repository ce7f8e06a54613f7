"""`convert --dequantize`: the float detour, only when asked. A pre-quantized checkpoint's linears become float
weights — each as its method's `dequantize` reads the layout the format made (the reference forward's weight), with
a `prequant_scaling_factor` folded into its columns (x · (1/s) · Wᵀ = x · (W · diag(1/s))ᵀ) — and the converted
checkpoint is unquantized: activation quantization and KV cache scales are dropped, which is what a float
checkpoint means. Torch is imported here only (plain convert stays numpy).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from toolchain.checkpoint.hf import TensorReader
from toolchain.checkpoint.prequant import Array, Made
from toolchain.checkpoint.safetensors_io import NUMPY_DTYPES, code_of
from toolchain.checkpoint.trtllm import ModelConfig

Shape = tuple[int, ...]


def dequantized(made: list[Made], cfg: ModelConfig, shapes: dict[str, Shape]) -> list[Made]:
    """One float PREFIX.weight per quantized linear among `made` (in cfg.dtype, of the HF weights' shapes in
    `shapes`); the linears' other tensors and the KV cache scales are gone."""
    by_prefix: dict[str, list[Made]] = {}
    for m in made:
        prefix, suffix = m.name.rsplit(".", 1)
        if suffix != "kv_cache_scaling_factor":
            by_prefix.setdefault(prefix, []).append(m)
    out = []
    for prefix, group in by_prefix.items():
        weight = next(m for m in group if m.name == f"{prefix}.weight")
        # qweight + g_idx, weight_packed + weight_shape, ...: each source names its linear, some more than once
        hf = list(dict.fromkeys(f"{src.rsplit('.', 1)[0]}.weight" for src in weight.srcs))
        shape = (sum(shapes[n][0] for n in hf), shapes[hf[0]][1])
        srcs = tuple(dict.fromkeys(s for m in group for s in m.srcs))
        out.append(Made(f"{prefix}.weight", shape, cfg.dtype, srcs, _float(prefix, group, cfg, shape)))
    return out


def _float(prefix: str, group: list[Made], cfg: ModelConfig, shape: Shape) -> Callable[[TensorReader], Array]:
    def make(reader: TensorReader) -> Array:
        from toolchain.quantize.methods.base import PREQUANT, Stored
        from toolchain.quantize.methods.registry import by_algo

        tensors = {m.name: _torch(m.make(reader)) for m in group}
        q = cfg.quantization
        assert q.quant_algo is not None
        s = Stored(prefix, tensors, shape[1], q.group_size)
        method = by_algo(q.quant_algo)
        assert method is not None, f"{q.quant_algo}: the format chose a quant_algo no method reads"
        w = method.dequantize(s).float()
        pre = s.get(PREQUANT)
        if pre is not None:
            w = w * pre.float()
        result: Array = w.numpy().astype(np.float32)
        with np.errstate(over="ignore"):  # an overflow is refused by convert's value check, naming the tensor
            return result.astype(NUMPY_DTYPES[code_of(cfg.dtype)])

    return make


def _torch(a: Array) -> Any:
    """numpy -> torch, ml_dtypes' float8 / bfloat16 by their bits."""
    import torch

    a = np.ascontiguousarray(a)
    name = str(a.dtype)
    if name == "float8_e4m3fn":
        return torch.from_numpy(a.view(np.uint8)).view(torch.float8_e4m3fn)
    if name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)
