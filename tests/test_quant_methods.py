"""The quantization-method registry: every method's plan, quantize, dequantize and export agree with each other on
tiny tensors, the CLI's and the recipe's choices are the registry's, and a quant_algo it does not hold is refused."""

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
from toolchain.quantize.fake import load_quantized
from toolchain.quantize.methods import KV_CACHE_NAMES, METHOD_NAMES
from toolchain.quantize.methods.base import Context
from toolchain.quantize.methods.registry import METHODS, by_algo
from toolchain.quantize.stage import QuantizeOptions, quantize_checkpoint
from toolchain.recipe import QuantizeSection

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


@pytest.mark.parametrize("name", METHOD_NAMES)
def test_method_round_trips(name: str) -> None:
    qm, ctx, w = METHODS[name], _ctx(), _weight()
    prepared = _prepared(name, w)
    made = qm.quantize(PREFIX, w, ctx, prepared)
    plan = qm.plan(PREFIX, (OUT, IN), ctx)
    assert {n: (i.dtype, i.shape) for n, i in plan.items()} == {n: (t.dtype, tuple(t.shape)) for n, t in made.items()}

    codes, scale = made[f"{PREFIX}.weight"], made[f"{PREFIX}.weights_scaling_factor"].float()
    back = qm.dequantize(codes, scale, IN)
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
    dq = qm.export(b, PREFIX, codes, scale, IN, GROUP)
    y = b.op("Gemm", ["x", dq], "y", transB=1)
    graph = helper.make_graph(
        b.nodes,
        "method",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, IN])],
        [helper.make_tensor_value_info(y, TensorProto.FLOAT, [3, OUT])],
        b.initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    x = torch.randn(3, IN, generator=torch.Generator().manual_seed(1))
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {"x": x.numpy()})
    np.testing.assert_allclose(got, (x @ back.T).numpy(), rtol=1e-5, atol=1e-5)


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
    assert KV_CACHE_NAMES == ("none", "int8", "fp8")
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
    with pytest.raises(UserError, match=r"kv_cache_quant_algo 'INT2' is not supported; supported: INT8, FP8"):
        load_quantized(tmp_path / "q")
