"""The paged KV cache's block manager: allocation with reference counts, prefix sharing by chained hashes of full
blocks, copy-on-write, and a free-block watermark.

A full block's hash chains its parent's: h_i = hash(h_{i-1}, tokens of block i), so equal hashes mean equal whole
prefixes. Full blocks are immutable once computed; a block whose last user is gone goes back to the free list but
keeps its contents and hash until it is handed out again, so a later request with the same prefix can take it back.
"""

from __future__ import annotations

from collections import OrderedDict


class OutOfBlocks(Exception):
    pass


class BlockManager:
    def __init__(self, num_blocks: int, tokens_per_block: int, watermark: float = 0.0, prefix_sharing: bool = True):
        if num_blocks < 1:
            raise ValueError("the pool needs at least one block")
        self.num_blocks, self.tokens_per_block = num_blocks, tokens_per_block
        self.watermark_blocks = int(watermark * num_blocks)
        self.prefix_sharing = prefix_sharing
        self.refcount = [0] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))  # LRU order
        self.hash_of: dict[int, int] = {}
        self.block_of: dict[int, int] = {}

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    def can_allocate(self, n: int, keep_watermark: bool = True) -> bool:
        return n <= len(self.free) - (self.watermark_blocks if keep_watermark else 0)

    def allocate(self) -> int:
        if not self.free:
            raise OutOfBlocks("no free KV blocks")
        block, _ = self.free.popitem(last=False)  # least recently freed first: keeps recent prefixes longest
        old = self.hash_of.pop(block, None)
        if old is not None and self.block_of.get(old) == block:
            del self.block_of[old]
        self.refcount[block] = 1
        return block

    def release(self, blocks: list[int]) -> None:
        for block in blocks:
            if self.refcount[block] <= 0:
                raise RuntimeError(f"KV block {block} released more often than it was taken")
            self.refcount[block] -= 1
            if self.refcount[block] == 0:
                self.free[block] = None

    def _hashes(self, tokens: list[int], full_blocks: int) -> list[int]:
        out, parent, t = [], 0, self.tokens_per_block
        for i in range(full_blocks):
            parent = hash((parent, tuple(tokens[i * t : (i + 1) * t])))
            out.append(parent)
        return out

    def match_prefix(self, tokens: list[int]) -> list[int]:
        """Take (reference) the cached blocks holding the longest prefix of `tokens` made of full blocks, leaving at
        least one token to compute (the engine must see one to produce logits)."""
        if not self.prefix_sharing:
            return []
        taken = []
        for h in self._hashes(tokens, (len(tokens) - 1) // self.tokens_per_block):
            block = self.block_of.get(h)
            if block is None:
                break
            if self.refcount[block] == 0:
                del self.free[block]
            self.refcount[block] += 1
            taken.append(block)
        return taken

    def register(self, tokens: list[int], blocks: list[int], computed: int) -> None:
        """Make the full, computed blocks of a sequence findable by later requests with the same prefix."""
        if not self.prefix_sharing:
            return
        for i, h in enumerate(self._hashes(tokens, computed // self.tokens_per_block)):
            if h not in self.block_of:
                self.block_of[h] = blocks[i]
                self.hash_of[blocks[i]] = h

    def ensure_writable(self, blocks: list[int], index: int) -> tuple[int, int] | None:
        """Copy-on-write: if block `index` of this table is shared, give the table a private copy. Returns
        (source, destination) for the caller to copy in the pool, or None when the block was private already."""
        block = blocks[index]
        if self.refcount[block] <= 1:
            return None
        fresh = self.allocate()
        self.refcount[block] -= 1
        blocks[index] = fresh
        return block, fresh
