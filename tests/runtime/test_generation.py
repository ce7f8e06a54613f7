"""The Generation API and the multi-tenant prefix cache, on the fake engine of tests/fakes.py (numpy, no ONNX):
streamed text with a real byte-level tokenizer (multi-byte characters, stop strings, bounded work per token);
LLMEngine from many threads and from asyncio, abort, engine failure; flat memory over many requests; and a prefix
cache where a hash collision costs a miss, never another tenant's KV."""

from __future__ import annotations

import asyncio
import gc
import hashlib
import random
import threading
import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from fakes import FakeEngine, expected_output, fake_limits, next_token

from toolchain.checkpoint.tiny import byte_level_tokenizer
from toolchain.engine.contract import Batch
from toolchain.runtime.blocks import BlockManager
from toolchain.runtime.detokenizer import IncrementalDetokenizer
from toolchain.runtime.llm_engine import LLMEngine
from toolchain.runtime.loop import Runtime
from toolchain.runtime.request import SamplingParams, Status, TokenEvent

REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def tok() -> Any:
    return byte_level_tokenizer()


def byte_ids(tok: Any) -> dict[int, int]:
    """byte value -> token id of the byte-level tokenizer (GPT-2's byte-to-unicode table), for byte strings that
    are not valid UTF-8 and so cannot go through `encode`."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    chars.update({b: chr(256 + n) for n, b in enumerate(b for b in range(256) if b not in chars)})
    return {b: int(tok.convert_tokens_to_ids(c)) for b, c in chars.items()}


def ids_of(tok: Any, data: bytes) -> list[int]:
    table = byte_ids(tok)
    return [table[b] for b in data]


class CountingDecoder:
    """The tokenizer, with the size of every decode call recorded: the detokenizer's work per token."""

    def __init__(self, tokenizer: Any):
        self.tokenizer, self.sizes = tokenizer, []

    def decode(
        self, ids: list[int], skip_special_tokens: bool = True, clean_up_tokenization_spaces: bool = False
    ) -> str:
        self.sizes.append(len(ids))
        return str(self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))


