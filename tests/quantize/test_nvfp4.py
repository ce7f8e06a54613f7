"""NVFP4 (quantize/methods/nvfp4.py): the weights and the run-time activation quantization are ModelOpt's
`NVFP4QTensor` arithmetic to the byte (computed by ModelOpt itself, in a subprocess); the engine graph is TensorRT's
form (FP4 initializers, two DequantizeLinear nodes, `trt::TRT_FP4DynamicQuantize`), valid ONNX at opset 23, and the
CPU engine's lowering of it computes what the reference forward computes."""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from conftest import WIKI, save_random_llama
from onnx import TensorProto
from safetensors.torch import save_file

from bench.quality_modelopt import modelopt_python
from tests.models import build, run_alone
from toolchain.checkpoint.convert import convert
from toolchain.checkpoint.spec import spec_of
from toolchain.checkpoint.trtllm import load_rank, rank_file, read_config, write_config
from toolchain.engine.export import OPSET_FP4, _Builder
from toolchain.engine.ort_backend import _split
from toolchain.engine.trt_ops import LOWERED_OPS, lower_for_ort
from toolchain.errors import UserError
from toolchain.quantize.awq import AwqChoice
from toolchain.quantize.calibrate import Calibration
from toolchain.quantize.core import pack_int4, unpack_int4
from toolchain.quantize.fake import load_quantized
from toolchain.quantize.methods.base import Context, Layer, Stored
from toolchain.quantize.methods.nvfp4 import global_scale, nvfp4_qdq
from toolchain.quantize.methods.registry import METHODS
from toolchain.quantize.stage import QuantizeOptions, quantize_checkpoint

PREFIX = "transformer.layers.0.mlp.proj"

# ModelOpt's NVFP4QTensor on the given weight and activations (CPU: its plain torch path), as npy files
WORKER = """
import sys, numpy as np, torch
from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor
d = sys.argv[1]
w = torch.from_numpy(np.load(f"{d}/w.npy"))
q, s, g = NVFP4QTensor.quantize(w, 16)
np.save(f"{d}/packed.npy", q._quantized_data.numpy())
np.save(f"{d}/scales.npy", s.view(torch.uint8).numpy())
np.save(f"{d}/global.npy", g.reshape(1).numpy())
np.save(f"{d}/dequant.npy", q.dequantize(torch.float32, scale=s, double_scale=g, block_sizes={-1: 16}).numpy())
x = torch.from_numpy(np.load(f"{d}/x.npy"))
xg = torch.from_numpy(np.load(f"{d}/xg.npy"))
qx, sx, _ = NVFP4QTensor.quantize(x, 16, weights_scaling_factor_2=xg)
np.save(f"{d}/x_qdq.npy", qx.dequantize(torch.float32, scale=sx, double_scale=xg, block_sizes={-1: 16}).numpy())
"""


def _weight(out: int = 24, inn: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(out, inn, generator=g) * torch.logspace(-3, 0, inn)  # blocks of very different sizes
    w[1] = 0  # an all-zero row: block scale 1, exact zeros
    w[2, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75] * 2) / 6 * 7  # near E2M1 bounds
    return w


@pytest.mark.slow  # ModelOpt's import: ~15 s
def test_weights_and_activations_are_modelopt_nvfp4qtensor(tmp_path: Path) -> None:
    python, why = modelopt_python()
    if python is None:
        pytest.skip(why)
    w = _weight()
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1)) * 3
    x[0, :16] = 0  # an all-zero block
    xg = global_scale(torch.tensor(4.0))  # a calibrated input amax below the largest |x|: saturating blocks
    for name, value in {"w": w, "x": x, "xg": xg}.items():
        np.save(tmp_path / f"{name}.npy", value.numpy())
    subprocess.run([python, "-c", WORKER, str(tmp_path)], check=True, capture_output=True, timeout=300)

    calib = Calibration()
    calib.input_amax[PREFIX] = 4.0
    made = METHODS["nvfp4"].quantize(PREFIX, w, Context(calib=calib))
    assert np.array_equal(made[f"{PREFIX}.weight"].numpy(), np.load(tmp_path / "packed.npy"))
    assert np.array_equal(
        made[f"{PREFIX}.weights_scaling_factor"].view(torch.uint8).numpy(), np.load(tmp_path / "scales.npy")
    )
    assert np.array_equal(made[f"{PREFIX}.weights_scaling_factor_2"].numpy(), np.load(tmp_path / "global.npy"))
    assert torch.equal(made[f"{PREFIX}.activation_scaling_factor"], xg)  # amax / (6 · 448) in float32
    back = METHODS["nvfp4"].dequantize(Stored(PREFIX, made, 64, 128))
    assert np.array_equal(back.numpy(), np.load(tmp_path / "dequant.npy"))  # bit for bit, ModelOpt's order
    assert np.array_equal(nvfp4_qdq(x, xg).numpy(), np.load(tmp_path / "x_qdq.npy"))


