"""The MoE op's experts in Triton: a grouped GEMM over the experts, each expert's routed tokens only.

Same contract as the reference op `toolchain.engine.ops.moe` (its docstring is the op's definition):
`moe(a, x, router_weight, fc_weight, proj_weight, *biases)` here takes the same arguments and returns the same y.
Three steps, as TensorRT would run them (docs/kernels.md, "MoE"):

1. routing — `ops.route` itself (router GEMM in float32, top-k, the router norm) and the assignments sorted by
   expert: `assignments` [T*k] int32 (assignment t*k+j of token t's j-th expert, grouped by expert, tokens in order
   within each, the reference's stable argsort) and `offsets` [E+1] int32 (expert e's assignments are
   assignments[offsets[e]:offsets[e+1]]). Here in torch; in TensorRT a router plugin (not written yet).
2. `moe_kernel` with STAGE 0 (fc): h[r] = up * act(gate) (or gpt-oss's clamped SwiGLU) of x[assignments[r] // k]
   (times the expert's 1/s, when `prequant`: AWQ / SmoothQuant experts) through expert e's fc rows, h [T*k, I] in
   the activation type, in the sorted order; STAGE 1 (proj): out[assignments[r]] = weight * (h[r] (times the
   expert's 1/s) @ proj_e^T + proj_bias_e), out [T*k, H] in fp32, in assignment
   (token-major) order. One launch each: two plugin instances of the same kernel. Programs over (expert, tile of
   BLOCK_M of its assignments, tile of BLOCK_N output columns); a tile past its expert's count does nothing, so an
   expert no token chose costs one load of its offsets and its weights are never read.
3. y = out.view(T, k, H).sum(1) in fp32, cast to the activation type (TensorRT: a reduce layer and a cast).

The products: in the activation's type on a GPU, accumulated in fp32; fp32 ("ieee") for fp32 activations and for
bf16 under the interpreter, whose bf16 tl.dot is wrong in triton 3.9 (attention.py's `dot`). Kernel arguments
follow TensorRT's ahead-of-time plugin convention (common.py): input pointers, no int32 scalar (every size is a
constexpr of the plugin instance; the token count only shapes the grid), the output pointer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from toolchain.engine.ops import MoEAttrs, route
from toolchain.plugins.kernels import common
from toolchain.plugins.kernels.attention import dot

OP = "MoE"
NUM_WARPS = 4
STAGES = ("fc", "proj")
# Assignments per program: decode gives an expert a handful of tokens (T * top_k / E on average), so a small M tile
# wastes the least; tl.dot's smallest M is 16.
BLOCK_M = 16
MAX_BLOCK = 64  # output columns (N) and reduction (K) per step: [16, 64] fp32 accumulators, [64, 64] weight tiles
ACT_CODES = {"silu": 0, "swiglu": 0, "gelu": 1, "gelu_new": 1, "gelu_pytorch_tanh": 1, "relu": 2}
SQRT_2_OVER_PI = 0.7978845608028654


@dataclass(frozen=True)
class Stage:
    """One plugin instance: the MoE op's attributes and which GEMM (STAGES) it runs."""

    moe: MoEAttrs
    stage: str


@triton.jit
def sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def activate(x, ACT: tl.constexpr):
    """spec.ACTIVATIONS in fp32: silu, gelu (tanh approximation, TensorRT-LLM's gelu), relu."""
    if ACT == 0:
        return x * sigmoid(x)
    elif ACT == 1:
        u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        return 0.5 * x * (1.0 + (2.0 * sigmoid(2.0 * u) - 1.0))  # tanh(u) = 2 sigmoid(2u) - 1
    else:
        return tl.maximum(x, 0.0)


