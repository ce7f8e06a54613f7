"""The producers of pre-quantized checkpoints, run inside their own virtual environments (never imported by
trtbuild): each quantizes a float HF Llama with the real library on CPU, saves the checkpoint as the library saves
it, and writes the reference issue 28's evidence compares our engine to — the producer's own dequantization in
float32 put into a float transformers model — as files, no pickles:

    OUT/ckpt/                   the pre-quantized checkpoint (config.json, model.safetensors, tokenizer)
    OUT/dequant.safetensors     {HF linear name .weight: float32}: the producer's dequantized weights
    OUT/logits_NAME.npy         float32 [rows, tokens, vocab]: the reference model's logits of each row alone, for
                                each set of rows NAME in ROWS.json ({NAME: [[token id, ...], ...]})
    OUT/meta.json               what ran, how long it took

    <venv>/bin/python bench/prequant_producers.py llmcompressor SCHEME MODEL OUT ROWS.json
    <venv>/bin/python bench/prequant_producers.py gptqmodel desc_act|plain MODEL OUT ROWS.json

llmcompressor (compressed-tensors 0.19): `oneshot` with QuantizationModifier (FP8, FP8_DYNAMIC, NVFP4, W8A16_CHANNEL) or
GPTQModifier (W4A16, W4A16_ASYM) on random calibration rows. Reference: each quantized module is decompressed by
compressed-tensors' own compressor with its scales in float32 (`decompress` for float- and pack-quantized; NVFP4's
`unpack_fp4_from_uint8(dtype=float32)` + `dequantize`, because its compressor decompresses to bfloat16), then the
model runs with compressed-tensors' own quantized forward (`set_forward_quantized`): static and dynamic input
activations are quantized by the producer's code, the weights are not touched again.

gptqmodel 7.7: `GPTQModel.load` + `quantize` (bits 4, group 32, sym False, desc_act on or off) on CPU, saved in its
default (v2-converted-to-v1 on save) GPTQ format. Reference: the saved tensors dequantized by gptqmodel's own
`PackableQuantLinear.dequantize_weight` (on a TorchLinear) in float32 (its CPU kernel runs in fp16/bf16 only), put
into a float transformers model; activations are not quantized (W4A16).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

CALIB_ROWS, CALIB_LEN = 16, 32
FP8_TENSOR = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor"}
# schemes without an llm-compressor preset, spelled out as compressed-tensors config groups (weights, inputs)
SPELLED_OUT: dict[str, tuple[dict[str, Any], dict[str, Any] | None]] = {
    # the preset W8A16 is int8 per group of 128
    "W8A16_CHANNEL": ({"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}, None),
    # per-tensor FP8 weights, each input quantized at run time over the whole tensor
    "FP8_DYNAMIC_TENSOR": (FP8_TENSOR, {**FP8_TENSOR, "dynamic": True}),
    # the preset FP8_BLOCK's 128 x 128 blocks with 1 x 128 input groups, at 64 (the test model's k/v have 64 rows)
    "FP8_BLOCK64": (
        {**FP8_TENSOR, "strategy": "block", "block_structure": [64, 64]},
        {**FP8_TENSOR, "strategy": "group", "group_size": 64, "dynamic": True},
    ),
}


def calibration(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, vocab, (CALIB_ROWS, CALIB_LEN), generator=g).tolist()


@torch.no_grad()
def save_logits(out: Path, model: Any, rows: dict[str, list[list[int]]]) -> None:
    for name, ids in rows.items():
        logits = [model(torch.tensor([r])).logits[0].float().numpy() for r in ids]
        np.save(out / f"logits_{name}.npy", np.stack(logits).astype(np.float32))


def save_weights(path: Path, weights: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().float().contiguous() for k, v in weights.items()}, str(path))


# --- llmcompressor / compressed-tensors ---


def llmcompressor(scheme: str, model_dir: Path, out: Path, rows: dict[str, list[list[int]]]) -> dict[str, Any]:
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    calib = calibration(model.config.vocab_size)
    ds = Dataset.from_dict({"input_ids": calib, "attention_mask": [[1] * CALIB_LEN] * CALIB_ROWS})
    if scheme in ("W4A16", "W4A16_ASYM"):
        recipe: Any = GPTQModifier(targets="Linear", scheme=scheme, ignore=["lm_head"])
    elif scheme in SPELLED_OUT:
        weights, inputs = SPELLED_OUT[scheme]
        group = {"targets": ["Linear"], "weights": weights, "input_activations": inputs}
        recipe = QuantizationModifier(config_groups={"group_0": group}, ignore=["lm_head"])
    elif scheme in ("FP8_KV", "FP8_KV_SHARED"):  # static FP8 with an FP8 KV cache (k_scale / v_scale per layer)
        recipe = QuantizationModifier(
            targets="Linear", scheme="FP8", ignore=["lm_head"], kv_cache_scheme={**FP8_TENSOR, "dynamic": False}
        )
    else:
        recipe = QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"])
    oneshot(
        model=model,
        dataset=ds,
        recipe=recipe,
        max_seq_length=CALIB_LEN,
        num_calibration_samples=CALIB_ROWS,
        output_dir=str(out / "ckpt"),
    )
    quantize_s = time.perf_counter() - t0
    if scheme == "FP8_KV_SHARED":
        share_kv_scales(out / "ckpt")
    t1 = time.perf_counter()
    ref, weights = ct_reference(out / "ckpt")
    save_weights(out / "dequant.safetensors", weights)
    save_logits(out, ref, rows)
    reference_s = time.perf_counter() - t1
    # that the reference's forward quantizes activations where the scheme says so: the same rows with
    # compressed-tensors' QDQ switched off (`quantization_enabled`) must then differ
    with torch.no_grad():
        ids = torch.tensor([rows["8"][0]])
        quantized = ref(ids).logits
        for module in ref.modules():
            if getattr(module, "quantization_scheme", None) is not None:
                module.quantization_enabled = False
        plain = ref(ids).logits
    return {
        "quantize_s": quantize_s,
        "reference_s": reference_s,
        "input_qdq_effect": (quantized - plain).abs().max().item(),
    }


def share_kv_scales(ckpt: Path) -> None:
    """Edit the saved checkpoint (stated as such where used): each layer's k_scale and v_scale set to their max, the
    one KV scale per layer our engine holds; the reference is then compressed-tensors' forward of that checkpoint."""
    from safetensors.torch import load_file, save_file

    path = ckpt / "model.safetensors"
    tensors = load_file(str(path))
    for name in [n for n in tensors if n.endswith(".k_scale")]:
        v = name.removesuffix(".k_scale") + ".v_scale"
        shared = torch.maximum(tensors[name], tensors[v])
        tensors[name], tensors[v] = shared, shared.clone()
    save_file(tensors, str(path), metadata={"format": "pt"})


