"""`trtbuild bench`: replay a trace against an engine in real time — requests join the running batch as they
arrive (in-flight batching), or, with static=True, wait for a full batch that then runs to completion — and
report throughput, TTFT, TPOT, queue time, preemptions, prefix-cache hits and KV-cache utilization over time.

The static baseline is request-level batching on the same runtime, not a padded static batch: it waits, while
idle, until max_batch_size requests have arrived (or the trace has no more), then runs that group to completion
before it admits anyone else; its TTFT includes that wait, as a static batcher's does. Inside the group the
runtime works as always (prefill chunked by the token budget, a finished request stops computing, no padding),
so it isolates the effect of admission (join at every step vs. once per batch) and nothing else.
TTFT and queue time are measured from each request's arrival time in the trace. The result names the engine
(path, manifest sha256) and every setting the replay ran with."""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np

from toolchain.engine.api import Engine
from toolchain.errors import UserError
from toolchain.runtime.llm_engine import LLMEngine, RequestStream
from toolchain.runtime.loop import Runtime
from toolchain.runtime.request import Request, SamplingParams, Status
from toolchain.runtime.speculative import SpecConfig
from toolchain.runtime.traces import TraceRequest


def replay(
    engine: Engine,
    trace: list[TraceRequest],
    policy: str = "max_utilization",
    num_blocks: int | None = None,
    static: bool = False,
    prefix_sharing: bool = True,
    speculation: SpecConfig | None = None,
    draft_engine: Engine | None = None,
) -> dict[str, Any]:
    """Submit the trace's requests through the Generation API at their arrival times; summarize when all ended.
    With `speculation` the runtime speculates (`draft_engine` for method draft) and the result has its counters."""
    batch = engine.spec.limits.max_batch_size
    if not trace:
        raise ValueError("an empty trace")
    options: dict[str, Any] = dict(
        num_blocks=num_blocks,
        policy=policy,
        prefix_sharing=prefix_sharing,
        speculation=speculation,
        draft_engine=draft_engine,
    )
    with LLMEngine(engine, record_utilization=True, **options) as llm:
        pending = deque(trace)
        arrived: deque[TraceRequest] = deque()
        sent: list[tuple[TraceRequest, RequestStream]] = []
        start = time.monotonic()
        while pending or arrived:
            now = time.monotonic() - start
            while pending and pending[0].arrival <= now:
                arrived.append(pending.popleft())
            if not static:
                sent += [(item, llm.submit(item.prompt, _params(item))) for item in _take(arrived, len(arrived))]
            elif len(arrived) >= batch or (not pending and arrived):  # a full batch, run to completion
                group = [(item, llm.submit(item.prompt, _params(item))) for item in _take(arrived, batch)]
                for _, stream in group:
                    stream.result()
                sent += group
                continue
            if pending:
                time.sleep(max(0.0, min(pending[0].arrival - (time.monotonic() - start), 0.05)))
        for _, stream in sent:
            stream.result()
        wall = time.monotonic() - start
    requests = []
    for item, stream in sent:
        if stream.request is None:  # refused before admission (its stream ended with the reason)
            done = stream.result()
            stream.request = Request(stream.prompt, _params(item), status=Status.FAILED, error=done.error)
        stream.request.arrival = start + item.arrival  # measured from the trace's arrival, not from admission
        requests.append(stream.request)
    result = summarize(requests, llm.runtime, wall)
    result["engine"] = {
        "path": str(engine.spec.engine_dir.resolve()),
        "manifest_sha256": engine.spec.manifest_sha256,
        "backend": engine.spec.backend,
        "quant_algo": engine.spec.quant_algo,
        "limits": {k: getattr(engine.spec.limits, k) for k in ("max_batch_size", "max_num_tokens", "max_seq_len")},
    }
    result["settings"] = {
        "batching": batching_label(static, batch),
        "static": static,
        "policy": policy,
        "kv_blocks": num_blocks,  # asked for; None: the build's
        "kv_blocks_used": llm.runtime.blocks.num_blocks,
        "tokens_per_block": engine.tokens_per_block,
        "prefix_sharing": prefix_sharing,
    }
    if speculation is not None:
        result["settings"]["speculation"] = dataclasses.asdict(speculation)
        result["speculation"] = llm.runtime.spec_stats.to_json()
    return result


