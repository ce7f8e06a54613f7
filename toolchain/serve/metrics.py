"""Prometheus metrics under vLLM's names, types, label names and histogram buckets, so that dashboards and load
generators built for vLLM (its Grafana boards, AIPerf's server-metrics scrape) read a trtbuild server unchanged; plus
trtbuild's own: engine info, requests and tokens per API key (the key's id, never the key), and rejections by reason.

The mirror is vLLM 0.34.0 (git 62d4bc3c7), vllm/v1/metrics/loggers.py `PrometheusStatLogger.__init__` (names, types,
documentation, labels) and `.record` (what each series counts), vllm/v1/metrics/buckets.py (bucket families,
`build_1_2_5_buckets`) and vllm/v1/metrics/stats.py `IterationStats.update_from_finished_request` (the request
phases). `VLLM_FAMILIES` below is that table; `ABSENT` names what vLLM's dashboards query and this server does not
expose, with the reason. tests/serve/data/vllm_dashboard_metrics.txt is the list the dashboards query.

Every vLLM series carries `model_name` and `engine` ("0": one engine core per server), as vLLM's do;
`cache_config_info` carries the cache's settings and `engine` instead, as vLLM's `log_metrics_info`.
prometheus_client adds `_total` to counters, so the counter `vllm:prompt_tokens` is exposed as
`vllm:prompt_tokens_total`. Each server has its own registry (several can live in one test process).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

from toolchain import __version__
from toolchain.engine.api import EngineSpec
from toolchain.runtime.loop import Runtime
from toolchain.runtime.request import Request, Status
from toolchain.runtime.speculative import SpecStats

# no `_created` series beside every counter: vLLM's exposition has none either
disable_created_metrics()  # type: ignore[no-untyped-call]

ENGINE = "0"  # vLLM's engine index: one engine core per server
REJECTION_REASONS = ("auth", "rate", "queue", "timeout", "bad_request", "draining")
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")  # vllm/v1/engine FINISH_REASON_STRINGS
WAITING_REASONS = ("capacity", "deferred")  # loggers.py WAITING_REASON_CAPACITY / _DEFERRED
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")  # loggers.py gauge_engine_sleep_state
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")  # stats.py PromptTokenStats.ALL_SOURCES
CACHE_HIT_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")  # cache_hit_source.py CacheHitSource

# vllm/v1/metrics/buckets.py, the static families; "request_tokens" is build_1_2_5_buckets(max_model_len)
BUCKETS: dict[str, tuple[float, ...]] = {
    "request_latency": (
        0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
        960.0, 1920.0, 7680.0,
    ),
    "time_to_first_token": (
        0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
        80.0, 160.0, 640.0, 2560.0,
    ),
    "inter_token_latency": (
        0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    ),
    "iteration_tokens": (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384),
    "request_params_n": (1, 2, 5, 10, 20),
    "request_num_preemptions": (1, 2, 3, 4, 5, 10, 20),
}  # fmt: skip


def build_1_2_5_buckets(max_value: int) -> tuple[float, ...]:
    """vLLM's buckets.py `build_1_2_5_buckets`: 1, 2, 5, 10, 20, 50, ... while <= `max_value`."""
    buckets: list[float] = []
    for exponent in itertools.count():
        for mantissa in (1, 2, 5):
            if mantissa * 10**exponent > max_value:
                return tuple(buckets)
            buckets.append(mantissa * 10**exponent)
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class Family:
    """One vLLM metric: its name as registered (counters without `_total`), type, vLLM's documentation, bucket
    family (histograms) and the labels beyond `model_name` and `engine`."""

    name: str
    kind: str  # counter | gauge | histogram
    doc: str
    buckets: str | None = None  # a key of BUCKETS, or "request_tokens"
    extra: tuple[str, ...] = ()


