"""How far two float32 evaluations of the same engine may put a logprob apart, shared by the logprob tests.

The runtime's logits come from other packings (batched, chunked, paged) than the scorer's
(`EngineSession.all_logits`), so float32 sums run in another order: each logit may differ by a few ulp of the
logits' scale, and a logprob (a logit minus a log-sum-exp) by twice that. 16 ulp of float32 (eps 2**-23) at that
scale, doubled, bounds it: measured on the random tiny Llama at most 3.1e-6 for logits of magnitude ~5 (about 5 ulp),
against a bound of ~1.6e-5.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from toolchain.runtime.loop import Runtime
from toolchain.runtime.request import Request, SamplingParams, TokenEvent, TokenLogprob

ULPS = 16


def tolerance(logits: torch.Tensor) -> float:
    """The bound for logprobs computed from `logits` (float32, any shape) and from another run of the engine."""
    scale = max(1.0, float(logits.abs().max()))
    return 2 * ULPS * float(np.finfo(np.float32).eps) * scale


def run_keeping_logprobs(
    rt: Runtime,
    jobs: Sequence[tuple[list[int], SamplingParams]],
    after_step: Callable[[Runtime], None] | None = None,
) -> list[tuple[Request, list[TokenLogprob]]]:
    """Add every job and run, keeping each request's logprobs from its events (the runtime streams them, it keeps
    none); `after_step` runs after every step (the speculative tests check the block books there)."""
    out = []
    for prompt, params in jobs:
        seen: list[TokenLogprob] = []

        def keep(event: TokenEvent, seen: list[TokenLogprob] = seen) -> None:
            if event.logprob is not None:
                seen.append(event.logprob)

        out.append((rt.add_request(prompt, params, on_event=keep), seen))
    while rt.has_work:
        rt.step()
        if after_step is not None:
            after_step(rt)
    return out