def ct_reference(ckpt: Path) -> tuple[Any, dict[str, torch.Tensor]]:
    """The compressed checkpoint loaded by transformers (still compressed: its decompression hook removed), each
    quantized linear decompressed as compressed-tensors' `decompress_module` does (compressors/base.py) but with
    every scale in float32, the module then DECOMPRESSED: its forward (`set_forward_quantized`) quantizes the input
    as declared and leaves the weight alone."""
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization import QuantizationStatus
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from compressed_tensors.utils.module import get_direct_state_dict, replace_direct_state_dict
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    hook = getattr(model, "ct_decompress_hook", None)
    assert hook is not None, "transformers no longer defers compressed-tensors' decompression: revisit"
    hook.remove()
    del model.ct_decompress_hook
    weights: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None or scheme.weights is None:
            continue
        assert module.quantization_status == QuantizationStatus.COMPRESSED, (name, module.quantization_status)
        state = dict(get_direct_state_dict(module))
        for k, v in state.items():
            if k != "weight" and v is not None and v.is_floating_point():
                state[k] = v.float()  # scales: float32 (a bfloat16 model's would otherwise set the dtype)
        fmt = str(getattr(scheme.format, "value", scheme.format))
        if fmt == "nvfp4-pack-quantized":  # its compressor unpacks to bfloat16: the same steps in float32
            packed = state.pop("weight_packed")
            m, n = packed.shape
            codes = unpack_fp4_from_uint8(packed, m, n * 2, dtype=torch.float32)
            state["weight"] = dequantize(
                x_q=codes,
                scale=state["weight_scale"],
                args=scheme.weights,
                global_scale=state["weight_global_scale"],
                dtype=torch.float32,
            )
        else:
            state = dict(BaseCompressor.load_from_registry(fmt).decompress(state, scheme))
        w = state["weight"]
        assert w.dtype == torch.float32, (name, w.dtype)
        replace_direct_state_dict(module, state)
        module.quantization_status = QuantizationStatus.DECOMPRESSED
        weights[f"{name}.weight"] = w
    return model, weights


