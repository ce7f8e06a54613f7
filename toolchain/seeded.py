"""Random numbers that are the same on every machine: the embedded default model, the test models and texts.

torch's float generators are not: `randn`/`normal_` on CPU take a vectorized Box-Muller path whose result depends on
the kernel set torch dispatches to (`ATEN_CPU_CAPABILITY` default / avx2 / avx512 give different weights for one
seed). Its integer generator is not vectorized: `torch.randint` with a CPU `Generator` draws from the Mersenne
Twister one value at a time, so its stream depends only on the seed. Floats are made from those integers by exact
operations and one rounding each, which IEEE arithmetic gives alike on every CPU:

    u_i = (k_i + 1/2) / 2^24,  k_i uniform on [0, 2^24)   exact in float64
    z   = (u_1 + u_2 + u_3 + u_4 - 2) · √3                Irwin–Hall(4), mean 0, variance 1; the sum is exact
    x   = mean + std · z  →  dtype                         one rounding per operation

z is bell-shaped (bounded by ±2√3), close enough to a normal for random weights; nothing here claims more.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

_BITS = 24
_TERMS = 4  # Irwin–Hall: the sum of 4 uniforms has variance 4/12


def generator(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


def integers(low: int, high: int, shape: Sequence[int], gen: torch.Generator) -> torch.Tensor:
    """int64 uniform on [low, high): torch's serial integer path, the same stream on every CPU."""
    return torch.randint(low, high, tuple(shape), generator=gen, dtype=torch.int64)


def normal(
    shape: Sequence[int], gen: torch.Generator, std: float = 1.0, mean: float = 0.0, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Bell-shaped values with `mean` and `std` (the module docstring's recipe), identical bytes on every CPU."""
    k = integers(0, 1 << _BITS, (_TERMS, *shape), gen).double()
    z = ((k + 0.5) / (1 << _BITS)).sum(0)  # four exact terms: their sum is exact in any order
    z = (z - _TERMS / 2) * math.sqrt(12 / _TERMS)
    return (z * std + mean).to(dtype)


Init = Callable[[str, torch.Tensor, torch.Generator], torch.Tensor]  # (name, tensor, generator) -> its new value


def fill_(named: Sequence[tuple[str, torch.Tensor]], seed: int, value: Init) -> None:
    """Overwrite each tensor of `named` (in that order, one generator) with `value(name, tensor, gen)`."""
    gen = generator(seed)
    with torch.no_grad():
        for name, tensor in named:
            tensor.copy_(value(name, tensor, gen))


def matrices(std: float) -> Init:
    """transformers' initialisation made portable: every matrix (embeddings, linears) drawn with `std`, vectors
    (norm weights at 1, biases at 0) kept as the model's constructor set them."""

    def value(name: str, p: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        return normal(p.shape, gen, std=std, dtype=p.dtype) if p.dim() > 1 else p

    return value