def batching_label(static: bool, batch: int) -> str:
    """What the replay's batching is, in words: the table and the JSON say the same."""
    if static:
        return f"static: batches of {batch} requests, each run to completion before the next is admitted (no padding)"
    return "in-flight: requests join the running batch at every step"


def _params(item: TraceRequest) -> SamplingParams:
    return SamplingParams(max_new_tokens=item.output_tokens)


def _take(items: deque[TraceRequest], n: int) -> list[TraceRequest]:
    return [items.popleft() for _ in range(min(n, len(items)))]


def _pct(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    a = np.array(values)
    return {f"p{p}": float(np.percentile(a, p)) for p in (50, 90, 99)}


def summarize(requests: list[Request], rt: Runtime, wall: float) -> dict[str, Any]:
    done = [r for r in requests if r.status is Status.FINISHED]
    tokens = sum(len(r.generated) for r in done)
    ttft = [r.first_token - r.arrival for r in done if r.first_token is not None]
    tpot = [
        (r.finished_at - r.first_token) / (len(r.generated) - 1)
        for r in done
        if r.finished_at is not None and r.first_token is not None and len(r.generated) > 1
    ]
    queue = [r.first_scheduled - r.arrival for r in done if r.first_scheduled is not None]
    admitted = sum(len(r.prompt) for r in requests if r.first_scheduled is not None)
    failed = [r for r in requests if r.status in (Status.FAILED, Status.CANCELLED)]
    reasons: dict[str, int] = {}
    for r in failed:
        reason = r.error or r.finish_reason or r.status.value
        reasons[reason] = reasons.get(reason, 0) + 1
    t0 = rt.utilization[0][0] if rt.utilization else 0.0
    peak = rt.peak_utilization  # from every step, before thinning
    series = [(round(t - t0, 4), round(u, 4)) for t, u in rt.utilization]
    if len(series) > 400:  # keep the report small
        series = series[:: len(series) // 400 + 1]
    return {
        "requests": len(requests),
        "completed": len(done),
        "failed": sum(r.status is Status.FAILED for r in requests),
        "cancelled": sum(r.status is Status.CANCELLED for r in requests),
        "not_completed": len(requests) - len(done),
        "errors": sorted({r.error for r in requests if r.error})[:5],
        "failure_reasons": dict(sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0]))),
        "wall_s": wall,
        "output_tokens": tokens,
        "output_tok_s": tokens / wall if wall else 0.0,
        "ttft_s": _pct(ttft),
        "tpot_s": _pct(tpot),
        "queue_s": _pct(queue),
        "preemptions": rt.scheduler.preempted,
        "prefix_cache": {
            "enabled": rt.blocks.prefix_sharing,
            "cached_prompt_tokens": rt.cached_tokens,
            "prompt_tokens": admitted,
            "hit_rate": rt.cached_tokens / admitted if admitted else 0.0,
        },
        "steps": rt.steps,
        "kv_utilization": series,
        "kv_utilization_max": peak,
    }


