"""In-flight batching runtime invariants on the CPU engine: greedy output under IFB equals each request alone;
nothing is lost when the pool is far too small (preemption by recompute); every block is free at the end; prefix
sharing changes no output and saves blocks; cancellation frees at once; block manager and sampler units."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import one_line_error, save_random_llama

from toolchain.checkpoint.convert import convert
from toolchain.engine.api import open_engine
from toolchain.engine.build import BuildOptions, build_engine
from toolchain.runtime.blocks import BlockManager
from toolchain.runtime.loop import Runtime
from toolchain.runtime.request import SamplingParams, Status
from toolchain.runtime.sampler import sample

TPB = 4


class SpacedIds:
    """A stand-in tokenizer: token ids as decimal words."""

    def decode(
        self, ids: list[int], skip_special_tokens: bool = True, clean_up_tokenization_spaces: bool = False
    ) -> str:
        return " ".join(map(str, ids))


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("rt")
    convert(save_random_llama(tmp / "hf", num_attention_heads=8, num_key_value_heads=2), tmp / "ckpt")
    opts = BuildOptions(backend="onnxruntime", tokens_per_block=TPB, max_batch_size=4, max_num_tokens=24)
    build_engine(tmp / "ckpt", tmp / "engine", opts)
    engine = open_engine(tmp / "engine")
    return engine, engine.spec.limits


def prompts(n: int, seed: int = 0, vocab: int = 90) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, vocab, (int(torch.randint(3, 30, (1,), generator=gen)),), generator=gen).tolist()
        for _ in range(n)
    ]


def alone(engine: Any, limits: dict[str, Any], prompt: list[int], new: int) -> list[int]:
    rt = Runtime(engine, limits, num_blocks=64)
    r = rt.add_request(prompt, SamplingParams(max_new_tokens=new))
    rt.run()
    return r.generated


def test_greedy_under_inflight_batching_equals_each_request_alone(engine: Any) -> None:
    eng, limits = engine
    ps = prompts(7)
    rt = Runtime(eng, limits, num_blocks=64)
    reqs = [rt.add_request(p, SamplingParams(max_new_tokens=9)) for p in ps[:3]]
    for _ in range(4):  # the rest join a batch that is already running
        rt.step()
    reqs += [rt.add_request(p, SamplingParams(max_new_tokens=9)) for p in ps[3:]]
    rt.run()
    assert all(r.status is Status.FINISHED and r.finish_reason == "length" for r in reqs)
    for r, p in zip(reqs, ps, strict=True):
        assert r.generated == alone(eng, limits, p, 9)
    assert rt.blocks.num_free == 64


@pytest.mark.parametrize("policy", ["max_utilization", "guaranteed_no_evict"])
def test_a_pool_far_too_small_loses_nothing(engine: Any, policy: str) -> None:
    eng, limits = engine
    ps = prompts(8, seed=1)
    rt = Runtime(eng, limits, num_blocks=14, policy=policy, watermark=0.0)
    reqs = [rt.add_request(p, SamplingParams(max_new_tokens=12)) for p in ps]
    too_big = rt.add_request(list(range(3, 60)), SamplingParams(max_new_tokens=12))  # can never fit
    rt.run()
    assert too_big.status is Status.FAILED and "whole pool" in (too_big.error or "")
    assert all(r.status is Status.FINISHED for r in reqs)  # completed, none lost
    assert rt.blocks.num_free == 14 and all(c == 0 for c in rt.blocks.refcount)
    if policy == "max_utilization":
        assert rt.scheduler.preempted > 0  # recompute exercised...
    else:
        assert rt.scheduler.preempted == 0
    for r, p in zip(reqs, ps, strict=True):  # ...and still the same greedy output
        assert r.generated == alone(eng, limits, p, 12)


def test_prefix_sharing_same_outputs_fewer_blocks(engine: Any) -> None:
    eng, limits = engine
    shared = list(range(10, 22))  # 3 full blocks
    ps = [shared + tail for tail in ([30, 31], [40], [50, 51, 52], [60, 61])]
    peaks = {}
    outputs = {}
    for sharing in (True, False):
        rt = Runtime(eng, limits, num_blocks=64, prefix_sharing=sharing)
        first = rt.add_request(ps[0], SamplingParams(max_new_tokens=5))
        rt.run()  # the prefix is computed once...
        reqs = [first] + [rt.add_request(p, SamplingParams(max_new_tokens=5)) for p in ps[1:]]
        peak = 0
        while rt.has_work:
            rt.step()
            peak = max(peak, rt.blocks.num_used)
        peaks[sharing], outputs[sharing] = peak, [r.generated for r in reqs]
        assert rt.blocks.num_free == 64  # cached blocks stay reusable, and free
        assert all(c == 0 for c in rt.blocks.refcount)
    assert outputs[True] == outputs[False]
    assert peaks[True] < peaks[False]


def test_cancellation_frees_blocks_at_once_and_timeout_fails(engine: Any) -> None:
    eng, limits = engine
    clock = [0.0]
    rt = Runtime(eng, limits, num_blocks=32, clock=lambda: clock[0])
    a = rt.add_request(list(range(5, 25)), SamplingParams(max_new_tokens=20))
    b = rt.add_request(list(range(5, 12)), SamplingParams(max_new_tokens=20), timeout=1.0)
    rt.step()
    used = rt.blocks.num_used
    rt.cancel(a.id)
    assert a.status is Status.CANCELLED and rt.blocks.num_used < used and not a.blocks
    clock[0] = 2.0
    ended = rt.step()
    assert b in ended and b.status is Status.FAILED and b.finish_reason == "timeout"
    assert not rt.has_work and rt.blocks.num_used == 0


def test_streaming_stop_tokens_and_sampling(engine: Any) -> None:
    eng, limits = engine
    rt = Runtime(eng, limits, num_blocks=32)
    seen: list[int] = []
    greedy = alone(eng, limits, [5, 6, 7, 8], 6)
    r = rt.add_request(
        [5, 6, 7, 8],
        SamplingParams(max_new_tokens=6, stop_token_ids=(greedy[2],)),
        on_event=lambda e: seen.append(e.token),
    )
    rt.run()
    first = greedy.index(greedy[2])  # the stop token's first appearance ends the request
    assert r.finish_reason == "stop_token" and r.generated == greedy[: first + 1] == seen
    logits = np.random.default_rng(0).normal(size=50)
    logits[[7, 9]] = logits.max() + 1  # a tie at the top: top-k 1 must still keep exactly one token
    for params in (SamplingParams(temperature=0.7, top_k=1), SamplingParams(temperature=0.7, top_p=1e-6)):
        picks = {sample(logits, params, torch.Generator().manual_seed(i)) for i in range(20)}
        assert len(picks) == 1 and picks <= {7, 9}  # exactly one of the tied top tokens, every time
    spread = {
        sample(logits, SamplingParams(temperature=5.0), g)
        for g in [torch.Generator().manual_seed(i) for i in range(20)]
    }
    assert len(spread) > 3


def test_block_manager_refcounts_and_prefix_sharing() -> None:
    bm = BlockManager(6, 4)
    tokens = list(range(13))  # 3 full blocks + 1
    table = [bm.allocate() for _ in range(4)]
    assert bm.register(tokens, table, 13, [], 0) == 3
    other = bm.match_prefix([*tokens[:12], 99], [])  # 3 full blocks shared
    assert other == table[:3] and bm.refcount[table[0]] == 2
    assert bm.match_prefix(tokens[:12], []) == table[:2]  # at least one token is left to compute
    bm.release(table[:2])
    bm.release(other)
    bm.release(table)
    assert bm.num_free == 6 and all(c == 0 for c in bm.refcount)
    with pytest.raises(RuntimeError, match="released more often"):
        bm.release([table[0]])
    watermarked = BlockManager(100, 4, watermark=0.05)
    assert watermarked.can_allocate(95) and not watermarked.can_allocate(96)


def test_generate_and_bench_cli(cli: Any, tiny_engine: Path, tmp_path: Path) -> None:
    result = cli("generate", tiny_engine, "--prompt", "The build farm", "--max-new-tokens", "8", "--json")
    assert result.exit_code == 0, result.stderr
    out = json.loads(result.stdout)
    assert len(out["tokens"]) == 8 and out["finish_reason"] == "length"
    streamed = cli("generate", tiny_engine, "--prompt", "The build farm", "--max-new-tokens", "8", "--stream")
    assert streamed.exit_code == 0 and streamed.stdout.strip() == out["text"].strip()
    azure = tmp_path / "trace.csv"
    azure.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        + "".join(f"2023-11-16 18:15:{46 + i // 4:02d}.{i % 10}000000,{300 + 40 * i},{20 + 7 * i}\n" for i in range(10))
    )
    result = cli("bench", tiny_engine, "--trace", azure, "--rate-scale", "50", "--json", "--plot", tmp_path / "kv.svg")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["requests"] == report["completed"] == 10 and report["failed"] == 0
    assert 0 < report["length_scale"] < 1 and report["output_tokens"] > 0 and report["ttft_s"]["p50"] is not None
    assert (tmp_path / "kv.svg").read_text().startswith("<svg")
    static = json.loads(cli("bench", tiny_engine, "--trace", azure, "--rate-scale", "50", "--static", "--json").stdout)
    assert static["completed"] == 10
    (tmp_path / "bad.jsonl").write_text('{"timestamp": 0}\n')
    assert "bad.jsonl:1" in one_line_error(cli("bench", tiny_engine, "--trace", tmp_path / "bad.jsonl"))
    assert "--policy" in one_line_error(cli("bench", tiny_engine, "--trace", azure, "--policy", "fifo"))


def test_mooncake_prefix_blocks_stay_shared(tmp_path: Path) -> None:
    from toolchain.runtime.traces import load_trace

    path = tmp_path / "m.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 1500, "output_length": 100, "hash_ids": [0, 1, 2]},
        {"timestamp": 500, "input_length": 1400, "output_length": 50, "hash_ids": [0, 1, 7]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    reqs, scale = load_trace(path, max_seq_len=256, vocab_size=100, rate_scale=2.0)
    block = round(512 * scale)
    assert reqs[0].prompt[: 2 * block] == reqs[1].prompt[: 2 * block]  # hash ids 0, 1 shared
    assert reqs[0].prompt[2 * block : 3 * block] != reqs[1].prompt[2 * block : 3 * block]
    assert reqs[1].arrival == pytest.approx(0.25) and all(len(r.prompt) + r.output_tokens <= 256 for r in reqs)


def test_seeded_sampling_reproduces_through_the_runtime_even_when_preempted(engine: Any) -> None:
    eng, limits = engine
    ps = prompts(6, seed=4)
    runs = []
    for blocks in (64, 12):  # the second pool forces preemption and recompute
        rt = Runtime(eng, limits, num_blocks=blocks, watermark=0.0)
        reqs = [rt.add_request(p, SamplingParams(max_new_tokens=10, temperature=1.0, seed=i)) for i, p in enumerate(ps)]
        rt.run()
        runs.append([r.generated for r in reqs])
        if blocks == 12:
            assert rt.scheduler.preempted > 0
    assert runs[0] == runs[1]
    unseeded = Runtime(eng, limits, num_blocks=64)
    a, b = (unseeded.add_request(ps[0], SamplingParams(max_new_tokens=10, temperature=1.0)) for _ in range(2))
    unseeded.run()
    assert a.generated != b.generated  # no seed given: each request draws its own


def test_stop_strings_and_cancelling_from_a_callback(engine: Any) -> None:
    eng, limits = engine
    greedy = alone(eng, limits, [5, 6, 7, 8], 8)
    text = lambda ids: " ".join(map(str, ids))  # noqa: E731 - a stand-in detokenizer
    rt = Runtime(eng, limits, num_blocks=32, tokenizer=SpacedIds())
    stop = text(greedy[2:4])
    r = rt.add_request([5, 6, 7, 8], SamplingParams(max_new_tokens=8, stop_strings=(stop,)))
    victim = rt.add_request([9, 10, 11], SamplingParams(max_new_tokens=8))
    killer = rt.add_request([12, 13], SamplingParams(max_new_tokens=8), on_event=lambda _: rt.cancel(victim.id))
    rt.run()
    assert r.finish_reason == "stop_string" and stop in text(r.generated) and len(r.generated) <= 4
    assert victim.status is Status.CANCELLED and killer.status is Status.FINISHED
    assert rt.blocks.num_used == 0 and all(c == 0 for c in rt.blocks.refcount)
    plain = Runtime(eng, limits, num_blocks=32)  # no detokenizer: a stop string cannot be honoured
    refused = plain.add_request([5, 6], SamplingParams(stop_strings=("x",)))
    assert refused.status is Status.FAILED and "tokenizer" in (refused.error or "")
    assert refused.id not in plain.requests  # ended requests leave the runtime: their id is free again
    live = plain.add_request([5, 6], SamplingParams(max_new_tokens=4))
    with pytest.raises(ValueError, match="already in use"):
        plain.add_request([5, 6], request_id=live.id)


def test_a_long_prefill_is_not_starved_by_a_stream_of_short_requests(engine: Any) -> None:
    """8 blocks of 4 tokens, a 28-token prompt part-way through prefill, and a new short request every step:
    the long prompt must still finish."""
    eng, limits = engine
    rt = Runtime(eng, replace(limits, max_num_tokens=8), num_blocks=8, watermark=0.0)
    long = rt.add_request(list(range(3, 31)), SamplingParams(max_new_tokens=2))
    for i in range(200):
        if long.done:
            break
        rt.add_request([40 + i % 40], SamplingParams(max_new_tokens=1))
        rt.step()
    assert long.status is Status.FINISHED
