"""The paged KV cache's block manager: allocation with reference counts, prefix sharing by chained hashes of full
blocks, and a free-block watermark.

A full block's hash chains its parent's: h_i = blake2b(h_{i-1} || token ids of block i), a cryptographic hash, so
that no client can craft a prompt whose blocks collide with another tenant's. Each request keeps its chain and
extends it only when a block fills (`extend_hashes`), never recomputing it per step. A hit is still verified
before reuse: the cached block's own tokens must equal the request's, and its recorded parent must be the block
just matched (in its current generation: a block reallocated since is a different parent). A hash collision
therefore costs a cache miss, never another sequence's KV.

Full blocks are immutable once computed: only full blocks are shared, and a sharer always computes at least one
token past them, so no copy-on-write is needed. A block whose last user is gone goes back to the free list but keeps
its contents and hash until it is handed out again, so a later request with the same prefix can take it back.

Two levels, as in nano-vllm and vLLM: blocks (`allocate`, `release`, `match_prefix`, `register`) and requests
(`can_allocate_for` / `allocate_for`, `share_prefix`, `advance`, `free`). The scheduler and the step loop use the
request verbs only: a request's block table, computed-token count and registered-block count change here and
nowhere else.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from toolchain.engine.geometry import blocks_for

if TYPE_CHECKING:
    from toolchain.runtime.request import Request

ROOT_HASH = b"trtbuild-kv-v1"  # h_{-1}: the chain's start, versioned so that a layout change invalidates nothing


def block_hash(parent: bytes, tokens: list[int]) -> bytes:
    return hashlib.blake2b(parent + np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=16).digest()


class OutOfBlocks(Exception):
    pass


@dataclass(frozen=True)
class _Cached:
    """What a findable block holds: its tokens and the (block, generation) of its parent, for verification."""

    hash: bytes
    tokens: tuple[int, ...]
    parent: tuple[int, int] | None


class BlockManager:
    def __init__(self, num_blocks: int, tokens_per_block: int, watermark: float = 0.0, prefix_sharing: bool = True):
        if num_blocks < 1:
            raise ValueError("the pool needs at least one block")
        self.num_blocks, self.tokens_per_block = num_blocks, tokens_per_block
        self.watermark_blocks = int(watermark * num_blocks)
        self.prefix_sharing = prefix_sharing
        self.refcount = [0] * num_blocks
        self.generation = [0] * num_blocks  # bumped on every allocation: a parent link names one lifetime
        self.free_list: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))  # LRU order
        self.cached: dict[int, _Cached] = {}  # block -> what it holds, for findable blocks
        self.block_of: dict[bytes, int] = {}  # chained hash -> block
        self.hash = block_hash  # replaceable in tests, to force collisions
        # prefix-cache lookups (vLLM's prefix_cache_queries / _hits): tokens looked up, tokens found
        self.prefix_queries = self.prefix_hits = 0

    @property
    def num_free(self) -> int:
        return len(self.free_list)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_list)

    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold `tokens` tokens (geometry.blocks_for at this pool's block size)."""
        return blocks_for(tokens, self.tokens_per_block)

    # -- blocks -------------------------------------------------------------------------------------------------
    def can_allocate(self, n: int, keep_watermark: bool = True) -> bool:
        return n <= len(self.free_list) - (self.watermark_blocks if keep_watermark else 0)

    def allocate(self) -> int:
        if not self.free_list:
            raise OutOfBlocks("no free KV blocks")
        block, _ = self.free_list.popitem(last=False)  # least recently freed first: keeps recent prefixes longest
        old = self.cached.pop(block, None)
        if old is not None and self.block_of.get(old.hash) == block:
            del self.block_of[old.hash]
        self.generation[block] += 1
        self.refcount[block] = 1
        return block

    def release(self, blocks: list[int]) -> None:
        for block in blocks:
            if self.refcount[block] <= 0:
                raise RuntimeError(f"KV block {block} released more often than it was taken")
            self.refcount[block] -= 1
            if self.refcount[block] == 0:
                self.free_list[block] = None

    def extend_hashes(self, tokens: list[int], hashes: list[bytes], full_blocks: int) -> list[bytes]:
        """Grow a request's hash chain `hashes` (in place) to cover `full_blocks` blocks of `tokens`."""
        t = self.tokens_per_block
        for i in range(len(hashes), full_blocks):
            hashes.append(self.hash(hashes[-1] if hashes else ROOT_HASH, tokens[i * t : (i + 1) * t]))
        return hashes

    def match_prefix(self, tokens: list[int], hashes: list[bytes]) -> list[int]:
        """Take (reference) the cached blocks holding the longest verified prefix of `tokens` made of full blocks,
        leaving at least one token to compute (the engine must see one to produce logits)."""
        if not self.prefix_sharing:
            return []
        t = self.tokens_per_block
        taken: list[int] = []
        parent: tuple[int, int] | None = None
        for i, h in enumerate(self.extend_hashes(tokens, hashes, (len(tokens) - 1) // t)):
            block = self.block_of.get(h, -1)
            entry = self.cached.get(block)
            if entry is None or entry.parent != parent or entry.tokens != tuple(tokens[i * t : (i + 1) * t]):
                break  # a miss, or a collision caught by the content check
            if self.refcount[block] == 0:
                del self.free_list[block]
            self.refcount[block] += 1
            taken.append(block)
            parent = (block, self.generation[block])
        return taken

    def register(self, tokens: list[int], blocks: list[int], computed: int, hashes: list[bytes], done: int) -> int:
        """Make the full, computed blocks of a sequence past the first `done` findable by later requests with the
        same prefix; returns the new count of full blocks handled. Each block is hashed once per request."""
        full = computed // self.tokens_per_block
        if not self.prefix_sharing or full <= done:
            return max(done, full)
        t = self.tokens_per_block
        self.extend_hashes(tokens, hashes, full)
        for i in range(done, full):
            block, h = blocks[i], hashes[i]
            if h in self.block_of or block in self.cached:
                continue
            parent = (blocks[i - 1], self.generation[blocks[i - 1]]) if i else None
            self.block_of[h] = block
            self.cached[block] = _Cached(h, tuple(tokens[i * t : (i + 1) * t]), parent)
        return full

    # -- requests -----------------------------------------------------------------------------------------------
    def can_allocate_for(self, request: Request, tokens: int, keep_watermark: bool = True) -> bool:
        """Whether the free blocks (less the watermark, unless told otherwise) let `request` hold `tokens` tokens."""
        return self.can_allocate(self.blocks_for(tokens) - len(request.blocks), keep_watermark)

    def max_tokens_for(self, request: Request) -> int:
        """The most tokens `request` could hold: its own blocks and every free one."""
        return (len(request.blocks) + len(self.free_list)) * self.tokens_per_block

    def allocate_for(self, request: Request, tokens: int) -> bool:
        """Grow `request`'s block table to hold `tokens` tokens in total, watermark or not; False, with nothing
        taken, when there are not enough free blocks."""
        need = self.blocks_for(tokens) - len(request.blocks)
        if need <= 0:
            return True
        if not self.can_allocate(need, keep_watermark=False):
            return False
        request.blocks += [self.allocate() for _ in range(need)]
        return True

    def share_prefix(self, request: Request) -> int:
        """Start a request with no blocks on the cached blocks of its longest prefix, counted as computed; returns
        how many tokens it found."""
        assert not request.blocks, f"{request.id} already holds blocks"
        shared = self.match_prefix(request.tokens, request.block_hashes)
        request.blocks = shared
        request.num_computed = len(shared) * self.tokens_per_block
        request.registered = len(shared)
        if self.prefix_sharing:  # as vLLM, which looks nothing up with prefix caching off
            self.prefix_queries += len(request.tokens)
            self.prefix_hits += request.num_computed
        return request.num_computed

    def advance(self, request: Request, tokens: int) -> None:
        """`tokens` more of the request's tokens are in the cache; the blocks they filled become findable."""
        request.num_computed += tokens
        if request.num_computed // self.tokens_per_block > request.registered:
            request.registered = self.register(
                request.tokens, request.blocks, request.num_computed, request.block_hashes, request.registered
            )

    def free(self, request: Request) -> None:
        """Give back the request's blocks: it holds nothing in the cache any more (its hash chain stays: it names
        tokens, not blocks)."""
        self.release(request.blocks)
        request.blocks, request.num_computed, request.registered = [], 0, 0
