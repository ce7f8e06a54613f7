"""NVIDIA ModelOpt's figures beside trtbuild's in bench/quality.py: for one method spec (trtbuild's method, group
size, KV cache), ModelOpt quantizes the float Hugging Face model on the same calibration windows and is scored on
the same evaluation tokens against the same float reference, two ways:

- engine: ModelOpt's TensorRT-LLM checkpoint export (`export_tensorrt_llm_checkpoint`) built with `trtbuild build`
  (ONNX Runtime backend, `--tokenizer` the HF dir) and scored through that engine: the deployable comparison;
- fake-quant: ModelOpt's own quantized torch model (its fake-quant modules) scored on the same windows.

ModelOpt runs in its own python (TRTBUILD_MODELOPT_PYTHON, else ~/.cache/trtbuild-peers/venvs/modelopt, else this
interpreter; tests/quantize/modelopt_export.py says how to make it), which runs this file as a worker: it reads the
windows from a safetensors file, writes the fake-quant logits and the export, and a result.json with the error of
whichever failed (ModelOpt's int4 export refuses a K that is not a whole number of groups). Each figure is a quality
dict (toolchain.quality.QualityReport) or a one-line reason.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the worker runs in ModelOpt's python, where only this checkout has toolchain

from toolchain.quantize.methods import KV_CACHE_NAMES  # noqa: E402  torch-free: the worker imports it too

PEER_VENV = Path.home() / ".cache" / "trtbuild-peers" / "venvs" / "modelopt" / "bin" / "python"

# trtbuild method -> ModelOpt's config of the same scheme (modelopt.torch.quantization), used as ModelOpt ships it
# but for the int4 block size and the KV cache quantizers (as tests/quantize/modelopt_export.py does)
MODELOPT_CONFIGS = {
    "w8a16": "INT8_WEIGHT_ONLY_CFG",
    "w4a16": "INT4_BLOCKWISE_WEIGHT_ONLY_CFG",
    "w4a16_awq": "INT4_AWQ_CFG",
    "w8a8_sq": "INT8_SMOOTHQUANT_CFG",
    "fp8": "FP8_DEFAULT_CFG",
    "w4a8_awq": "W4A8_AWQ_BETA_CFG",  # int4 per 128 (awq_lite), FP8 per tensor stage of the weight, FP8 inputs
}


@dataclass(frozen=True)
class Spec:
    """One row of bench/quality.py in trtbuild's names."""

    method: str
    group: int = 128
    kv_cache: str = "none"

    def args(self) -> list[str]:
        return ["--method", self.method, "--group-size", str(self.group), "--kv-cache", self.kv_cache]


def modelopt_python() -> tuple[str | None, str]:
    """(a python that imports modelopt, "") or (None, why there is none)."""
    candidates = [os.environ.get("TRTBUILD_MODELOPT_PYTHON"), str(PEER_VENV), sys.executable]
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('modelopt') is None)"
    for python in candidates:
        if (
            python
            and Path(python).is_file()
            and subprocess.run([python, "-c", probe], capture_output=True).returncode == 0
        ):
            return python, ""
    return None, (
        "nvidia-modelopt not importable (set TRTBUILD_MODELOPT_PYTHON, make the venv "
        f"{PEER_VENV.parent.parent} or `pip install -e .[peers]`; see tests/quantize/modelopt_export.py)"
    )


def skip_reason(spec: Spec) -> str | None:
    """Why ModelOpt has no figure for `spec` at all, before running it."""
    if spec.method not in MODELOPT_CONFIGS:
        return f"no ModelOpt config for {spec.method} (known: {', '.join(MODELOPT_CONFIGS)})"
    return None


@dataclass(frozen=True)
class Inputs:
    """What every row is scored with, as bench/quality.py's trtbuild rows are (toolchain/quantize/stage.py)."""

    hf_dir: Path
    calib_windows: Any  # int64 [samples, seq_len]: trtbuild's calibration windows
    eval_tokens: Any  # int64 [tokens]
    window: int
    reference: Any  # ids [batch, seq] -> logits: the float checkpoint's reference forward


def prepare(
    hf_dir: Path, ckpt: Path, calib_data: Path, samples: int, seq_len: int, seed: int, eval_data: Path, limit: int
) -> Inputs:
    """The calibration windows `trtbuild quantize` samples, the evaluation tokens it scores and its float
    reference, for converted checkpoint `ckpt` of `hf_dir`."""
    from toolchain.checkpoint.trtllm import load_rank, read_config
    from toolchain.quantize.calibrate import sample_windows
    from toolchain.reference.model import ReferenceModel
    from toolchain.text import tokenize

    cfg = read_config(ckpt)
    calib = sample_windows(tokenize(calib_data, ckpt), samples, seq_len, seed)
    model = ReferenceModel(cfg, load_rank(ckpt, 0))
    window = min(256, cfg.max_position_embeddings)
    return Inputs(hf_dir, calib, tokenize(eval_data, ckpt, max_tokens=limit), window, model.forward)


