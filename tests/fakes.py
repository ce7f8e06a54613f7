"""A fake `Engine` for runtime and server tests: numpy only, no ONNX, no weights, microseconds per call.

It keeps the engine contract for real: each call checks the packed batch, writes every new token's id into the
KV pool (as its "K", at the slot the block table names) and reads each sequence's whole context back from the
pool to pick the next token. So greedy output is a known function of the context (`expected_output`), and a
block table that points at a block holding other tokens (a prefix-cache mistake) changes the output.

`FakeRankedEngine` adds what a multi-rank engine's rank-0 facade has (issue 27): `health()`, `close()`, and ranks
that die or time out, for the rank-failure tests of the runtime and the server.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from toolchain.checkpoint.trtllm import Mapping
from toolchain.engine.api import EngineSpec, KVCacheSpec, Limits, StepTokens, tokens_on_host
from toolchain.engine.collectives import CollectiveError
from toolchain.engine.contract import Batch

VOCAB = 320  # as the tiny model's byte-level tokenizer: 3 specials + 256 bytes fit
TOKENS_PER_BLOCK = 4
_MODULUS = 317  # prime: changing one context token (by less than 317) changes the weighted sum modulo it
_FIRST = VOCAB - _MODULUS  # next tokens fall in [3, 320): never one of the specials 0, 1, 2


def _weights(n: int) -> np.ndarray:
    return np.arange(n, dtype=np.int64) % 101 + 1


def next_token(context: Sequence[int] | np.ndarray) -> int:
    """The fake model: its greedy next token after `context`, which depends on every token and its position."""
    ids = np.asarray(context, dtype=np.int64)
    return _FIRST + int((ids * _weights(ids.size)).sum() % _MODULUS)


def expected_output(prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """What the runtime must generate greedily from `prompt`, computed without it."""
    context, out = list(prompt), []
    for _ in range(max_new_tokens):
        out.append(next_token(context))
        context.append(out[-1])
    return out


def fake_limits(
    max_batch_size: int = 8, max_num_tokens: int = 64, max_seq_len: int = 256, num_blocks: int = 256
) -> Limits:
    return Limits(
        max_batch_size=max_batch_size,
        max_num_tokens=max_num_tokens,
        max_seq_len=max_seq_len,
        tokens_per_block=TOKENS_PER_BLOCK,
        num_blocks=num_blocks,
    )


class FakeEngine:
    """An `Engine` whose model is `next_token` (or `model`, any function of the context), run over the KV pool;
    with `logits_model` (the context -> a logits row [vocab]) each row is that row instead of a one-hot of `model`'s
    token (a distribution to sample from, for the speculative-sampling tests).

    `delay_s` sleeps in every call (a slow engine, for cancellation tests); while `broken` is set, calls raise.
    `calls` counts the calls and `seen` sums the sequences they carried."""

    def __init__(
        self,
        limits: Limits | None = None,
        model: Callable[[np.ndarray], int] = next_token,
        delay_s: float = 0.0,
        vocab_size: int = VOCAB,
        logits_model: Callable[[np.ndarray], np.ndarray] | None = None,
    ):
        limits = limits or fake_limits()
        kv = KVCacheSpec("float32", num_layers=1, num_kv_heads=1, tokens_per_block=TOKENS_PER_BLOCK, head_size=1)
        self.spec = EngineSpec(
            engine_dir=Path("."),
            backend="fake",
            dtype="float32",
            checkpoint_dtype="float32",
            architecture="FakeForCausalLM",
            vocab_size=vocab_size,
            limits=limits,
            kv_cache=kv,
        )
        self.vocab_size, self.tokens_per_block = vocab_size, TOKENS_PER_BLOCK
        self.model, self.delay_s, self.logits_model = model, delay_s, logits_model
        self.broken = False
        self.calls = self.seen = 0

    def new_kv_cache(self, num_blocks: int) -> torch.Tensor:
        return torch.zeros(self.spec.kv_cache.pool_shape(num_blocks), dtype=torch.float32)

    def forward_tokens(self, batch: Batch, kv_cache: torch.Tensor, sampled: Sequence[int]) -> StepTokens:
        return tokens_on_host(self.forward(batch, kv_cache), sampled)

    def forward(self, batch: Batch, kv_cache: torch.Tensor) -> np.ndarray:
        if self.broken:
            raise RuntimeError("fake engine failure")
        if self.delay_s:
            time.sleep(self.delay_s)
        tpb, num_blocks = self.tokens_per_block, kv_cache.shape[1]
        batch.check(tpb)
        batch.check_blocks(num_blocks, tpb)
        pool = kv_cache.numpy()[0, :, 0, 0, :, 0]  # [blocks, tokens_per_block]: a view, written in place
        seq = np.repeat(np.arange(batch.new_lens.size), batch.new_lens)
        pos = batch.position_ids.astype(np.int64)
        pool[batch.block_tables[seq, pos // tpb], pos % tpb] = batch.input_ids
        logits = np.zeros((batch.logits_index.size, self.vocab_size), dtype=np.float32)
        for r, at in enumerate(batch.logits_index.tolist()):  # each output row sees its context up to its token
            s, end = int(seq[at]), int(pos[at]) + 1
            blocks = batch.block_tables[s, : -(-end // tpb)]
            context = pool[blocks].reshape(-1)[:end].astype(np.int64)
            if self.logits_model is not None:
                logits[r] = self.logits_model(context)
            else:
                logits[r, self.model(context)] = 1.0
        self.calls += 1
        self.seen += int(batch.new_lens.size)
        return logits


class FakeRankedEngine(FakeEngine):
    """A multi-rank engine's rank-0 facade as the runtime and the server see it (issue 27): `FakeEngine` plus the
    optional `health()` and `close()` of the Engine protocol, and ways to fail as real ranks do.

    `kill_rank(r)`: a worker died, as the facade's process monitor reports it at once (`health()` names it); the
    next forward then raises what gloo raises when a peer is gone (a plain RuntimeError). `time_out(r)`: the next
    forward raises the `CollectiveError` of a collective that timed out on rank `r`, after `hang_s`."""

    def __init__(self, limits: Limits | None = None, delay_s: float = 0.0, world_size: int = 2):
        super().__init__(limits, delay_s=delay_s)
        self.spec = replace(self.spec, mapping=Mapping.for_parallel(world_size, 1))
        self.down: str | None = None
        self.timeout_rank: int | None = None
        self.hang_s = 0.0
        self.closed = 0  # close() calls
        self.closed_at = 0.0  # time.monotonic() of the last

    def health(self) -> str | None:
        return self.down

    def close(self) -> None:
        self.closed += 1
        self.closed_at = time.monotonic()

    def kill_rank(self, rank: int, code: int = -9) -> None:
        self.down = f"rank {rank} died (exit {code})"

    def time_out(self, rank: int, hang_s: float = 0.0) -> None:
        self.timeout_rank, self.hang_s = rank, hang_s

    def forward(self, batch: Batch, kv_cache: torch.Tensor) -> np.ndarray:
        if self.down is not None:
            raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:29500")
        if self.timeout_rank is not None:
            time.sleep(self.hang_s)
            group = tuple(range(self.spec.mapping.world_size))
            raise CollectiveError(
                self.timeout_rank, "AllReduce", "after layer 0 mlp.proj", group, self.hang_s, "timed out"
            )
        return super().forward(batch, kv_cache)


class Spy:
    """Wraps an engine and records the `sampled` rows of every call: which rows' logits came to the host."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.spec, self.vocab_size, self.tokens_per_block = engine.spec, engine.vocab_size, engine.tokens_per_block
        self.calls: list[list[int]] = []

    def new_kv_cache(self, num_blocks: int) -> torch.Tensor:
        return self.engine.new_kv_cache(num_blocks)  # type: ignore[no-any-return]

    def forward(self, batch: Batch, kv_cache: torch.Tensor) -> np.ndarray:
        return self.engine.forward(batch, kv_cache)  # type: ignore[no-any-return]

    def forward_tokens(self, batch: Batch, kv_cache: torch.Tensor, sampled: Sequence[int]) -> StepTokens:
        self.calls.append(list(sampled))
        return self.engine.forward_tokens(batch, kv_cache, sampled)  # type: ignore[no-any-return]
