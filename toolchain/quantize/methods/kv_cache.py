"""KV cache quantization (INT8 / FP8): one float32 [1] scale per attention layer,
LAYER.attention.kv_cache_scaling_factor, from the calibration maximum of |k| and |v| as the cache stores them.

INT8 clips below that maximum (a searched ratio, calibrate.kv_cache_clip: a few large |k| would otherwise set a
coarse step for all the rest); FP8's error is relative to each value, so clipping buys it nothing
(docs/quality.md)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
