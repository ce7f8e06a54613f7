"""Prometheus metrics under vLLM's names and types, so that dashboards and load generators built for vLLM (its
Grafana board, AIPerf's server-metrics scrape) read a trtbuild server unchanged; plus trtbuild's own: engine info,
requests and tokens per API key (the key's id, never the key), and rejections by reason.

Names follow vLLM's V1 metrics (vllm/v1/metrics/loggers.py): prometheus_client adds `_total` to counters, so the
counter `vllm:prompt_tokens` is exposed as `vllm:prompt_tokens_total`. Every vLLM metric carries `model_name`.
Each server has its own registry (several can live in one test process).
"""

from __future__ import annotations

import itertools

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

from toolchain import __version__
from toolchain.engine.api import EngineSpec
from toolchain.runtime.loop import Runtime
from toolchain.runtime.request import Request

# no `_created` series beside every counter: vLLM's exposition has none either
disable_created_metrics()  # type: ignore[no-untyped-call]

REJECTION_REASONS = ("auth", "rate", "queue", "timeout", "bad_request", "draining")
FINISH_REASONS = ("stop", "length", "abort", "error")
_LATENCY = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_TOKENS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)


_PER_MODEL = (
    "running", "waiting", "kv_usage", "prompt_tokens", "generation_tokens", "preemptions",
    "ttft", "itl", "e2e", "queue", "req_prompt", "req_generation",
)  # fmt: skip


class Metrics:
    def __init__(self, spec: EngineSpec, model_name: str):
        self.registry = r = CollectorRegistry()
        self.model = model_name
        m = ["model_name"]
        self.running = Gauge("vllm:num_requests_running", "Requests in the running batch.", m, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to run.", m, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache blocks in use (1 = 100 %).", m, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed.", m, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", m, registry=r)
        self.preemptions = Counter("vllm:num_preemptions", "Requests preempted (recomputed).", m, registry=r)
        self.success = Counter(
            "vllm:request_success", "Requests ended, by finish reason.", [*m, "finished_reason"], registry=r
        )

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, m, buckets=buckets, registry=r)

        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token.", _LATENCY)
        self.itl = hist("vllm:inter_token_latency_seconds", "Time between tokens of a request.", _LATENCY)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Arrival to last token.", _LATENCY)
        self.queue = hist("vllm:request_queue_time_seconds", "Arrival to first scheduling.", _LATENCY)
        self.req_prompt = hist("vllm:request_prompt_tokens", "Prompt tokens per request.", _TOKENS)
        self.req_generation = hist("vllm:request_generation_tokens", "Generated tokens per request.", _TOKENS)
        info = Gauge(
            "trtbuild_engine_info",
            "The engine being served (value 1).",
            ["engine_sha256", "quant_algo", "backend", "version"],
            registry=r,
        )
        info.labels(spec.manifest_sha256 or "unknown", spec.quant_algo, spec.backend, __version__).set(1)
        self.key_requests = Counter(
            "trtbuild_api_key_requests", "Requests admitted per API key id.", ["key_id"], registry=r
        )
        self.key_tokens = Counter(
            "trtbuild_api_key_tokens", "Tokens per API key id (prompt, generation).", ["key_id", "kind"], registry=r
        )
        self.rejections = Counter("trtbuild_rejections", "Requests refused, by reason.", ["reason"], registry=r)
        for reason in REJECTION_REASONS:  # present at 0 from the start: rate() needs a first sample
            self.rejections.labels(reason)
        for reason in FINISH_REASONS:
            self.success.labels(model_name, reason)
        self._seen_preemptions = 0
        # children for our model_name, looked up once: labels() per token pair was 9 % of the event loop's time
        self.c = {name: getattr(self, name).labels(model_name) for name in _PER_MODEL}

    def observe_gauges(self, rt: Runtime) -> None:
        """Batch gauges (a scrape refreshes them too: after an abort no step may follow)."""
        self.c["running"].set(rt.num_running)
        self.c["waiting"].set(rt.num_waiting)
        self.c["kv_usage"].set(rt.blocks.num_used / rt.blocks.num_blocks)

    def observe_step(self, rt: Runtime) -> None:
        """From the step loop only, after each step: the gauges and the preemption counter."""
        self.observe_gauges(rt)
        if rt.scheduler.preempted > self._seen_preemptions:
            self.c["preemptions"].inc(rt.scheduler.preempted - self._seen_preemptions)
            self._seen_preemptions = rt.scheduler.preempted

    def observe_request(self, request: Request, finish_reason: str, arrived: float, token_times: list[float]) -> None:
        """A request that ran has ended. `arrived`: when the server received it; `token_times`: when each of its
        tokens reached the server (time.monotonic, as the runtime's clock)."""
        m = self.model
        self.c["prompt_tokens"].inc(len(request.prompt))
        self.c["generation_tokens"].inc(len(request.generated))
        self.success.labels(m, finish_reason).inc()
        self.c["req_prompt"].observe(len(request.prompt))
        self.c["req_generation"].observe(len(request.generated))
        if request.first_scheduled is not None:
            self.c["queue"].observe(request.first_scheduled - arrived)
        if token_times:
            self.c["ttft"].observe(token_times[0] - arrived)
            self.c["e2e"].observe(token_times[-1] - arrived)
        for a, b in itertools.pairwise(token_times):
            self.c["itl"].observe(b - a)
