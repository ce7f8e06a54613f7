"""Serving benchmark: the same workload through `trtbuild serve` and through the runtime called directly, in one
run; then the server at three times its capacity; then AIPerf against it, when set up.

1. Direct (the baseline): the Generation API in this process (`LLMEngine.submit`), --concurrency client threads,
   each submitting its next request and consuming its stream.
2. Server: `python -m toolchain serve ENGINE` as a subprocess on a free loopback port, --concurrency asyncio
   clients streaming `/v1/completions` (SSE, `stream_options.include_usage` for the token count) with httpx.
   Rounds alternate direct, server, direct, server... over the same requests; figures are medians over rounds.
3. Overload: open-loop Poisson arrivals at --overload-factor x the server's measured capacity (its req/s at
   --concurrency) for --overload-s seconds, each request on its own task with a client timeout, against the
   server's bounded --max-queue; counts completions, 429s (with and without Retry-After), other 4xx, 5xx,
   timeouts and connection errors.
4. AIPerf (`--setup-aiperf` installs it into its own venv under --work; later runs reuse it): `aiperf profile`
   with synthetic prompts, streaming, the same concurrency, against the same server.

Workload: --requests text prompts of seeded words, lengths log-normal (median --prompt-median tokens; the
byte-level tokenizer makes one token per byte), --max-tokens each, temperature 0, the tokenizer's EOS as stop
token on both paths (the server always stops there). Output tok/s = generated tokens / wall time of the round;
TTFT = submit to the first event carrying text (the server streams only chunks with text: a random model's first
byte is often half a UTF-8 character), e2e = submit to the final event. CPU s: CPU time of this process (direct:
engine and client threads; server rounds: the HTTP clients) and of the server process during a round (Linux /proc).
The goal lines (server/direct throughput >= 0.95, added TTFT p50 <= 5 ms) pair each server round with the direct
round just before it and take the median over rounds: background load drifts less within a pair than across a run.
Prints a table (or --json); the baseline is measured in the same run; figures go to docs/benchmarks.md.

    python bench/serve.py                                 # tiny Llama (3 MB), 96 requests, 16 clients, 5 rounds
    python bench/serve.py --model random --requests 48    # bench/engine.py's 8-layer shape, byte vocabulary
    python bench/serve.py --setup-aiperf                  # once: install AIPerf into WORK/aiperf-venv
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import queue
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from toolchain.checkpoint.convert import convert  # noqa: E402
from toolchain.checkpoint.tiny import byte_level_tokenizer, make_tiny_llama  # noqa: E402
from toolchain.engine.api import load_tokenizer, open_engine  # noqa: E402
from toolchain.engine.build import BuildOptions, build_engine  # noqa: E402
from toolchain.runtime.llm_engine import LLMEngine  # noqa: E402
from toolchain.runtime.request import SamplingParams  # noqa: E402

ROUND_TIMEOUT_S = 180  # a round that takes longer is stuck: say what the runtime holds instead of hanging

TEXT = (  # the prompts' words
    "the build farm compiles every engine overnight and the runtime schedules requests in flight while each "
    "kernel reads its weights from memory so that a batch of prompts finishes before the deadline of the "
    "release; users ask about models, quantization, tokens, latency, throughput, caches and graphs"
)
WORDS = TEXT.split()


@dataclass(frozen=True)
class Sample:
    """One request as a client saw it."""

    ttft: float | None  # seconds to the first text
    e2e: float
    tokens: int
    text: str


# -- the engine and the workload -----------------------------------------------------------------------------


def random_llama(path: Path) -> Path:
    """bench/engine.py's random Llama shape (hidden 512, 8 layers), with the byte-level tokenizer's vocabulary so
    that text prompts and streamed text work as on the tiny model."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from toolchain.checkpoint.tiny import CONFIG

    torch.manual_seed(0)
    shape = dict(hidden_size=512, intermediate_size=1344, num_hidden_layers=8, num_attention_heads=8)
    config = LlamaConfig(**{**CONFIG, **shape, "num_key_value_heads": 2}, dtype="float32")
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    byte_level_tokenizer().save_pretrained(path)
    return path


