"""The import-only methods' graphs and references (fp8_pc_pt, fp8_dynamic, fp8_block, w4a16_gptq) and FP8's
per-part scales of a fused GEMM (issue 28, decision D4): each exported linear computes what the reference's
`fake_linear` (or its dequantized weight) computes on random tensors, and an engine built from a checkpoint in each
layout matches the reference forward (quantize/fake.py) of the same checkpoint.

Tolerances. Each graph quantizes its input with the reference's own float32 arithmetic (the same division, the
same round-to-nearest-even cast, the same saturation), and its DequantizeLinear computes the reference's weight with
one float32 rounding per element as the reference does, so on a given input the two differ only in the GEMM's
summation order: |Δy| ≤ n·u·Σ|x̂_i·w_i| for n terms at float32's unit roundoff u = 2^-24 (the standard bound on a
recursive sum, any order). Whole models differ more: a last-bit difference before a run-time quantizer can move a
code by one step, so there the engine is held to the reference by KLD (tests/prequant/harness.py's gates)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
from models import assert_matches, build, run_alone
from onnx import TensorProto, helper
from safetensors.torch import load_file, save_file

from tests.prequant.harness import agreement, assert_reads_exactly
from toolchain.checkpoint.convert import convert
from toolchain.checkpoint.prequant.codecs import int4_rows_pack
from toolchain.engine.export import _Builder
from toolchain.quantize.core import FP8_E4M3_MAX, fake_quant
from toolchain.quantize.fake import FakeQuant, load_quantized
from toolchain.quantize.methods.base import PARTS, QuantMethod, Stored
from toolchain.quantize.methods.fp8_block import fake_groups
from toolchain.quantize.methods.fp8_pc_pt import fake_dynamic_fp8
from toolchain.quantize.methods.registry import IMPORTED, METHODS
from toolchain.reference.model import ReferenceModel

P = "transformer.layers.0.attention.qkv"
U = 2.0**-24  # float32's unit roundoff
E4M3 = torch.float8_e4m3fn


def _fp8(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (w / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(E4M3)


def _amax_scale(amax: torch.Tensor) -> torch.Tensor:
    return torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax)).float()


# -- first-principles writers of each layout: what a reader (checkpoint/prequant/) hands the engine ---------------


def pc_pt(w: torch.Tensor, parts: list[int] | None, group: int) -> dict[str, torch.Tensor]:
    scale = _amax_scale(w.abs().amax(1))
    return {"weight": _fp8(w, scale[:, None]), "weights_scaling_factor": scale}


def dynamic(w: torch.Tensor, parts: list[int] | None, group: int) -> dict[str, torch.Tensor]:
    if parts is None:
        scale = _amax_scale(w.abs().amax().reshape(1))
        return {"weight": _fp8(w, scale), "weights_scaling_factor": scale}
    scale = torch.stack([_amax_scale(r.abs().amax()) for r in torch.split(w, parts)])
    rows = torch.repeat_interleave(scale, torch.tensor(parts))[:, None]
    return {"weight": _fp8(w, rows), "weights_scaling_factor": scale, PARTS: torch.tensor(parts)}


def block(w: torch.Tensor, parts: list[int] | None, group: int) -> dict[str, torch.Tensor]:
    out, inn = w.shape
    nb_o, nb_i = -(-out // group), -(-inn // group)
    padded = torch.nn.functional.pad(w, (0, nb_i * group - inn, 0, nb_o * group - out))
    amax = padded.reshape(nb_o, group, nb_i, group).abs().amax((1, 3))
    scale = _amax_scale(amax)
    rows = scale.repeat_interleave(group, 0).repeat_interleave(group, 1)[:out, :inn]
    return {"weight": _fp8(w, rows), "weights_scaling_factor": scale}


def gptq(w: torch.Tensor, parts: list[int] | None, group: int, act_order: bool = True) -> dict[str, torch.Tensor]:
    """Asymmetric min/max int4 per group, in act-order: the columns sorted by a random permutation first."""
    out, inn = w.shape
    perm = torch.randperm(inn, generator=torch.Generator().manual_seed(out * inn)) if act_order else None
    stored = w[:, perm] if perm is not None else w
    g = stored.reshape(out, inn // group, group)
    lo, hi = g.amin(2).clamp(max=0), g.amax(2).clamp(min=0)
    scale = torch.where(hi > lo, (hi - lo) / 15, torch.ones_like(hi))
    zero = torch.round(-lo / scale).clamp(0, 15)
    q = torch.round(g / scale[..., None] + zero[..., None]).clamp(0, 15).reshape(out, inn)
    made = {
        "weight": torch.from_numpy(int4_rows_pack(q.to(torch.uint8).numpy())),
        "weights_scaling_factor": scale.float(),
        "weights_zero_point": zero.to(torch.uint8),
    }
    return {**made, "input_perm": perm} if perm is not None else made


def fp8_parts(acts: list[float]) -> Callable[..., dict[str, torch.Tensor]]:
    """FP8 with a per-part weight scale and the given static input scale per part."""

    def make(w: torch.Tensor, parts: list[int] | None, group: int) -> dict[str, torch.Tensor]:
        made = dynamic(w, parts, group)
        act = torch.tensor(acts[: len(parts)] if parts else [max(acts)])
        return {**made, "activation_scaling_factor": act}

    return make


LAYOUTS: dict[str, tuple[Callable[..., dict[str, torch.Tensor]], int]] = {  # method -> (writer, group size)
    "fp8_pc_pt": (pc_pt, 128),
    "fp8_dynamic": (dynamic, 128),
    "fp8_block": (block, 40),  # 40 divides none of 64, 96: partial blocks at every edge
    "w4a16_gptq": (gptq, 16),
    "fp8": (fp8_parts([0.02, 0.05, 0.004]), 128),  # FP8 with per-part static input scales (D4)
}


# -- one linear on ONNX Runtime against the reference -------------------------------------------------------------


def _graph_linear(qm: QuantMethod, s: Stored, x: torch.Tensor) -> np.ndarray:
    b = _Builder(torch.float32)
    y = qm.export_gemm(b, s, "x")
    if y is None:
        x_in, weight = qm.export(b, s, "x")
        y = b.op("Gemm", [x_in, weight], "y", transB=1)
    graph = helper.make_graph(
        b.nodes,
        "linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
        [helper.make_tensor_value_info(y, TensorProto.FLOAT, None)],
        b.initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    got: np.ndarray = session.run(None, {"x": x.numpy()})[0]
    return got


def _reference(qm: QuantMethod, s: Stored, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, the bound n·u·|x̂|·|w|ᵀ on a float32 sum's error) of the reference, x̂ its quantized input."""
    w = qm.dequantize(s)
    y: torch.Tensor | None = qm.fake_linear(s, x, w)
    if y is None:  # the reference's static input treatment (FakeQuant.linear_input): none for w4a16_gptq
        scales = qm.input_scales(s)
        activation = {s.prefix: scales.activation.item()} if scales.activation is not None else {}
        xq = FakeQuant({}, activation, qm.activation_kind, {}, None).linear_input(s.prefix, x)
        y = xq @ w.T
    elif qm.activation_kind == "FP8":  # FP8's parts: each part's rows read the input at the part's own scale
        parts, acts = s[PARTS].tolist(), s["activation_scaling_factor"].tolist()
        bounds = [fake_quant(x, a, "FP8").abs() @ r.abs().T for a, r in zip(acts, torch.split(w, parts), strict=True)]
        return y, x.shape[-1] * U * torch.cat(bounds, -1)
    else:  # a method computing its own linear: its quantized input, through an identity weight (exact)
        xq = qm.fake_linear(s, x, torch.eye(x.shape[-1]))
        assert xq is not None
    return y, x.shape[-1] * U * (xq.abs() @ w.abs().T)


