"""NVIDIA ModelOpt beside trtbuild on the random Qwen3-MoE of bench/moe_quant.py: the same model, the same
calibration windows (WikiText-2 valid.txt through the demo byte-level tokenizer, sampled as `trtbuild quantize`
samples them) and the same random-id scoring windows, every row scored by toolchain.quality.compare against the
float checkpoint's reference forward. trtbuild's rows are its fake-quant reference (which the CPU engine equals to
1e-4); ModelOpt's are its own fake-quant transformers model (`mtq.quantize`, CPU), one ModelOpt config per trtbuild
method (bench/quality_modelopt.py's MODELOPT_CONFIGS, as ModelOpt ships them but for the int4 block size). A method
trtbuild or ModelOpt refuses gets its one-line reason in the table, not a crash; the "float" row is the
harness check (transformers' float model in the worker against our reference: KLD ~0).

ModelOpt runs in its own python (bench/quality_modelopt.py's `modelopt_python`: TRTBUILD_MODELOPT_PYTHON, else
~/.cache/trtbuild-peers/venvs/modelopt, else this one), which runs this file as a worker over every config in one
process. With --export the worker also writes each config's `export_tensorrt_llm_checkpoint` and
`export_hf_checkpoint`, and the table below the figures says what `trtbuild build` / `trtbuild convert` make of them.

    python bench/moe_modelopt.py [--export] [--methods w8a16,fp8]   # markdown (or --json); docs/quantization.md
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the worker runs in ModelOpt's python, where only this checkout has toolchain

import quality_modelopt  # noqa: E402  bench/: ModelOpt's python, its configs, the logits replay

# (trtbuild method, group): each gets a trtbuild row and a ModelOpt row of the same scheme. "fp8" is trtbuild's
# routed calibration; its "(layer scales)" ablation is trtbuild-only (ModelOpt's experts share one input scale per
# layer, which is what that ablation does). Add a method here and both sides run it.
METHODS = [
    ("w8a16", 128),
    ("w4a16", 32),
    ("w4a16", 64),
    ("w4a16", 128),
    ("w4a16_awq", 32),
    ("w4a16_awq", 64),
    ("w4a16_awq", 128),
    ("w8a8_sq", 128),
    ("fp8", 128),
    ("fp8 (layer scales)", 128),
]
GROUPED = ("w4a16", "w4a16_awq")  # the methods whose group size is a row's key


def trtbuild_row(ckpt: Path, out: Path, label: str, group: int) -> dict[str, Any]:
    """Quantize `ckpt` with trtbuild as bench/moe_quant.py does -> {"reason"} or {"variant", "seconds", ...}."""
    from moe_quant import CALIB, CALIB_SAMPLES, CALIB_SEQ_LEN

    from toolchain.errors import UserError
    from toolchain.quantize import calibrate
    from toolchain.quantize.fake import load_quantized
    from toolchain.quantize.stage import QuantizeOptions, quantize_checkpoint

    method, layer_scales = label.split()[0], label.endswith("(layer scales)")
    calib = {"calib_data": CALIB, "calib_samples": CALIB_SAMPLES, "calib_seq_len": CALIB_SEQ_LEN}
    start, kept = time.perf_counter(), calibrate.MIN_EXPERT_TOKENS
    calibrate.MIN_EXPERT_TOKENS = 1 << 62 if layer_scales else kept  # the ablation: every expert falls back
    try:
        quantize_checkpoint(ckpt, out, QuantizeOptions(method, group_size=group, **calib))
    except UserError as e:
        return {"reason": f"trtbuild refuses it: {_first_line(str(e)).split('; ')[0]}"}  # the line, not its advice
    finally:
        calibrate.MIN_EXPERT_TOKENS = kept
    return {"variant": load_quantized(out).forward, "seconds": time.perf_counter() - start}


def modelopt_jobs(methods: list[tuple[str, int]]) -> list[dict[str, Any]]:
    """The worker's jobs: the float harness check, then one per distinct ModelOpt scheme in `methods`."""
    jobs: list[dict[str, Any]] = [{"name": "float", "method": None, "group": 128}]
    for label, group in methods:
        method = label.split()[0]
        if label != method:  # a trtbuild-only variant of its method, e.g. the layer-scales ablation
            continue
        name = f"{method}-g{group}" if method in GROUPED else method
        jobs.append({"name": name, "method": method, "group": group})
    return jobs