def engine_dir(work: Path, model: str, batch: int, max_seq_len: int) -> Path:
    """Build the engine once; later runs with the same --work reuse it."""
    out = work / f"{model}-b{batch}-s{max_seq_len}"
    if (out / "manifest.json").is_file():
        return out
    hf = work / f"{model}-hf"
    if not (hf / "config.json").is_file():
        make_tiny_llama(hf, force=True) if model == "tiny" else random_llama(hf)
    convert(hf, work / f"{model}-ckpt", dtype="float32", force=True)
    opts = BuildOptions(backend="onnxruntime", max_batch_size=batch, max_seq_len=max_seq_len)
    build_engine(work / f"{model}-ckpt", out, opts, force=True)
    return out


def make_prompts(n: int, median: int, longest: int, seed: int) -> list[str]:
    """Seeded text prompts with log-normal lengths in bytes (= tokens with a byte-level tokenizer)."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(math.log(median), 0.6, n).round(), 8, longest).astype(int)
    prompts = []
    for length in lengths:
        words = rng.choice(WORDS, size=int(length) // 3 + 1)
        prompts.append(" ".join(words)[: int(length)].strip())
    return prompts


def cpu_seconds(pid: int | str) -> float:
    """User + system CPU seconds of a process so far, all its threads (Linux /proc); NaN elsewhere."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return math.nan
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def summarize(samples: list[Sample], wall: float) -> dict[str, Any]:
    ttft = [s.ttft for s in samples if s.ttft is not None]
    e2e = [s.e2e for s in samples]
    tokens = sum(s.tokens for s in samples)
    return {
        "completed": len(samples),
        "output_tokens": tokens,
        "wall_s": wall,
        "output_tok_s": tokens / wall,
        "req_s": len(samples) / wall,
        "ttft_p50_s": float(np.percentile(ttft, 50)) if ttft else None,
        "ttft_p90_s": float(np.percentile(ttft, 90)) if ttft else None,
        "e2e_p50_s": float(np.percentile(e2e, 50)),
        "e2e_p90_s": float(np.percentile(e2e, 90)),
    }


# -- direct: the Generation API in this process --------------------------------------------------------------


def direct_one(llm: LLMEngine, prompt: str, params: SamplingParams) -> Sample:
    start = time.perf_counter()
    ttft, tokens, text = None, 0, []
    for event in llm.submit(prompt, params):
        if event.token is not None:
            tokens += 1
        if event.text and ttft is None:
            ttft = time.perf_counter() - start
        text.append(event.text)
    return Sample(ttft, time.perf_counter() - start, tokens, "".join(text))


def runtime_state(llm: LLMEngine) -> str:
    """What the step loop holds (read from another thread: for a diagnosis, not exact)."""
    rt = llm.runtime
    live = [
        f"{r.id} {r.status.value} prompt {len(r.prompt)} generated {len(r.generated)} computed {r.num_computed} "
        f"blocks {len(r.blocks)}"
        for r in [*rt.scheduler.running, *rt.scheduler.waiting]
    ]
    return f"steps {rt.steps}, free blocks {rt.blocks.num_free}/{rt.blocks.num_blocks}; " + "; ".join(live)


def run_direct(llm: LLMEngine, prompts: list[str], params: SamplingParams, concurrency: int) -> dict[str, Any]:
    """`concurrency` threads, each taking the next prompt, submitting it and reading its stream to the end."""
    todo: queue.SimpleQueue[int] = queue.SimpleQueue()
    for i in range(len(prompts)):
        todo.put(i)
    samples: dict[int, Sample] = {}

    def client() -> None:
        while True:
            try:
                i = todo.get_nowait()
            except queue.Empty:
                return
            samples[i] = direct_one(llm, prompts[i], params)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(concurrency)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, start + ROUND_TIMEOUT_S - time.perf_counter()))
    if any(t.is_alive() for t in threads):
        raise RuntimeError(f"direct round unfinished after {ROUND_TIMEOUT_S} s: {runtime_state(llm)}")
    wall = time.perf_counter() - start
    ordered = [samples[i] for i in range(len(prompts))]
    return {**summarize(ordered, wall), "texts": [s.text for s in ordered]}