def _inputs(n: int, rows: int = 5) -> torch.Tensor:
    g = torch.Generator().manual_seed(n)
    x = torch.randn(rows, n, generator=g) * torch.logspace(-2, 1, n)  # channels of different sizes
    x[2] = 0  # an all-zero token: a dynamic scale of 0 must not give NaN
    return x


CASES = [(name, None) for name in LAYOUTS] + [("fp8_dynamic", [24, 8, 8]), ("fp8", [24, 8, 8])]


@pytest.mark.parametrize(("name", "parts"), CASES)
def test_exported_linear_equals_the_reference(name: str, parts: list[int] | None) -> None:
    write, group = LAYOUTS[name]
    qm = IMPORTED.get(name) or METHODS[name]
    w = torch.randn(40, 48, generator=torch.Generator().manual_seed(1)) * torch.logspace(-1, 0, 48)
    w[3] = 0  # an all-zero output row
    made = write(w, parts, group)
    s = Stored(P, {f"{P}.{k}": v for k, v in made.items()}, 48, group)
    for x in (_inputs(48), torch.zeros(3, 48)):  # all zeros: a per-tensor dynamic scale of 0
        got = _graph_linear(qm, s, x)
        want, bound = _reference(qm, s, x)
        assert np.isfinite(got).all() and torch.isfinite(want).all()
        assert (np.abs(got - want.numpy()) <= bound.numpy()).all()
        assert (got[2] == 0).all() and (want[2] == 0).all()  # the all-zero token