VLLM_FAMILIES = (
    Family("vllm:num_requests_running", "gauge", "Number of requests in model execution batches."),
    Family("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed."),
    Family(
        "vllm:num_requests_waiting_by_reason", "gauge",
        "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling capacity; "
        "'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked status). Sum of all "
        "reasons equals vllm:num_requests_waiting.", extra=("reason",),
    ),
    Family(
        "vllm:engine_sleep_state", "gauge",
        "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; "
        "weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.", extra=("sleep_state",),
    ),
    Family("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage."),
    Family("vllm:prefix_cache_queries", "counter", "Prefix cache queries, in terms of number of queried tokens."),
    Family("vllm:prefix_cache_hits", "counter", "Prefix cache hits, in terms of number of cached tokens."),
    Family(
        "vllm:external_prefix_cache_queries", "counter",
        "External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of "
        "queried tokens.",
    ),
    Family(
        "vllm:external_prefix_cache_hits", "counter",
        "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of cached "
        "tokens.",
    ),
    Family("vllm:mm_cache_queries", "counter", "Multi-modal cache queries, in terms of number of queried items."),
    Family("vllm:mm_cache_hits", "counter", "Multi-modal cache hits, in terms of number of cached items."),
    Family("vllm:num_preemptions", "counter", "Cumulative number of preemption from the engine."),
    Family("vllm:prompt_tokens", "counter", "Number of prefill tokens processed."),
    Family("vllm:prompt_tokens_by_source", "counter", "Number of prompt tokens by source.", extra=("source",)),
    Family("vllm:prompt_tokens_cached", "counter", "Number of cached prompt tokens (local + external)."),
    Family(
        "vllm:prompt_tokens_cached_by_source", "counter",
        "Prefix-cache hit tokens by the cache tier that supplied them: device (local HBM), host (offloaded to DRAM), "
        "disk, p2p (transferred from another vLLM instance) or external_unspecified. Counted at admission; sums to "
        "vllm:prefix_cache_hits + vllm:external_prefix_cache_hits.", extra=("source",),
    ),
    Family("vllm:generation_tokens", "counter", "Number of generation tokens processed."),
    Family("vllm:request_success", "counter", "Count of successfully processed requests.", extra=("finished_reason",)),
    Family("vllm:request_prompt_tokens", "histogram", "Number of prefill tokens processed.", "request_tokens"),
    Family("vllm:request_generation_tokens", "histogram", "Number of generation tokens processed.", "request_tokens"),
    Family(
        "vllm:iteration_tokens_total", "histogram", "Histogram of number of tokens per engine_step.",
        "iteration_tokens",
    ),
    Family(
        "vllm:request_max_num_generation_tokens", "histogram",
        "Histogram of maximum number of requested generation tokens.", "request_tokens",
    ),
    Family("vllm:request_params_n", "histogram", "Histogram of the n request parameter.", "request_params_n"),
    Family(
        "vllm:request_params_max_tokens", "histogram", "Histogram of the max_tokens request parameter.",
        "request_tokens",
    ),
    Family(
        "vllm:time_to_first_token_seconds", "histogram", "Histogram of time to first token in seconds.",
        "time_to_first_token",
    ),
    Family(
        "vllm:inter_token_latency_seconds", "histogram", "Histogram of inter-token latency in seconds.",
        "inter_token_latency",
    ),
    Family(
        "vllm:request_time_per_output_token_seconds", "histogram",
        "Histogram of time_per_output_token_seconds per request.", "inter_token_latency",
    ),
    Family(
        "vllm:e2e_request_latency_seconds", "histogram", "Histogram of e2e request latency in seconds.",
        "request_latency",
    ),
    Family(
        "vllm:request_queue_time_seconds", "histogram", "Histogram of time spent in WAITING phase for request.",
        "request_latency",
    ),
    Family(
        "vllm:request_inference_time_seconds", "histogram", "Histogram of time spent in RUNNING phase for request.",
        "request_latency",
    ),
    Family(
        "vllm:request_prefill_time_seconds", "histogram", "Histogram of time spent in PREFILL phase for request.",
        "request_latency",
    ),
    Family(
        "vllm:request_decode_time_seconds", "histogram", "Histogram of time spent in DECODE phase for request.",
        "request_latency",
    ),
    Family(
        "vllm:request_num_preemptions", "histogram", "Histogram of the number of times a request was preempted.",
        "request_num_preemptions",
    ),
    Family(
        "vllm:request_prefill_kv_computed_tokens", "histogram",
        "Histogram of new KV tokens computed during prefill (excluding cached tokens).", "request_tokens",
    ),
)  # fmt: skip

# vLLM's CacheConfig.metrics_info() gives every CacheConfig field; these are the ones this server has a value for
# (what each holds: Metrics.__init__). cache_config_info has these and `engine`, no model_name, as vLLM's.
CACHE_CONFIG_LABELS = (
    "block_size",
    "cache_dtype",
    "enable_prefix_caching",
    "num_gpu_blocks",
    "prefix_caching_hash_algo",
)