def test_block_scales_clamp_and_codes_round_half_to_even() -> None:
    w = torch.zeros(2, 32)
    w[0, 0] = 6 * 448.0  # the tensor's amax: global 1, first block's scale 448
    w[0, 16] = 1e-6  # a tiny block: its scale clamps to 2^-9, the value rounds to 0
    made = METHODS["nvfp4"].quantize("p", w, Context(calib=_calib("p")))
    scales = made["p.weights_scaling_factor"].float()
    assert made["p.weights_scaling_factor_2"].item() == 1.0
    assert scales[0, 0] == 448 and scales[0, 1] == 2**-9
    back = METHODS["nvfp4"].dequantize(Stored("p", made, 32, 128))
    assert back[0, 0] == 6 * 448 and back[0, 16] == 0


def _calib(*prefixes: str) -> Calibration:
    calib = Calibration()
    calib.input_amax.update(dict.fromkeys(prefixes, 4.0))
    return calib


def test_in_features_not_a_multiple_of_16_refused() -> None:
    with pytest.raises(UserError, match="172 input channels; NVFP4 needs a multiple of 16"):
        METHODS["nvfp4"].quantize("p", torch.ones(4, 172), Context(calib=_calib("p")))


def nvfp4_checkpoint(root: Path, method: str = "nvfp4") -> Path:
    """A random Llama converted and quantized linear by linear by `method` (input amax 4 everywhere: the test is
    about the graph computing what the reference does, not about calibration)."""
    hf = save_random_llama(root / "hf", hidden_size=64, intermediate_size=96)
    convert(hf, root / "ckpt")
    cfg = read_config(root / "ckpt")
    spec, w, qm = spec_of(cfg), load_rank(root / "ckpt", 0), METHODS[method]
    ctx = Context(calib=_calib(*(p for ls in spec.layers for p in ls.linears())))
    out = dict(w)
    for ls in spec.layers:
        tensors = {k: v for k, v in w.items() if k.startswith(f"{ls.prefix}.")}
        prepared = qm.prepare(Layer(ls.prefix, tensors, ls.linears(), set(ls.linears()), ls), ctx)
        for p in ls.linears():
            del out[f"{p}.weight"]
            out.update(qm.quantize(p, w[f"{p}.weight"], ctx, prepared.get(p)))
    q = root / "q"
    q.mkdir()
    write_config(
        q, dataclasses.replace(cfg, quantization=dataclasses.replace(cfg.quantization, quant_algo=qm.quant_algo))
    )
    save_file({k: v.contiguous() for k, v in out.items()}, str(q / rank_file(0)))
    return q


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, np.ndarray]:
    root = tmp_path_factory.mktemp("nvfp4")
    q = nvfp4_checkpoint(root)
    ids = list(range(3, 40))
    logits = run_alone(build(q, root / "engine"), ids)
    return q, root / "engine", logits


@pytest.mark.slow  # the engine build: ~4 s
def test_engine_computes_the_reference_forward(engine: tuple[Path, Path, np.ndarray]) -> None:
    q, _, got = engine
    with torch.no_grad():
        want = load_quantized(q).forward(torch.tensor([list(range(3, 40))]))[0].numpy()
    # float32 sums in another order: a few ulps of logits ~1, and no rounding of an FP4 input flipped
    assert np.abs(got - want).max() < 1e-5
    assert (got.argmax(-1) == want.argmax(-1)).all()


