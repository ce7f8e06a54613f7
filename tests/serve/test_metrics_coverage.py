"""vLLM's metric set on a trtbuild server: every series vLLM's Grafana dashboards query (the list in
data/vllm_dashboard_metrics.txt, with its sources) is exposed with vLLM's type, buckets and labels, or is named in
metrics.ABSENT with the reason, or is a speculative-decoding series, exposed (as vLLM's) only by a server that
speculates and checked on one; and after a known workload the values are what that workload implies. Plus GET
/tokenizer_info in vLLM's shape, as lm-eval's remote tokenizer reads it.

The expected types, buckets and labels below are transcribed from vLLM 0.34.0 (git 62d4bc3c7)
vllm/v1/metrics/loggers.py and buckets.py (speculation's from vllm/v1/spec_decode/metrics.py) independently of
toolchain/serve/metrics.py's table, so a slip in either shows.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from tests.serve.helpers import (  # the in-process server helpers (fixtures: tests/serve/fixtures.py)
    MAX_SEQ_LEN,
    MODEL,
    TIMEOUT,
    Running,
    metric,
    post,
    running,
)
from toolchain.runtime.request import Request, SamplingParams, Status
from toolchain.runtime.speculative import SpecConfig
from toolchain.serve.metrics import ABSENT, SPEC_DECODE_EXPOSED

DASHBOARD = Path(__file__).parent / "data" / "vllm_dashboard_metrics.txt"

# vLLM 0.34.0 buckets.py
REQUEST_LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0]  # fmt: skip
TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
        160.0, 640.0, 2560.0]  # fmt: skip
ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
ITERATION = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
TOKENS = [1, 2, 5, 10, 20, 50, 100]  # build_1_2_5_buckets(max_model_len = 128)
assert MAX_SEQ_LEN == 128, "TOKENS is build_1_2_5_buckets(128)"

# exposed name -> (type, buckets, labels beyond model_name and engine), vLLM 0.34.0 loggers.py
VLLM: dict[str, tuple[str, list[float] | None, set[str]]] = {
    "vllm:num_requests_running": ("gauge", None, set()),
    "vllm:num_requests_waiting": ("gauge", None, set()),
    "vllm:num_requests_waiting_by_reason": ("gauge", None, {"reason"}),
    "vllm:engine_sleep_state": ("gauge", None, {"sleep_state"}),
    "vllm:kv_cache_usage_perc": ("gauge", None, set()),
    "vllm:prefix_cache_queries_total": ("counter", None, set()),
    "vllm:prefix_cache_hits_total": ("counter", None, set()),
    "vllm:external_prefix_cache_queries_total": ("counter", None, set()),
    "vllm:external_prefix_cache_hits_total": ("counter", None, set()),
    "vllm:mm_cache_queries_total": ("counter", None, set()),
    "vllm:mm_cache_hits_total": ("counter", None, set()),
    "vllm:num_preemptions_total": ("counter", None, set()),
    "vllm:prompt_tokens_total": ("counter", None, set()),
    "vllm:prompt_tokens_by_source_total": ("counter", None, {"source"}),
    "vllm:prompt_tokens_cached_total": ("counter", None, set()),
    "vllm:prompt_tokens_cached_by_source_total": ("counter", None, {"source"}),
    "vllm:generation_tokens_total": ("counter", None, set()),
    "vllm:request_success_total": ("counter", None, {"finished_reason"}),
    "vllm:request_prompt_tokens": ("histogram", TOKENS, set()),
    "vllm:request_generation_tokens": ("histogram", TOKENS, set()),
    "vllm:iteration_tokens_total": ("histogram", ITERATION, set()),
    "vllm:request_max_num_generation_tokens": ("histogram", TOKENS, set()),
    "vllm:request_params_n": ("histogram", [1, 2, 5, 10, 20], set()),
    "vllm:request_params_max_tokens": ("histogram", TOKENS, set()),
    "vllm:time_to_first_token_seconds": ("histogram", TTFT, set()),
    "vllm:inter_token_latency_seconds": ("histogram", ITL, set()),
    "vllm:request_time_per_output_token_seconds": ("histogram", ITL, set()),
    "vllm:e2e_request_latency_seconds": ("histogram", REQUEST_LATENCY, set()),
    "vllm:request_queue_time_seconds": ("histogram", REQUEST_LATENCY, set()),
    "vllm:request_inference_time_seconds": ("histogram", REQUEST_LATENCY, set()),
    "vllm:request_prefill_time_seconds": ("histogram", REQUEST_LATENCY, set()),
    "vllm:request_decode_time_seconds": ("histogram", REQUEST_LATENCY, set()),
    "vllm:request_num_preemptions": ("histogram", [1, 2, 3, 4, 5, 10, 20], set()),
    "vllm:request_prefill_kv_computed_tokens": ("histogram", TOKENS, set()),
}
# vllm/v1/spec_decode/metrics.py SpecDecodingProm: registered only with a speculative config; per_pos's children
# are positions "0".."num_speculative_tokens - 1"
SPEC_DECODE: dict[str, tuple[str, list[float] | None, set[str]]] = {
    "vllm:spec_decode_num_drafts_total": ("counter", None, set()),
    "vllm:spec_decode_num_draft_tokens_total": ("counter", None, set()),
    "vllm:spec_decode_num_accepted_tokens_total": ("counter", None, set()),
    "vllm:spec_decode_num_accepted_tokens_per_pos_total": ("counter", None, {"position"}),
}
SPEC_K = 3
# vLLM 0.34.0 config/cache.py CacheConfig fields (metrics_info() = every field, as strings) and the label values
# each field names; cache_config_info may carry a subset, never a label vLLM's has not
CACHE_CONFIG_FIELDS = {
    "block_size", "user_specified_block_size", "kv_cache_layout", "prefix_match_unit", "gpu_memory_utilization",
    "cache_dtype", "is_attention_free", "num_gpu_blocks_override", "sliding_window", "enable_prefix_caching",
    "prefix_caching_hash_algo", "prefix_cache_retention_interval", "kv_cache_dtype_skip_layers",
    "mamba_page_size_padded", "skip_page_size_padded", "mamba_block_size", "mamba_cache_dtype",
    "mamba_ssm_cache_dtype", "mamba_cache_mode", "enable_mamba_shared_prefix_checkpoint", "replayssm_buffer_len",
    "use_replayssm", "use_kda_recoverssm", "num_gpu_blocks", "num_cpu_blocks", "simple_cpu_offload_num_blocks",
    "effective_attention_block_size", "kv_cache_size_tokens", "kv_cache_max_concurrency", "hash_block_size",
    "cache_hit_alignment_tokens", "kv_sharing_fast_prefill", "swa_bounded_replay", "kv_cache_memory_bytes",
    "enable_extensible_kv_cache", "kv_offloading_size", "kv_offloading_backend",
}  # fmt: skip
LABEL_VALUES = {  # the values vLLM pre-creates for each extra label (loggers.py, engine/__init__.py, stats.py)
    "reason": {"capacity", "deferred"},
    "sleep_state": {"awake", "weights_offloaded", "discard_all"},
    "source": None,  # two families, two value sets: checked per family below
    "finished_reason": {"stop", "length", "abort", "error", "repetition"},
}
SOURCES = {
    "vllm:prompt_tokens_by_source_total": {"local_compute", "local_cache_hit", "external_kv_transfer"},
    "vllm:prompt_tokens_cached_by_source_total": {"device", "host", "p2p", "disk", "external_unspecified"},
}


@pytest.fixture(scope="module")
def fresh(engine_dir: Path) -> Iterator[Running]:
    """A server of its own: the prefix-cache counts below must not meet blocks another test left cached."""
    with running(engine_dir) as r:
        yield r


@pytest.fixture(scope="module")
def speculating(engine_dir: Path) -> Iterator[Running]:
    with running(engine_dir, speculation=SpecConfig("ngram", SPEC_K)) as r:
        yield r


def dashboard_names() -> list[str]:
    lines = DASHBOARD.read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]


def exposed(text: str) -> dict[str, tuple[str, list[Sample]]]:
    """Exposed name (counters with _total, as queried) -> (type, samples)."""
    out = {}
    for family in text_string_to_metric_families(text):
        name = family.name + "_total" if family.type == "counter" else family.name
        out[name] = (family.type, family.samples)
    return out


# -- coverage -----------------------------------------------------------------------------------------------------
def test_the_dashboard_list_and_the_exceptions_agree() -> None:
    names = dashboard_names()
    assert len(names) == len(set(names)) == 70 and names == sorted(names)
    assert set(ABSENT) <= set(names), set(ABSENT) - set(names)  # no stale excuse
    assert set(SPEC_DECODE_EXPOSED) == set(SPEC_DECODE) == {n for n in names if n.startswith("vllm:spec_decode_")}
    assert not set(ABSENT) & set(SPEC_DECODE_EXPOSED)
    assert all(reason.strip() for reason in ABSENT.values())


def test_every_dashboard_metric_is_exposed_as_vllm_defines_it(fresh: Running) -> None:
    families = exposed(fresh.metrics())
    checked = 0
    for name in dashboard_names():
        if name in ABSENT or name in SPEC_DECODE:  # speculation's: absent without it, as vLLM's
            assert name not in families, f"{name} is exposed but listed as absent: drop it from the list"
            continue
        assert name in families, f"vLLM's dashboards query {name}: expose it or list it in metrics.ABSENT"
        if name == "vllm:cache_config_info":
            continue  # its own test
        kind, buckets, extra = VLLM[name]
        got_kind, samples = families[name]
        assert got_kind == kind, f"{name}: {got_kind}, vLLM's is a {kind}"
        assert samples, f"{name}: no sample (vLLM's children exist from the start)"
        for s in samples:
            labels = set(s.labels) - {"le"}
            assert labels == {"model_name", "engine", *extra}, f"{name}: labels {sorted(labels)}"
            assert s.labels["model_name"] == MODEL and s.labels["engine"] == "0", f"{name}: {s.labels}"
        for label in extra:
            values = {s.labels[label] for s in samples}
            assert values == (SOURCES[name] if label == "source" else LABEL_VALUES[label]), f"{name}: {values}"
        if buckets is not None:
            bounds = sorted({float(s.labels["le"]) for s in samples if s.name == name + "_bucket"})
            assert bounds == [*map(float, buckets), float("inf")], f"{name}: buckets {bounds}"
        checked += 1
    assert checked == 30  # 70 names: 35 absent, 4 speculation's (checked below), cache_config_info (its own test)
    # and the metrics vLLM has that no dashboard queries, which the issue asks for too
    for name in set(VLLM) - set(dashboard_names()):
        assert families[name][0] == VLLM[name][0], name


def test_a_speculating_server_exposes_the_spec_decode_series_as_vllm_defines_them(speculating: Running) -> None:
    families = exposed(speculating.metrics())
    for name, (kind, _, extra) in SPEC_DECODE.items():
        assert name in families, f"vLLM's speculative-decoding dashboard queries {name}"
        got_kind, samples = families[name]
        assert got_kind == kind, f"{name}: {got_kind}, vLLM's is a {kind}"
        for s in samples:
            assert set(s.labels) == {"model_name", "engine", *extra}, f"{name}: labels {sorted(s.labels)}"
            assert s.labels["model_name"] == MODEL and s.labels["engine"] == "0", f"{name}: {s.labels}"
        want = {str(i) for i in range(SPEC_K)} if extra else {""}  # children pre-created, one per position
        assert {s.labels.get("position", "") for s in samples} == want, f"{name}: {samples}"
    # the rest of the set is the same with speculation on
    assert {n for n in VLLM if n in exposed(speculating.metrics())} == set(VLLM)


def test_cache_config_info_says_what_the_pool_is(fresh: Running) -> None:
    [(kind, samples)] = [v for k, v in exposed(fresh.metrics()).items() if k == "vllm:cache_config_info"]
    assert kind == "gauge" and len(samples) == 1 and samples[0].value == 1
    labels = samples[0].labels
    assert set(labels) - {"engine"} <= CACHE_CONFIG_FIELDS and "model_name" not in labels  # as vLLM's
    blocks, spec = fresh.state.llm.runtime.blocks, fresh.state.spec
    assert labels == {
        "block_size": str(spec.limits.tokens_per_block),
        "num_gpu_blocks": str(blocks.num_blocks),
        "cache_dtype": spec.kv_cache.dtype,
        "enable_prefix_caching": "True",
        "prefix_caching_hash_algo": "blake2b",
        "engine": "0",
    }


# -- values -------------------------------------------------------------------------------------------------------
# vLLM's series read here, as exposed; a delta over the workload each
READ = [
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_cached_total",
    "vllm:iteration_tokens_total_sum", "vllm:iteration_tokens_total_count", "vllm:request_params_max_tokens_sum",
    "vllm:request_params_n_sum", "vllm:request_params_n_count", "vllm:request_max_num_generation_tokens_sum",
    "vllm:request_prefill_kv_computed_tokens_sum", "vllm:request_decode_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum", "vllm:request_inference_time_seconds_sum",
    "vllm:e2e_request_latency_seconds_sum", "vllm:time_to_first_token_seconds_sum",
    "vllm:request_time_per_output_token_seconds_count", "vllm:request_queue_time_seconds_count",
    "vllm:request_num_preemptions_sum", "vllm:request_success_total", "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
]  # fmt: skip


def deltas(before: str, after: str) -> dict[str, float]:
    return {name: metric(after, name) - metric(before, name) for name in READ}


def test_values_after_two_requests_that_share_two_blocks(fresh: Running) -> None:
    tpb = fresh.state.spec.limits.tokens_per_block
    rng = random.Random(29)
    shared = [rng.randrange(3, 256) for _ in range(2 * tpb)]  # ids past <unk>, <s>, </s>: no special token
    a, b = shared + [rng.randrange(3, 256) for _ in range(5)], shared + [rng.randrange(3, 256) for _ in range(3)]
    asked = (24, 6)
    assert len(a) + asked[0] <= MAX_SEQ_LEN
    before = fresh.metrics()
    generated = []
    for prompt, max_tokens in zip((a, b), asked, strict=True):  # one after the other: b finds a's two blocks
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        response = post(fresh.url, body)
        assert response.status_code == 200, response.text
        generated.append(response.json()["usage"]["completion_tokens"])
    after = fresh.metrics()
    d = deltas(before, after)
    prompts, out, hit = len(a) + len(b), sum(generated), 2 * tpb

    assert d["vllm:request_success_total"] == 2
    assert d["vllm:prompt_tokens_total"] == prompts and d["vllm:generation_tokens_total"] == out
    assert d["vllm:prefix_cache_queries_total"] == prompts  # each prompt looked up whole
    assert d["vllm:prefix_cache_hits_total"] == hit  # b found a's two full blocks, a found nothing
    assert d["vllm:prompt_tokens_cached_total"] == hit
    assert (
        metric(after, "vllm:prompt_tokens_by_source_total", source="local_cache_hit")
        - metric(before, "vllm:prompt_tokens_by_source_total", source="local_cache_hit")
        == hit
    )
    assert (
        metric(after, "vllm:prompt_tokens_by_source_total", source="local_compute")
        - metric(before, "vllm:prompt_tokens_by_source_total", source="local_compute")
        == prompts - hit
    )
    assert (
        metric(after, "vllm:prompt_tokens_cached_by_source_total", source="device")
        - metric(before, "vllm:prompt_tokens_cached_by_source_total", source="device")
        == hit
    )
    assert d["vllm:request_prefill_kv_computed_tokens_sum"] == prompts - hit
    # vLLM's iteration tokens: prompt tokens computed (cached ones are not) + tokens generated, over every step
    assert d["vllm:iteration_tokens_total_sum"] == prompts - hit + out
    assert d["vllm:iteration_tokens_total_count"] >= 2 + max(generated) - 1  # >= a prefill and a step per token
    assert d["vllm:request_params_max_tokens_sum"] == sum(asked)  # what was asked, not what ran
    assert d["vllm:request_params_n_sum"] == d["vllm:request_params_n_count"] == 2
    assert d["vllm:request_max_num_generation_tokens_sum"] == out
    assert d["vllm:request_num_preemptions_sum"] == 0
    assert d["vllm:request_queue_time_seconds_count"] == d["vllm:request_time_per_output_token_seconds_count"] == 2
    # the phases on the loop's clock add up exactly: inference = prefill + decode (float sums: 1e-9 s)
    inference = d["vllm:request_prefill_time_seconds_sum"] + d["vllm:request_decode_time_seconds_sum"]
    assert d["vllm:request_inference_time_seconds_sum"] == pytest.approx(inference, abs=1e-9)
    # decode (first to last token on the loop's clock) against e2e - TTFT (the same tokens as the handler received
    # them): they differ only by how long the first and the last token of each request took to cross from the loop
    # thread to the handler (a thread hop and an event-loop wake-up, under 25 ms each even on a loaded 2-core box):
    # 2 requests x 2 tokens x 25 ms
    server_side = d["vllm:e2e_request_latency_seconds_sum"] - d["vllm:time_to_first_token_seconds_sum"]
    assert d["vllm:request_decode_time_seconds_sum"] > 0
    assert d["vllm:request_decode_time_seconds_sum"] == pytest.approx(server_side, abs=0.1)
    # at rest: nothing runs or waits, the engine is awake
    assert metric(after, "vllm:num_requests_waiting_by_reason", reason="capacity") == 0
    assert metric(after, "vllm:num_requests_running") == 0
    assert metric(after, "vllm:engine_sleep_state", sleep_state="awake") == 1
    assert metric(after, "vllm:engine_sleep_state", sleep_state="discard_all") == 0


def test_one_request_observed_as_vllms_stats_py_would(fresh: Running) -> None:
    """Known times on one request: each phase is the interval vLLM's IterationStats.update_from_finished_request
    takes, and max_tokens is what was asked (50), not what ran (4)."""
    request = Request([5, 6, 7], SamplingParams(max_new_tokens=50), arrival=100.0)
    request.first_scheduled, request.first_token, request.finished_at = 100.5, 101.25, 104.25
    request.num_cached, request.status = 0, Status.FINISHED
    for token in (8, 9, 10, 11):
        request.append(token)
    server_arrival, token_times = 99.75, [101.5, 102.5, 103.5, 104.5]
    before = fresh.metrics()
    fresh.state.metrics.observe_request(request, "length", server_arrival, token_times)
    after = fresh.metrics()

    def grew(name: str) -> Any:
        """The sample's growth, to the rounding of a float sum that held other requests' times (1e-9 s)."""
        return pytest.approx(metric(after, name) - metric(before, name), abs=1e-9)

    assert grew("vllm:request_queue_time_seconds_sum") == 0.5  # scheduled - queued (the loop's arrival)
    assert grew("vllm:request_prefill_time_seconds_sum") == 0.75  # first token - scheduled
    assert grew("vllm:request_decode_time_seconds_sum") == 3.0  # last token - first token
    assert grew("vllm:request_inference_time_seconds_sum") == 3.75  # last token - scheduled
    assert grew("vllm:request_time_per_output_token_seconds_sum") == 1.0  # decode / (4 - 1)
    assert grew("vllm:time_to_first_token_seconds_sum") == 1.75  # the server's: first token received - arrival
    assert grew("vllm:e2e_request_latency_seconds_sum") == 4.75
    assert grew("vllm:inter_token_latency_seconds_count") == 3 and grew("vllm:inter_token_latency_seconds_sum") == 3
    assert grew("vllm:request_params_max_tokens_sum") == 50 and grew("vllm:request_max_num_generation_tokens_sum") == 4
    assert (
        metric(after, "vllm:request_params_max_tokens_bucket", le="50.0")
        - metric(before, "vllm:request_params_max_tokens_bucket", le="50.0")
        == 1
    )
    assert metric(after, "vllm:request_params_max_tokens_bucket", le="20.0") == metric(
        before, "vllm:request_params_max_tokens_bucket", le="20.0"
    )


# -- /tokenizer_info ----------------------------------------------------------------------------------------------
def test_tokenizer_info_in_vllms_shape(fresh: Running) -> None:
    response = httpx.get(f"{fresh.url}/tokenizer_info", timeout=TIMEOUT)
    assert response.status_code == 200, response.text
    info: dict[str, Any] = response.json()
    tok = fresh.state.tokenizer
    # what lm-eval 0.4.13's RemoteTokenizer reads (lm_eval/utils.py): the special tokens' text and the template
    assert info["eos_token"] == tok.eos_token == "</s>" and info["bos_token"] == tok.bos_token == "<s>"
    assert info.get("pad_token") == tok.pad_token  # this tokenizer has none: absent, as from vLLM
    assert info["chat_template"] == tok.chat_template and "{% for m in messages %}" in info["chat_template"]
    # vLLM's: tokenizer_config.json's keys as the tokenizer keeps them, tokenizer_class, no file paths
    assert info["tokenizer_class"] == type(tok).__name__
    assert info["model_max_length"] == tok.model_max_length
    assert {"vocab_file", "merges_file", "name_or_path"}.isdisjoint(info)
    # eos_token_id as lm-eval derives it: /tokenize of the eos text without special tokens, first id
    ids = post(fresh.url, {"prompt": info["eos_token"], "add_special_tokens": False}, path="/tokenize").json()
    assert ids["tokens"][0] == tok.eos_token_id


def test_tokenizer_info_without_a_tokenizer_is_a_clean_404(fresh: Running, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fresh.state, "tokenizer", None)
    response = httpx.get(f"{fresh.url}/tokenizer_info", timeout=TIMEOUT)
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["type"] == "not_found_error" and "no tokenizer" in error["message"] and error["code"] == 404
