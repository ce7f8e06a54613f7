"""MXFP8 (quantize/methods/mxfp8.py): per-32 E8M0 block scales, the weights byte-identical to ModelOpt's
`MXFP8QTensor` (computed by ModelOpt in a subprocess); the graph is TensorRT's trt::TRT_MXFP8* form, valid ONNX, and
the CPU engine's lowering of it computes what the reference forward computes."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from bench.quality_modelopt import modelopt_python
from tests.models import build, run_alone
from tests.quantize.test_nvfp4 import nvfp4_checkpoint
from toolchain.quantize.fake import load_quantized
from toolchain.quantize.methods.base import Context, Stored
from toolchain.quantize.methods.mxfp8 import mxfp8_qdq, mxfp8_quantize
from toolchain.quantize.methods.registry import METHODS

WORKER = """
import sys, numpy as np, torch
from modelopt.torch.quantization.qtensor.mxfp8_tensor import MXFP8QTensor
d = sys.argv[1]
q, s = MXFP8QTensor.quantize(torch.from_numpy(np.load(f"{d}/w.npy")))
np.save(f"{d}/codes.npy", q._quantized_data.view(torch.uint8).numpy())
np.save(f"{d}/scales.npy", s.numpy())
"""


def _weight() -> torch.Tensor:
    w = torch.randn(16, 128, generator=torch.Generator().manual_seed(0)) * torch.logspace(-4, 2, 128)
    w[1] = 0
    w[2, :32] = 448.0 * 2.0**-3 * 1.01  # amax just past a power of two times 448: the larger exponent, no clipping
    return w


@pytest.mark.slow  # ModelOpt's import: ~15 s
def test_weights_are_modelopt_mxfp8qtensor(tmp_path: Path) -> None:
    python, why = modelopt_python()
    if python is None:
        pytest.skip(why)
    w = _weight()
    np.save(tmp_path / "w.npy", w.numpy())
    subprocess.run([python, "-c", WORKER, str(tmp_path)], check=True, capture_output=True, timeout=300)
    made = METHODS["mxfp8"].quantize("p", w, Context())
    assert np.array_equal(made["p.weight"].view(torch.uint8).numpy(), np.load(tmp_path / "codes.npy"))
    assert np.array_equal(made["p.weights_scaling_factor"].numpy(), np.load(tmp_path / "scales.npy"))


def test_scales_are_powers_of_two_rounded_up() -> None:
    codes, scales = mxfp8_quantize(_weight())
    assert scales[2, 0] == 127 - 3 + 1  # 448 · 2^-3 · 1.01 needs 2^-2: E4M3 never saturates
    assert scales[1].tolist() == [0] * 4  # an all-zero block: 2^-127
    back = METHODS["mxfp8"].dequantize(Stored("p", {"p.weight": codes, "p.weights_scaling_factor": scales}, 128, 128))
    w = _weight()
    rel = ((back - w).abs() / w.abs().clamp_min(1e-30))[w.abs() > w.abs().amax(1, keepdim=True) * 2**-6]
    assert rel.max() <= 2**-4  # 3 mantissa bits: half a step is 2^-4 of the value (normal range)
    x = torch.randn(3, 64) * 5
    assert torch.equal(mxfp8_qdq(x), mxfp8_qdq(mxfp8_qdq(x)))  # a fixed point: the scales are the same again


@pytest.mark.slow  # the engine build: ~4 s
def test_engine_computes_the_reference_forward_in_tensorrts_form(tmp_path: Path) -> None:
    q = nvfp4_checkpoint(tmp_path, "mxfp8")
    ids = list(range(3, 40))
    got = run_alone(build(q, tmp_path / "engine"), ids)
    with torch.no_grad():
        want = load_quantized(q).forward(torch.tensor([ids]))[0].numpy()
    assert np.abs(got - want).max() < 1e-5  # float32 sums in another order, no E4M3 rounding flipped
    assert (got.argmax(-1) == want.argmax(-1)).all()
    model = onnx.load(str(tmp_path / "engine" / "model.onnx"))
    onnx.checker.check_model(model, full_check=True)
    types = {(n.domain, n.op_type) for n in model.graph.node}
    assert {("trt", "TRT_MXFP8DynamicQuantize"), ("trt", "TRT_MXFP8DequantizeLinear")} <= types
    assert ("", "DequantizeLinear") not in types and ("", "QuantizeLinear") not in types  # never per-tensor FP8
    assert model.ir_version == 10 and ("", 21) in {(o.domain, o.version) for o in model.opset_import}