def run_modelopt(
    python: str | None,
    why: str,
    hf: Path,
    work: Path,
    calib: Any,
    eval_windows: Any,
    jobs: list[dict[str, Any]],
    export: bool,
) -> dict[str, dict[str, Any]]:
    """Every job's {"fake_quant": None | reason, "seconds", "exports": {"trtllm" | "hf": why it failed}} from one
    worker run (a job's exports that succeeded are in work/NAME-trtllm, work/NAME-hf)."""
    if python is None:
        return {j["name"]: {"fake_quant": why} for j in jobs}
    from safetensors.torch import save_file

    work.mkdir(parents=True)
    save_file({"calib": calib.contiguous(), "eval": eval_windows.contiguous()}, str(work / "windows.safetensors"))
    (work / "jobs.json").write_text(json.dumps({"jobs": jobs, "export": export}))
    cmd = [python, str(Path(__file__).resolve()), "--worker", str(hf), str(work)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    results = json.loads((work / "result.json").read_text()) if (work / "result.json").is_file() else {}
    said = done.stderr.strip().splitlines()
    crashed = f"ModelOpt worker exited {done.returncode}" + (f": {said[-1].strip()[:300]}" if said else "")
    return {j["name"]: results.get(j["name"], {"fake_quant": crashed}) for j in jobs}


def read_exports(name: str, work: Path, hf: Path, window: int) -> dict[str, str]:
    """What trtbuild makes of ModelOpt's two exports of job `name`: one line each."""
    from toolchain.checkpoint.convert import convert
    from toolchain.engine.build import BuildOptions, build_engine
    from toolchain.errors import UserError

    def build() -> None:
        opts = BuildOptions("onnxruntime", max_seq_len=window)
        build_engine(work / f"{name}-trtllm", work / f"{name}-engine", opts, tokenizer=hf)

    def read_hf() -> None:
        convert(work / f"{name}-hf", work / f"{name}-converted")

    lines = {}
    tries = {"trtllm": build, "hf": read_hf}
    for kind, attempt in tries.items():
        if not (work / f"{name}-{kind}").is_dir():
            continue
        try:
            attempt()
            lines[kind] = "accepted"
        except UserError as e:
            lines[kind] = f"refused: {_first_line(str(e).replace(f'{work}/', ''))}"
        except Exception as e:  # a crash is a finding too: say what it was
            lines[kind] = f"crashed: {type(e).__name__}: {_first_line(str(e).replace(f'{work}/', ''))}"
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--methods", help="comma-separated labels of METHODS to run (default: all), e.g. w8a16,fp8")
    ap.add_argument("--export", action="store_true", help="also try ModelOpt's exports through trtbuild")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    import torch
    from moe_quant import CALIB, CALIB_SAMPLES, CALIB_SEQ_LEN, SHAPE
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from toolchain.checkpoint.convert import convert
    from toolchain.checkpoint.tiny import make_tiny_llama
    from toolchain.quality import compare
    from toolchain.quantize.calibrate import sample_windows
    from toolchain.reference.model import ReferenceModel
    from toolchain.text import tokenize

    wanted = args.methods.split(",") if args.methods else None
    methods = [(label, g) for label, g in METHODS if wanted is None or label in wanted or label.split()[0] in wanted]
    if not methods:
        ap.error(f"--methods {args.methods}: none of {', '.join(dict.fromkeys(m for m, _ in METHODS))}")
    torch.manual_seed(0)  # the model and tokens exactly as bench/moe_quant.py's main makes them
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**SHAPE)).eval()
    tokens = torch.randint(
        0, SHAPE["vocab_size"], (args.windows * args.window,), generator=torch.Generator().manual_seed(1)
    )
    python, why = quality_modelopt.modelopt_python()
    rows: list[dict[str, Any]] = []
    exports: dict[str, dict[str, str]] = {}
    with tempfile.TemporaryDirectory() as work_dir, torch.no_grad():
        work = Path(work_dir)
        hf, ckpt = work / "hf", work / "ckpt"
        model.save_pretrained(hf, safe_serialization=True)
        make_tiny_llama(work / "demo")  # its byte-level tokenizer, for the calibration text
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(work / "demo" / name, hf / name)
        convert(hf, ckpt)
        full = ReferenceModel.from_checkpoint(ckpt)
        calib = sample_windows(tokenize(CALIB, ckpt), CALIB_SAMPLES, CALIB_SEQ_LEN, 0)  # QuantizeOptions' seed
        count = tokens.numel() // args.window
        scored = tokens[: count * args.window].view(count, args.window)  # the windows compare() scores, in order
        jobs = modelopt_jobs(methods)
        start = time.perf_counter()
        mo = run_modelopt(python, why, hf, work / "modelopt", calib, scored, jobs, args.export)
        modelopt_s = time.perf_counter() - start
        by_method = {j["method"]: j for j in jobs if j["method"] and j["method"] not in GROUPED}
        by_group = {(j["method"], j["group"]): j for j in jobs if j["method"] in GROUPED}

        def modelopt_row(job: dict[str, Any], label: str, group: int | None) -> dict[str, Any]:
            res = mo[job["name"]]
            config = quality_modelopt.MODELOPT_CONFIGS.get(job["method"])
            by = f"ModelOpt {config}" if job["method"] else "transformers (harness check)"
            row = {"by": by, "method": label, "group": group, "quantize_s": res.get("seconds")}
            if res["fake_quant"] is not None:
                return {**row, "reason": res["fake_quant"]}
            replay = quality_modelopt._Replay(work / "modelopt" / f"{job['name']}.safetensors")
            return {**row, **compare(full.forward, replay, tokens, args.window).to_dict()}

        rows.append(modelopt_row(jobs[0], "float", None))
        for label, group in methods:
            method = label.split()[0]
            out = work / f"trtbuild-{label.replace(' ', '_')}-{group}"
            t = trtbuild_row(ckpt, out, label, group)
            row = {"by": "trtbuild", "method": label, "group": group if method in GROUPED else None}
            if "reason" in t:
                rows.append({**row, "reason": t["reason"]})
            else:
                r = compare(full.forward, t["variant"], tokens, args.window)
                rows.append({**row, "quantize_s": t["seconds"], **r.to_dict()})
            job = by_group.get((method, group)) if method in GROUPED else by_method.get(method)
            if job is not None and label == method:
                rows.append(modelopt_row(job, label, row["group"]))
        if args.export:
            for job in jobs[1:]:
                if mo[job["name"]]["fake_quant"] is None:
                    read = read_exports(job["name"], work / "modelopt", hf, args.window)
                    exports[job["name"]] = {**mo[job["name"]].get("exports", {}), **read}
    if args.json:
        print(json.dumps({"rows": rows, "exports": exports, "modelopt_s": modelopt_s}, indent=2))
        return
    print("\n".join(markdown(rows, exports, args.window, modelopt_s)))