@pytest.mark.slow
def test_graph_is_tensorrts_form_at_opset_23(engine: tuple[Path, Path, np.ndarray]) -> None:
    model = onnx.load(str(engine[1] / "model.onnx"))
    onnx.checker.check_model(model, full_check=True)
    assert model.ir_version == 11 and {(o.domain, o.version) for o in model.opset_import} == {
        ("", OPSET_FP4),
        ("trtbuild", 1),
        ("trt", 1),
    }
    types = {(n.domain, n.op_type) for n in model.graph.node}
    assert ("trt", "TRT_FP4DynamicQuantize") in types and ("", "DequantizeLinear") in types
    assert {d for d, _ in types} == {"", "trtbuild", "trt"} and ("", "QuantizeLinear") not in types
    fp4 = [t for t in model.graph.initializer if t.data_type == TensorProto.FLOAT4E2M1]
    fp8 = [t for t in model.graph.initializer if t.data_type == TensorProto.FLOAT8E4M3FN]
    assert len(fp4) == len(fp8) == 2 * 5  # qkv, dense, fc, gate, proj of 2 layers (lm_head stays float here)
    quant_nodes = [n for n in model.graph.node if n.op_type == "TRT_FP4DynamicQuantize"]
    assert len(quant_nodes) == len(fp4)
    for n in quant_nodes:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        assert attrs == {"axis": -1, "block_size": 16, "scale_type": TensorProto.FLOAT8E4M3FN}


def run_lowered(b: _Builder, y: str, x: torch.Tensor, out_dim: int) -> np.ndarray:
    """Graph `b` (input "x" [rows, in], output `y` [rows, out_dim]) as the CPU engine runs it: lowered
    (trt_ops.py), cut at the lowered nodes, segments on ONNX Runtime and the lowered nodes by their references."""
    import onnxruntime as ort

    graph = onnx.helper.make_graph(
        b.nodes,
        "linear",
        [onnx.helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
        [onnx.helper.make_tensor_value_info(y, TensorProto.FLOAT, [x.shape[0], out_dim])],
        b.initializers,
    )
    opsets = [onnx.helper.make_opsetid("", OPSET_FP4), onnx.helper.make_opsetid("trt", 1)]
    model = onnx.helper.make_model(graph, opset_imports=opsets, ir_version=11)
    onnx.checker.check_model(model, full_check=True)  # the un-lowered graph is valid ONNX
    lowered = lower_for_ort(model)
    inferred = onnx.shape_inference.infer_shapes(lowered)
    types = {v.name: v for v in [*inferred.graph.value_info, *lowered.graph.input, *lowered.graph.output]}
    inits = {t.name: t for t in lowered.graph.initializer}
    values: dict[str, np.ndarray] = {"x": x.numpy()}
    parts = _split(lowered)
    for index, (nodes, ref) in enumerate(parts):
        later = {y} | {
            i
            for rest, after in parts[index + 1 :]
            for i in [*(i for n in rest for i in n.input), *(after.input if after else [])]
        }
        if ref is not None:
            later |= set(ref.input)
        if nodes:
            made = {o for n in nodes for o in n.output}
            needed = sorted({i for n in nodes for i in n.input if i and i not in inits} - made)
            outs = [o for n in nodes for o in n.output if o in later]
            sub = onnx.helper.make_graph(
                nodes,
                "segment",
                [types[i] for i in needed],
                [types[o] for o in outs],
                [inits[i] for i in sorted({i for n in nodes for i in n.input if i in inits})],
            )
            m = onnx.helper.make_model(sub, opset_imports=[onnx.helper.make_opsetid("", OPSET_FP4)], ir_version=11)
            session = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
            values.update(zip(outs, session.run(outs, {i: values[i] for i in needed}), strict=True))
        if ref is not None:
            args = [
                torch.from_numpy(onnx.numpy_helper.to_array(inits[i]).copy())
                if i in inits
                else torch.from_numpy(values[i])
                for i in ref.input
            ]
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in ref.attribute}
            values[ref.output[0]] = LOWERED_OPS[ref.op_type](attrs, *args).numpy()
    return values[y]