# -- server: `trtbuild serve` in a subprocess ------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(engine: Path, port: int, max_queue: int, log: Path) -> subprocess.Popen[bytes]:
    """`python -m toolchain serve` on loopback; returns once /ready says yes."""
    cmd = [sys.executable, "-m", "toolchain", "serve", str(engine), "--port", str(port), "--max-queue", str(max_queue)]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    stop_server(proc)
    raise RuntimeError(f"the server was not ready within 180 s; see {log}")


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)  # drain, then exit 0
    try:
        proc.wait(timeout=40)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def completion_body(model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def read_sse(response: httpx.Response, start: float) -> tuple[float | None, int, str, dict[str, Any] | None]:
    """TTFT, completion tokens (from the usage chunk), text, and the error event if one came instead."""
    ttft, tokens, text, error = None, 0, [], None
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: ") :]
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk:
            error = chunk["error"]
            continue
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        for choice in chunk.get("choices", []):
            if choice.get("text"):
                ttft = ttft if ttft is not None else time.perf_counter() - start
                text.append(choice["text"])
    return ttft, tokens, "".join(text), error


async def server_one(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> Sample:
    start = time.perf_counter()
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}")
        ttft, tokens, text, error = await read_sse(r, start)
    if error is not None:
        raise RuntimeError(f"error event: {error}")
    return Sample(ttft, time.perf_counter() - start, tokens, text)


async def run_server(url: str, model: str, prompts: list[str], max_tokens: int, concurrency: int) -> dict[str, Any]:
    """`concurrency` asyncio clients, each taking the next prompt and streaming its completion to the end."""
    todo = iter(range(len(prompts)))
    samples: dict[int, Sample] = {}

    async def client_task(client: httpx.AsyncClient) -> None:
        for i in todo:  # one iterator shared by the tasks of one event loop
            samples[i] = await server_one(client, url, completion_body(model, prompts[i], max_tokens))

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=ROUND_TIMEOUT_S) as client:
        start = time.perf_counter()
        await asyncio.gather(*(client_task(client) for _ in range(concurrency)))
        wall = time.perf_counter() - start
    ordered = [samples[i] for i in range(len(prompts))]
    return {**summarize(ordered, wall), "texts": [s.text for s in ordered]}


# -- overload ----------------------------------------------------------------------------------------------------


async def overload_one(client: httpx.AsyncClient, url: str, body: dict[str, Any], counts: Counter[str]) -> float | None:
    """One open-loop request, counted by outcome; its e2e seconds when it completed."""
    start = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code == 429:
                counts["429 with Retry-After" if r.headers.get("retry-after") else "429 without Retry-After"] += 1
            elif r.status_code >= 500:
                counts[f"{r.status_code}"] += 1
            elif r.status_code != 200:
                counts[f"other {r.status_code}"] += 1
            else:
                _, _, _, error = await read_sse(r, start)
                if error is None:
                    counts["completed"] += 1
                    return time.perf_counter() - start
                counts[f"in-stream error {error.get('code')}"] += 1
    except httpx.TimeoutException:
        counts["client timeout"] += 1
    except httpx.TransportError as e:
        counts[f"connection error ({type(e).__name__})"] += 1
    return None


async def overload(url: str, model: str, prompts: list[str], args: argparse.Namespace, rate: float) -> dict[str, Any]:
    """Poisson arrivals at `rate` req/s for --overload-s seconds; waits for every request to end."""
    rng = random.Random(args.seed)
    counts: Counter[str] = Counter()
    tasks: list[asyncio.Task[float | None]] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    async with httpx.AsyncClient(limits=limits, timeout=args.client_timeout) as client:
        start = time.perf_counter()
        at = 0.0
        while at < args.overload_s:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - start)))
            body = completion_body(model, prompts[len(tasks) % len(prompts)], args.max_tokens)
            tasks.append(asyncio.create_task(overload_one(client, url, body, counts)))
            at += rng.expovariate(rate)
        sent_s = time.perf_counter() - start
        e2e = [t for t in await asyncio.gather(*tasks) if t is not None]
        wall = time.perf_counter() - start
    answered = counts["completed"] + counts["429 with Retry-After"] + counts["429 without Retry-After"]
    return {
        "offered_req_s": rate,
        "sent": len(tasks),
        "sent_s": sent_s,
        "wall_s": wall,
        "counts": dict(counts),
        "answered": answered,
        "completed_req_s": counts["completed"] / wall,
        "completed_e2e_p50_s": float(np.percentile(e2e, 50)) if e2e else None,
        "completed_e2e_p90_s": float(np.percentile(e2e, 90)) if e2e else None,
        "fivexx": sum(v for k, v in counts.items() if k.startswith("5") or k == "in-stream error 500"),
    }


