"""Weight-only quantization of mixture-of-experts layers (quantize/experts.py): each expert's stacked slice
quantized with its own scales, the router kept float32, the checkpoint run by the fake-quant reference and the CPU
engine. Parity cases of tests/models.py (Mixtral, Qwen3-MoE with dense and sparse layers mixed)."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
import torch
from models import build, run_alone, save_case

from toolchain.checkpoint.convert import convert
from toolchain.checkpoint.trtllm import load_rank, read_config
from toolchain.errors import UserError
from toolchain.quantize.core import dequantize_groupwise, unpack_int4
from toolchain.quantize.fake import load_quantized
from toolchain.quantize.stage import QuantizeOptions, quantize_checkpoint
from toolchain.reference.model import ReferenceModel

# Qwen3-MoE: dense layers 0, 2 (quantized as dense linears) and sparse 1, 3; Mixtral (8 experts, ~6 s): slow tier
CASES = [pytest.param("mixtral-top2-of-8", marks=pytest.mark.slow), "qwen3-moe-unnormalised-step2"]
METHODS = (("w8a16", 128), ("w4a16", 64))  # group 64: the experts' widths 32 and 48 end in a partial block


def _kld(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per row, in float64."""
    lp, lq = p.double().log_softmax(-1), q.double().log_softmax(-1)
    return (lp.exp() * (lp - lq)).sum(-1)


def _sparse(ckpt: Path) -> list[str]:
    """The MoE layers' mlp prefixes of a checkpoint (those with a router)."""
    return [k.removesuffix(".router.weight") for k in load_rank(ckpt, 0) if k.endswith(".mlp.router.weight")]


def _check_layout(src: Path, out: Path, method: str, group: int) -> None:
    """The router is the float one, float32 and excluded; each expert's fc and proj have their own scales (per row
    for w8a16, per row and group for w4a16) and every weight is within half a step of its round-to-nearest value."""
    cfg, raw, float_w = read_config(out), load_rank(out, 0), load_rank(src, 0)
    sparse = _sparse(out)
    assert sparse
    for mlp in sparse:
        assert (
            raw[f"{mlp}.router.weight"].dtype == torch.float32 and f"{mlp}.router" in cfg.quantization.exclude_modules
        )
        assert torch.equal(raw[f"{mlp}.router.weight"], float_w[f"{mlp}.router.weight"])
        for linear in ("fc", "proj"):
            w = float_w[f"{mlp}.{linear}.weight"].float()
            codes, scale = raw[f"{mlp}.{linear}.weight"], raw[f"{mlp}.{linear}.weights_scaling_factor"]
            e, rows, width = w.shape
            if method == "w8a16":  # per expert and output row: max |w| of that row / 127
                assert codes.dtype == torch.int8 and codes.shape == w.shape and scale.shape == (e, rows)
                torch.testing.assert_close(scale, w.abs().amax(-1) / 127, rtol=0, atol=0)
                deq, step = codes.float() * scale[..., None], scale[..., None].expand_as(w)
            else:  # per expert, output row and group of `group` inputs: max |w| of the group / 7
                groups = -(-width // group)
                assert codes.shape == (e, rows // 2, groups * group) and scale.shape == (e, rows, groups)
                deq = torch.stack(
                    [dequantize_groupwise(unpack_int4(c), s)[:, :width] for c, s in zip(codes, scale, strict=True)]
                )
                step = scale.repeat_interleave(group, -1)[..., :width]
            assert ((deq - w).abs() <= step / 2 * (1 + 1e-6)).all()


@pytest.mark.parametrize("case", CASES)
def test_quantized_experts_layout_engine_and_quality(case: str, tmp_path: Path) -> None:
    """Per method: the layout; the CPU engine equals the fake-quant reference (< 1e-4, same argmax: float32
    summation order only, the dense weight-only bound of tests/engine/test_engine.py); against float, the dense
    methods' bound (tests/quantize/test_quantize.py): quantization costs something, and w8a16 costs less than
    w4a16 in KLD and no more in top-1 agreement."""
    src = convert(save_case(tmp_path / "hf", case), tmp_path / "ckpt") and tmp_path / "ckpt"
    full = ReferenceModel.from_checkpoint(src)
    ids = [
        torch.randint(0, full.config.vocab_size, (40,), generator=torch.Generator().manual_seed(s)).tolist()
        for s in (6, 7)
    ]
    floats = torch.cat([full.forward(torch.tensor([i]))[0] for i in ids])
    quality = {}
    for method, group in METHODS:
        out = tmp_path / method
        quantize_checkpoint(src, out, QuantizeOptions(method, group_size=group))
        _check_layout(src, out, method, group)
        fake, engine = load_quantized(out), build(out, tmp_path / f"{method}-engine")
        graph = onnx.load(str(engine.spec.engine_dir / "model.onnx"), load_external_data=False).graph
        dq = {n.input[0] for n in graph.node if n.op_type == "DequantizeLinear"}
        assert {f"{mlp}.{lin}.weight" for mlp in _sparse(out) for lin in ("fc", "proj")} <= dq  # int codes in the graph
        g = torch.cat([torch.from_numpy(run_alone(engine, i)) for i in ids])
        e = torch.cat([fake.forward(torch.tensor([i]))[0] for i in ids])
        assert (g - e).abs().max() < 1e-4
        assert torch.equal(g.argmax(-1), e.argmax(-1))
        quality[method] = (_kld(floats, g).mean().item(), (floats.argmax(-1) == g.argmax(-1)).double().mean().item())
    assert 0 < quality["w8a16"][0] < quality["w4a16"][0], quality
    assert quality["w8a16"][1] >= quality["w4a16"][1], quality


def test_calibrated_methods_refuse_experts(tmp_path: Path) -> None:
    """Methods that calibrate (or quantize activations) do not run experts yet: one clear error naming the two that
    do, before any calibration text is read."""
    src = convert(save_case(tmp_path / "hf", "qwen3-moe-unnormalised-step2"), tmp_path / "ckpt") and tmp_path / "ckpt"
    for method in ("fp8", "w4a16_awq", "w8a8_sq"):
        with pytest.raises(UserError, match=f"not '{method}'; choose --method w8a16 or w4a16"):
            quantize_checkpoint(src, tmp_path / method, QuantizeOptions(method))
