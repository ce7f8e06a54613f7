"""The plugin kernels, in Triton: one source that runs three ways — on CPU tensors under Triton's interpreter
(`TRITON_INTERPRET=1`, how CI executes them against the reference ops), natively on a GPU (plugins/gpu_check.py),
and compiled ahead of time to PTX for TensorRT's `tensorrt.plugin` (toolchain/plugins/compile.py)."""

from __future__ import annotations

from types import ModuleType

from toolchain.plugins.kernels import attention, kv_write, moe, moe_sort

# op name -> its kernel module. Each module has: OP, NUM_WARPS, the @triton.jit kernel, check(a, activation),
# signature(a, activation), constexprs(a, activation), scalars(a, num_tokens, num_seqs, max_blocks, num_blocks),
# grid(a, num_tokens), and an entry point with the reference op's arguments (kv_cache_write / paged_attention).
KERNELS: dict[str, ModuleType] = {kv_write.OP: kv_write, attention.OP: attention}
KERNEL_FUNCTIONS = {kv_write.OP: kv_write.kv_write_kernel, attention.OP: attention.attention_kernel}

# Every kernel compile.py compiles ahead of time: the two above, which TensorRT's registration serves
# (tensorrt_registration.py, launch.py: the attention-pool signature of common.common_signature), and the MoE
# experts' grouped GEMM (moe.py: its own parameters; registered as the MoEFc* / MoEProj* plugins of the split MoE
# op, engine/moe_split.py) and the routing's sort by expert on the device (moe_sort.py: one program, one launch).
COMPILED: dict[str, ModuleType] = {**KERNELS, moe.OP: moe, moe_sort.OP: moe_sort}
COMPILED_FUNCTIONS = {**KERNEL_FUNCTIONS, moe.OP: moe.moe_kernel, moe_sort.OP: moe_sort.sort_kernel}