# -- AIPerf --------------------------------------------------------------------------------------------------------


def aiperf_bin(work: Path) -> Path:
    return work / "aiperf-venv" / "bin" / "aiperf"


def setup_aiperf(work: Path) -> str | None:
    """Install AIPerf into its own venv (its dependencies must not touch the project's); None or why not."""
    venv = work / "aiperf-venv"
    try:
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        pip = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "aiperf"], capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError) as e:
        return f"could not create {venv}: {e}"
    if pip.returncode != 0:
        return f"pip install aiperf failed: {pip.stderr.strip().splitlines()[-1:]}"
    return None


def run_aiperf(work: Path, url: str, model: str, engine: Path, args: argparse.Namespace) -> list[str]:
    """`aiperf profile` against the server; its command and summary table (or why there is none)."""
    exe = aiperf_bin(work)
    if not exe.is_file():
        return [f"AIPerf skipped: {exe} not found (run once with --setup-aiperf)"]
    out = work / "aiperf-artifacts"
    shutil.rmtree(out, ignore_errors=True)
    # --use-server-token-count: re-tokenizing streamed text overcounts a random model's output (each U+FFFD of a
    # split byte sequence becomes 3 byte tokens). No HF_HUB_OFFLINE: AIPerf 0.13 then looks a local tokenizer
    # path up as a hub repo id and fails; online, a local directory is used as it is.
    cmd = [
        str(exe), "profile", "--model", model, "--url", url, "--endpoint-type", "completions", "--streaming",
        "--tokenizer", str(engine), "--use-server-token-count", "--concurrency", str(args.concurrency),
        "--request-count", str(args.requests), "--synthetic-input-tokens-mean", str(args.prompt_median),
        "--synthetic-input-tokens-stddev", str(args.prompt_median // 2), "--output-tokens-mean", str(args.max_tokens),
        "--random-seed", str(args.seed), "--artifact-dir", str(out), "--ui-type", "none", "--no-gpu-telemetry",
    ]  # fmt: skip
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.aiperf_timeout)
    except subprocess.TimeoutExpired:
        return [f"AIPerf gave no result within {args.aiperf_timeout:g} s"]
    if done.returncode != 0:
        return [f"AIPerf failed (exit {done.returncode}):", *(done.stdout + done.stderr).splitlines()[-15:]]
    return ["aiperf " + " ".join(cmd[1:]), *aiperf_table((out / "profile_export_console.txt").read_text())]


def aiperf_table(console: str) -> list[str]:
    """The "LLM Metrics" table of AIPerf's console export, and its error summary if any."""
    lines = console.splitlines()
    keep, on = [], False
    for line in lines:
        title = line.strip()
        if title in ("NVIDIA AIPerf | LLM Metrics", "NVIDIA AIPerf | Error Summary"):
            on = True
        if on:
            keep.append(line.rstrip())
        if on and line.startswith("└"):
            on = False
    return keep


# -- the run ---------------------------------------------------------------------------------------------------