def parts_linear(method: str, parts: list[int], inn: int = 64) -> Stored:
    """A fused linear of `parts` projections quantized each by itself (its own global / FP8 scales), as a
    pre-quantized checkpoint's reader stores them: the per-part scales stacked, PREFIX.parts the row counts."""
    g = torch.Generator().manual_seed(3)
    qm, made, calib = METHODS[method], [], Calibration()
    for i, rows in enumerate(parts):
        w = torch.randn(rows, inn, generator=g) * (i + 1)  # each part its own size: the scales differ
        calib.input_amax["p"] = 2.0 * (i + 1)
        calib.input_channel_amax["p"] = torch.full((inn,), 2.0 * (i + 1), dtype=torch.float64)
        choice = AwqChoice(torch.ones(inn, dtype=torch.float64), torch.ones(rows, inn // 32), 0.5, 1.0)
        made.append(qm.quantize("p", w, Context(group_size=32, calib=calib), choice if "awq" in method else None))
    stored = {n: torch.cat([m[n] for m in made]) for n in made[0] if not n.endswith("prequant_scaling_factor")}
    if method == "w4a8_awq":  # one input, one 1/s for all parts
        stored["p.weight"] = pack_int4(torch.cat([unpack_int4(m["p.weight"]) for m in made]))
        stored["p.prequant_scaling_factor"] = torch.linspace(0.5, 2.0, inn)
    stored["p.parts"] = torch.tensor(parts)
    return Stored("p", stored, inn, 32)


@pytest.mark.parametrize("method", ["nvfp4", "w4a8_awq"])
def test_per_part_scales_export_one_gemm_a_part(method: str) -> None:
    """A fused linear whose parts keep their own scales (issue 28: requantizing to the largest costs KLD): the graph
    (export_gemm) computes what the reference (fake_linear) does, and both differ from one shared scale."""
    qm, s = METHODS[method], parts_linear(method, [32, 16, 16])
    acts = s["activation_scaling_factor"]
    assert len(set(acts.tolist())) == 3 and len(set(s["weights_scaling_factor_2"].tolist())) == 3
    b = _Builder(torch.float32)
    y = qm.export_gemm(b, s, "x")
    assert y is not None and qm.export_gemm(b, Stored("q", {}, 64, 32), "x") is None
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(4)) * 3
    want = qm.fake_linear(s, x, qm.dequantize(s))
    assert want is not None
    got = run_lowered(b, y, x, 64)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-5)  # float32 sums in another order
    one = dict(s.tensors)
    one["p.activation_scaling_factor"] = acts.max().expand(3).clone()  # the max: what the parts avoid
    shared = qm.fake_linear(Stored("p", one, 64, 32), x, qm.dequantize(s))
    assert shared is not None and not torch.allclose(shared, want, atol=1e-3)


@pytest.mark.slow  # three calibrations of stories260K: ~10 s
def test_quantize_makes_each_new_method(stories: Path, tmp_path: Path) -> None:
    """`quantize --method nvfp4 | mxfp8 | w4a8_awq` end to end on stories260K (short calibration): the layouts the
    modules state, config.json's quant_algo, a reference forward; a width that is not whole blocks is refused
    naming the --exclude that keeps it float."""
    convert(stories, tmp_path / "ckpt")
    calib = {"calib_data": WIKI / "valid.txt", "calib_samples": 2, "calib_seq_len": 32}
    with pytest.raises(UserError, match=r"mlp\.proj: 172 input channels; NVFP4 needs a multiple of 16: keep it float"):
        quantize_checkpoint(tmp_path / "ckpt", tmp_path / "refused", QuantizeOptions("nvfp4", **calib))  # type: ignore[arg-type]
    layouts = {
        "nvfp4": {"weight": torch.uint8, "weights_scaling_factor": torch.float8_e4m3fn},
        "mxfp8": {"weight": torch.float8_e4m3fn, "weights_scaling_factor": torch.uint8},
        "w4a8_awq": {"weight": torch.int8, "weights_scaling_factor_2": torch.float32},
    }
    for method, dtypes in layouts.items():
        exclude = ("lm_head", "mlp.proj") if method != "w4a8_awq" else ("lm_head",)
        opts = QuantizeOptions(method, exclude=exclude, **calib)  # type: ignore[arg-type]
        quantize_checkpoint(tmp_path / "ckpt", tmp_path / method, opts)
        assert read_config(tmp_path / method).quantization.quant_algo == METHODS[method].quant_algo
        tensors = load_rank(tmp_path / method, 0)
        for suffix, dtype in dtypes.items():
            assert tensors[f"transformer.layers.0.attention.qkv.{suffix}"].dtype == dtype
        assert ("transformer.layers.0.mlp.proj.weights_scaling_factor" in tensors) == (method == "w4a8_awq")
        with torch.no_grad():
            logits = load_quantized(tmp_path / method).forward(torch.tensor([[1, 5, 9, 30]]))
        assert torch.isfinite(logits).all()
