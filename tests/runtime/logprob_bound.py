"""How far two float32 evaluations of the same engine may put a logprob apart, shared by the logprob tests.

The runtime's logits come from other packings (batched, chunked, paged) than the scorer's
(`EngineSession.all_logits`), so float32 sums run in another order: each logit may differ by a few ulp of the
logits' scale, and a logprob (a logit minus a log-sum-exp) by twice that. 16 ulp of float32 (eps 2**-23) at that
scale, doubled, bounds it: measured on the random tiny Llama at most 3.1e-6 for logits of magnitude ~5 (about 5 ulp),
against a bound of ~1.6e-5.
"""

from __future__ import annotations

import numpy as np
import torch

ULPS = 16


def tolerance(logits: torch.Tensor) -> float:
    """The bound for logprobs computed from `logits` (float32, any shape) and from another run of the engine."""
    scale = max(1.0, float(logits.abs().max()))
    return 2 * ULPS * float(np.finfo(np.float32).eps) * scale
