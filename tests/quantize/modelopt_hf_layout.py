"""ModelOpt's own unified HF export of a model, for tests/quantize/test_hf_roundtrip.py to hold `quantize --format hf`
to: run in a python that imports `modelopt` (a subprocess; trtbuild's own process never imports it), files in and
out (JSON), no pickles.

    HF OUT CALIB GROUP   for each of fp8 (+ FP8 KV cache), int4_awq and w4a8_awq (int4 block GROUP), int8_wo and
                         nvfp4: HF quantized on CPU with ModelOpt's own config (calibration: the first windows of
                         text file CALIB), written by
                         `modelopt.torch.export.export_hf_checkpoint` into OUT/ALGO, and OUT/ALGO/layout.json:
                         {tensor: [safetensors dtype, shape]} of its weights, and `convert_hf_quant_config_format`
                         of hf_quant_config.json under the key "__quantization_config__" (what config.json embeds)
"""

from __future__ import annotations

import copy
import json
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")  # ModelOpt warns about untested transformers versions and CPU-only torch


def main(hf: Path, out: Path, calib: Path, group: int) -> None:
    import modelopt.torch.quantization as mtq
    import torch
    from modelopt.torch.export import export_hf_checkpoint
    from modelopt.torch.export.convert_hf_config import convert_hf_quant_config_format
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf)
    ids = tok(calib.read_text(encoding="utf-8")[:16384], return_tensors="pt").input_ids[0]
    windows = [ids[i * 64 : (i + 1) * 64][None] for i in range(4)]
    configs = {
        "fp8": mtq.FP8_DEFAULT_CFG,
        "int4_awq": mtq.INT4_AWQ_CFG,
        "int8_wo": mtq.INT8_WEIGHT_ONLY_CFG,
        "nvfp4": mtq.NVFP4_DEFAULT_CFG,
        "w4a8_awq": mtq.W4A8_AWQ_BETA_CFG,
    }
    for algo, base in configs.items():
        cfg = copy.deepcopy(base)
        for entry in cfg["quant_cfg"]:
            if entry.get("quantizer_name") == "*weight_quantizer" and algo in ("int4_awq", "w4a8_awq"):
                for c in entry["cfg"] if isinstance(entry["cfg"], list) else [entry["cfg"]]:
                    if c.get("block_sizes"):  # the int4 stage (W4A8's second, FP8 stage has none)
                        c["block_sizes"][-1] = group
        if algo == "fp8":
            cfg["quant_cfg"] = [*cfg["quant_cfg"], *copy.deepcopy(mtq.FP8_KV_CFG["quant_cfg"])]
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()

        def loop(m: torch.nn.Module) -> None:
            with torch.no_grad():
                for w in windows:
                    m(w)

        model = mtq.quantize(model, cfg, loop)
        with torch.no_grad():
            export_hf_checkpoint(model, export_dir=out / algo)
        layout: dict[str, object] = {}
        for path in sorted((out / algo).glob("*.safetensors")):
            with safe_open(str(path), "pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    t = f.get_slice(name)
                    layout[name] = [t.get_dtype(), list(t.get_shape())]
        hf_quant = json.loads((out / algo / "hf_quant_config.json").read_text())
        layout["__quantization_config__"] = convert_hf_quant_config_format(hf_quant)
        (out / algo / "layout.json").write_text(json.dumps(layout))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]))
