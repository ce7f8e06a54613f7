"""The engine I/O contract: the one definition of what an engine takes and returns, used by ONNX export, both
backends and the runtime.

A call carries a packed batch — no padding — so prefill chunks and decode steps of different sequences share one
call (in-flight batching). Sequence s owns tokens [cu[s], cu[s] + new_lens[s]) of the packed arrays, where cu is
the exclusive prefix sum of new_lens; it already has context_lens[s] tokens in the KV cache, so its new tokens sit
at positions context_lens[s] .. context_lens[s] + new_lens[s] - 1.

The KV cache is ONE pool for all layers, [layers, blocks, 2 (K, V), kv_heads, tokens_per_block, head_size]: one
binding, an INPUT that the plugins update in place: every layer's KVCacheWrite node writes the new tokens' K
(after rotary) and V into it, and its PagedAttention node reads it. Nothing threads the pool from node to node: a
pool-sized plugin output is a tensor TensorRT would allocate and copy (TensorRT-Edge-LLM saw exactly that with
declared aliasing, and binds past and present KV at one address instead; TensorRT-LLM passes pool pointers to
its attention plugin the same way). The data dependencies order the accesses: PagedAttention consumes the q that
KVCacheWrite produces, and the next layer's KVCacheWrite consumes what this layer's attention produced. Token
position p of sequence s lives in block block_tables[s, p // tokens_per_block], slot p % tokens_per_block.

`logits_index` picks the rows of the packed hidden states that reach lm_head: each sequence's last new token for
generation (num_outputs = num_seqs), every token for evaluation (num_outputs = num_tokens).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from toolchain.engine.geometry import blocks_for

CONTRACT_VERSION = 2  # 2: attention as KVCacheWrite + PagedAttention, the pool an input updated in place
PLUGIN_DOMAIN = "trtbuild"  # the plugins' namespace: ONNX custom-op domain and TensorRT plugin namespace
WRITE_OP = "KVCacheWrite"  # rotary + KV store; plugin name = ONNX op_type = TensorRT plugin name
ATTENTION_OP = "PagedAttention"  # attention over the paged pool

# name -> (ONNX element type, symbolic shape); dims named here are dynamic in the graph
INPUTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "input_ids": ("int32", ("num_tokens",)),
    "position_ids": ("int32", ("num_tokens",)),
    "context_lens": ("int32", ("num_seqs",)),
    "new_lens": ("int32", ("num_seqs",)),
    "block_tables": ("int32", ("num_seqs", "max_blocks_per_seq")),
    "logits_index": ("int32", ("num_outputs",)),
    "kv_cache": ("kv", ("num_layers", "num_blocks", "2", "num_kv_heads", "tokens_per_block", "head_size")),
}
OUTPUTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "logits": ("float32", ("num_outputs", "vocab_size")),
}
KV_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
    "fp8": torch.float8_e4m3fn,
    "nvfp4": torch.float32,  # NVFP4-dequantized values (quantize/methods/kv_cache.py): no memory saved
}


def _positions(context_lens: np.ndarray, new_lens: np.ndarray) -> np.ndarray:
    """Each sequence's new tokens at context_lens[s], context_lens[s] + 1, ... (vectorised: no loop over sequences)."""
    starts = np.cumsum(new_lens) - new_lens
    offsets = np.arange(int(new_lens.sum())) - np.repeat(starts, new_lens)
    positions: np.ndarray = (np.repeat(context_lens, new_lens) + offsets).astype(np.int32)
    return positions


