"""ModelOpt's side of the unified-HF-export evidence (tests/prequant/test_modelopt_hf.py), run in a python that
imports `modelopt` (a subprocess: trtbuild's own process never imports it). Files in, files out (JSON, .npy,
safetensors), no pickles.

    HF ROOT CALIB ALGO...   for each ALGO, in ROOT/ALGO (which holds rows.json, token rows):
        export/              HF quantized with ModelOpt's own config for ALGO on CPU (calibration: the first
                             windows of text file CALIB) and written by `export_hf_checkpoint` (+ HF's tokenizer)
        fake.npy             the fake-quant model's logits of the rows (not for NVFP4: ModelOpt's NVFP4 fake-quant
                             forward asserts CUDA, tensor_quant.py `_dynamic_block_quantize_impl`)
        ref.npy              the export's tensors dequantized in float32 with ModelOpt's functions, in a float
                             transformers model built from HF's config: its logits of the rows
        weights.safetensors  those dequantized weights, by HF linear

One process for all (importing ModelOpt takes seconds).

Dequantization per format (ModelOpt 0.47): FP8 `quant_utils.from_quantized_weight(weight, weight_scale, "fp8")`;
NVFP4 `NVFP4QTensor(shape, float32, weight).dequantize(scale=weight_scale, double_scale=weight_scale_2,
block_sizes={-1: 16})`; INT4 AWQ / W4A8 AWQ: ModelOpt has no unpacker for `pack_int4_in_uint8`'s layout
(INT4QTensor packs another way), so the codes are unpacked here from that function's definition and the unpacking
is proven by packing them back with ModelOpt's own `pack_int4_in_uint8` (bytes identical) before use; W4A8's
weight then takes its SequentialQuantizer's FP8 stage at weight_scale_2 (`FP8QTensor.quantize(w, scales=ws2)` and
`dequantize`), as its fake-quant forward does (measured by slice C: quantize/methods/w4a8_awq.py).

Run-time input treatment of the export (what our engine does, so the reference does it too; first principles,
stated as such): `pre_quant_scale` multiplies the linear's input (a forward pre-hook); FP8 / W4A8 activations are
quantize-dequantized per tensor at `input_scale` (x / s -> float8_e4m3fn -> · s, saturating at ±448); NVFP4
activations are quantized in blocks of 16 with `input_scale` as the global scale by ModelOpt's own
`NVFP4QTensor.quantize` / `dequantize`.
"""

from __future__ import annotations

import copy
import json
import shutil
import sys
import warnings
from pathlib import Path

import numpy as np
import torch

warnings.filterwarnings("ignore")  # ModelOpt warns about untested transformers versions and CPU-only torch
GROUP = 32  # AWQ block size: stories260K's widths (64) are not a multiple of ModelOpt's default 128
NVFP4_BLOCK = 16
FP8_MAX = 448.0


def quant_config(algo: str) -> dict:
    import modelopt.torch.quantization as mtq

    base = {
        "fp8": mtq.FP8_DEFAULT_CFG,
        "fp8_kv": mtq.FP8_DEFAULT_CFG,
        "int4_awq": mtq.INT4_AWQ_CFG,
        "w4a8_awq": mtq.W4A8_AWQ_BETA_CFG,
        "nvfp4": mtq.NVFP4_DEFAULT_CFG,
    }[algo]
    cfg = copy.deepcopy(base)
    for entry in cfg["quant_cfg"]:
        if entry.get("quantizer_name") == "*weight_quantizer" and algo in ("int4_awq", "w4a8_awq"):
            for c in entry["cfg"] if isinstance(entry["cfg"], list) else [entry["cfg"]]:
                if c.get("block_sizes"):
                    c["block_sizes"][-1] = GROUP
    # stories260K's down_proj reads 172 channels: no whole int4 groups / NVFP4 blocks; it stays float (excluded)
    cfg["quant_cfg"] = [*cfg["quant_cfg"], {"quantizer_name": "*mlp.down_proj*", "enable": False}]
    if algo == "fp8_kv":
        cfg["quant_cfg"] = [*cfg["quant_cfg"], *copy.deepcopy(mtq.FP8_KV_CFG["quant_cfg"])]
    return cfg


