"""The acceptance rule for a drafted token on a host row (issue 30): speculative sampling, Leviathan et al. 2023
("Fast Inference from Transformers via Speculative Decoding", arXiv 2211.17192, Algorithm 1) and Chen et al. 2023
("Accelerating Large Language Model Decoding with Speculative Sampling", arXiv 2302.01318, modified rejection
sampling). vLLM implements the same rule (vllm/v1/sample/rejection_sampler.py, "strictly follows arXiv 2211.17192").

Per drafted position, left to right, with p = `sampler.distribution` of the processed row (mask, pipeline,
temperature, min_p, top-k, top-p — the very distribution a plain step would sample from):
- a draft sampled from q (`Draft.probs`): accept d iff u < p(d) / q(d), u ~ U[0, 1) from the request's generator;
  on rejection emit a token drawn from the residual normalize(max(p - q, 0)). P(emit x) = min(p(x), q(x)) +
  (1 - Σ min(p, q)) · max(p(x) - q(x), 0) / Σ max(p - q, 0) = p(x) (the papers' theorem), so the output keeps the
  target's distribution whatever q is.
- a point-mass draft (q = δ_d: n-gram, or a draft proposing its argmax): the rule reduces to accept with
  probability p(d), else draw from p conditioned on x ≠ d. Drawing x ~ p exactly as `sampler.sample` would and
  accepting iff x == d is that rule (P(accept) = p(d); a rejected x is p restricted to x ≠ d) and it spends one
  draw per emitted token, in the order a run without speculation spends them: with a seed, the output equals the
  output without speculation token for token.
- temperature 0 (a greedy request on the host for its penalties, bias or logprobs): the argmax of the processed row;
  the draft is accepted iff it is that argmax (no draw).
The bonus token after a fully accepted draft is a plain `sample` from the last row (the loop's `_choose`).
"""

from __future__ import annotations

import numpy as np
import torch

from toolchain.runtime.request import SamplingParams
from toolchain.runtime.sampler import distribution, draw, sample


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """What a rejected position draws from: max(p - q, 0), unnormalized (Leviathan et al. 2023, Algorithm 1)."""
    return torch.clamp(p - q, min=0.0)


def verify_position(
    scores: torch.Tensor, draft: int, q: np.ndarray | None, params: SamplingParams, generator: torch.Generator
) -> tuple[int, bool]:
    """The token emitted at one drafted position and whether it is the draft accepted: `scores` the processed
    float64 row (mask and pipeline applied), `q` the draft's distribution there [vocab] (None: a point mass on
    `draft`)."""
    if params.temperature == 0:
        token = int(torch.argmax(scores))
        return token, token == draft
    if q is None:
        token = sample(scores, params, generator)  # the same draw a step without speculation makes
        return token, token == draft
    p = distribution(scores, params)
    qt = torch.as_tensor(np.asarray(q, dtype=np.float64))
    if qt.shape != p.shape:
        raise ValueError(f"the draft's distribution has {qt.numel()} entries, the target's row {p.numel()}")
    u = float(torch.rand((), generator=generator, dtype=torch.float64))
    if u * float(qt[draft]) < float(p[draft]):  # u < p(d) / q(d), without dividing by a q(d) that may round to 0
        return draft, True
    rest = residual(p, qt)
    total = float(rest.sum())
    # rejecting means p(d) < q(d), so some mass of p lies where q has less: the residual is not empty. Rounding can
    # leave it 0 when p and q agree to the last bit (then the draft is all but always accepted); p is then exact
    return (draw(rest / total, generator) if total > 0 else draw(p, generator)), False