def interleaved(
    llm: LLMEngine, url: str, model: str, server_pid: int, prompts: list[str], args: argparse.Namespace
) -> dict[str, Any]:
    """Warm both paths up, then alternate direct and server rounds over the same prompts."""
    eos = llm.tokenizer.eos_token_id  # type: ignore[union-attr]
    params = SamplingParams(max_new_tokens=args.max_tokens, temperature=0, stop_token_ids=(eos,))
    warm = prompts[: args.concurrency]
    run_direct(llm, warm, params, args.concurrency)
    asyncio.run(run_server(url, model, warm, args.max_tokens, args.concurrency))
    rounds: dict[str, list[dict[str, Any]]] = {"direct": [], "server": []}
    paths: dict[str, Callable[[], dict[str, Any]]] = {
        "direct": lambda: run_direct(llm, prompts, params, args.concurrency),
        "server": lambda: asyncio.run(run_server(url, model, prompts, args.max_tokens, args.concurrency)),
    }
    for r in range(args.rounds):
        for name, fn in paths.items():
            before = cpu_seconds("self"), cpu_seconds(server_pid)
            x = fn()
            x["cpu_bench_s"], x["cpu_server_s"] = cpu_seconds("self") - before[0], cpu_seconds(server_pid) - before[1]
            rounds[name].append(x)
            print(
                f"round {r + 1} {name}: {x['output_tok_s']:.1f} tok/s, {x['req_s']:.2f} req/s, CPU s: this process "
                f"{x['cpu_bench_s']:.1f}, server {x['cpu_server_s']:.1f}, wall {x['wall_s']:.1f}",
                file=sys.stderr,
            )
    same = sum(a == b for a, b in zip(rounds["direct"][-1]["texts"], rounds["server"][-1]["texts"], strict=True))
    return {"rounds": rounds, "same_text": same}


def median_of(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    keys = [k for k, v in rounds[0].items() if isinstance(v, (int, float))]
    return {k: statistics.median(r[k] for r in rounds if r[k] is not None) for k in keys}


def run(args: argparse.Namespace) -> dict[str, Any]:
    engine = engine_dir(args.work, args.model, args.batch, args.max_seq_len)
    longest = args.max_seq_len - args.max_tokens - 1
    prompts = make_prompts(args.requests, args.prompt_median, longest, args.seed)
    port, model = free_port(), engine.name
    url = f"http://127.0.0.1:{port}"
    server = start_server(engine, port, args.max_queue, args.work / "server.log")
    result: dict[str, Any] = {"engine": str(engine), "load_before": os.getloadavg()}
    try:
        with LLMEngine(open_engine(engine), load_tokenizer(engine)) as llm:
            result.update(interleaved(llm, url, model, server.pid, prompts, args))
        for name in ("direct", "server"):
            result[name] = median_of(result["rounds"][name])
        if args.overload_s > 0:
            rate = args.overload_factor * result["server"]["req_s"]
            print(f"overload: {rate:.1f} req/s for {args.overload_s:g} s ...", file=sys.stderr, flush=True)
            result["overload"] = asyncio.run(overload(url, model, prompts, args, rate))
        if args.aiperf:
            print("aiperf ...", file=sys.stderr, flush=True)
            result["aiperf"] = run_aiperf(args.work, url, model, engine, args)
    finally:
        stop_server(server)
    result["load_after"] = os.getloadavg()
    return result


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:.1f}"


def paired(
    result: dict[str, Any], fn: Callable[[dict[str, Any], dict[str, Any]], float], fmt: str
) -> tuple[float, str]:
    """A figure of each round's server run against the direct run just before it (the machine's other load drifts
    less within a pair than across the run): its median, and the rounds' values."""
    values = [fn(sv, dr) for sv, dr in zip(result["rounds"]["server"], result["rounds"]["direct"], strict=True)]
    return statistics.median(values), ", ".join(format(v, fmt) for v in values)


