"""KV cache quantization (INT8 / FP8 / NVFP4): one float32 [1] scale per attention layer,
LAYER.attention.kv_cache_scaling_factor, from the calibration maximum of |k| and |v| as the cache stores them.

INT8 clips below that maximum (a searched ratio, calibrate.kv_cache_clip: a few large |k| would otherwise set a
coarse step for all the rest); FP8's error is relative to each value, so clipping buys it nothing
(docs/quality.md).

NVFP4 (`--kv-cache nvfp4`, kv_cache_quant_algo "NVFP4", TensorRT-LLM's `QuantAlgo.NVFP4` as a KV cache algo): the
layer's scale is the NVFP4 global (second-level) scale, amax / (6 · 448), multiplying — what ModelOpt writes for a
(2, 1)-bit KV quantizer (modelopt/torch/export/quant_utils.py `get_scaling_factor` ->
`NVFP4QTensor.get_weights_scaling_factor_2_from_quantizer`; `_compute_kv_cache_dtype` names it NVFP4, NVFP4_AFFINE
when the quantizers carry a bias, which trtbuild does not make). Each stored k / v head row is quantized in blocks of
16 along head_size: an E4M3 block scale = block amax / (6 · global), then E2M1 codes of x / (block scale · global)
(NVFP4QTensor's arithmetic, methods/nvfp4.py `nvfp4_qdq`, which the engine's KVCacheWrite and the reference forward
both call). TensorRT-LLM holds such a cache as packed FP4 with the block scales in a pool of their own; trtbuild's
pool holds the NVFP4-dequantized values in float32 (contract.KV_DTYPES "nvfp4"): the reads are the same numbers, the
memory is not saved (docs/quantization.md).

The scale conventions differ by consumer. What trtbuild writes is ModelOpt's TensorRT-LLM-checkpoint value (above),
amax / (6 · 448). ModelOpt 0.47's HF export writes k_scale = v_scale = amax / 448 for NVFP4 as for FP8
(modelopt/torch/export/unified_export_hf.py `_export_transformers_checkpoint`: `kv_cache_max_bound = 448`, applied in
quant_utils.py `postprocess_state_dict`). TensorRT-LLM's PyTorch runtime uses amax / 448 as its second-level scale
(`kv_scales` = [1, max k_scale, max v_scale], passed to the attention op as kv_scale_quant_orig / `kv_scales_sf`,
its inverse as kv_scale_orig_quant; tensorrt_llm/_torch/modules/linear.py
`FP8QDQLinearMethod.process_weights_after_loading_fused_qkv_linear`, commit 00bbf71e: the checkpoint's k_scale as is,
under TRTLLM_LOAD_KV_SCALES=1, the default; an older stored version of the same file multiplied a checkpoint's
amax / (6 · 448) by 6, "to avoid overflow when dequantizing NVFP4 in attention kernels", default off). With that
global the block scales are a sixth of ModelOpt's (at most 448 / 6) and round to E4M3 differently, so most stored
values differ from these (84.6 % of a 4096 × 128 Gaussian K, measured with `nvfp4_qdq` at both globals) while the
error is the same size (relative RMS 0.0953 here, 0.0954 at amax / 448): an engine of TensorRT-LLM's is not
expected to match this reference value for value.
The block size needs head_size a multiple of 16 (`check_head_size`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from toolchain.errors import UserError
from toolchain.quantize.calibrate import Calibration, kv_cache_clip
from toolchain.quantize.core import FP8_E4M3_MAX

KV_SCALE = "attention.kv_cache_scaling_factor"  # LAYER.<this>: TensorRT-LLM's name


@dataclass(frozen=True)
class KvCacheQuant:
    name: str  # `--kv-cache`, a recipe's `quantize.kv_cache`
    quant_algo: str  # config.json's quantization.kv_cache_quant_algo; also the fake-quant kind
    maxbound: float
    clips: bool

    def scales(self, calib: Calibration) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """Each calibrated layer's scale tensor, by tensor name, and (INT8) its clip ratio r, by layer:
        scale = max(|k|, |v|) · r / maxbound."""
        tensors: dict[str, torch.Tensor] = {}
        clip: dict[str, float] = {}
        for layer, amax in calib.kv_amax.items():
            if self.clips:
                clip[layer] = kv_cache_clip(calib, layer)
            scale = amax * clip.get(layer, 1.0) / self.maxbound
            tensors[f"{layer}.{KV_SCALE}"] = torch.tensor([scale if scale > 0 else 1.0])
        return tensors, clip


INT8_KV: KvCacheQuant = KvCacheQuant("int8", "INT8", 127.0, clips=True)
FP8_KV: KvCacheQuant = KvCacheQuant("fp8", "FP8", FP8_E4M3_MAX, clips=False)
NVFP4_BLOCK = 16  # along head_size
NVFP4_KV: KvCacheQuant = KvCacheQuant("nvfp4", "NVFP4", 6.0 * FP8_E4M3_MAX, clips=False)  # E2M1's 6 · E4M3's 448


def check_head_size(kv: KvCacheQuant | None, head_size: int, source: str) -> None:
    """Refuse an NVFP4 KV cache on heads that are not whole blocks of 16."""
    if kv is NVFP4_KV and head_size % NVFP4_BLOCK:
        raise UserError(
            f"{source}: head_size {head_size} is not a multiple of {NVFP4_BLOCK}; an NVFP4 KV cache quantizes each "
            "head row in blocks of 16: use --kv-cache fp8 (or int8, none)"
        )