def test_dynamic_fp8_is_within_half_a_step_and_reaches_448() -> None:
    """The run-time quantizer from first principles: each token's largest |x| maps to ±448 (its scale is
    max|x| / 448), every value is within half an E4M3 step of itself (2^-4 relative for normals, half the smallest
    subnormal 2^-10 times the scale below), and a row of zeros stays zeros."""
    x = _inputs(64)
    xq = fake_dynamic_fp8(x, (-1,))
    scale = (x.abs().amax(-1, keepdim=True) / FP8_E4M3_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    assert ((xq - x).abs() <= x.abs() * 2**-4 + scale * 2**-10).all()
    assert torch.equal(xq.abs().amax(-1), x.abs().amax(-1))  # 448 · scale is the max itself (or 0)
    assert torch.equal(xq[2], torch.zeros(64))
    grouped = fake_groups(x, 40)  # 64 = 40 + a partial group of 24, each with its own scale
    for cols in (slice(0, 40), slice(40, 64)):
        assert torch.equal(grouped[:, cols], fake_dynamic_fp8(x[:, cols], (-1,)))


# -- whole models: an engine built from each layout against the reference forward of the same checkpoint ------

LINEARS = ("attention.qkv", "attention.dense", "mlp.fc", "mlp.gate", "mlp.proj")


@pytest.fixture(scope="module")
def float_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from conftest import save_random_llama

    root = tmp_path_factory.mktemp("import")
    convert(save_random_llama(root / "hf"), root / "float")
    return root / "float"


def write_quantized(src: Path, dst: Path, algo: str, write: Callable[..., dict[str, torch.Tensor]], group: int) -> Path:
    """Every decoder linear of the float checkpoint `src` in `write`'s layout, as a reader would leave it: q/k/v's
    rows as three parts where the layout has per-part scales."""
    cfg = json.loads((src / "config.json").read_text())
    heads, kv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_size"]
    w = load_file(str(src / "rank0.safetensors"))
    for i in range(cfg["num_hidden_layers"]):
        for linear in LINEARS:
            prefix = f"transformer.layers.{i}.{linear}"
            parts = [heads * d, kv * d, kv * d] if linear == "attention.qkv" else None
            made = write(w.pop(f"{prefix}.weight"), parts, group)
            w.update({f"{prefix}.{k}": v.contiguous() for k, v in made.items()})
    dst.mkdir()
    save_file(w, str(dst / "rank0.safetensors"))
    cfg["quantization"] = {**cfg["quantization"], "quant_algo": algo, "group_size": group}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _engine_and_reference(ckpt: Path, out: Path, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    ref = load_quantized(ckpt).forward(torch.tensor([ids]))[0].detach().numpy()
    return run_alone(build(ckpt, out), ids), ref


@pytest.mark.parametrize("name", ["fp8_pc_pt", "fp8_dynamic", "fp8_block", "w4a16_gptq"])
def test_engine_matches_the_reference(name: str, float_ckpt: Path, tmp_path: Path) -> None:
    write, group = LAYOUTS[name]
    ckpt = write_quantized(float_ckpt, tmp_path / "q", IMPORTED[name].quant_algo, write, group)
    ids = torch.randint(0, 97, (24,), generator=torch.Generator().manual_seed(2)).tolist()
    got, want = _engine_and_reference(ckpt, tmp_path / "engine", ids)
    full = ReferenceModel.from_checkpoint(float_ckpt).forward(torch.tensor([ids]))[0].detach().numpy()
    ours, cost = agreement(want, got), agreement(full, want)
    assert np.isfinite(got).all()
    assert_reads_exactly(ours, weight_only=name == "w4a16_gptq")
    if name == "w4a16_gptq":  # weights only: nothing quantized at run time, the float32 engine bound
        assert_matches(got, want)
    # the check can fail: quantization itself moved the logits far more than the engine's reading does
    assert cost.p95 > 1e3 * max(ours.p95, 1e-12), (ours.line(), cost.line())


def test_fp8_per_part_input_scales_are_kept(float_ckpt: Path, tmp_path: Path) -> None:
    """A checkpoint whose q, k and v have their own input (and weight) scales builds, its engine matches the
    reference that quantizes each part's input at its own scale, and both differ from the same checkpoint
    requantized to the largest scales (one Q/DQ, one weight scale: what TensorRT-LLM's fused-qkv loader does)."""
    acts = [0.01, 0.02, 0.04]
    parts = write_quantized(float_ckpt, tmp_path / "parts", "FP8", fp8_parts(acts), 128)
    maxed = write_quantized(float_ckpt, tmp_path / "max", "FP8", lambda w, p, g: fp8_parts(acts)(w, None, g), 128)
    stored = load_file(str(parts / "rank0.safetensors"))
    assert stored[f"{P}.activation_scaling_factor"].tolist() == pytest.approx(acts)
    assert stored[f"{P}.{PARTS}"].tolist() == [64, 16, 16]
    ids = torch.randint(0, 97, (24,), generator=torch.Generator().manual_seed(3)).tolist()
    got, want = _engine_and_reference(parts, tmp_path / "engine", ids)
    got_max, want_max = _engine_and_reference(maxed, tmp_path / "engine-max", ids)
    ours, requantized = agreement(want, got), agreement(want, want_max)
    assert_reads_exactly(ours, weight_only=False)
    assert_reads_exactly(agreement(want_max, got_max), weight_only=False)  # our fp8 path, unchanged
    assert requantized.mean > 1e3 * max(ours.mean, 1e-12), (ours.line(), requantized.line())
    assert agreement(want_max, got).mean > 1e3 * max(ours.mean, 1e-12)