def report(result: dict[str, Any], args: argparse.Namespace) -> None:
    d, s = result["direct"], result["server"]
    print(
        f"model {args.model} ({Path(result['engine']).name}): {args.requests} requests, prompts median "
        f"{args.prompt_median} tokens, max_tokens {args.max_tokens}, temperature 0, {args.concurrency} concurrent "
        f"clients; median of {args.rounds} interleaved rounds; {os.cpu_count()} cores, load average "
        f"{' / '.join(f'{x:.2f}' for x in result['load_before'])} before, "
        f"{' / '.join(f'{x:.2f}' for x in result['load_after'])} after"
    )
    print(
        "| path | done | output tok/s | req/s | TTFT p50 / p90 ms | e2e p50 / p90 ms | CPU s: bench / server "
        "| vs direct |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, x in (("direct: LLMEngine in-process (baseline)", d), ("server: trtbuild serve, HTTP SSE", s)):
        print(
            f"| {name} | {x['completed']:.0f} | {x['output_tok_s']:.1f} | {x['req_s']:.2f} | {ms(x['ttft_p50_s'])} / "
            f"{ms(x['ttft_p90_s'])} | {ms(x['e2e_p50_s'])} / {ms(x['e2e_p90_s'])} | {x['cpu_bench_s']:.1f} / "
            f"{x['cpu_server_s']:.1f} | {x['output_tok_s'] / d['output_tok_s']:.3f}x |"
        )
    ratio, ratios = paired(result, lambda sv, dr: sv["output_tok_s"] / dr["output_tok_s"], ".2f")
    added, adds = paired(result, lambda sv, dr: 1e3 * (sv["ttft_p50_s"] - dr["ttft_p50_s"]), "+.1f")
    print(f"\nthroughput server/direct, median of the {args.rounds} rounds' ratios: {ratio:.3f} (rounds: {ratios}; "
          f"goal >= 0.95: {'met' if ratio >= 0.95 else 'NOT met'})")  # fmt: skip
    print(f"added TTFT p50, median of the rounds' differences: {added:+.1f} ms (rounds: {adds}; goal <= 5 ms: "
          f"{'met' if added <= 5 else 'NOT met'})")  # fmt: skip
    print(f"identical outputs, last round: {result['same_text']}/{args.requests}")
    if "overload" in result:
        report_overload(result["overload"], args)
    for line in result.get("aiperf", []):
        print(line)


def report_overload(o: dict[str, Any], args: argparse.Namespace) -> None:
    print(
        f"\noverload: {o['sent']} requests in {o['sent_s']:.0f} s (Poisson, {o['offered_req_s']:.1f} req/s = "
        f"{args.overload_factor:g}x capacity), --max-queue {args.max_queue}, client timeout {args.client_timeout:g} s"
    )
    print("| outcome | count |\n|---|---:|")
    for k, v in sorted(o["counts"].items(), key=lambda kv: -kv[1]):
        print(f"| {k} | {v} |")
    print(
        f"completed {o['completed_req_s']:.2f} req/s over {o['wall_s']:.0f} s, e2e p50 / p90 "
        f"{ms(o['completed_e2e_p50_s'])} / {ms(o['completed_e2e_p90_s'])} ms"
    )
    print(f"zero 5xx: {'met' if o['fivexx'] == 0 else 'NOT met'} ({o['fivexx']})")
    print(f"every request answered (completion or 429): {'met' if o['answered'] == o['sent'] else 'NOT met'} "
          f"({o['answered']}/{o['sent']})")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["tiny", "random"], default="tiny", help="random: 8 layers, hidden 512")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "trtbuild-bench-serve")
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--prompt-median", type=int, default=64, help="tokens; log-normal, sigma 0.6")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5, help="direct and server rounds, interleaved")
    ap.add_argument("--batch", type=int, default=16, help="the engine's max_batch_size")
    ap.add_argument("--max-seq-len", type=int, default=256)
    ap.add_argument("--max-queue", type=int, default=32, help="the server's --max-queue")
    ap.add_argument("--overload-s", type=float, default=60.0, help="0: skip the overload phase")
    ap.add_argument("--overload-factor", type=float, default=3.0)
    ap.add_argument("--client-timeout", type=float, default=60.0, help="seconds, overload requests")
    ap.add_argument("--setup-aiperf", action="store_true", help="install AIPerf into WORK/aiperf-venv, then run")
    ap.add_argument("--aiperf", action=argparse.BooleanOptionalAction, default=True, help="run AIPerf if installed")
    ap.add_argument("--aiperf-timeout", type=float, default=300.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run `finally`: stop the server subprocess too
    if args.setup_aiperf:
        why = setup_aiperf(args.work)
        print(f"AIPerf: {why or 'installed in ' + str(aiperf_bin(args.work).parent)}", file=sys.stderr)
    result = run(args)
    if args.json:
        for rounds in result["rounds"].values():
            for r in rounds:
                r.pop("texts")
        print(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, **result}, indent=2))
        return
    report(result, args)


if __name__ == "__main__":
    main()