def utilization_svg(series: list[tuple[float, float]], path: Path, title: str) -> None:
    width, height, pad = 640, 220, 40
    end = max((t for t, _ in series), default=1.0) or 1.0
    points = " ".join(
        f"{pad + (width - 2 * pad) * t / end:.1f},{height - pad - (height - 2 * pad) * u:.1f}" for t, u in series
    )
    path.write_text(
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}">'
        f'<text x="{pad}" y="20" font-size="13">{title}</text>'
        f'<line x1="{pad}" y1="{height - pad}" x2="{width - pad}" y2="{height - pad}" stroke="#333"/>'
        f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{height - pad}" stroke="#333"/>'
        f'<text x="4" y="{pad + 4}" font-size="9">100%</text><text x="10" y="{height - pad}" font-size="9">0%</text>'
        f'<text x="{width - pad - 40}" y="{height - pad + 14}" font-size="9">{end:.1f} s</text>'
        f'<polyline points="{points}" fill="none" stroke="#4a7bd0" stroke-width="1.5"/></svg>\n',
        encoding="utf-8",
    )


def table(r: dict[str, Any]) -> list[str]:
    """The result of `replay` (with the CLI's trace settings) as the lines `trtbuild bench` prints."""

    def ms(d: dict[str, float | None]) -> str:
        return " / ".join("-" if v is None else f"{1e3 * v:.0f}" for v in d.values())

    engine, settings, cache = r["engine"], r["settings"], r["prefix_cache"]
    kv = f"{settings['kv_blocks_used']} blocks" + ("" if settings["kv_blocks"] else " (the build's)")
    lines = [
        f"engine {engine['path']} (manifest sha256 {engine['manifest_sha256'] or 'none: no manifest.json'})",
        f"  batching      {settings['batching']}; policy {settings['policy']}; KV pool {kv}",
        f"  trace         {r['trace']}: {r['requests']} requests, rate x {settings['rate_scale']:g}, "
        f"lengths x {r['length_scale']:.4f}, gaps over {settings['max_gap_s']:g} s shortened: {r['gaps_cut']}",
        f"{r['completed']}/{r['requests']} completed, {r['failed']} failed, {r['cancelled']} cancelled, "
        f"{r['preemptions']} preemptions, {r['wall_s']:.1f} s",
    ]
    lines += [f"  not completed {n} x {reason}" for reason, n in r["failure_reasons"].items()]
    hits = (
        f"{100 * cache['hit_rate']:.1f} % of prompt tokens ({cache['cached_prompt_tokens']}/{cache['prompt_tokens']})"
        if cache["enabled"]
        else "off (--no-prefix-sharing)"
    )
    return [
        *lines,
        f"  output        {r['output_tok_s']:.1f} tok/s ({r['output_tokens']} tokens)",
        f"  TTFT ms       {ms(r['ttft_s'])} (p50 / p90 / p99)",
        f"  TPOT ms       {ms(r['tpot_s'])}",
        f"  queue ms      {ms(r['queue_s'])}",
        f"  prefix cache  {hits}",
        f"  KV blocks     peak {100 * r['kv_utilization_max']:.0f} % in use",
    ]


# -- speculative decoding: both runs, their ratio, and a projection of the GPU speedup (issue 30) --------------------
WEIGHT_SUFFIXES = (".onnx", ".data", ".bin", ".plan", ".engine", ".safetensors", ".onnx_data")


def read_prompts(path: Path) -> list[str]:
    """Text prompts from a JSONL file: each line's "prompt" (a golden file) or "text" (a data or business sample)."""
    prompts = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            text = item.get("prompt", item.get("text")) if isinstance(item, dict) else None
        except ValueError:
            text = None
        if not isinstance(text, str) or not text:
            raise UserError(f'--prompts {path}:{n}: expected a JSON object with a non-empty "prompt" or "text"')
        prompts.append(text)
    if not prompts:
        raise UserError(f"--prompts {path}: no prompts in it")
    return prompts


def with_prompts(trace: list[TraceRequest], prompts: list[list[int]], max_seq_len: int) -> list[TraceRequest]:
    """The trace's arrivals and output lengths with these prompts, cycled (each cut to leave room for its output).
    A trace's own prompts are random ids: the n-gram proposer finds few matches in them and a draft model agrees
    with the target less than on text, so what speculation gains on them is not what it gains on text."""
    out = []
    for i, item in enumerate(trace):
        ids = prompts[i % len(prompts)][: max(1, max_seq_len - item.output_tokens)]
        out.append(dataclasses.replace(item, prompt=ids, output_tokens=min(item.output_tokens, max_seq_len - len(ids))))
    return out