@triton.jit
def moe_kernel(
    a,
    assignments,
    offsets,
    weights,
    w,
    bias,
    prequant,
    out,
    TOP_K: tl.constexpr,
    K: tl.constexpr,
    N: tl.constexpr,
    W_ROWS: tl.constexpr,
    STAGE: tl.constexpr,
    GATED: tl.constexpr,
    ACT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
    SWIGLU: tl.constexpr,
    SWIGLU_ALPHA: tl.constexpr,
    SWIGLU_BETA: tl.constexpr,
    SWIGLU_LIMIT: tl.constexpr,
):
    expert = tl.program_id(0)
    start = tl.load(offsets + expert)
    end = tl.load(offsets + expert + 1)
    row0 = start + tl.program_id(1) * BLOCK_M
    if row0 < end:
        r = row0 + tl.arange(0, BLOCK_M)
        rows = r < end
        asg = tl.load(assignments + r, mask=rows, other=0)
        # fc reads token asg // k of x; proj reads h's own (sorted) row r
        a_row = (asg // TOP_K) if STAGE == 0 else r
        n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = n < N
        kk = tl.arange(0, BLOCK_K)
        w_base = w + expert.to(tl.int64) * (W_ROWS * K)
        act = a.dtype.element_ty
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + kk
            at = tl.load(
                a + a_row.to(tl.int64)[:, None] * K + ks[None, :], mask=rows[:, None] & (ks < K)[None, :], other=0.0
            )
            if prequant is not None:  # the expert's 1/s [K] (fp32): the A tile times it, in fp32, back to the dtype
                p = tl.load(prequant + expert.to(tl.int64) * K + ks, mask=ks < K, other=0.0)
                at = common.cast(at.to(tl.float32) * p[None, :], act)
            w_mask = (ks < K)[:, None] & cols[None, :]
            wt = tl.load(w_base + n[None, :] * K + ks[:, None], mask=w_mask, other=0.0)  # [BLOCK_K, BLOCK_N]
            acc += dot(at, wt, act, DOT_FP32)
            if STAGE == 0 and GATED:  # the gate half: rows N.. of fc = [up; gate]
                gt = tl.load(w_base + (N + n)[None, :] * K + ks[:, None], mask=w_mask, other=0.0)
                acc_gate += dot(at, gt, act, DOT_FP32)
        if bias is not None:
            b_base = bias + expert * W_ROWS
            acc += tl.load(b_base + n, mask=cols, other=0.0).to(tl.float32)[None, :]
            if STAGE == 0 and GATED:
                acc_gate += tl.load(b_base + N + n, mask=cols, other=0.0).to(tl.float32)[None, :]
        mask = rows[:, None] & cols[None, :]
        if STAGE == 0:
            if SWIGLU:  # gpt-oss's clamped SwiGLU (ops.moe): gate * sigmoid(alpha * gate) * (up + beta)
                gate = acc_gate
                up = acc
                if SWIGLU_LIMIT > 0:
                    gate = tl.minimum(gate, SWIGLU_LIMIT)
                    up = tl.minimum(tl.maximum(up, -SWIGLU_LIMIT), SWIGLU_LIMIT)
                h = gate * sigmoid(gate * SWIGLU_ALPHA) * (up + SWIGLU_BETA)
            else:
                h = acc * activate(acc_gate, ACT) if GATED else activate(acc, ACT)
            tl.store(out + r.to(tl.int64)[:, None] * N + n[None, :], common.cast(h, out.dtype.element_ty), mask=mask)
        else:
            scale = tl.load(weights + asg, mask=rows, other=0.0)
            tl.store(out + asg.to(tl.int64)[:, None] * N + n[None, :], acc * scale[:, None], mask=mask)


def check(s: Stage, activation: str) -> None:
    if activation not in common.ACTIVATIONS:
        choices = ", ".join(common.ACTIVATIONS)
        raise ValueError(f"activation dtype {activation!r} has no kernel; choose one of {choices}")
    if s.stage not in STAGES:
        raise ValueError(f"MoE stage {s.stage!r}: expected one of {', '.join(STAGES)}")
    split_experts(s.moe)


def split_experts(a: MoEAttrs) -> None:
    """Experts split over ranks (expert_offset / num_local_experts, issue 27) have no kernel yet: the grid and the
    weights' indexing assume every expert is local. Refused by name."""
    if a.local_experts != a.number_of_experts:
        raise ValueError(
            f"MoE experts {a.expert_offset} .. {a.expert_offset + a.local_experts - 1} of {a.number_of_experts} "
            "(expert_offset, num_local_experts: an expert- or tensor-parallel rank) have no kernel yet; multi-rank "
            "MoE engines run on the onnxruntime backend"
        )


def _dims(s: Stage) -> tuple[int, int, int]:
    """(K, N, rows of one expert's weight) of the stage's GEMM: fc [I or 2I, H], proj [H, I]."""
    m = s.moe
    if s.stage == "fc":
        return m.expert_hidden_size, m.expert_inter_size, m.fc_rows
    return m.expert_inter_size, m.expert_hidden_size, m.expert_hidden_size


def _block(size: int) -> int:
    return max(16, min(MAX_BLOCK, int(triton.next_power_of_2(size))))


def signature(s: Stage, activation: str) -> dict[str, str]:
    """triton.compile's signature: a (x or h), assignments, offsets, weights, w (fc or proj), bias (a constexpr
    None without use_bias), prequant (the experts' 1/s [E, K] fp32; a constexpr None without it), out (h in the
    activation type, or the weighted outputs in fp32), then the constexprs."""
    check(s, activation)
    act = "*" + common.ACTIVATIONS[activation]
    bias = act if s.moe.use_bias else "constexpr"
    sig = {"a": act, "assignments": "*i32", "offsets": "*i32", "weights": "*fp32", "w": act, "bias": bias}
    sig["prequant"] = "*fp32" if s.moe.prequant else "constexpr"
    sig["out"] = act if s.stage == "fc" else "*fp32"
    consts = {k: "constexpr" for k in constexprs(s, activation) if k not in ("bias", "prequant")}
    return {**sig, **consts}


def constexprs(s: Stage, activation: str) -> dict[str, Any]:
    """The compiled-in values of the GPU variant; under the interpreter the entry point overrides DOT_FP32 for bf16
    (dot_fp32)."""
    k, n, w_rows = _dims(s)
    consts: dict[str, Any] = {} if s.moe.use_bias else {"bias": None}
    consts |= {} if s.moe.prequant else {"prequant": None}
    return {
        **consts,
        "TOP_K": s.moe.top_k,
        "K": k,
        "N": n,
        "W_ROWS": w_rows,
        "STAGE": STAGES.index(s.stage),
        "GATED": bool(s.moe.gated),
        "ACT": ACT_CODES[s.moe.activation],
        "BLOCK_M": BLOCK_M,
        "BLOCK_N": _block(n),
        "BLOCK_K": _block(k),
        "DOT_FP32": activation == "float32",
        # neutral values without the clamped SwiGLU: one compiled variant per distinct plugin, not per unused field
        "SWIGLU": s.moe.clamped_swiglu,
        "SWIGLU_ALPHA": float(s.moe.swiglu_alpha) if s.moe.clamped_swiglu else 1.0,
        "SWIGLU_BETA": float(s.moe.swiglu_beta) if s.moe.clamped_swiglu else 0.0,
        "SWIGLU_LIMIT": float(s.moe.swiglu_limit) if s.moe.clamped_swiglu else 0.0,
    }


def grid(s: Stage, num_tokens: Any) -> tuple[Any, Any, Any]:
    """(expert, tile of BLOCK_M of its assignments, tile of output columns): an expert takes each token at most
    once, so ceil(T / BLOCK_M) tiles cover any expert's count; the tiles past it return at once."""
    _, n, _ = _dims(s)
    # (T + BLOCK_M - 1) // BLOCK_M, not -(-T // BLOCK_M): TensorRT's shape expressions have + and // but no negation
    return s.moe.number_of_experts, (num_tokens + BLOCK_M - 1) // BLOCK_M, -(-n // _block(n))


def dot_fp32(activation: str) -> bool:
    interpreted = isinstance(moe_kernel, InterpretedFunction)
    return activation == "float32" or (interpreted and activation == "bfloat16")


def sort_by_expert(experts: torch.Tensor, number_of_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(assignments [T*k] int32, offsets [E+1] int32) of the routing's experts [T, k]: the reference's stable
    argsort (tokens in order within an expert) and the prefix sum of the counts."""
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=number_of_experts)
    offsets = torch.zeros(number_of_experts + 1, dtype=torch.int64, device=flat.device)
    offsets[1:] = torch.cumsum(counts, 0)
    return order.to(torch.int32), offsets.to(torch.int32)


def moe(
    a: MoEAttrs,
    x: torch.Tensor,
    router_weight: torch.Tensor,
    fc_weight: torch.Tensor,
    proj_weight: torch.Tensor,
    *biases: torch.Tensor,
) -> torch.Tensor:
    split_experts(a)
    if a.fp8_inputs or a.int8_inputs:
        raise ValueError(
            f"MoE fp8_inputs {a.fp8_inputs} / int8_inputs {a.int8_inputs}: the kernel has no input quantization yet; "
            "run fp8 and w8a8_sq experts on the reference op (the onnxruntime backend)"
        )
    expected = 2 * a.use_bias + a.router_bias + 2 * a.prequant
    if len(biases) != expected:
        raise ValueError(
            f"MoE: {len(biases)} bias inputs, expected {expected} (use_bias {a.use_bias}, router_bias "
            f"{a.router_bias}, prequant {a.prequant}: its fc and proj 1/s counted with them)"
        )
    prequant = (biases[-2].float().contiguous(), biases[-1].float().contiguous()) if a.prequant else (None, None)
    biases = biases[: len(biases) - 2 * a.prequant]
    fc_bias, proj_bias = (biases[0], biases[1]) if a.use_bias else (None, None)
    t, k, hidden, inter = x.shape[0], a.top_k, a.expert_hidden_size, a.expert_inter_size
    y = torch.zeros(t, hidden, dtype=x.dtype, device=x.device)
    if t == 0:
        return y
    weights, experts = route(a, x, router_weight, biases[-1] if a.router_bias else None)
    assignments, offsets = sort_by_expert(experts, a.number_of_experts)
    h = torch.empty(t * k, inter, dtype=x.dtype, device=x.device)
    out = torch.empty(t * k, hidden, dtype=torch.float32, device=x.device)
    steps = (("fc", x, fc_weight, fc_bias, prequant[0], h), ("proj", h, proj_weight, proj_bias, prequant[1], out))
    for stage, src, w, bias, pre, dst in steps:
        launch_stage(Stage(a, stage), t, src, assignments, offsets, weights, w, bias, pre, dst)
    return out.view(t, k, hidden).sum(1).to(x.dtype)


def launch_stage(
    s: Stage, num_tokens: int, src: torch.Tensor, assignments: torch.Tensor, offsets: torch.Tensor,
    weights: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, pre: torch.Tensor | None, dst: torch.Tensor,
) -> None:  # fmt: skip
    """One launch of `moe_kernel` (one plugin: MoEFc or MoEProj), writing dst: h [T*k, I] or out [T*k, H] fp32."""
    activation = str(src.dtype).removeprefix("torch.")
    check(s, activation)
    consts = {**constexprs(s, activation), "DOT_FP32": dot_fp32(activation)}
    consts.pop("bias", None)
    consts.pop("prequant", None)
    moe_kernel[grid(s, num_tokens)](
        src, assignments, offsets, weights.reshape(-1).contiguous(), w.contiguous(), bias, pre, dst,
        **consts, num_warps=NUM_WARPS, **common.OPTIONS,
    )  # fmt: skip
