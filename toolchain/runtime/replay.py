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

import time
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np

from toolchain.engine.api import Engine
from toolchain.runtime.llm_engine import LLMEngine, RequestStream
from toolchain.runtime.loop import Runtime
from toolchain.runtime.request import Request, SamplingParams, Status
from toolchain.runtime.traces import TraceRequest


def replay(
    engine: Engine,
    trace: list[TraceRequest],
    policy: str = "max_utilization",
    num_blocks: int | None = None,
    static: bool = False,
    prefix_sharing: bool = True,
) -> dict[str, Any]:
    """Submit the trace's requests through the Generation API at their arrival times; summarize when all ended."""
    batch = engine.spec.limits.max_batch_size
    if not trace:
        raise ValueError("an empty trace")
    options: dict[str, Any] = dict(num_blocks=num_blocks, policy=policy, prefix_sharing=prefix_sharing)
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