# --- gptqmodel ---


def gptqmodel(variant: str, model_dir: Path, out: Path, rows: dict[str, list[list[int]]]) -> dict[str, Any]:
    # its loader asks for a pool of 2 CPU workers but sizes the CPU pool (cores + 1) // 2: 1 on a 2-core machine
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
    from gptqmodel import GPTQModel, QuantizeConfig
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    cfg = QuantizeConfig(bits=4, group_size=32, sym=False, desc_act=variant == "desc_act")
    model = GPTQModel.load(str(model_dir), cfg, device="cpu", dtype=torch.float32)
    vocab = model.model.config.vocab_size
    calib = [{"input_ids": r, "attention_mask": [1] * len(r)} for r in calibration(vocab)]
    model.quantize(calib, batch_size=1)
    model.save(str(out / "ckpt"))
    quantize_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    weights = gptq_dequantized(out / "ckpt")
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    state = ref.state_dict()
    for k, w in weights.items():
        assert state[k].shape == w.shape, (k, state[k].shape, w.shape)
        state[k].copy_(w)
    save_weights(out / "dequant.safetensors", weights)
    save_logits(out, ref, rows)
    return {"quantize_s": quantize_s, "reference_s": time.perf_counter() - t1}


def gptq_dequantized(ckpt: Path) -> dict[str, torch.Tensor]:
    """Each saved GPTQ linear dequantized by gptqmodel's TorchLinear (its v1 -> v2 zero conversion included),
    in float32."""
    from gptqmodel.nn_modules.qlinear import PackableQuantLinear
    from gptqmodel.nn_modules.qlinear.torch import TorchLinear
    from gptqmodel.utils.model import convert_gptq_v1_to_v2_format_module
    from safetensors.torch import load_file

    config = json.loads((ckpt / "config.json").read_text())["quantization_config"]
    tensors = load_file(str(ckpt / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for key in sorted(k for k in tensors if k.endswith(".qweight")):
        prefix = key.removesuffix(".qweight")
        qweight = tensors[key]
        in_features, out_features = qweight.shape[0] * 32 // config["bits"], qweight.shape[1]
        layer = TorchLinear(
            bits=config["bits"],
            group_size=config["group_size"],
            sym=config["sym"],
            desc_act=config["desc_act"],
            in_features=in_features,
            out_features=out_features,
            bias=False,
            pack_dtype=torch.int32,
        )
        layer.qweight.copy_(qweight)
        layer.qzeros.copy_(tensors[f"{prefix}.qzeros"])
        layer.scales = tensors[f"{prefix}.scales"].float()
        layer.g_idx.copy_(tensors[f"{prefix}.g_idx"])
        if config.get("checkpoint_format", "gptq") == "gptq":
            convert_gptq_v1_to_v2_format_module(layer, bits=config["bits"], pack_dtype=torch.int32)
        layer.eval()
        # the generic unpack (PackableQuantLinear.s), not TorchLinear's torch.compile'd fast path: the same arithmetic
        w = PackableQuantLinear.dequantize_weight(layer)
        assert w.dtype == torch.float32, (prefix, w.dtype)
        out[f"{prefix}.weight"] = w.T.contiguous()
    return out


def main() -> None:
    producer, variant, model_dir, out, rows_file = sys.argv[1:6]
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = json.loads(Path(rows_file).read_text())
    run = {"llmcompressor": llmcompressor, "gptqmodel": gptqmodel}[producer]
    meta = run(variant, Path(model_dir), out_dir, rows)
    meta |= {"producer": producer, "variant": variant, "torch": torch.__version__}
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=1))


if __name__ == "__main__":
    main()
