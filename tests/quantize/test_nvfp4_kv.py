"""The NVFP4 KV cache (`quantize --kv-cache nvfp4`, quantize/methods/kv_cache.py): the calibrated per-layer global
scale, the values KVCacheWrite stores (NVFP4's, decoded with the checkpoint codecs), the engine computing the
reference forward, and the refusals (heads not whole blocks of 16, the Triton kernels, `--format hf`)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import WIKI, save_random_llama

from tests.models import TPB, build, run_alone
from toolchain.checkpoint.convert import convert
from toolchain.checkpoint.prequant.codecs import E2M1_VALUES, e2m1_codes, e2m1_decode, e2m1_pack
from toolchain.checkpoint.trtllm import load_rank, read_config
from toolchain.engine.ops import AttentionAttrs, kv_cache_write
from toolchain.errors import UserError
from toolchain.plugins.kernels import common
from toolchain.quantize.fake import load_quantized
from toolchain.quantize.methods.kv_cache import KV_SCALE
from toolchain.quantize.methods.nvfp4 import global_scale
from toolchain.quantize.stage import QuantizeOptions, quantize_checkpoint

CALIB = {"calib_data": WIKI / "valid.txt", "calib_samples": 2, "calib_seq_len": 32}


def _nvfp4_by_codecs(x: np.ndarray, g: np.float32) -> np.ndarray:
    """NVFP4QTensor's arithmetic in numpy, written apart from methods/nvfp4.py: per block of 16 along the last axis,
    block scale = E4M3(clamp(block amax / (6 · g), 2^-9, 448)) (0 -> 1), codes = E2M1 of x / (scale · g) by the
    checkpoint codecs, values decoded by them and multiplied by scale · g (float32 throughout)."""
    blocks = x.astype(np.float32).reshape(*x.shape[:-1], -1, 16)
    raw = np.abs(blocks).max(-1) / (np.float32(6.0) * g)
    raw = np.where(raw == 0, np.float32(1.0), raw).clip(2.0**-9, 448.0).astype(np.float32)
    scale = torch.from_numpy(raw).to(torch.float8_e4m3fn).float().numpy() * g  # one float32 product, as ModelOpt
    codes = e2m1_codes(blocks / scale[..., None])
    decoded = e2m1_decode(e2m1_pack(codes.reshape(*x.shape[:-1], -1))).reshape(blocks.shape)
    values: np.ndarray = (decoded * scale[..., None]).reshape(x.shape).astype(np.float32)
    return values


def test_kv_cache_write_stores_nvfp4_values() -> None:
    """What KVCacheWrite stores for an nvfp4 pool is, block for block, an E2M1 value times one E4M3 scale times the
    layer's global scale, and exactly what the codecs' NVFP4 arithmetic makes of the same K and V (round half to
    even at every E2M1 midpoint, saturation past 6 · 448 · g, zero blocks)."""
    heads, d = 2, 32
    g = global_scale(torch.tensor(2688.0 / 256))  # 2^-8 exactly: the midpoints below stay exact ties
    assert g.item() == 2.0**-8
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(40, heads, d, generator=gen) * 0.02
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])  # E2M1 midpoints (and the top), scale 1
    kv[0, 0, :16] = torch.cat([mids, -mids]) * g  # block amax 6 · g: block scale 1, x / g on the midpoints
    kv[1, 0, :16] = 0.0
    kv[2, 1] *= 1e4  # block scales past 448: saturated
    t = kv.shape[0]
    a = AttentionAttrs(
        0, heads, heads, d, tokens_per_block=TPB, rotary_style="none", kv_cache_dtype="nvfp4", kv_scale=g.item()
    )
    qkv = torch.cat([torch.zeros(t, heads * d), kv.reshape(t, -1), -kv.reshape(t, -1)], dim=1)
    blocks = -(-t // TPB)
    pool = torch.zeros(1, blocks, 2, heads, TPB, d, dtype=torch.float32)
    table = torch.randperm(blocks, generator=gen).int()
    positions = torch.arange(t, dtype=torch.int32)
    kv_cache_write(a, qkv, positions, torch.tensor([0]), torch.tensor([t]), table[None], pool)
    stored = pool[0][table.long()[positions // TPB], :, :, positions % TPB]  # [tokens, K/V, heads, d]
    gn = np.float32(g.item())
    for part, x in ((0, kv), (1, -kv)):
        assert np.array_equal(stored[:, part].numpy(), _nvfp4_by_codecs(x.numpy(), gn))
    ties = torch.tensor([0, 1, 1, 2, 2, 4, 4, 6.0])  # round half to even: 0.25 -> 0, 0.75 -> 1, ..., 5 -> 4
    assert torch.equal(stored[0, 0, 0, :16], torch.cat([ties, -ties]) * g)
    assert (stored[1, 0, 0, :16] == 0).all()
    assert stored[2, 0, 1].abs().max().item() == 6 * 448 * g.item()  # E2M1's 6 at block scale 448
    grid = torch.from_numpy(E2M1_VALUES).float()
    unit = stored[3:, 0].reshape(-1, 16) / g  # every stored block: E2M1 values times one E4M3 scale
    scale = (unit.abs().amax(-1, keepdim=True) / 6).to(torch.float8_e4m3fn).float()
    assert torch.isin(unit / scale, grid).all()


def _model(root: Path, stories: Path) -> Path:
    """A random Llama with 16-wide heads and stories260K's tokenizer (calibration reads WikiText through it)."""
    hf = save_random_llama(root / "hf", vocab_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"):
        shutil.copy(stories / name, hf / name)
    convert(hf, root / "ckpt")
    return root / "ckpt"


@pytest.mark.slow  # a calibration, two engine builds: ~6 s
def test_quantize_kv_nvfp4_scale_and_engine_equals_reference(stories: Path, tmp_path: Path) -> None:
    """`quantize --method fp8 --kv-cache nvfp4` writes one float32 global scale per layer, max(|k|, |v|) / (6 · 448)
    of the calibration (a sixth of the FP8 cache's amax / 448 from the same calibration); the CPU engine's logits
    are the reference forward's (its KV fake-quantized to NVFP4) to float32 rounding, and differ from the same
    engine with an FP8 cache. `--format hf` refuses NVFP4 KV by name."""
    ckpt = _model(tmp_path, stories)
    with pytest.raises(UserError, match=r"not NVFP4 .*amax / 448, is not written yet.*--format trtllm"):
        hf = QuantizeOptions("fp8", "nvfp4", format="hf", **CALIB)
        quantize_checkpoint(ckpt, tmp_path / "hf-out", hf)
    assert not (tmp_path / "hf-out").exists()
    r = quantize_checkpoint(ckpt, tmp_path / "q", QuantizeOptions("fp8", "nvfp4", **CALIB))
    assert r.kv_cache_quant_algo == "NVFP4" and read_config(tmp_path / "q").quantization.kv_cache_quant_algo == "NVFP4"
    w = load_rank(tmp_path / "q", 0)
    scales = {n: t for n, t in w.items() if n.endswith(KV_SCALE)}
    assert len(scales) == 2 and all(t.dtype == torch.float32 and t.shape == (1,) for t in scales.values())
    ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    expected = load_quantized(tmp_path / "q").forward(torch.tensor([ids]))[0].numpy()
    got = run_alone(build(tmp_path / "q", tmp_path / "engine"), ids)
    # float32 rounding: the engine sums in another order (ONNX Runtime GEMMs, the paged attention op); 1e-4 is the
    # bound the float engine's parity tests hold on logits of this size (tests/models.py assert_matches)
    assert np.abs(got - expected).max() < 1e-4 and (got.argmax(-1) == expected.argmax(-1)).all()
    quantize_checkpoint(ckpt, tmp_path / "f", QuantizeOptions("fp8", "fp8", **CALIB))
    fp8 = run_alone(build(tmp_path / "f", tmp_path / "engine-f"), ids)
    assert np.abs(fp8 - got).max() > 1e-3  # the NVFP4 cache is not the FP8 one
    fp8_scales = load_rank(tmp_path / "f", 0)
    for name, t in scales.items():  # the same calibration's amax: FP8's amax / 448 is six times NVFP4's amax / 2688
        assert t.item() == pytest.approx(fp8_scales[name].item() / 6, rel=2**-23)


def test_head_size_not_whole_blocks_refused(stories: Path, tmp_path: Path) -> None:
    convert(stories, tmp_path / "ckpt")
    with pytest.raises(UserError, match=r"head_size 8 is not a multiple of 16.*use --kv-cache fp8"):
        quantize_checkpoint(tmp_path / "ckpt", tmp_path / "q", QuantizeOptions("fp8", "nvfp4", **CALIB))
    assert not (tmp_path / "q").exists()


def test_kernels_refuse_nvfp4_pool_by_name() -> None:
    with pytest.raises(ValueError, match=r"KV cache nvfp4 has no Triton kernel.*CPU engine.*--kv-cache fp8"):
        common.check_types("nvfp4", 64, "float16")


def test_build_keeps_nvfp4_kv_on_the_cpu_engine() -> None:
    from toolchain.engine.backends import ONNXRUNTIME, TENSORRT, _no_kv

    assert "NVFP4 KV cache has no TensorRT kernel" in (_no_kv(TENSORRT, "nvfp4") or "")
    assert _no_kv(ONNXRUNTIME, "nvfp4") is None and _no_kv(TENSORRT, "fp8") is None


# ModelOpt's own NVFP4QTensor on K (CPU: its plain torch path) over the given global scale, dequantized, as npy
KV_WORKER = """
import sys, numpy as np, torch
from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor
d = sys.argv[1]
x, g = (torch.from_numpy(np.load(f"{d}/{n}.npy")) for n in ("k", "g"))
q, s, _ = NVFP4QTensor.quantize(x, 16, weights_scaling_factor_2=g)
np.save(f"{d}/k_qdq.npy", q.dequantize(torch.float32, scale=s, double_scale=g, block_sizes={-1: 16}).numpy())
"""


@pytest.mark.slow  # ModelOpt's import: ~15 s
def test_kv_cache_write_is_modelopt_nvfp4qtensor(tmp_path: Path) -> None:
    """The stored K rows are ModelOpt's NVFP4QTensor quantize-dequantize of them over the layer's global scale, bit
    for bit (run by ModelOpt itself, in a subprocess)."""
    from bench.quality_modelopt import modelopt_python

    python, why = modelopt_python()
    if python is None:
        pytest.skip(why)
    heads, d, t = 2, 64, 24
    k = torch.randn(t, heads, d, generator=torch.Generator().manual_seed(5)) * torch.logspace(-2, 0, d)
    g = global_scale(k.abs().amax() / 2)  # half the amax: saturating blocks too
    np.save(tmp_path / "k.npy", k.numpy())
    np.save(tmp_path / "g.npy", g.numpy())
    subprocess.run([python, "-c", KV_WORKER, str(tmp_path)], check=True, capture_output=True, timeout=300)
    a = AttentionAttrs(
        0, heads, heads, d, tokens_per_block=TPB, rotary_style="none", kv_cache_dtype="nvfp4", kv_scale=g.item()
    )
    qkv = torch.cat([torch.zeros(t, heads * d), k.reshape(t, -1), k.reshape(t, -1)], dim=1)
    pool = torch.zeros(1, t // TPB, 2, heads, TPB, d)
    table = torch.arange(t // TPB, dtype=torch.int32)
    kv_cache_write(a, qkv, torch.arange(t, dtype=torch.int32), torch.tensor([0]), torch.tensor([t]), table[None], pool)
    stored = pool[0].permute(0, 3, 1, 2, 4).reshape(t, 2, heads, d)  # blocks in order: [tokens, K/V, heads, d]
    assert np.array_equal(stored[:, 0].numpy(), np.load(tmp_path / "k_qdq.npy"))