def streamed(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    """The pieces a client receives, token by token, then the flush at the end."""
    return [detok.add(t) for t in ids] + [detok.flush()]


def within(seconds: float, fn: Callable[[], Any]) -> Any:
    """fn() on a helper thread: a loop that died or hangs fails the test instead of hanging the run."""
    out: list[Any] = []
    helper = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    helper.start()
    helper.join(seconds)
    assert out, f"no answer within {seconds} s: the engine loop is stuck or dead"
    return out[0]


# -- incremental detokenization ----------------------------------------------------------------------------------
MULTIBYTE = ["café au lait", "中文 and 日本語", "a llama 🦙 here", "🦙🦙🦙", "naïve “quotes” — ok", "é"]


@pytest.mark.parametrize("text", MULTIBYTE)
def test_streamed_pieces_rebuild_the_text_and_never_split_a_character(tok: Any, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == len(text.encode())  # one token per byte: multi-byte characters span several tokens
    pieces = streamed(IncrementalDetokenizer(tok), ids)
    assert "".join(pieces) == tok.decode(ids) == text
    assert not any(REPLACEMENT in p for p in pieces)


def test_a_four_byte_character_comes_out_whole_on_its_fourth_token(tok: Any) -> None:
    ids = tok.encode("a🦙b", add_special_tokens=False)
    assert len(ids) == 6
    detok = IncrementalDetokenizer(tok)
    assert [detok.add(t) for t in ids] == ["a", "", "", "", "🦙", "b"]


def test_work_per_token_is_bounded(tok: Any) -> None:
    """2000 tokens of mixed 1-4 byte characters, cut off mid-character: every decode call sees a window of a few
    tokens, not the output so far (which would be O(n^2) over a long answer)."""
    ids = tok.encode("中文 🦙 é, " * 400, add_special_tokens=False)[:2000]
    counting = CountingDecoder(tok)
    pieces = streamed(IncrementalDetokenizer(counting), ids)
    assert "".join(pieces) == tok.decode(ids)  # the cut character comes out as U+FFFD, as a full decode gives
    assert not any(REPLACEMENT in p for p in pieces[:-1])
    assert max(counting.sizes) <= 12 and len(counting.sizes) <= 2 * len(ids) + 2


@pytest.mark.parametrize(
    "data",
    [
        "\ufffd".encode() * 700,  # the replacement character itself, generated as such
        b"\x80" * 2000,  # lone continuation bytes: invalid UTF-8 that no later byte completes
        random.Random(0).randbytes(2000),
        b"\x80\xe4\xb8\xad\xf0\x9f\xa6\x99\xc3" * 200,  # garbage, then valid characters split over tokens
    ],
    ids=["fffd", "continuation", "random", "mixed"],
)
def test_degenerate_output_streams_in_bounded_work(tok: Any, data: bytes) -> None:
    """Text that keeps ending in U+FFFD (invalid bytes, or U+FFFD itself) is not a character waiting for its
    bytes: it is streamed as a full decode renders it, without the window growing with the output."""
    ids = ids_of(tok, data)
    counting = CountingDecoder(tok)
    pieces = streamed(IncrementalDetokenizer(counting), ids)
    assert "".join(pieces) == tok.decode(ids) == data.decode("utf-8", errors="replace")
    assert max(counting.sizes) <= 12
    assert len("".join(pieces[:-1])) > len(tok.decode(ids)) - 8  # streamed as it came, not all at the end


# -- stop strings ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "stops", "before", "stopped"),
    [
        ("The answer is 42.\n\nQ: next question", ("\n\nQ:",), "The answer is 42.", "\n\nQ:"),
        ("a\n\nQb, then\n\nQ: more", ("\n\nQ:",), "a\n\nQb, then", "\n\nQ:"),  # a false start is released
        ("say 中文 and stop", ("中文",), "say ", "中文"),  # a stop split inside its characters' bytes
        ("Hello, world!", ("world", "lo, world"), "Hel", "lo, world"),  # both end on the same token: earliest
        ("Hello, world!", ("rld", "o, w"), "Hell", "o, w"),  # the one completed first ends the text
    ],
)
def test_a_stop_string_is_never_streamed_in_part(
    tok: Any, text: str, stops: tuple[str, ...], before: str, stopped: str
) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, stops)
    pieces, sent = [], ""
    for t in ids:
        pieces.append(detok.add(t))
        sent += pieces[-1]
        assert before.startswith(sent)  # at every token: nothing past the text before the stop has gone out
    pieces.append(detok.flush())
    assert "".join(pieces) == before and detok.stopped == stopped


def test_stop_strings_through_the_runtime(tok: Any) -> None:
    """A model that writes a fixed text: the request ends with 'stop_string', its events' text is the text before
    the stop, and generation stops on the token that completed it."""
    script = tok.encode("Sure: 🦙 done.\n\nUser: more", add_special_tokens=False)
    prompt = tok.encode("Hi", add_special_tokens=False)
    engine = FakeEngine(model=lambda context: script[len(context) - len(prompt)])
    rt = Runtime(engine, tokenizer=tok)
    events: list[TokenEvent] = []
    params = SamplingParams(max_new_tokens=len(script), stop_strings=("\n\nUser:", "nothing"))
    r = rt.add_request(prompt, params, on_event=events.append)
    rt.run()
    stop_end = len(tok.encode("Sure: 🦙 done.\n\nUser:", add_special_tokens=False))
    assert r.finish_reason == "stop_string" and r.status is Status.FINISHED
    assert r.generated == script[:stop_end] == [e.token for e in events]
    assert "".join(e.text for e in events) == "Sure: 🦙 done."
    assert [e.finish_reason for e in events] == [None] * (stop_end - 1) + ["stop_string"]
    assert rt.blocks.num_used == 0


# -- LLMEngine: many callers, one loop ---------------------------------------------------------------------------
def prompt_for(a: int, b: int) -> list[int]:
    return [3 + a % 300, 3 + b % 300, *range(10 + (a * 7 + b) % 50, 13 + (a * 7 + b) % 50 + b % 9)]