def measure(spec: Spec, inputs: Inputs, python: str, work: Path) -> dict[str, Any]:
    """ModelOpt's figures for `spec`: {"engine": quality dict | reason, "fake_quant": quality dict | reason,
    "seconds": float}, scored as toolchain.quality.compare scores trtbuild's rows."""
    reason = skip_reason(spec)
    if reason:
        return {"engine": reason, "fake_quant": reason, "seconds": 0.0}
    from safetensors.torch import save_file

    from toolchain.quality import compare

    start, tokens, window = time.perf_counter(), inputs.eval_tokens, inputs.window
    work.mkdir(parents=True)
    count = tokens.numel() // window
    windows = {"calib": inputs.calib_windows.clone(), "eval": tokens[: count * window].reshape(count, window).clone()}
    save_file(windows, str(work / "windows.safetensors"))
    cmd = [python, str(Path(__file__).resolve()), "--worker", str(inputs.hf_dir), str(work), *spec.args()]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0 or not (work / "result.json").is_file():
        reason = _last_line(done.stderr) or f"ModelOpt worker exited {done.returncode}"
        return {"engine": reason, "fake_quant": reason, "seconds": time.perf_counter() - start}
    result = json.loads((work / "result.json").read_text())
    out: dict[str, Any] = {"engine": result["export"], "fake_quant": result["fake_quant"]}
    if result["fake_quant"] is None:
        replay = _Replay(work / "logits.safetensors")
        out["fake_quant"] = compare(inputs.reference, replay, tokens, window).to_dict()
    if result["export"] is None:
        out["engine"] = engine_quality(work / "export", inputs, work / "engine")
    out["seconds"] = time.perf_counter() - start
    return out


def engine_quality(checkpoint: Path, inputs: Inputs, engine_dir: Path) -> dict[str, Any] | str:
    """Build `checkpoint` into a CPU engine (the tokenizer from the HF dir) and score it on the tokens; a refusal
    is the reason."""
    from toolchain.engine.api import open_engine
    from toolchain.engine.build import BuildOptions, build_engine
    from toolchain.errors import UserError
    from toolchain.evaluate.engine_eval import EngineSession
    from toolchain.quality import compare

    try:
        opts = BuildOptions("onnxruntime", max_seq_len=inputs.window)
        build_engine(checkpoint, engine_dir, opts, tokenizer=inputs.hf_dir)
    except UserError as e:
        return f"trtbuild build refused it: {e}"
    session = EngineSession(open_engine(engine_dir))
    return compare(inputs.reference, session.all_logits, inputs.eval_tokens, inputs.window).to_dict()


class Peer:
    """ModelOpt's column for bench/quality.py: one measurement per spec (rows that differ only in a trtbuild
    option, e.g. SmoothQuant's α, share it), or None for every row with the reason printed once."""

    def __init__(self, hf_dir: Path, ckpt: Path, work: Path, calib_data: Path, data: Path, limit: int, **calib: int):
        """`calib`: samples, seq_len, seed as bench/quality.py calibrates trtbuild (default 64, 256, 0)."""
        self.python, self.reason = modelopt_python()
        self.work = work
        self.done: dict[Spec, dict[str, Any]] = {}
        if self.python is None:
            print(f"ModelOpt column skipped: {self.reason}", file=sys.stderr)
            return
        c = {"samples": 64, "seq_len": 256, "seed": 0, **calib}
        self.inputs = prepare(hf_dir, ckpt, calib_data, c["samples"], c["seq_len"], c["seed"], data, limit)

    def row(self, method: str, group: int, kv_cache: str) -> dict[str, Any] | None:
        if self.python is None:
            return None
        method = method.split(" ")[0]  # "w8a8_sq (α 0.5)": ModelOpt's SmoothQuant is one spec, its own α
        spec = Spec(method, group if method.startswith("w4a16") and group else 128, kv_cache)
        if spec not in self.done:
            self.done[spec] = measure(spec, self.inputs, self.python, self.work / f"modelopt-{len(self.done)}")
        return {"config": MODELOPT_CONFIGS.get(method), **self.done[spec]}


