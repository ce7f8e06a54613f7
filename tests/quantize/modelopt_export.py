"""Quantize a Hugging Face model with NVIDIA ModelOpt and export a TensorRT-LLM checkpoint: the peer whose output
`trtbuild build` must accept (tests/quantize/test_modelopt_interop.py, docs/conversion.md "ModelOpt checkpoints").

Run it with a python that imports `modelopt` (nvidia-modelopt >= 0.47; it runs on CPU), for example the venv that
`pip install -e .[peers]` makes, or one beside trtbuild's:

    M=~/.cache/trtbuild-peers/venvs/modelopt   # ModelOpt's own venv, seeing trtbuild's torch and transformers:
    .venv/bin/python -m venv $M && echo $PWD/.venv/lib/python3.11/site-packages > $M/lib/python3.11/site-packages/t.pth
    $M/bin/pip install 'nvidia-modelopt>=0.47' requests
    $M/bin/python tests/quantize/modelopt_export.py HF_DIR -o OUT --method fp8:fp8 --calib-data VALID.txt

Methods are ModelOpt's own configs, unchanged but for the AWQ block size: fp8 = FP8_DEFAULT_CFG, w8a8_sq =
INT8_SMOOTHQUANT_CFG, int4_awq = INT4_AWQ_CFG; --kv-cache fp8 adds FP8_KV_CFG, int8 the same quantizers with 8 bits.
The export is `modelopt.torch.export.export_tensorrt_llm_checkpoint` (decoder type llama), which writes no
tokenizer: give the HF dir to `trtbuild build --tokenizer`. Deterministic for a given model and text (CPU, no
sampling): the calibration windows are the first N of the text.
"""

from __future__ import annotations

import argparse
import copy
import shutil
import sys
import warnings
from pathlib import Path

METHODS = ("fp8", "w8a8_sq", "int4_awq")
KV_CACHES = ("none", "fp8", "int8")


def quant_config(method: str, kv_cache: str, group_size: int, exclude: list[str] | None = None) -> dict:
    import modelopt.torch.quantization as mtq

    base = {"fp8": mtq.FP8_DEFAULT_CFG, "w8a8_sq": mtq.INT8_SMOOTHQUANT_CFG, "int4_awq": mtq.INT4_AWQ_CFG}[method]
    cfg = copy.deepcopy(base)
    if method == "int4_awq":
        for entry in cfg["quant_cfg"]:
            if entry.get("quantizer_name") == "*weight_quantizer":
                entry["cfg"]["block_sizes"][-1] = group_size
    for pattern in exclude or []:  # HF module names, e.g. *mlp.down_proj*: those linears stay in float
        cfg["quant_cfg"] = [*cfg["quant_cfg"], {"quantizer_name": f"{pattern}", "enable": False}]
    if kv_cache != "none":
        kv = copy.deepcopy(mtq.FP8_KV_CFG["quant_cfg"])
        if kv_cache == "int8":
            for entry in kv:
                entry["cfg"]["num_bits"] = 8
        cfg["quant_cfg"] = list(cfg["quant_cfg"]) + kv
    return cfg


def calibration_windows(hf_dir: Path, text_file: Path, samples: int, seq_len: int) -> list:
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    tokenizer.model_max_length = 1 << 62  # the text is cut into windows below
    text = text_file.read_text(encoding="utf-8")[: samples * seq_len * 16]  # a token is rarely over 16 characters
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    count = min(samples, ids.numel() // seq_len)
    if count < 1:
        raise SystemExit(f"error: {text_file} has {ids.numel()} tokens, fewer than --calib-seq-len {seq_len}")
    return [ids[i * seq_len : (i + 1) * seq_len][None].to(torch.long) for i in range(count)]


def export(
    hf_dir: Path, out: Path, method: str, kv_cache: str, windows: list, group_size: int, exclude: list[str]
) -> None:
    import modelopt.torch.quantization as mtq
    import torch
    from modelopt.torch.export import export_tensorrt_llm_checkpoint
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()

    def forward_loop(m: torch.nn.Module) -> None:
        with torch.no_grad():
            for ids in windows:
                m(ids)

    model = mtq.quantize(model, quant_config(method, kv_cache, group_size, exclude), forward_loop)
    tmp = out.with_name(f".{out.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    with torch.no_grad():  # tensor parallel 0 ("as calibrated") divides by zero in 0.47's shape check: say 1
        export_tensorrt_llm_checkpoint(model, "llama", dtype=torch.float32, export_dir=tmp, inference_tensor_parallel=1)
    tmp.rename(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("hf_dir", type=Path)
    ap.add_argument("-o", "--out", type=Path, required=True)
    ap.add_argument(
        "--method",
        action="append",
        required=True,
        help=f"one of {', '.join(METHODS)}, optionally :KV ({', '.join(KV_CACHES)}), e.g. fp8:fp8; repeat it to "
        "export several in one run (then into OUT/METHOD or OUT/METHOD-KVkv)",
    )
    ap.add_argument("--kv-cache", choices=KV_CACHES, default="none", help="KV cache of a --method without :KV")
    ap.add_argument("--calib-data", type=Path, required=True, help="text file (not the evaluation text)")
    ap.add_argument("--calib-samples", type=int, default=16)
    ap.add_argument("--calib-seq-len", type=int, default=256)
    ap.add_argument("--group-size", type=int, default=128, help="int4_awq block size along the input")
    ap.add_argument(
        "--awq-exclude", action="append", default=[], help="HF module pattern int4_awq leaves in float (repeatable)"
    )
    args = ap.parse_args(argv)
    runs = []
    for spec in args.method:
        method, _, kv = spec.partition(":")
        kv = kv or args.kv_cache
        if method not in METHODS or kv not in KV_CACHES:
            ap.error(f"--method {spec}: expected one of {', '.join(METHODS)}, optionally :{'|'.join(KV_CACHES)}")
        name = method if kv == "none" else f"{method}-{kv}kv"
        runs.append((method, kv, args.out if len(args.method) == 1 else args.out / name))
    for _, _, out in runs:
        if out.exists():
            print(f"error: {out} exists; choose a new output directory", file=sys.stderr)
            return 1
    warnings.filterwarnings("ignore")  # ModelOpt warns about untested transformers versions and CPU-only torch
    windows = calibration_windows(args.hf_dir, args.calib_data, args.calib_samples, args.calib_seq_len)
    for method, kv, out in runs:
        out.parent.mkdir(parents=True, exist_ok=True)
        exclude = args.awq_exclude if method == "int4_awq" else []
        export(args.hf_dir, out, method, kv, windows, args.group_size, exclude)
        print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