def test_many_threads_submit_at_once_and_all_complete_with_the_expected_output() -> None:
    limits = fake_limits(max_batch_size=16, max_num_tokens=64, num_blocks=128)
    threads, per_thread = 8, 50
    results: dict[int, list[tuple[str, list[int], str, list[int]]]] = {}
    start = threading.Barrier(threads)
    with LLMEngine(FakeEngine(limits)) as llm:

        def client(t: int) -> None:
            start.wait()
            jobs = []
            for i in range(per_thread):
                prompt, new = prompt_for(t, i), 1 + (t + i) % 8
                jobs.append((llm.submit(prompt, SamplingParams(max_new_tokens=new)), prompt, new))
            results[t] = []
            for stream, prompt, new in jobs:
                done = stream.result()
                results[t].append((stream.request_id, done.token_ids, done.finish_reason, expected_output(prompt, new)))

        workers = [threading.Thread(target=client, args=(t,), daemon=True) for t in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(timeout=60)
        done = [r for rs in results.values() for r in rs]
        assert len(done) == threads * per_thread
        assert len({rid for rid, *_ in done}) == len(done)  # unique ids across threads
        assert all(reason == "length" and got == want for _, got, reason, want in done)
        assert llm.runtime.blocks.num_used == 0 and not llm.runtime.requests and llm.failure is None


def test_abort_from_another_thread_cancels_a_long_request_and_frees_its_blocks() -> None:
    limits = fake_limits(max_seq_len=2048, num_blocks=600)
    prompt, new = list(range(5, 12)), 1500
    with LLMEngine(FakeEngine(limits, delay_s=0.001)) as llm:
        stream = llm.submit(prompt, SamplingParams(max_new_tokens=new))
        events: list[TokenEvent] = []

        def consume() -> None:
            for event in stream:
                events.append(event)
                if len(events) == 3:
                    threading.Thread(target=llm.abort, args=(stream.request_id,)).start()

        within(30, consume)
        last, tokens = events[-1], [e.token for e in events[:-1]]
        assert last.finish_reason == "cancelled" and last.token is None
        assert 3 <= len(tokens) < new and tokens == expected_output(prompt, len(tokens))
        assert llm.runtime.blocks.num_used == 0 and all(c == 0 for c in llm.runtime.blocks.refcount)
        after = within(30, llm.submit(prompt, SamplingParams(max_new_tokens=4)).result)  # the loop serves on
        assert after.token_ids == expected_output(prompt, 4)


def letters(tok: Any) -> Callable[[np.ndarray], int]:
    """The fake model writing lowercase letters (so that events carry text), still a function of the context."""
    table = byte_ids(tok)
    return lambda context: table[ord("a") + next_token(context) % 26]


def test_an_asyncio_consumer_gets_the_same_events_as_a_thread(tok: Any) -> None:
    prompts = [tok.encode(p, add_special_tokens=False) for p in ("one", "two words", "three more words")]
    params = SamplingParams(max_new_tokens=12, stop_strings=("zz",))

    def view(events: list[TokenEvent]) -> list[tuple[Any, ...]]:
        return [(e.token, e.text, e.finish_reason, e.generated_tokens) for e in events]

    with LLMEngine(FakeEngine(model=letters(tok)), tokenizer=tok) as llm:
        plain = [view(within(30, lambda p=p: list(llm.submit(p, params)))) for p in prompts]

        async def consume_all() -> list[list[tuple[Any, ...]]]:
            loop = asyncio.get_running_loop()

            async def consume(prompt: list[int]) -> list[tuple[Any, ...]]:
                return view([e async for e in llm.submit(prompt, params, loop=loop)])

            return list(await asyncio.wait_for(asyncio.gather(*(consume(p) for p in prompts)), 30))

        assert asyncio.run(consume_all()) == plain
    assert all(events[-1][2] in ("length", "stop_string") for events in plain)
    assert all("".join(e[1] for e in events) for events in plain)  # text, not only ids


def test_an_engine_failure_ends_the_requests_in_flight_and_the_loop_serves_on() -> None:
    engine = FakeEngine(fake_limits(max_seq_len=1024, num_blocks=512), delay_s=0.001)
    with LLMEngine(engine) as llm:
        long = llm.submit(list(range(5, 12)), SamplingParams(max_new_tokens=900))
        events = iter(long)
        assert within(30, lambda: next(events)).token is not None  # running
        engine.broken = True
        also = llm.submit([7, 8, 9], SamplingParams(max_new_tokens=5))
        last = within(30, lambda: list(events))[-1]
        assert last.finish_reason == "error" and "fake engine failure" in (last.error or "")
        assert last.generated_tokens < 900
        assert within(30, also.result).finish_reason == "error"
        assert llm.failure is not None and "fake engine failure" in llm.failure
        engine.broken = False
        after = within(30, llm.submit([7, 8, 9], SamplingParams(max_new_tokens=5)).result)
        assert after.finish_reason == "length" and after.token_ids == expected_output([7, 8, 9], 5)
        assert llm.runtime.blocks.num_used == 0 and not llm.runtime.requests


# -- memory stays flat -------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_memory_stays_flat_over_many_requests() -> None:
    """Short requests in waves through LLMEngine: what the process holds after 6,000 more requests does not grow
    (a leak of 50 bytes a request would show: a list entry, a dict item, a request kept), and nothing the runtime
    keeps outlives its requests."""
    limits = fake_limits(max_batch_size=128, max_num_tokens=1024, num_blocks=512)
    params = [SamplingParams(max_new_tokens=1), SamplingParams(max_new_tokens=2)]
    rng = random.Random(0)

    def wave(llm: LLMEngine, n: int) -> None:
        streams = [llm.submit(prompt_for(rng.randrange(10**6), i), params[i % 2]) for i in range(n)]
        for s in streams:
            assert s.result().finish_reason == "length"

    def held() -> int:
        gc.collect()
        return tracemalloc.get_traced_memory()[0]

    with LLMEngine(FakeEngine(limits)) as llm:
        wave(llm, 4_000)  # warm-up: the prefix cache fills, lazy imports and caches settle
        tracemalloc.start()
        try:
            wave(llm, 2_000)  # structures made before tracing started are reallocated (and traced) in this one
            base = held()
            for _ in range(3):
                wave(llm, 2_000)
            grown = held() - base
        finally:
            tracemalloc.stop()
        rt, bm = llm.runtime, llm.runtime.blocks
        assert grown < 150_000, f"held memory grew by {grown} B over 6,000 requests"
        assert not rt.requests and not rt.utilization and not rt.has_work and not llm.num_pending
        assert len(bm.cached) <= bm.num_blocks and len(bm.block_of) <= bm.num_blocks and bm.num_used == 0


# -- the prefix cache across tenants -----------------------------------------------------------------------------
def collide(parent: bytes, tokens: list[int]) -> bytes:
    return b"same"


def test_a_forced_hash_collision_costs_a_miss_not_another_tenants_blocks() -> None:
    bm = BlockManager(8, 4)
    bm.hash = collide  # every block of every prompt has one hash
    mine = [11, 12, 13, 14, 15, 16, 17, 18, 19]
    table = [bm.allocate() for _ in range(3)]
    assert bm.register(mine, table, len(mine), [], 0) == 2
    assert bm.match_prefix([21, 22, 23, 24, 25, 26, 27, 28, 29], []) == []  # another tenant: same hashes, no reuse
    assert bm.match_prefix([11, 12, 13, 99, 15, 16, 17, 18, 19], []) == []  # one token differs
    assert bm.match_prefix(mine, []) == [table[0]]  # same tokens: reused (the 2nd block's hash names the 1st)
    assert bm.refcount[table[0]] == 2 and bm.refcount[table[1]] == 1


def test_tenants_with_colliding_hashes_get_their_own_outputs_and_blocks() -> None:
    """Three tenants, every block hash colliding; the third shares its first block's tokens with the first. The
    fake model reads its context back from the KV pool, so a block shared by mistake would change an output."""
    one, two, three = list(range(10, 23)), list(range(40, 53)), [10, 11, 12, 13, *range(70, 79)]
    params = SamplingParams(max_new_tokens=9)
    rt = Runtime(FakeEngine(), num_blocks=64)
    rt.blocks.hash = collide
    r1 = rt.add_request(one, params)
    rt.step()  # the first tenant's prompt is in the cache, and it is still decoding when the others arrive
    r2, r3 = rt.add_request(two, params), rt.add_request(three, params)
    rt.step()
    assert set(r1.blocks) & set(r3.blocks) == {r1.blocks[0]} == {r3.blocks[0]}  # a true hit, verified
    assert rt.blocks.refcount[r1.blocks[0]] == 2
    while rt.has_work:
        assert set(r2.blocks).isdisjoint([*r1.blocks, *r3.blocks])  # the colliding tenant shares nothing
        assert set(r1.blocks[1:]).isdisjoint(r3.blocks[1:])
        rt.step()
    for r, prompt in ((r1, one), (r2, two), (r3, three)):
        alone = Runtime(FakeEngine(), num_blocks=64)
        solo = alone.add_request(prompt, params)
        alone.run()
        assert r.generated == solo.generated == expected_output(prompt, 9)
    assert rt.cached_tokens == 4 and rt.blocks.num_used == 0


def test_a_hit_whose_parent_block_was_reallocated_is_not_reused() -> None:
    """With a hash that ignores the parent (a collision on the chain), block 2 of [A, B] still names B's KV
    computed after A; once A's block holds other tokens, a request for [A2, B] must not take it."""
    bm = BlockManager(4, 4)
    bm.hash = lambda parent, tokens: hashlib.blake2b(bytes(tokens)).digest()
    a, a2, b = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    first = [bm.allocate(), bm.allocate()]
    bm.register([*a, *b], first, 8, [], 0)
    bm.release(first)
    assert bm.match_prefix([*a, *b, 0], []) == first  # while A's block is A's: reused
    bm.release(first)
    while True:  # take blocks until A's block is handed out again, then fill it with A2
        block = bm.allocate()
        if block == first[0]:
            break
    bm.register([*a2], [block], 4, [], 0)
    hit = bm.match_prefix([*a2, *b, 0], [])
    assert hit == [first[0]]  # A2 itself is found, in the reallocated block...
    assert first[1] not in hit  # ...but not B's block, whose parent was A's block in an earlier generation


@pytest.mark.parametrize(("prompt_len", "new", "max_num_tokens"), [(10, 13, 64), (30, 6, 8), (8, 1, 64)])
def test_each_full_block_is_hashed_once(prompt_len: int, new: int, max_num_tokens: int) -> None:
    """Hashes follow blocks, not steps: a request of P prompt + G generated tokens hashes each of its
    (P + G - 1) // 4 full computed blocks once (the last token is sampled, never fed), chunked prefill or not."""
    rt = Runtime(FakeEngine(fake_limits(max_num_tokens=max_num_tokens)))
    calls: list[list[int]] = []
    real = rt.blocks.hash

    def counted(parent: bytes, tokens: list[int]) -> bytes:
        calls.append(tokens)
        return real(parent, tokens)

    rt.blocks.hash = counted
    prompt = list(range(3, 3 + prompt_len))
    r = rt.add_request(prompt, SamplingParams(max_new_tokens=new))
    rt.run()
    assert r.generated == expected_output(prompt, new)
    full = (prompt_len + new - 1) // 4
    assert len(calls) == full == len(r.block_hashes)
    assert calls == [r.tokens[i * 4 : (i + 1) * 4] for i in range(full)]  # in order, each block once


class NaNRows(FakeEngine):
    """Every sequence whose context holds token 13 gets NaN logits: its sampling must fail, alone."""

    def forward(self, batch: Batch, kv_cache: torch.Tensor) -> np.ndarray:
        logits = super().forward(batch, kv_cache)
        starts = np.cumsum(batch.new_lens) - batch.new_lens
        for s, (start, n) in enumerate(zip(starts, batch.new_lens, strict=True)):
            if 13 in batch.input_ids[start : start + n]:
                logits[s] = np.nan
        return logits


def test_a_request_whose_sampling_fails_ends_alone() -> None:
    rt = Runtime(NaNRows())
    poisoned = rt.add_request([13, 14, 15], SamplingParams(max_new_tokens=4, temperature=0.8, seed=1))
    healthy = rt.add_request([3, 4, 5], SamplingParams(max_new_tokens=4))
    rt.run()
    assert poisoned.finish_reason == "error" and "sampling failed" in (poisoned.error or "")
    assert healthy.finish_reason == "length" and healthy.generated == expected_output([3, 4, 5], 4)
    assert rt.blocks.num_used == 0


def test_timeouts_come_from_a_deadline_heap_that_forgets_ended_requests() -> None:
    clock = [0.0]
    rt = Runtime(FakeEngine(), clock=lambda: clock[0])
    late = rt.add_request([3, 4], SamplingParams(max_new_tokens=200), timeout=5.0)
    for i in range(150):  # requests with deadlines that end in time must not pile up in the heap
        rt.add_request([5 + i % 7], SamplingParams(max_new_tokens=1), timeout=10.0)
        rt.step()
    assert len(rt._deadlines) <= 2 * len(rt.requests) + 64 + 1
    clock[0] = 6.0
    assert late in rt.step() and late.finish_reason == "timeout"


def test_partial_prefills_holding_every_block_do_not_deadlock() -> None:
    from toolchain.runtime.request import Request
    from toolchain.runtime.scheduler import Scheduler

    blocks = BlockManager(4, 4)
    sched = Scheduler(blocks, max_batch_size=4, max_num_tokens=16)
    a, b = Request(list(range(3, 15))), Request(list(range(20, 32)))  # 12 prompt tokens: 3 blocks each
    for r in (a, b):  # each prefilled 8 of 12 tokens into 2 blocks: the pool is full, neither can go on
        r.blocks, r.num_computed, r.status = [blocks.allocate(), blocks.allocate()], 8, Status.RUNNING
        sched.running.append(r)
    assert sched.schedule() == []  # nothing fits this step...
    assert b.status is Status.WAITING and b.num_computed == 0 and blocks.num_free == 2  # ...so the newest yields
    (s,) = sched.schedule()
    assert s.request is a and s.tokens == a.prompt[8:]


def test_close_ends_every_stream_and_refuses_later_submits() -> None:
    llm = LLMEngine(FakeEngine(delay_s=0.01))
    streams = [llm.submit([3 + i, 4], SamplingParams(max_new_tokens=200)) for i in range(3)]
    llm.close()
    assert {s.result().finish_reason for s in streams} <= {"shutdown", "length"}
    assert any(s.result().finish_reason == "shutdown" for s in streams)
    assert llm.runtime.blocks.num_used == 0 and not llm.alive
    with pytest.raises(RuntimeError, match="closed"):
        llm.submit([3], SamplingParams(max_new_tokens=1))


def test_a_failing_step_hook_ends_requests_but_not_the_loop() -> None:
    with LLMEngine(FakeEngine()) as llm:
        calls = []

        def hook(_: Runtime) -> None:
            calls.append(1)
            if len(calls) == 1:
                raise KeyError("metrics bug")

        llm.on_step = hook
        first = llm.submit([3, 4], SamplingParams(max_new_tokens=5)).result()
        second = llm.submit([5, 6], SamplingParams(max_new_tokens=5)).result()
        assert first.finish_reason == "error" and "metrics bug" in (first.error or "")
        assert second.finish_reason == "length" and second.token_ids == expected_output([5, 6], 5)
        assert llm.alive


class RewritingDecoder:
    """Rewrites text before the newest token (drops the space before a '.'), as clean-up decoders do."""

    def decode(
        self, ids: list[int], skip_special_tokens: bool = True, clean_up_tokenization_spaces: bool = False
    ) -> str:
        return " ".join("." if i == 0 else f"w{i}" for i in ids).replace(" .", ".")


def test_a_decoder_that_rewrites_earlier_text_never_stalls_the_stream() -> None:
    detok = IncrementalDetokenizer(RewritingDecoder())
    pieces = [detok.add(t) for t in [1, 2, 0, 3, 4, 0, 5] * 30]
    assert sum(bool(p) for p in pieces) > 150  # text keeps coming, token after token
    assert detok.read == len(detok.ids) and detok.prefix >= len(detok.ids) - 8  # the window keeps moving