def markdown(rows: list[dict[str, Any]], exports: dict[str, dict[str, str]], window: int, seconds: float) -> list[str]:
    from moe_quant import SHAPE

    scored = next((r for r in rows if "tokens" in r), None)
    what = (
        f"{scored['tokens']:,} scored tokens of random ids in {scored['windows']} windows of {window}"
        if scored
        else "nothing scored"
    )
    lines = [
        f"random Qwen3-MoE ({SHAPE['num_hidden_layers']} sparse layers, {SHAPE['num_experts']} experts top "
        f"{SHAPE['num_experts_per_tok']}, hidden {SHAPE['hidden_size']}, expert width "
        f"{SHAPE['moe_intermediate_size']}), {what}",
        "",
        "| method | group | by | PPL ratio | mean KLD | KLD p99 | same top-1 | RMS Δp |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        head = f"| {r['method']} | {r['group'] or '-'} | {r['by']} "
        if "reason" in r:
            lines.append(head + f"| {r['reason'].replace('|', '/')} | | | | |")
            continue
        lines.append(
            head + f"| {r['ppl_ratio']:.4f} | {r['kld_mean']:.5f} | {r['kld_p99']:.4f} | {100 * r['same_top1']:.2f} % "
            f"| {100 * r['dp_rms']:.2f} % |"
        )
    if scored:
        lines.append(f"\nPPL(reference) = {scored['ppl_reference']:.3f}; the ModelOpt worker took {seconds:.0f} s")
    if exports:
        lines += [
            "",
            "| ModelOpt job | export_tensorrt_llm_checkpoint, then trtbuild build "
            "| export_hf_checkpoint, then trtbuild convert |",
            "|---|---|---|",
        ]
        for name, e in exports.items():
            lines.append(
                f"| {name} | {e.get('trtllm', '-').replace('|', '/')} | {e.get('hf', '-').replace('|', '/')} |"
            )
    return lines


def _first_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[0][:300] if lines else "no message"


def _error(e: BaseException) -> str:
    """An exception in one line; a bare assert says where it fired."""
    said = _first_line(str(e))
    if said == "no message" and e.__traceback__ is not None:
        frame = traceback.extract_tb(e.__traceback__)[-1]
        said = f"at {Path(frame.filename).name}:{frame.lineno} ({frame.line})"
    return f"{type(e).__name__}: {said}"


# -- the worker: runs in ModelOpt's python ---------------------------------------------------------------------------


def worker(hf_dir: Path, work: Path) -> None:
    """Every job in work/jobs.json on a fresh float model: its logits on the eval windows into work/NAME.safetensors,
    optionally its two exports, and result.json (rewritten after each job, so a crash keeps the earlier ones)."""
    import modelopt.torch.quantization as mtq
    import torch
    from modelopt.torch.export import export_hf_checkpoint, export_tensorrt_llm_checkpoint
    from modelopt.torch.export.model_utils import get_model_type
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    warnings.filterwarnings("ignore")  # ModelOpt warns about untested transformers versions and CPU-only torch
    windows = load_file(str(work / "windows.safetensors"))
    spec = json.loads((work / "jobs.json").read_text())
    results: dict[str, dict[str, Any]] = {}

    def forward_loop(m: torch.nn.Module) -> None:
        with torch.no_grad():
            for start in range(0, windows["calib"].shape[0], 8):
                m(windows["calib"][start : start + 8])

    for job in spec["jobs"]:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        start, res = time.perf_counter(), {}
        try:
            if job["method"] is not None:
                cfg = quality_modelopt.quant_config(quality_modelopt.Spec(job["method"], job["group"]))
                model = mtq.quantize(model, cfg, forward_loop)
            res["seconds"] = time.perf_counter() - start
            with torch.no_grad():
                ev = windows["eval"]
                logits = torch.cat([model(ev[s : s + 8]).logits.float() for s in range(0, ev.shape[0], 8)])
            save_file({"ids": ev, "logits": logits.contiguous()}, str(work / f"{job['name']}.safetensors"))
            res["fake_quant"] = None
        except Exception as e:  # ModelOpt's refusal is the row's reason
            res["fake_quant"] = f"ModelOpt {_error(e)}"
        if spec["export"] and job["method"] is not None and res["fake_quant"] is None:
            res["exports"] = {}
            # ModelOpt's own model type ("qwen3moe"), then TensorRT-LLM's name for the Qwen family ("qwen")
            decoders = dict.fromkeys([get_model_type(model), "qwen"])
            for kind, decoder in [*(("trtllm", d) for d in decoders), ("hf", None)]:
                out = work / f"{job['name']}-{kind}"
                if out.is_dir():
                    continue  # an earlier decoder type exported it
                try:
                    with torch.no_grad():
                        if decoder is None:
                            export_hf_checkpoint(model, dtype=torch.float32, export_dir=out)
                        else:  # tensor parallel 0 ("as calibrated") divides by zero in 0.47: say 1
                            export_tensorrt_llm_checkpoint(
                                model, decoder, dtype=torch.float32, export_dir=out, inference_tensor_parallel=1
                            )
                    res["exports"].pop(kind, None)
                except Exception as e:  # ditto: the export's failure is the finding
                    shutil.rmtree(out, ignore_errors=True)
                    said = res["exports"].get(kind)
                    this = f"{f'decoder {decoder!r}: ' if decoder else ''}{_error(e)}"
                    res["exports"][kind] = f"{said}; {this}" if said else f"export failed: {this}"
        results[job["name"]] = res
        (work / "result.json").write_text(json.dumps(results))


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        worker(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        main()