def weight_bytes(engine: Engine) -> int:
    """The bytes of an engine's weight files (its ONNX graph and external data, or its TensorRT plan): what a
    memory-bound decode step reads besides the KV cache."""
    root = engine.spec.engine_dir
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))


def projection(
    stats: dict[str, Any], target: Engine, draft: Engine | None, batch: float, context: float
) -> dict[str, Any]:
    """A GPU speedup projected from the measured acceptance (plan D12): decode is memory-bound, so a step costs the
    bytes it reads. speedup = MAL / (k * c + v): MAL the mean accepted length (tokens per target step), k the mean
    drafted tokens per draft, c = draft / target weight bytes (0 for n-gram: no model), v = a k+1-token verify step
    over a 1-token decode step = (W + (k+1) * KV) / (W + KV), since the attention kernel re-reads each new token's
    prefix (plugins/kernels/attention.py); W the target's weight bytes, KV the batch's KV bytes at the mean
    context (`batch` sequences of `context` tokens). Not a measurement."""
    mal, drafts = stats["mean_accepted_length"], stats["drafts"]
    k = stats["draft_tokens"] / drafts if drafts else 0.0
    w = weight_bytes(target)
    c = weight_bytes(draft) / w if draft is not None and w else 0.0
    kv = batch * context * target.spec.kv_cache.bytes_per_block() / target.tokens_per_block
    v = (w + (k + 1) * kv) / (w + kv) if w + kv else 1.0
    speedup = mal / (k * c + v) if mal is not None else None
    return {
        "speedup": speedup,
        "mean_accepted_length": mal,
        "k": k,
        "c": c,
        "v": v,
        "weight_bytes": w,
        "kv_bytes": kv,
        "batch": batch,
        "context": context,
        "label": "projection, not a measurement",
    }


def compare_speculation(
    engine: Engine,
    trace: list[TraceRequest],
    speculation: SpecConfig,
    draft_engine: Engine | None = None,
    rounds: int = 1,
    **options: Any,
) -> dict[str, Any]:
    """The trace replayed without and with speculation in `rounds` interleaved rounds (the order alternating, after
    one warm-up each, as evaluate/diff.py `speed`); per side the median round, their ratios, the speculative run's
    acceptance (the same every round under greedy: the proposers are deterministic) and the projection."""
    sides: dict[str, dict[str, Any]] = {
        "plain": {},
        "speculative": dict(speculation=speculation, draft_engine=draft_engine),
    }
    warm = [dataclasses.replace(r, arrival=0.0) for r in trace[:2]]
    for extra in sides.values():
        replay(engine, warm, **options, **extra)
    runs: dict[str, list[dict[str, Any]]] = {"plain": [], "speculative": []}
    for round_ in range(rounds):
        for side in ("plain", "speculative") if round_ % 2 == 0 else ("speculative", "plain"):
            r = replay(engine, trace, **options, **sides[side])
            runs[side].append({k: v for k, v in r.items() if k != "kv_utilization"})
    plain, spec = (_median(runs[side]) for side in ("plain", "speculative"))
    stats = runs["speculative"][0]["speculation"]
    first = runs["plain"][0]
    batch = first["output_tokens"] / first["steps"] if first["steps"] else 1.0  # tokens per plain step
    context = statistics.mean(len(r.prompt) + r.output_tokens / 2 for r in trace)
    return {
        "plain": plain,
        "speculative": spec,
        "ratios": {
            "throughput": _ratio(spec["output_tok_s"], plain["output_tok_s"]),
            "tpot_p50": _ratio(spec["tpot_s"]["p50"], plain["tpot_s"]["p50"]),
            "steps": _ratio(spec["steps"], plain["steps"]),
        },
        "speculation": {**dataclasses.asdict(speculation), **stats},
        "projection": projection(stats, engine, draft_engine, batch, context),
        "rounds": rounds,
        "per_round": runs,
        "engine": first["engine"],
        "settings": first["settings"],
    }


