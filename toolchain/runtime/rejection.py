"""The acceptance rule for drafted tokens under sampling (issue 30): Leviathan et al. 2023 (arXiv 2211.17192) /
Chen et al. 2023 — accept draft d with probability min(1, p(d) / q(d)), on rejection draw from
normalize(max(p − q, 0)); for point-mass drafts (n-gram) this is: draw x from p as `sample` would, accept iff x == d.
The target's distribution is preserved.

FRAME STUB: unreachable while `speculative.may_speculate` keeps host rows at k = 0. Slice C fills it.
"""

from __future__ import annotations

import numpy as np
import torch

from toolchain.runtime.request import SamplingParams


def verify_position(
    scores: torch.Tensor, draft: int, q: np.ndarray | None, params: SamplingParams, generator: torch.Generator
) -> tuple[int, bool]:
    """The token emitted at one drafted position and whether it is the draft: `scores` the processed float64 row
    (pipeline and mask applied), `q` the draft's distribution there (None: a point mass on `draft`)."""
    raise NotImplementedError("speculative sampling: slice C")
