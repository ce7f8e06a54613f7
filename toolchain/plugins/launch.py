"""How each plugin op becomes one kernel launch, read from its Triton kernel module (toolchain/plugins/kernels):
the PTX entry's name, the kernel's parameters in order (input pointers, int32 scalars, output pointers), the grid,
the block size and the int32 scalar values. Pure functions over dims that may be ints or TensorRT's symbolic
expressions (anything with + * and //), so TensorRT's registration (tensorrt_registration.py), the tests and the
GPU check (plugins/gpu_check.py) describe the same launch.

The dynamic shared memory of a launch is the compiled kernel's own figure (Triton's `metadata.shared`), so it
comes from the compile (toolchain/plugins/compile.py), not from here."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from toolchain.engine.ops import AttentionAttrs
from toolchain.plugins.kernels import KERNEL_FUNCTIONS, KERNELS

WARP_SIZE = 32


def _module(op: str) -> Any:
    if op not in KERNELS:
        raise ValueError(f"plugin op {op!r} has no kernel; choose one of {', '.join(KERNELS)}")
    return KERNELS[op]


def kernel_name(op: str) -> str:
    """The PTX `.entry` of op's kernel: Triton names it after the jit function."""
    _module(op)
    return str(KERNEL_FUNCTIONS[op].__name__)


def block_threads(op: str) -> int:
    """Threads per block: Triton launches 32 * num_warps (the PTX says so in `.reqntid`)."""
    return WARP_SIZE * int(_module(op).NUM_WARPS)


def parameters(op: str, a: AttentionAttrs, activation: str) -> list[tuple[str, str]]:
    """The kernel's runtime parameters in order, as (name, Triton type): pointers `*fp16`, `*i32`, ..., scalars `i32`.
    The constexprs are compiled in and are not parameters."""
    return [(n, t) for n, t in _module(op).signature(a, activation).items() if t != "constexpr"]


def batch_dims(first: Any, new_lens: Any, block_tables: Any, kv_cache: Any) -> tuple[Any, Any, Any, Any]:
    """(num_tokens, num_seqs, max_blocks, num_blocks) from the shapes of the op's inputs qkv / q, new_lens,
    block_tables and kv_cache: torch shapes or TensorRT shape expressions alike."""
    return first[0], new_lens[0], block_tables[1], kv_cache[1]


def scalars(op: str, a: AttentionAttrs, num_tokens: Any, num_seqs: Any, max_blocks: Any, num_blocks: Any) -> list[Any]:
    """The int32 arguments in kernel order (a float as its bit pattern)."""
    return list(_module(op).scalars(a, num_tokens, num_seqs, max_blocks, num_blocks))


def grid(op: str, a: AttentionAttrs, num_tokens: Any) -> tuple[Any, Any, Any]:
    g = _module(op).grid(a, num_tokens)
    return g[0], g[1], g[2]


def output_width(a: AttentionAttrs) -> int:
    """Both ops output [num_tokens, num_heads * head_size] (q after rotary; the attention output)."""
    return a.num_heads * a.head_size


@dataclass(frozen=True)
class Launch:
    """One kernel launch, as TensorRT's ahead-of-time plugin makes it: `cuLaunchKernel(kernel, *grid, block_x, 1, 1,
    shared_mem, stream, [*input pointers, *scalars, *output pointers])`."""

    kernel: str
    grid: tuple[Any, Any, Any]
    block_x: int
    shared_mem: int
    scalars: list[Any]


def describe(op: str, a: AttentionAttrs, dims: tuple[Any, Any, Any, Any], shared_mem: int) -> Launch:
    """The launch of op for batch dims `dims` (batch_dims) and the compiled kernel's shared memory bytes."""
    num_tokens = dims[0]
    return Launch(kernel_name(op), grid(op, a, num_tokens), block_threads(op), shared_mem, scalars(op, a, *dims))


def ptx_parameter_types(ptx: str, entry: str) -> list[str]:
    """The PTX types (`.u64`, `.u32`, ...) of `entry`'s parameters, in order."""
    head = re.search(rf"\.entry {re.escape(entry)}\((.*?)\)", ptx, re.S)
    if head is None:
        raise ValueError(f"the PTX has no .entry {entry}")
    return [line.split()[1] for line in head.group(1).strip().splitlines() if line.strip()]


def check_ptx(op: str, a: AttentionAttrs, activation: str, ptx: str) -> None:
    """Refuse PTX whose entry does not take exactly what TensorRT passes: the kernel's pointers and int32 scalars in
    order (`parameters`), nothing after them — Triton's hidden scratch pointers must have been stripped."""
    want = [".u64" if t.startswith("*") else ".u32" for _, t in parameters(op, a, activation)]
    got = [".u32" if t == ".s32" else t for t in ptx_parameter_types(ptx, kernel_name(op))]
    if got != want:
        raise ValueError(
            f"{op}: PTX entry {kernel_name(op)} takes ({', '.join(got)}), TensorRT will pass ({', '.join(want)}): "
            "compile it with toolchain.plugins.compile, which strips Triton's hidden scratch parameters"
        )
