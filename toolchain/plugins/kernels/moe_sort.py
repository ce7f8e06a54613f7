"""The MoE op's routing sort on the device: a layer's (token, k) assignments grouped by expert, in one launch.

`sort_kernel` takes the routing's experts [T, top_k] int32 (what TopK chose, token-major) and writes what the
experts kernel (moe.py) reads: `assignments` [T*top_k] int32 (assignment t*top_k + j, grouped by expert, tokens in
order within each) and `offsets` [E+1] int32 (expert e's assignments are assignments[offsets[e]:offsets[e+1]]) —
exactly `moe.sort_by_expert`'s (a stable argsort and the prefix sum of the counts).

A counting sort in ONE program, so one launch (one `tensorrt.plugin` ahead-of-time plugin, MoESort) and
deterministic: pass 1 counts each expert's assignments (a one-hot [BLOCK, E_BLOCK] summed over the chunk), an
exclusive prefix sum gives the offsets; pass 2 walks the chunks again in order, and places assignment i at its
expert's running start plus the number of earlier assignments of the same expert in its chunk (a [BLOCK, BLOCK]
comparison), then advances the running starts by the chunk's counts — a stable scatter. One program is enough for
what it sorts: T*top_k int32 ids (decode: a few hundred; a 8192-token prefill at top 8: 64 K ids, 256 KiB read twice
by one SM); a multi-program sort would need a second launch (a second plugin) or a grid-wide barrier.

Ids outside [0, E) (TensorRT's tactic timing runs a plugin on buffers of its own) are counted nowhere and written
nowhere: every write stays inside the outputs whatever the input holds. Kernel arguments follow TensorRT's
ahead-of-time order: the input pointer, the int32 token count, the two output pointers.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from toolchain.engine.ops import MoEAttrs

OP = "MoESort"
NUM_WARPS = 4
BLOCK = 64  # assignments per chunk: the rank's [BLOCK, BLOCK] comparison and the [BLOCK, E_BLOCK] one-hot
SCALARS = ("num_tokens",)


@triton.jit
def sort_kernel(experts, num_tokens, assignments, offsets, TOP_K: tl.constexpr, E: tl.constexpr,
                E_BLOCK: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    n = num_tokens * TOP_K
    ids = tl.arange(0, E_BLOCK)
    lane = tl.arange(0, BLOCK)
    counts = tl.zeros([E_BLOCK], tl.int32)
    for start in range(0, n, BLOCK):
        i = start + lane
        e = tl.load(experts + i, mask=i < n, other=-1)
        counts += tl.sum((e[:, None] == ids[None, :]).to(tl.int32), axis=0)
    counts = tl.where(ids < E, counts, 0)  # an id in [E, E_BLOCK) is no expert
    ends = tl.cumsum(counts, axis=0)
    running = ends - counts  # each expert's first slot: the exclusive prefix sum
    tl.store(offsets + ids, running, mask=ids < E)
    tl.store(offsets + E, tl.sum(counts, axis=0))
    earlier = lane[None, :] < lane[:, None]  # [i, j]: j comes before i in the chunk
    for start in range(0, n, BLOCK):
        i = start + lane
        e = tl.load(experts + i, mask=i < n, other=-1)
        known = (e >= 0) & (e < E)
        e = tl.where(known, e, -1)
        onehot = (e[:, None] == ids[None, :]).to(tl.int32)
        base = tl.sum(onehot * running[None, :], axis=1)
        rank = tl.sum(((e[:, None] == e[None, :]) & earlier).to(tl.int32), axis=1)
        tl.store(assignments + base + rank, i, mask=known)
        running += tl.sum(onehot, axis=0)


def check(a: MoEAttrs, activation: str) -> None:
    """The sort reads int32 ids only: any activation dtype's layer takes the same kernel."""
    del a, activation


def signature(a: MoEAttrs, activation: str) -> dict[str, str]:
    """experts (*i32), num_tokens (i32), assignments and offsets (*i32), then the constexprs."""
    consts = {k: "constexpr" for k in constexprs(a, activation)}
    return {"experts": "*i32", "num_tokens": "i32", "assignments": "*i32", "offsets": "*i32", **consts}


def constexprs(a: MoEAttrs, activation: str) -> dict[str, Any]:
    del activation
    e = a.number_of_experts
    return {"TOP_K": a.top_k, "E": e, "E_BLOCK": int(triton.next_power_of_2(e)), "BLOCK": BLOCK}


def grid(a: MoEAttrs, num_tokens: Any) -> tuple[int, int, int]:
    """One program: the scatter's order is the sort's, so no program may run ahead of another."""
    del a, num_tokens
    return 1, 1, 1


def scalars(a: MoEAttrs, num_tokens: Any) -> list[Any]:
    del a
    return [num_tokens]


def sort(experts: torch.Tensor, number_of_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(assignments [T*k] int32, offsets [E+1] int32) of the routing's experts [T, k]: moe.sort_by_expert's
    answer, computed by the kernel (on experts' device; under TRITON_INTERPRET on CPU tensors)."""
    t, k = experts.shape
    a = MoEAttrs(number_of_experts, k, 1, 1)
    ids = experts.to(torch.int32).contiguous()
    assignments = torch.empty(t * k, dtype=torch.int32, device=experts.device)
    offsets = torch.empty(number_of_experts + 1, dtype=torch.int32, device=experts.device)
    sort_kernel[grid(a, t)](ids, t, assignments, offsets, **constexprs(a, "float32"), num_warps=NUM_WARPS)
    return assignments, offsets