# What vLLM's Grafana dashboards query (tests/serve/data/vllm_dashboard_metrics.txt) and this server does not expose.
ABSENT: dict[str, str] = {
    **{
        name: "KV connector metric: this server has no KV connector (vLLM registers it only with --kv-transfer-config "
        "and a connector that reports it)"
        for name in (
            "vllm:num_requests_kv_fetch_by_stage", "vllm:nixl_xfer_time_seconds", "vllm:nixl_bytes_transferred",
            "vllm:nixl_post_time_seconds", "vllm:nixl_num_descriptors", "vllm:nixl_num_failed_transfers_total",
            "vllm:nixl_num_failed_notifications_total", "vllm:nixl_num_kv_expired_reqs_total",
            "vllm:nixl_num_notifications_after_expiry_total", "vllm:kv_offload_load_bytes_total",
            "vllm:kv_offload_store_bytes_total", "vllm:kv_offload_load_time_total", "vllm:kv_offload_store_time_total",
            "vllm:kv_offload_load_size", "vllm:kv_offload_store_size", "vllm:kv_offload_lookup_sync_delay_seconds",
            "vllm:kv_offload_lookup_async_delay_seconds", "vllm:kv_offload_cpu_cache_usage_perc",
            "vllm:kv_offload_cpu_cache_write_usage_perc", "vllm:kv_offload_cpu_cache_read_usage_perc",
            "vllm:kv_offload_allocation_failure_total", "vllm:kv_offload_stores_skipped_total",
            "vllm:simple_kv_offload_save_outcomes_total", "vllm:simple_kv_offload_load_blocks_total",
            "vllm:simple_kv_offload_used_blocks", "vllm:simple_kv_offload_pending_store_blocks",
        )
    },
    **{
        name: "KV block residency: the block manager does not time its blocks (vLLM registers these only with "
        "--kv-cache-metrics)"
        for name in (
            "vllm:kv_block_lifetime_seconds", "vllm:kv_block_idle_before_evict_seconds",
            "vllm:kv_block_reuse_gap_seconds",
        )
    },
    "vllm:lora_requests_info": "no LoRA adapters are served (vLLM registers it only with --enable-lora)",
    "vllm:sleep_mode_operation_duration_seconds": "no sleep-mode API (the engine is always awake)",
    "vllm:rl_weight_update_operation_duration_seconds": "no weight-update API",
    **{
        name: "model FLOPs/bytes estimates: no per-step cost model of the engine (vLLM: --enable-mfu-metrics)"
        for name in (
            "vllm:estimated_flops_per_gpu_total", "vllm:estimated_read_bytes_per_gpu_total",
            "vllm:estimated_write_bytes_per_gpu_total",
        )
    },
}  # fmt: skip

# Speculative decoding (issue 30), vllm/v1/spec_decode/metrics.py `SpecDecodingProm`: registered only when the
# server speculates (vLLM's `spec_decoding_enabled`), counters with the engine's labels; per_pos has `position` too,
# one child per drafted position "0".."k-1" created at start. Semantics: runtime/speculative.py SpecStats.
SPEC_DECODE_FAMILIES = (
    Family("vllm:spec_decode_num_drafts", "counter", "Number of spec decoding drafts."),
    Family("vllm:spec_decode_num_draft_tokens", "counter", "Number of draft tokens."),
    Family("vllm:spec_decode_num_accepted_tokens", "counter", "Number of accepted tokens."),
    Family(
        "vllm:spec_decode_num_accepted_tokens_per_pos", "counter", "Accepted tokens per draft position.",
        extra=("position",),
    ),
)  # fmt: skip
# as exposed (counters end in _total): present only on a speculating server
SPEC_DECODE_EXPOSED = tuple(f"{f.name}_total" for f in SPEC_DECODE_FAMILIES)

_KINDS = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}