def windows(hf: Path, text: Path, count: int = 4, length: int = 128) -> list[torch.Tensor]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf)
    ids = tok(text.read_text(encoding="utf-8")[: count * length * 16], return_tensors="pt").input_ids[0]
    return [ids[i * length : (i + 1) * length][None] for i in range(min(count, ids.numel() // length))]


def logits(model: torch.nn.Module, rows: list[list[int]]) -> np.ndarray:
    with torch.no_grad():
        return np.stack([model(torch.tensor([r])).logits[0].float().numpy() for r in rows])


def export(hf: Path, out: Path, algo: str, calib: Path, rows_file: Path, fake: Path) -> None:
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    calib_ids = windows(hf, calib)

    def forward_loop(m: torch.nn.Module) -> None:
        with torch.no_grad():
            for ids in calib_ids:
                m(ids)

    model = mtq.quantize(model, quant_config(algo), forward_loop)
    if algo != "nvfp4":
        np.save(fake, logits(model, json.loads(rows_file.read_text())))
    tmp = out.with_name(f".{out.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    with torch.no_grad():
        export_hf_checkpoint(model, dtype=torch.float32, export_dir=tmp)
    for f in hf.iterdir():
        if f.name.startswith("tokenizer"):
            shutil.copy(f, tmp / f.name)
    tmp.rename(out)


def unpack_int4_rows(packed: torch.Tensor) -> torch.Tensor:
    """`pack_int4_in_uint8`'s inverse (2-D): uint8 [out/2, in] -> int8 codes [out, in], row 2j the low nibble."""
    p = packed.to(torch.int16)
    low, high = p & 0x0F, p >> 4
    codes = torch.empty((p.shape[0] * 2, p.shape[1]), dtype=torch.int16)
    codes[0::2], codes[1::2] = low, high
    return torch.where(codes > 7, codes - 16, codes).to(torch.int8)


def dequantize(algo: str, t: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    from modelopt.torch.export.quant_utils import from_quantized_weight, pack_int4_in_uint8
    from modelopt.torch.quantization.qtensor.fp8_tensor import FP8QTensor
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    w, s = t[f"{prefix}.weight"], t[f"{prefix}.weight_scale"]
    if algo == "FP8":
        return from_quantized_weight(w, s, "fp8", torch.float32)
    if algo == "NVFP4":
        shape = torch.Size((w.shape[0], w.shape[1] * 2))
        q = NVFP4QTensor(shape, torch.float32, w)
        return q.dequantize(
            dtype=torch.float32, scale=s, double_scale=t[f"{prefix}.weight_scale_2"], block_sizes={-1: NVFP4_BLOCK}
        )
    codes = unpack_int4_rows(w)
    group = w.shape[1] // s.shape[1]
    deq = codes.float() * s.float().repeat_interleave(group, dim=1)
    again = pack_int4_in_uint8(deq, s.float(), group)  # ModelOpt's own packer reproduces the export's bytes
    assert torch.equal(again, w), f"{prefix}: the int4 unpacking is not pack_int4_in_uint8's inverse"
    if algo == "W4A8_AWQ":  # the second stage of its SequentialQuantizer: E4M3 at weight_scale_2
        ws2 = t[f"{prefix}.weight_scale_2"].float()
        fp8, _ = FP8QTensor.quantize(deq, scales=ws2)
        return fp8.dequantize(dtype=torch.float32, scale=ws2)
    return deq


def fp8_qdq(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale


def nvfp4_qdq(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    flat = x.reshape(-1, x.shape[-1]).float()
    q, scale, scale_2 = NVFP4QTensor.quantize(
        flat, NVFP4_BLOCK, weights_scaling_factor_2=global_scale.float(), try_tensorrt=False
    )
    deq = q.dequantize(dtype=torch.float32, scale=scale, double_scale=scale_2, block_sizes={-1: NVFP4_BLOCK})
    return deq.reshape(x.shape)


def reference(export_dir: Path, hf: Path, rows_file: Path, out: Path, weights_out: Path) -> None:
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    algo = json.loads((export_dir / "hf_quant_config.json").read_text())["quantization"]["quant_algo"]
    t = load_file(str(export_dir / "model.safetensors"))
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(hf), dtype=torch.float32).eval()
    state = model.state_dict()
    quantized = sorted(n.removesuffix(".weight_scale") for n in t if n.endswith(".weight_scale"))
    deq = {p: dequantize(algo, t, p) for p in quantized}
    new = {}
    for name in state:
        prefix = name.removesuffix(".weight")
        if prefix in deq:
            new[name] = deq[prefix]
        elif name in t:
            new[name] = t[name].float()
    missing = model.load_state_dict(new, strict=False).missing_keys
    assert set(missing) <= {"lm_head.weight"}, missing  # tied to the embedding
    model.tie_weights()
    modules = dict(model.named_modules())
    for p in quantized:
        pqs, act = t.get(f"{p}.pre_quant_scale"), t.get(f"{p}.input_scale")

        def hook(_m: torch.nn.Module, args: tuple, pqs=pqs, act=act) -> tuple:
            x = args[0]
            if pqs is not None:
                x = x * pqs
            if act is not None:
                x = nvfp4_qdq(x, act) if algo == "NVFP4" else fp8_qdq(x, act)
            return (x, *args[1:])

        modules[p].register_forward_pre_hook(hook)
    np.save(out, logits(model, json.loads(rows_file.read_text())))
    save_file({p: w.contiguous() for p, w in deq.items()}, str(weights_out))


if __name__ == "__main__":
    hf, root, calib, *algos = map(Path, sys.argv[1:])
    for algo in algos:
        d = root / algo.name
        export(hf, d / "export", algo.name, calib, d / "rows.json", d / "fake.npy")
        reference(d / "export", hf, d / "rows.json", d / "ref.npy", d / "weights.safetensors")