def markdown(rows: list[dict[str, Any]]) -> list[str]:
    """trtbuild's rows beside ModelOpt's figures: PPL ratio / mean KLD, or why there is none."""
    lines = [
        "| method | group | KV cache | trtbuild | ModelOpt export → trtbuild engine | ModelOpt fake-quant |",
        "|---|---:|---|---|---|---|",
    ]
    for r in rows:
        mo = r.get("modelopt")
        if mo is None:
            continue
        lines.append(
            f"| {r['method']} | {r['group'] or '-'} | {r['kv_cache']} | {cell(r)} | {cell(mo['engine'])} "
            f"| {cell(mo['fake_quant'])} |"
        )
    return lines


class _Replay:
    """The worker's logits, handed out batch by batch in the order compare() asks for them (checked by the ids)."""

    def __init__(self, path: Path):
        from safetensors.torch import load_file

        saved = load_file(str(path))
        self.ids, self.logits, self.at = saved["ids"], saved["logits"], 0

    def __call__(self, ids: Any) -> Any:
        rows = slice(self.at, self.at + ids.shape[0])
        if not bool((self.ids[rows] == ids).all()):
            raise RuntimeError("ModelOpt's logits are for other windows than the ones scored")
        self.at += ids.shape[0]
        return self.logits[rows]


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def cell(figure: dict[str, Any] | str) -> str:
    """A table cell: "PPL ratio / mean KLD" or the reason."""
    if isinstance(figure, str):
        return figure.replace("|", "/")
    return f"{figure['ppl_ratio']:.4f} / {figure['kld_mean']:.5f}"


# -- the worker: runs in ModelOpt's python ---------------------------------------------------------------------------


def quant_config(spec: Spec) -> dict[str, Any]:
    import modelopt.torch.quantization as mtq

    cfg = copy.deepcopy(getattr(mtq, MODELOPT_CONFIGS[spec.method]))
    for entry in cfg["quant_cfg"]:
        if entry.get("quantizer_name") == "*weight_quantizer" and "block_sizes" in entry.get("cfg", {}):
            entry["cfg"]["block_sizes"][-1] = spec.group
    if spec.kv_cache != "none":
        kv = copy.deepcopy(mtq.FP8_KV_CFG["quant_cfg"])
        if spec.kv_cache == "int8":
            for entry in kv:
                entry["cfg"]["num_bits"] = 8
        cfg["quant_cfg"] = list(cfg["quant_cfg"]) + kv
    return cfg


def _error(e: BaseException) -> str:
    return f"ModelOpt {type(e).__name__}: {_last_line(str(e)) or 'no message'}"


def worker(hf_dir: Path, work: Path, spec: Spec) -> None:
    import modelopt.torch.quantization as mtq
    import torch
    from modelopt.torch.export import export_tensorrt_llm_checkpoint
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    warnings.filterwarnings("ignore")  # ModelOpt warns about untested transformers versions and CPU-only torch
    windows = load_file(str(work / "windows.safetensors"))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()

    def forward_loop(m: torch.nn.Module) -> None:
        with torch.no_grad():
            for start in range(0, windows["calib"].shape[0], 8):
                m(windows["calib"][start : start + 8])

    result: dict[str, str | None] = {}
    try:
        model = mtq.quantize(model, quant_config(spec), forward_loop)
    except Exception as e:  # ModelOpt's refusal is the figure's reason
        (work / "result.json").write_text(json.dumps({"export": _error(e), "fake_quant": _error(e)}))
        return
    with torch.no_grad():
        logits = [model(windows["eval"][s : s + 8]).logits.float() for s in range(0, windows["eval"].shape[0], 8)]
    save_file({"ids": windows["eval"], "logits": torch.cat(logits).contiguous()}, str(work / "logits.safetensors"))
    result["fake_quant"] = None
    try:
        with torch.no_grad():  # tensor parallel 0 divides by zero in 0.47's shape check: say 1
            export_tensorrt_llm_checkpoint(
                model, "llama", dtype=torch.float32, export_dir=work / "export", inference_tensor_parallel=1
            )
        result["export"] = None
    except Exception as e:  # ditto
        result["export"] = f"export failed: {_error(e)}"
    (work / "result.json").write_text(json.dumps(result))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", nargs=2, type=Path, metavar=("HF_DIR", "WORK"), required=True)
    ap.add_argument("--method", choices=sorted(MODELOPT_CONFIGS), required=True)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--kv-cache", choices=KV_CACHE_NAMES, default="none")
    args = ap.parse_args(argv)
    worker(args.worker[0], args.worker[1], Spec(args.method, args.group_size, args.kv_cache))
    return 0


if __name__ == "__main__":
    sys.exit(main())
