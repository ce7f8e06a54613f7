"""The Triton MoE experts kernel (toolchain/plugins/kernels/moe.py), run by Triton's interpreter, against the
reference op `ops.moe` on the same inputs.

Activations fp32 / fp16 / bf16; experts 1 to 9, top_k 1 to E; hidden and intermediate sizes that are not powers of
two and pass one 64-column tile; gated and plain experts, silu / gelu / relu, biases, a router bias, every router
norm; per-expert prequant vectors (AWQ / SmoothQuant experts); one token; an expert no token chose, its weights
all NaN (its programs must not read them). The truth is the reference op in float64 (same routing: the router
reads x in float32 either way); the tolerance is a bound derived from the dtype's unit roundoff (`bound`)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import torch

from toolchain import seeded
from toolchain.engine.ops import MOE_OP, MoEAttrs, route
from toolchain.engine.ops import moe as reference
from toolchain.plugins.kernels import moe as kernel
from toolchain.reference.model import ACTIVATIONS

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
UNIT = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}  # unit roundoff
# The largest |act'(x)|: silu's is 1.0998 (at x = 2.40), tanh-gelu's 1.129 (at x = 2.42), relu's 1.
SLOPE = 1.2


class Case(NamedTuple):
    activation: str
    experts: int
    top_k: int
    hidden: int
    inter: int
    tokens: int
    gated: int = 1
    act: str = "silu"
    bias: int = 0
    router_bias: int = 0
    norm: str = "softmax_topk"
    swiglu: tuple[float, float, float] = (1.0, 0.0, 0.0)  # gpt-oss's (alpha, beta, limit); these: plain silu
    prequant: int = 0  # AWQ / SmoothQuant experts: each expert's 1/s multiplies its A tile (fc's x, proj's h)


# Not the cross product: every value of every axis appears, each kernel path at least once.
CASES = [
    Case("float32", 4, 2, 24, 40, 5),
    Case("float32", 3, 3, 96, 20, 1, act="gelu", bias=1, norm="topk_softmax"),  # top_k = E, one token
    Case("float32", 5, 1, 40, 72, 7, gated=0, act="relu", norm="softmax_topk_renormalise"),
    Case("float16", 8, 2, 72, 24, 9, bias=1, router_bias=1, norm="topk_softmax"),
    Case("float16", 6, 3, 32, 48, 17, act="gelu", norm="softmax_topk_renormalise"),  # 17 tokens: two M tiles
    Case("float16", 2, 2, 16, 16, 1, gated=0, act="silu"),  # top_k = E, one token
    Case("bfloat16", 9, 2, 80, 36, 6, norm="softmax_topk_renormalise"),
    Case("bfloat16", 4, 1, 48, 100, 4, gated=0, act="gelu", bias=1),
    Case("bfloat16", 3, 2, 24, 16, 3, act="relu", router_bias=1),
    # gpt-oss: the clamped SwiGLU with a limit the O(1) pre-activations cross, biases, router bias, topk_softmax
    Case("float32", 4, 2, 24, 40, 5, bias=1, router_bias=1, norm="topk_softmax", swiglu=(1.702, 1.0, 0.5)),
    Case("float16", 6, 3, 32, 48, 17, bias=1, router_bias=1, norm="topk_softmax", swiglu=(1.702, 1.0, 0.5)),
    # AWQ / SmoothQuant experts: the per-expert prequant vectors on the A tiles, each dtype, two M tiles, biases
    Case("float32", 4, 2, 24, 40, 5, prequant=1),
    Case("float16", 6, 3, 32, 48, 17, bias=1, router_bias=1, prequant=1),
    Case("bfloat16", 9, 2, 80, 36, 6, gated=0, act="gelu", prequant=1),
]


class Inputs(NamedTuple):
    attrs: MoEAttrs
    x: torch.Tensor
    router: torch.Tensor
    fc: torch.Tensor
    proj: torch.Tensor
    biases: tuple[torch.Tensor, ...]
    prequant: tuple[torch.Tensor, ...] = ()  # fc's [E, hidden] and proj's [E, inter] 1/s (float32), when prequant


def make(case: Case, seed: int) -> Inputs:
    a = MoEAttrs(
        case.experts, case.top_k, case.hidden, case.inter, case.norm, case.act, case.gated, case.bias, case.router_bias,
        *case.swiglu, prequant=case.prequant,
    )  # fmt: skip
    gen, dtype, e, h, i = seeded.generator(seed), DTYPES[case.activation], case.experts, case.hidden, case.inter
    x = seeded.normal((case.tokens, h), gen, dtype=dtype)
    router = seeded.normal((e, h), gen, std=h**-0.5)  # float32, as converted
    fc = seeded.normal((e, a.fc_rows, h), gen, std=h**-0.5, dtype=dtype)
    proj = seeded.normal((e, h, i), gen, std=i**-0.5, dtype=dtype)
    biases: list[torch.Tensor] = []
    if case.bias:
        biases += [seeded.normal((e, a.fc_rows), gen, std=0.5, dtype=dtype), seeded.normal((e, h), gen, dtype=dtype)]
    if case.router_bias:
        biases.append(seeded.normal((e,), gen, std=0.5))
    # 1/s in [0.5, 1.5): AWQ's and SmoothQuant's scales are centred near 1
    prequant = tuple(seeded.normal((e, n), gen, std=0.25).abs() + 0.5 for n in (h, i)) if case.prequant else ()
    return Inputs(a, x, router, fc, proj, tuple(biases), prequant)


def truth(x: Inputs) -> torch.Tensor:
    """The reference op in float64 on the same values (the routing is the same: route reads x.float())."""
    wide = (t.double() for t in (*x.biases, *x.prequant))
    return reference(x.attrs, x.x.double(), x.router, x.fc.double(), x.proj.double(), *wide)


def bound(x: Inputs) -> torch.Tensor:
    """Per element, how far the kernel may be from the float64 truth, from the standard rounding-error bounds
    (|fl(sum of n products) - exact| <= n u sum|products|, u = 2**-24 for the fp32 accumulators; rounding to the
    dtype: u of the dtype times the value): the fc GEMM's errors in up and gate, through up * act(gate) (|act'| <=
    SLOPE), plus h rounded to the dtype; through the proj GEMM with its own accumulation error; the weighted sum
    over top_k in fp32; y rounded to the dtype. With prequant, each A element times its 1/s is rounded to the dtype
    once more before its GEMM (x·p and h·p: u of the dtype times |x·p|, |h·p|)."""
    a, u, u32 = x.attrs, UNIT[x.x.dtype], 2.0**-24
    weights, experts = route(a, x.x, x.router, x.biases[-1] if a.router_bias else None)
    act = ACTIVATIONS[a.activation]
    xs = x.x.double()
    fc_bias, proj_bias = (x.biases[0].double(), x.biases[1].double()) if a.use_bias else (None, None)
    total = torch.zeros(xs.shape, dtype=torch.float64)
    for t in range(xs.shape[0]):
        for j in range(a.top_k):
            e, w = int(experts[t, j]), float(weights[t, j])
            fc, proj = x.fc[e].double(), x.proj[e].double()
            xt = xs[t] * x.prequant[0][e].double() if a.prequant else xs[t]
            pre = fc @ xt + (0 if fc_bias is None else fc_bias[e])
            mag = fc.abs() @ xt.abs() + (0 if fc_bias is None else fc_bias[e].abs())
            err_pre = (a.expert_hidden_size + 1) * u32 * mag  # + 1: the bias add
            if a.prequant:  # x·p rounded to the dtype
                err_pre = err_pre + u * fc.abs() @ xt.abs()
            if a.gated:
                up, gate = pre.chunk(2)
                err_up, err_gate = err_pre.chunk(2)
                if a.clamped_swiglu:  # clamps are 1-Lipschitz; d/dg g sigmoid(alpha g) is silu's slope at alpha g
                    limit = a.swiglu_limit or math.inf
                    up = up.clamp(-limit, limit) + a.swiglu_beta
                    gate = gate.clamp(max=limit)
                    sg = gate * torch.sigmoid(a.swiglu_alpha * gate)
                else:
                    sg = act(gate)
                h = up * sg
                err_h = sg.abs() * err_up + (up.abs() + err_up) * SLOPE * err_gate
            else:
                h, err_h = act(pre), SLOPE * err_pre
            err_h = err_h + u * (h.abs() + err_h)  # stored in the dtype
            if a.prequant:  # h·p, rounded to the dtype again
                p = x.prequant[1][e].double()
                h, err_h = h * p, err_h * p
                err_h = err_h + u * (h.abs() + err_h)
            y_mag = proj.abs() @ (h.abs() + err_h) + (0 if proj_bias is None else proj_bias[e].abs())
            err_y = proj.abs() @ err_h + (a.expert_inter_size + 2) * u32 * y_mag  # + 2: bias, router weight
            total[t] += w * (err_y + a.top_k * u32 * y_mag)  # the fp32 sum over top_k
    return total + u * (truth(x).abs() + total)  # y rounded to the dtype


def run(x: Inputs) -> torch.Tensor:
    return kernel.moe(x.attrs, x.x, x.router, x.fc, x.proj, *x.biases, *x.prequant)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.activation}-E{c.experts}k{c.top_k}-{c.hidden}x{c.inter}")
def test_the_kernel_computes_the_reference_op(case: Case) -> None:
    x = make(case, seed=CASES.index(case))
    got, want, tol = run(x), truth(x), bound(x)
    assert got.dtype == x.x.dtype and got.shape == want.shape
    err = (got.double() - want).abs()
    assert torch.isfinite(got).all() and (err <= tol).all(), (err.max().item(), (err / tol).max().item())
    # the float32 reference op too: the engine's own output, within the same bound doubled (both are off the truth)
    ref = reference(x.attrs, x.x, x.router, x.fc, x.proj, *x.biases, *x.prequant).double()
    assert ((got.double() - ref).abs() <= 2 * tol).all()


@pytest.mark.parametrize("activation", list(DTYPES))
def test_an_expert_no_token_chose_is_never_read(activation: str) -> None:
    """8 experts, 2 tokens x top 2: at least 4 experts get no token; their fc, proj and biases are NaN. A program
    that read them (a wrong expert offset, a tile past its expert's count) would put NaN into y."""
    x = make(Case(activation, 8, 2, 40, 24, 2, bias=1), seed=99)
    _, experts = route(x.attrs, x.x, x.router)
    idle = sorted(set(range(8)) - set(experts.flatten().tolist()))
    assert len(idle) >= 4
    for tensor in (x.fc, x.proj, *x.biases):
        tensor[idle] = float("nan")
    got = run(x)
    assert torch.isfinite(got).all()
    assert ((got.double() - truth(x)).abs() <= bound(x)).all()


def test_the_assignments_are_sorted_by_expert_as_the_reference_sorts_them() -> None:
    experts = torch.tensor([[2, 0], [0, 3], [3, 2], [0, 1]])
    assignments, offsets = kernel.sort_by_expert(experts, 5)
    assert assignments.tolist() == [1, 2, 6, 7, 0, 5, 3, 4]  # expert 0: token 0's j=1, token 1's j=0, token 3's j=0
    assert offsets.tolist() == [0, 3, 4, 6, 8, 8] and assignments.dtype == offsets.dtype == torch.int32


def test_the_grid_covers_every_expert_and_column_tile() -> None:
    a = MoEAttrs(128, 8, 2048, 768)
    assert kernel.grid(kernel.Stage(a, "fc"), 1) == (128, 1, 768 // 64)
    assert kernel.grid(kernel.Stage(a, "proj"), 33) == (128, 3, 2048 // 64)


def test_refusals_name_the_value() -> None:
    a = MoEAttrs(4, 2, 16, 16)
    with pytest.raises(ValueError, match="activation dtype 'float64' has no kernel; choose one of float32"):
        kernel.check(kernel.Stage(a, "fc"), "float64")
    with pytest.raises(ValueError, match="MoE stage 'down': expected one of fc, proj"):
        kernel.check(kernel.Stage(a, "down"), "float16")
    x = make(Case("float32", 4, 2, 16, 16, 1), seed=0)
    with pytest.raises(ValueError, match="MoE: 1 bias inputs, expected 0"):
        kernel.moe(x.attrs, x.x, x.router, x.fc, x.proj, x.router[0])
    sq = MoEAttrs(4, 2, 16, 16, int8_inputs=1, prequant=1)
    with pytest.raises(ValueError, match="int8_inputs 1: the kernel has no input quantization yet"):
        kernel.moe(sq, x.x, x.router, x.fc, x.proj, *[x.router[0]] * 2, x.fc[:, 0], x.proj[:, 0])


@pytest.mark.slow
@pytest.mark.parametrize("case", ["mixtral-top2-of-8", "qwen3-moe-unnormalised-step2", "gpt-oss-every-feature"])
def test_the_kernel_drives_a_moe_model_as_the_reference_op_does(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CPU engine with its MoE op swapped for the kernel (run by the interpreter), layer after layer, against
    the same engine on the reference op: fp32 logits within 1e-4 of their scale, the same top-1 everywhere."""
    from models import build, run_alone, save_case

    from toolchain.checkpoint.convert import convert
    from toolchain.engine import ort_backend

    convert(save_case(tmp_path / "hf", case), tmp_path / "ckpt")
    engine = build(tmp_path / "ckpt", tmp_path / "engine")
    ids = torch.randint(0, int(engine.spec.vocab_size), (19,), generator=torch.Generator().manual_seed(3)).tolist()
    want = run_alone(engine, ids)
    calls: list[MoEAttrs] = []

    def moe(a: MoEAttrs, *inputs: torch.Tensor, memo: object = None) -> torch.Tensor:
        calls.append(a)
        return kernel.moe(a, *inputs)

    monkeypatch.setitem(ort_backend.OPS, MOE_OP, moe)
    got = run_alone(engine, ids)
    assert calls  # every sparse layer ran the kernel
    scale = float(np.abs(want).max())
    assert np.abs(got - want).max() <= 1e-4 * scale, (np.abs(got - want).max(), scale)
    assert (got.argmax(-1) == want.argmax(-1)).all()
