"""W4A8_AWQ (quantize/methods/w4a8_awq.py): the dequantized weight is ModelOpt's fake-quant weight (int4 per group,
then its FP8 stage at weight_scale_2), measured on ModelOpt itself in a subprocess; the engine graph computes what the
reference forward does."""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import save_random_llama
from safetensors.torch import save_file

from bench.quality_modelopt import modelopt_python
from tests.models import build, run_alone
from toolchain.checkpoint.convert import convert
from toolchain.checkpoint.spec import spec_of
from toolchain.checkpoint.trtllm import load_rank, rank_file, read_config, write_config
from toolchain.quantize.awq import AwqChoice
from toolchain.quantize.calibrate import Calibration
from toolchain.quantize.core import pack_int4
from toolchain.quantize.fake import load_quantized
from toolchain.quantize.methods.base import Context, Stored
from toolchain.quantize.methods.registry import METHODS

# ModelOpt's W4A8_AWQ_BETA_CFG (max calibration: the question is the forward's arithmetic) on one CPU Linear
WORKER = """
import copy, sys, numpy as np, torch
import modelopt.torch.quantization as mtq
from modelopt.torch.export.quant_utils import get_weight_scaling_factor, get_weight_scaling_factor_2
d = sys.argv[1]
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(256, 32, bias=False))
x = torch.randn(16, 256)
cfg = copy.deepcopy(mtq.W4A8_AWQ_BETA_CFG)
cfg["algorithm"] = "max"
mq = mtq.quantize(m, cfg, lambda mm: mm(x))
lin = mq[0]
with torch.no_grad():
    ws, ws2 = get_weight_scaling_factor(lin), get_weight_scaling_factor_2(lin)
    codes = torch.round(lin.weight / ws.float().repeat_interleave(128, 1)).clamp(-8, 7)
    faked = lin.weight_quantizer[1](lin.weight_quantizer[0](lin.weight))
    for name, t in dict(x=x, y=lin(x), codes=codes, ws=ws, ws2=ws2.reshape(1), faked=faked,
                        xq=lin.input_quantizer(x), amax=lin.input_quantizer.amax.reshape(1)).items():
        np.save(f"{d}/{name}.npy", t.float().numpy())
"""


@pytest.mark.slow  # ModelOpt's import: ~15 s
def test_dequantize_is_modelopts_fake_quant_weight(tmp_path: Path) -> None:
    python, why = modelopt_python()
    if python is None:
        pytest.skip(why)
    subprocess.run([python, "-c", WORKER, str(tmp_path)], check=True, capture_output=True, timeout=300)
    a = {n: torch.from_numpy(np.load(tmp_path / f"{n}.npy")) for n in ("x", "y", "codes", "ws", "ws2", "faked", "xq")}
    stored = {
        "p.weight": pack_int4(a["codes"].to(torch.int8)),
        "p.weights_scaling_factor": a["ws"],
        "p.weights_scaling_factor_2": a["ws2"],
        "p.prequant_scaling_factor": torch.ones(256),
        "p.activation_scaling_factor": torch.from_numpy(np.load(tmp_path / "amax.npy")) / 448,
    }
    w = METHODS["w4a8_awq"].dequantize(Stored("p", stored, 256, 128))
    assert torch.equal(w, a["faked"])  # the FP8 stage included, bit for bit
    int4_only = a["codes"] * a["ws"].repeat_interleave(128, 1)
    assert not torch.allclose(int4_only, a["faked"], atol=1e-4)  # ... and it matters
    np.testing.assert_allclose((a["xq"] @ w.T).numpy(), a["y"].numpy(), rtol=0, atol=1e-6)


def w4a8_checkpoint(root: Path) -> Path:
    """A random Llama quantized linear by linear with a fixed AWQ choice (s from 0.5 to 2, no clipping): the test
    is the graph against the reference, not the search."""
    hf = save_random_llama(root / "hf", hidden_size=64, intermediate_size=96)
    convert(hf, root / "ckpt")
    cfg = read_config(root / "ckpt")
    spec, w, qm = spec_of(cfg), load_rank(root / "ckpt", 0), METHODS["w4a8_awq"]
    calib = Calibration()
    out = dict(w)
    for ls in spec.layers:
        for p in ls.linears():
            weight = w.pop(f"{p}.weight")
            del out[f"{p}.weight"]
            calib.input_channel_amax[p] = torch.linspace(0.5, 4.0, weight.shape[1], dtype=torch.float64)
            groups = -(-weight.shape[1] // 32)
            choice = AwqChoice(
                torch.linspace(0.5, 2.0, weight.shape[1], dtype=torch.float64),
                torch.ones(weight.shape[0], groups),
                0.5,
                1.0,
            )
            out.update(qm.quantize(p, weight, Context(group_size=32, calib=calib), choice))
    q = root / "q"
    q.mkdir()
    quant = dataclasses.replace(cfg.quantization, quant_algo="W4A8_AWQ", group_size=32, pre_quant_scale=True)
    write_config(q, dataclasses.replace(cfg, quantization=quant))
    save_file({k: v.contiguous() for k, v in out.items()}, str(q / rank_file(0)))
    return q


@pytest.mark.slow  # the engine build: ~4 s
def test_engine_computes_the_reference_forward(tmp_path: Path) -> None:
    q = w4a8_checkpoint(tmp_path)
    ids = list(range(3, 40))
    got = run_alone(build(q, tmp_path / "engine"), ids)
    with torch.no_grad():
        want = load_quantized(q).forward(torch.tensor([ids]))[0].numpy()
    # float32 sums in another order; an FP8 rounding of an input flipped by the last bit moves logits by ~1e-4
    assert np.abs(got - want).max() < 1e-4
    assert (got.argmax(-1) == want.argmax(-1)).all()