def _median(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    def med(values: list[float | None]) -> float | None:
        present = [v for v in values if v is not None]
        return statistics.median(present) if present else None

    out: dict[str, Any] = {
        "output_tok_s": med([r["output_tok_s"] for r in rounds]),
        "wall_s": med([r["wall_s"] for r in rounds]),
    }
    for metric in ("ttft_s", "tpot_s", "queue_s"):
        out[metric] = {p: med([r[metric][p] for r in rounds]) for p in ("p50", "p90", "p99")}
    for key in ("requests", "completed", "not_completed", "output_tokens", "steps", "errors", "failure_reasons"):
        out[key] = rounds[0][key]
    out["not_completed"] = max(r["not_completed"] for r in rounds)
    return out


def _ratio(new: float | None, old: float | None) -> float | None:
    return None if new is None or not old else new / old


def speculation_table(r: dict[str, Any]) -> list[str]:
    """`compare_speculation`'s result (with the CLI's trace settings) as the lines `trtbuild bench` prints."""

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{1e3 * v:.1f}"

    def num(v: float | None, fmt: str = ".2f") -> str:
        return "-" if v is None else format(v, fmt)

    s, p, ratios = r["speculation"], r["projection"], r["ratios"]
    how = (
        f"n-gram [{s['prompt_lookup_min']}, {s['prompt_lookup_max']}]"
        if s["method"] == "ngram"
        else f"draft {r.get('draft', '?')}"
    )
    rate = s["acceptance_rate"]
    lines = [
        f"engine {r['engine']['path']} (manifest sha256 {r['engine']['manifest_sha256'] or 'none: no manifest.json'})",
        f"  trace         {r['trace']}: {r['plain']['requests']} requests, rate x {r['settings']['rate_scale']:g}, "
        f"lengths x {r['length_scale']:.4f}; prompts: {r['prompts']}",
        f"  speculation   {how}, k {s['num_speculative_tokens']}; {r['rounds']} interleaved round(s), medians",
        "                plain        speculative  ratio",
    ]
    for name, key, fmt in (("output tok/s", "output_tok_s", ".1f"), ("steps", "steps", "d")):
        a, b = r["plain"][key], r["speculative"][key]
        ratio = ratios["throughput" if key == "output_tok_s" else "steps"]
        lines.append(f"  {name:<13} {num(a, fmt):<12} {num(b, fmt):<12} {num(ratio, '.3f')}")
    a, b = r["plain"]["tpot_s"]["p50"], r["speculative"]["tpot_s"]["p50"]
    lines.append(f"  {'TPOT p50 ms':<13} {ms(a):<12} {ms(b):<12} {num(ratios['tpot_p50'], '.3f')}")
    lines += [
        f"  acceptance    {'-' if rate is None else f'{100 * rate:.1f} %'} ({s['accepted_tokens']}/{s['draft_tokens']} "
        f"drafted tokens, {s['drafts']} drafts); mean accepted length {num(s['mean_accepted_length'])}",
        f"  GPU speedup   {num(p['speedup'])}x: projection, not a measurement (MAL / (k*c + v): k {p['k']:.2f}, "
        f"c {p['c']:.3f} draft/target weight bytes, v {p['v']:.3f} verify/decode step bytes)",
    ]
    if r["prompts"].startswith("the trace's"):
        lines.append("  note          trace prompts are random ids: unrepresentative of text (--prompts FILE.jsonl)")
    for side in ("plain", "speculative"):
        if r[side]["not_completed"]:
            lines.append(f"  {side}: {r[side]['not_completed']} of {r[side]['requests']} requests did not complete")
    return lines
