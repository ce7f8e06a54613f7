"""`trtbuild bench`: replay a trace against an engine in real time — requests join the running batch as they
arrive (in-flight batching), or, with static=True, wait for a full batch that then runs to completion — and
report throughput, TTFT, TPOT, queue time, preemptions and KV-cache utilization over time.

The static baseline waits, while idle, until max_batch_size requests have arrived (or the trace has no more),
then runs them to completion: its TTFT includes that wait, as a static batcher's does.
TTFT and queue time are measured from each request's arrival time in the trace."""

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
        assert stream.request is not None
        stream.request.arrival = start + item.arrival  # measured from the trace's arrival, not from admission
        requests.append(stream.request)
    return summarize(requests, llm.runtime, wall)


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
        "errors": sorted({r.error for r in requests if r.error})[:5],
        "wall_s": wall,
        "output_tokens": tokens,
        "output_tok_s": tokens / wall if wall else 0.0,
        "ttft_s": _pct(ttft),
        "tpot_s": _pct(tpot),
        "queue_s": _pct(queue),
        "preemptions": rt.scheduler.preempted,
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