class Metrics:
    def __init__(self, spec: EngineSpec, model_name: str, runtime: Runtime):
        self.registry = r = CollectorRegistry()
        self.model = model_name
        token_buckets = build_1_2_5_buckets(spec.limits.max_seq_len)  # vLLM: max_model_len
        self.families: dict[str, Any] = {}  # Counter | Gauge | Histogram, by name
        for f in VLLM_FAMILIES:
            kwargs: dict[str, Any] = {"registry": r}
            if f.buckets is not None:
                kwargs["buckets"] = token_buckets if f.buckets == "request_tokens" else BUCKETS[f.buckets]
            self.families[f.name] = _KINDS[f.kind](f.name, f.doc, ["model_name", "engine", *f.extra], **kwargs)

        # children for our labels, looked up once: labels() per token pair was 9 % of the event loop's time
        m = (model_name, ENGINE)
        self.c: dict[str, Any] = {
            f.name.removeprefix("vllm:"): self.families[f.name].labels(*m) for f in VLLM_FAMILIES if not f.extra
        }
        self.success = {why: self.families["vllm:request_success"].labels(*m, why) for why in FINISH_REASONS}
        self.waiting_by = {
            why: self.families["vllm:num_requests_waiting_by_reason"].labels(*m, why) for why in WAITING_REASONS
        }
        self.prompt_by = {s: self.families["vllm:prompt_tokens_by_source"].labels(*m, s) for s in PROMPT_SOURCES}
        self.cached_by = {
            s: self.families["vllm:prompt_tokens_cached_by_source"].labels(*m, s) for s in CACHE_HIT_SOURCES
        }
        self.spec_k = 0  # drafted positions per step at most; 0: the server does not speculate
        self._seen_spec = SpecStats()
        if runtime.speculation is not None:
            self.spec_k = runtime.speculation.num_speculative_tokens
            for f in SPEC_DECODE_FAMILIES:
                self.families[f.name] = Counter(f.name, f.doc, ["model_name", "engine", *f.extra], registry=r)
            for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
                self.c[f"spec_decode_{name}"] = self.families[f"vllm:spec_decode_{name}"].labels(*m)
            per_pos = self.families["vllm:spec_decode_num_accepted_tokens_per_pos"]
            self.spec_per_pos = [per_pos.labels(*m, str(i)) for i in range(self.spec_k)]
        for state in SLEEP_STATES:  # no sleep mode: always awake (vLLM's record_sleep_state for an awake engine)
            self.families["vllm:engine_sleep_state"].labels(*m, state).set(1 if state == "awake" else 0)

        cache = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            [*CACHE_CONFIG_LABELS, "engine"],
            registry=r,
        )
        blocks = runtime.blocks
        cache.labels(
            block_size=str(blocks.tokens_per_block),  # tokens per KV block
            cache_dtype=spec.kv_cache.dtype,  # the engine's KV dtype (vLLM's "auto" resolves to the model's)
            enable_prefix_caching=str(blocks.prefix_sharing),  # "True"/"False", as vLLM's str(bool)
            num_gpu_blocks=str(blocks.num_blocks),  # the KV pool's blocks, wherever the backend keeps them
            prefix_caching_hash_algo="blake2b",  # blocks.py block_hash (vLLM's default is "sha256")
            engine=ENGINE,
        ).set(1)

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
        self._seen_preemptions = 0
        self._seen_steps = 0
        self._seen_queries = self._seen_hits = 0

    def observe_gauges(self, rt: Runtime) -> None:
        """Batch gauges (a scrape refreshes them too: after an abort no step may follow)."""
        waiting = rt.num_waiting
        self.c["num_requests_running"].set(rt.num_running)
        self.c["num_requests_waiting"].set(waiting)
        self.waiting_by["capacity"].set(waiting)  # every waiting request waits for batch or KV capacity
        self.waiting_by["deferred"].set(0)  # no LoRA budget or KV transfer defers one here
        self.c["kv_cache_usage_perc"].set(rt.blocks.num_used / rt.blocks.num_blocks)

    def observe_step(self, rt: Runtime) -> None:
        """From the step loop only, after each loop turn: gauges, preemptions, prefix-cache lookups and, when a step
        ran, its tokens."""
        self.observe_gauges(rt)
        if rt.scheduler.preempted > self._seen_preemptions:
            self.c["num_preemptions"].inc(rt.scheduler.preempted - self._seen_preemptions)
            self._seen_preemptions = rt.scheduler.preempted
        blocks = rt.blocks
        if blocks.prefix_queries > self._seen_queries:
            hits = blocks.prefix_hits - self._seen_hits
            self.c["prefix_cache_queries"].inc(blocks.prefix_queries - self._seen_queries)
            self.c["prefix_cache_hits"].inc(hits)
            self.cached_by["device"].inc(hits)  # vLLM counts every local hit as the device tier's
            self._seen_queries, self._seen_hits = blocks.prefix_queries, blocks.prefix_hits
        if self.spec_k and rt.spec_stats.drafts > self._seen_spec.drafts:
            self._observe_spec(rt.spec_stats)
        if rt.steps > self._seen_steps:  # the loop runs at most one step per turn
            self.c["iteration_tokens_total"].observe(rt.step_tokens)
            self._seen_steps = rt.steps

    def _observe_spec(self, stats: SpecStats) -> None:
        """Add the runtime's speculation counters since the last call (vLLM's `SpecDecodingProm.observe`)."""
        seen = self._seen_spec
        self.c["spec_decode_num_drafts"].inc(stats.drafts - seen.drafts)
        self.c["spec_decode_num_draft_tokens"].inc(stats.draft_tokens - seen.draft_tokens)
        self.c["spec_decode_num_accepted_tokens"].inc(stats.accepted - seen.accepted)
        for i, child in enumerate(self.spec_per_pos):
            now = stats.per_pos[i] if i < len(stats.per_pos) else 0
            before = seen.per_pos[i] if i < len(seen.per_pos) else 0
            if now > before:
                child.inc(now - before)
        self._seen_spec = SpecStats(stats.drafts, stats.draft_tokens, stats.accepted, list(stats.per_pos))

    def observe_request(
        self,
        request: Request,
        finish_reason: str,
        arrived: float,
        token_times: list[float],
        token_steps: list[int] | None = None,
    ) -> None:
        """A request that ran has ended. `arrived`: when the server received it; `token_times`: when each of its
        tokens reached the server (time.monotonic, as the runtime's clock); `token_steps`: the runtime step that
        emitted each (TokenEvent.step).

        As vLLM's stats.py: TTFT, ITL and e2e from the server's side (arrival and token receipt), the phases from
        the engine loop's (queued, first scheduled, first and last token): queue = scheduled - queued, prefill =
        first token - scheduled, decode = last token - first token, inference = last token - scheduled, time per
        output token = decode / (tokens - 1). ITL is one observation per engine step that gave the request tokens
        (vLLM's `IterationStats` per engine-core output, not per token): with speculation a step's several tokens
        are one gap, measured from the first token of each step."""
        c, prompt, generated, cached = self.c, len(request.prompt), len(request.generated), request.num_cached
        c["prompt_tokens"].inc(prompt)
        c["generation_tokens"].inc(generated)
        self.prompt_by["local_compute"].inc(prompt - cached)
        self.prompt_by["local_cache_hit"].inc(cached)
        c["prompt_tokens_cached"].inc(cached)
        success = self.success.get(finish_reason)
        if success is None:  # a reason vLLM does not have: its own series, rather than a wrong one
            success = self.families["vllm:request_success"].labels(self.model, ENGINE, finish_reason)
        success.inc()
        c["request_prompt_tokens"].observe(prompt)
        c["request_generation_tokens"].observe(generated)
        c["request_prefill_kv_computed_tokens"].observe(prompt - cached)
        c["request_max_num_generation_tokens"].observe(generated)  # n = 1: the one sequence's length (vLLM v0)
        c["request_params_n"].observe(1)
        c["request_params_max_tokens"].observe(request.params.max_new_tokens)
        c["request_num_preemptions"].observe(request.preemptions)
        end = token_times[-1] if token_times else None
        if end is not None:
            c["time_to_first_token_seconds"].observe(token_times[0] - arrived)
            c["e2e_request_latency_seconds"].observe(end - arrived)
        step_times = token_times
        if token_steps is not None and len(token_steps) == len(token_times):
            step_times = [t for k, t in enumerate(token_times) if k == 0 or token_steps[k] != token_steps[k - 1]]
        for a, b in itertools.pairwise(step_times):
            c["inter_token_latency_seconds"].observe(b - a)
        scheduled, first = request.first_scheduled, request.first_token
        if scheduled is None:
            return
        c["request_queue_time_seconds"].observe(scheduled - request.arrival)
        if first is None:
            return
        # a finished request's last token is its finish (set together in the loop); an aborted one's last token the
        # server received (its finish is the abort)
        if request.status is Status.FINISHED and request.finished_at is not None:
            decode = request.finished_at - first
        else:
            decode = token_times[-1] - token_times[0] if token_times else 0.0
        c["request_prefill_time_seconds"].observe(first - scheduled)
        c["request_decode_time_seconds"].observe(decode)
        c["request_inference_time_seconds"].observe(first - scheduled + decode)
        c["request_time_per_output_token_seconds"].observe(decode / (generated - 1) if generated > 1 else 0.0)
