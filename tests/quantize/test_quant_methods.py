"""The quantization-method registry: every method's plan, quantize, dequantize and export agree with each other on
tiny tensors and touch only the tensor names the method declares, every method declares the group sizes it accepts,
the CLI's and the recipe's choices are the registry's, and a quant_algo it does not hold is refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
import torch
from conftest import one_line_error
from onnx import TensorProto, helper

from toolchain.checkpoint.convert import convert
from toolchain.engine.export import _Builder
from toolchain.errors import UserError
from toolchain.quantize.awq import AwqChoice
from toolchain.quantize.calibrate import Calibration
from toolchain.quantize.core import FP8_E4M3_MAX
from toolchain.quantize.fake import FakeQuant, load_quantized
from toolchain.quantize.methods import KV_CACHE_NAMES, METHOD_NAMES
from toolchain.quantize.methods.base import PREQUANT, WEIGHT_SCALE, Context, Stored
from toolchain.quantize.methods.registry import METHODS, by_algo
from toolchain.quantize.stage import QuantizeOptions, quantize_checkpoint
from toolchain.recipe import QuantizeSection

# The methods whose input is a static per-tensor treatment and whose weights take any width: the block-scaled ones
# (nvfp4, mxfp8: dynamic per-block inputs, widths of whole blocks) and w4a8_awq have their own test files.
STATIC = tuple(n for n in METHOD_NAMES if n not in ("nvfp4", "mxfp8", "w4a8_awq"))
PREFIX = "transformer.layers.0.mlp.proj"
OUT, IN, GROUP = 6, 40, 16  # IN is not a multiple of GROUP: int4 pads to 48 and the graph cuts back to 40


def _weight() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(OUT, IN, generator=g) * torch.logspace(-2, 0, IN)  # channels of different sizes
    w[1] = 0  # an all-zero output channel: scale 1, exact zeros
    return w


def _prepared(name: str, w: torch.Tensor) -> Any:
    """What the method's per-layer preparation hands `quantize` (an AWQ choice: a scale vector and no clipping)."""
    if name != "w4a16_awq":
        return None
    s = torch.linspace(0.5, 2.0, IN, dtype=torch.float64)
    return AwqChoice(s, torch.ones(OUT, -(-IN // GROUP)), 0.5, 1.0)


def _ctx() -> Context:
    calib = Calibration()
    calib.input_amax[PREFIX] = 3.0
    return Context(group_size=GROUP, dtype=torch.float32, calib=calib)


@pytest.mark.parametrize("name", STATIC)
def test_method_round_trips(name: str) -> None:
    qm, ctx, w = METHODS[name], _ctx(), _weight()
    prepared = _prepared(name, w)
    made = qm.quantize(PREFIX, w, ctx, prepared)
    plan = qm.plan(PREFIX, (OUT, IN), ctx)
    assert {n: (i.dtype, i.shape) for n, i in plan.items()} == {n: (t.dtype, tuple(t.shape)) for n, t in made.items()}

    assert set(made) <= set(qm.tensor_names(PREFIX)) and f"{PREFIX}.{WEIGHT_SCALE}" in made

    read = _Reads(made)
    scale = made[f"{PREFIX}.weights_scaling_factor"].float()
    back = qm.dequantize(Stored(PREFIX, read, IN, GROUP))
    target = w if prepared is None else (w.double() * prepared.scale).float()  # AWQ stores W·diag(s)
    assert back.shape == (OUT, IN) and torch.equal(back[1], torch.zeros(IN))
    error = (back - target).abs()
    if qm.activation_kind == "FP8":  # 3 mantissa bits: half a step is 2^-4 of the value, subnormals 2^-10 · scale
        assert (error <= target.abs() * 2**-4 + scale * 2**-10 + 1e-7).all()
    elif scale.dim() == 2:  # int4 per group: within half a step of each value's own group
        steps = scale.repeat_interleave(GROUP, dim=1)[:, :IN]
        assert (error <= steps / 2 + 1e-7).all()
    else:  # int8 per output channel
        assert (error <= scale[:, None] / 2 + 1e-7).all()
    if qm.activation_kind:
        bound = 127 if qm.activation_kind == "INT8" else FP8_E4M3_MAX
        assert made[f"{PREFIX}.activation_scaling_factor"].item() == pytest.approx(3.0 / bound)

    # the graph's DequantizeLinear pattern computes the same weight: x · backᵀ on ONNX Runtime
    b = _Builder(torch.float32)
    dq = qm.export_weight(b, Stored(PREFIX, read, IN, GROUP))
    x = torch.randn(3, IN, generator=torch.Generator().manual_seed(1))
    np.testing.assert_allclose(_run(b, "x", dq, x), (x @ back.T).numpy(), rtol=1e-5, atol=1e-5)
    assert read.names <= set(qm.tensor_names(PREFIX))  # a method reads its own tensors only


class _Reads(dict[str, torch.Tensor]):
    """A checkpoint's tensors, remembering which ones were read."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        super().__init__(tensors)
        self.names: set[str] = set()

    def __getitem__(self, name: str) -> torch.Tensor:
        self.names.add(name)
        return super().__getitem__(name)


def _run(b: _Builder, x: str, weight: str, value: torch.Tensor) -> Any:
    """x · weightᵀ of the graph `b` built, on ONNX Runtime, for x = `value`."""
    y = b.op("Gemm", [x, weight], "y", transB=1)
    graph = helper.make_graph(
        b.nodes,
        "method",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(value.shape))],
        [helper.make_tensor_value_info(y, TensorProto.FLOAT, [value.shape[0], OUT])],
        b.initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": value.numpy()})[0]


@pytest.mark.parametrize("name", STATIC)
def test_engine_and_reference_read_the_input_alike(name: str) -> None:
    """The whole exported linear (input side and weight) computes what the reference does with the method's
    dequantized weight and input scales (FakeQuant), on the tensors a checkpoint stores."""
    qm, ctx, w = METHODS[name], _ctx(), _weight()
    stored = qm.quantize(PREFIX, w, ctx, _prepared(name, w))
    if qm.pre_quant_scale:  # `prepare`'s (SmoothQuant) or quantize's (AWQ) 1/s
        stored[f"{PREFIX}.{PREQUANT}"] = torch.linspace(0.5, 2.0, IN)
    read = _Reads(stored)
    linear = Stored(PREFIX, read, IN, GROUP)
    b = _Builder(torch.float32)
    x_out, weight = qm.export(b, linear, "x")
    x = torch.randn(3, IN, generator=torch.Generator().manual_seed(1))
    got = _run(b, x_out, weight, x)

    scales = qm.input_scales(linear)
    assert (scales.prequant is not None) == qm.pre_quant_scale
    assert (scales.activation is not None) == (qm.activation_kind is not None)
    activation = {PREFIX: scales.activation.item()} if scales.activation is not None else {}
    prequant = {PREFIX: scales.prequant} if scales.prequant is not None else {}
    hooks = FakeQuant(prequant, activation, qm.activation_kind, {}, None)
    want = hooks.linear_input(PREFIX, x) @ qm.dequantize(linear).T
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-5)
    assert read.names == set(stored) and set(stored) <= set(qm.tensor_names(PREFIX))


@pytest.mark.parametrize("name", METHOD_NAMES)
def test_group_sizes_are_the_methods(name: str) -> None:
    """Each method declares the group sizes it accepts; QuantizeOptions refuses any other, naming them."""
    sizes = METHODS[name].group_sizes
    assert sizes and all(isinstance(g, int) and g > 0 for g in sizes)
    for g in sizes:
        assert QuantizeOptions(name, group_size=g).group_size == g
    for g in (0, 48, max(sizes) * 2):
        if g not in sizes:
            with pytest.raises(UserError, match=rf"^group size {g} is not supported; choose one of \({sizes[0]}, "):
                QuantizeOptions(name, group_size=g)


def test_choices_are_the_registrys(cli: Any) -> None:
    assert tuple(METHODS) == METHOD_NAMES and {by_algo(m.quant_algo) for m in METHODS.values()} == set(METHODS.values())
    help_text = cli("quantize", "--help").stdout
    assert all(name in help_text for name in METHOD_NAMES)
    for name in METHOD_NAMES:
        assert QuantizeSection(method=name).method == name
    with pytest.raises(ValueError, match="must be one of w8a16"):
        QuantizeSection(method="int3")
    with pytest.raises(ValueError, match="must be one of none, int8, fp8"):
        QuantizeSection(method="fp8", kv_cache="int4")
    assert KV_CACHE_NAMES == ("none", "int8", "fp8", "nvfp4")
    with pytest.raises(UserError, match="method 'int3' is not supported; choose one of w8a16"):
        QuantizeOptions("int3")


def test_unknown_quant_algo_is_one_line(cli: Any, make_llama: Any, tmp_path: Path) -> None:
    convert(make_llama(), tmp_path / "ckpt")
    quantize_checkpoint(tmp_path / "ckpt", tmp_path / "q", QuantizeOptions("w8a16", group_size=32))
    config = tmp_path / "q" / "config.json"
    data = json.loads(config.read_text())
    data["quantization"]["quant_algo"] = "W3A7_MADE_UP"
    config.write_text(json.dumps(data))
    line = one_line_error(cli("build", tmp_path / "q", "-o", tmp_path / "engine", "--backend", "onnxruntime"))
    assert "quantization.quant_algo 'W3A7_MADE_UP' is not supported" in line and "W8A16, W4A16" in line
    assert not (tmp_path / "engine").exists()
    with pytest.raises(UserError, match=r"config.json: quantization.quant_algo 'W3A7_MADE_UP'"):
        load_quantized(tmp_path / "q")
    data["quantization"] |= {"quant_algo": "W8A16", "kv_cache_quant_algo": "INT2"}
    config.write_text(json.dumps(data))
    with pytest.raises(UserError, match=r"kv_cache_quant_algo 'INT2' is not supported; supported: INT8, FP8, NVFP4"):
        load_quantized(tmp_path / "q")
