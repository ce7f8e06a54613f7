"""The KV pool's geometry, defined once: the shape of one block, how many blocks N tokens need, and the block sizes
an engine may be built with. The pool itself is [layers, blocks, *block shape] (contract.py says how it is used).

Importable without torch or numpy: the CLI's and the recipe's checks read it at start-up."""

from __future__ import annotations

from typing import TYPE_CHECKING, overload

if TYPE_CHECKING:
    import numpy as np

TOKENS_PER_BLOCK = (1, 2, 4, 8, 16, 32, 64, 128)  # what the attention plugin's kernels are compiled for


def kv_block_shape(num_kv_heads: int, tokens_per_block: int, head_size: int) -> tuple[int, int, int, int]:
    """One block of the pool: K and V of `tokens_per_block` tokens, [2, kv_heads, tokens_per_block, head_size]."""
    return (2, num_kv_heads, tokens_per_block, head_size)


@overload
def blocks_for(tokens: int, tokens_per_block: int) -> int: ...
@overload
def blocks_for(tokens: np.ndarray, tokens_per_block: int) -> np.ndarray: ...
def blocks_for(tokens: int | np.ndarray, tokens_per_block: int) -> int | np.ndarray:
    """The blocks that hold `tokens` tokens (elementwise for an array): the last one may be part-full."""
    return -(-tokens // tokens_per_block)