@dataclass
class Batch:
    """One engine call's inputs (the KV pool is held by the caller and passed alongside)."""

    input_ids: np.ndarray
    position_ids: np.ndarray
    context_lens: np.ndarray
    new_lens: np.ndarray
    block_tables: np.ndarray
    logits_index: np.ndarray

    def check(self, tokens_per_block: int) -> None:
        n, s = self.input_ids.shape[0], self.context_lens.shape[0]
        if self.position_ids.shape != (n,) or self.new_lens.shape != (s,) or self.block_tables.shape[0] != s:
            raise ValueError("batch arrays disagree on num_tokens / num_seqs")
        if int(self.new_lens.sum()) != n:
            raise ValueError(f"new_lens sum to {int(self.new_lens.sum())}, not num_tokens {n}")
        needed = blocks_for(self.context_lens + self.new_lens, tokens_per_block)
        if s and int(needed.max()) > self.block_tables.shape[1]:
            raise ValueError("a sequence needs more blocks than block_tables has columns")
        if not np.array_equal(self.position_ids, _positions(self.context_lens, self.new_lens)):
            raise ValueError("position_ids must run from context_lens[s] for each sequence's new tokens")
        if self.logits_index.size and not (self.logits_index.min() >= 0 and self.logits_index.max() < n):
            raise ValueError("logits_index out of range")

    def check_blocks(self, num_blocks: int, tokens_per_block: int) -> None:
        """Every block a sequence uses exists (a negative id would silently wrap around in the pool)."""
        needed = blocks_for(self.context_lens.astype(np.int64) + self.new_lens, tokens_per_block)
        used = np.arange(self.block_tables.shape[1])[None, :] < needed[:, None]
        bad = used & ((self.block_tables < 0) | (self.block_tables >= num_blocks))
        if bad.any():
            s = int(np.argmax(bad.any(axis=1)))
            ids = self.block_tables[s, : int(needed[s])].tolist()
            raise ValueError(f"sequence {s}: block ids {ids} outside the pool's {num_blocks} blocks")

    @staticmethod
    def from_sequences(
        new_tokens: list[list[int]],
        context_lens: list[int],
        block_tables: list[list[int]],
        all_logits: bool | Sequence[bool] = False,
    ) -> Batch:
        """Pack per-sequence new tokens (each after `context_lens[s]` cached ones) into one call. Output rows: the
        last new token's of each sequence, or every new token's for the sequences `all_logits` names (all of them
        when it is True)."""
        new_lens = np.fromiter(map(len, new_tokens), dtype=np.int32, count=len(new_tokens))
        ctx = np.asarray(context_lens, dtype=np.int32)
        ids = np.fromiter(itertools.chain.from_iterable(new_tokens), dtype=np.int32, count=int(new_lens.sum()))
        pos = _positions(ctx, new_lens)
        used = np.fromiter(map(len, block_tables), dtype=np.int64, count=len(block_tables))
        tables = np.zeros((len(block_tables), max(1, int(used.max(initial=0)))), dtype=np.int32)
        # row by row, left to right: the order chain() reads them in (2x faster than padding lists at batch 256)
        tables[np.arange(tables.shape[1])[None, :] < used[:, None]] = np.fromiter(
            itertools.chain.from_iterable(block_tables), dtype=np.int32, count=int(used.sum())
        )
        if isinstance(all_logits, bool):
            every = all_logits
        else:  # some sequences (prompt logprobs) want every position, the others their last
            flags = np.asarray(all_logits, dtype=bool)
            every = bool(flags.all())
            if flags.any() and not every:
                ends = np.cumsum(new_lens)
                rows = [
                    np.arange(e - n, e) if f else np.asarray([e - 1])
                    for e, n, f in zip(ends, new_lens, flags, strict=True)
                ]
                return Batch(ids, pos, ctx, new_lens, tables, np.concatenate(rows).astype(np.int32))
        index = np.arange(ids.shape[0], dtype=np.int32) if every else (np.cumsum(new_lens) - 1).astype(np.int32)
        return Batch(ids, pos, ctx, new_lens, tables, index)

    def feeds(self) -> dict[str, np.ndarray]:
        return {
            "input_ids": self.input_ids,
            "position_ids": self.position_ids,
            "context_lens": self.context_lens,
            "new_lens": self.new_lens,
            "block_tables": self.block_tables,
            "logits_index": self.logits_index,
        }
