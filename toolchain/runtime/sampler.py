"""Next-token sampling: greedy, temperature, min-p, top-k, top-p (nucleus), each request with its own seeded
generator. The order is vLLM's (vllm/v1/sample/sampler.py `Sampler.sample`): temperature, then the argmax-invariant
min_p (`MinPLogitsProcessor`: drop tokens whose probability is below min_p times the largest), then top-k / top-p.
Greedy is the argmax of the scores (the request's pipeline has processed them already); min_p cannot change it."""

from __future__ import annotations

import math

import numpy as np
import torch

from toolchain.runtime.request import SamplingParams


def distribution(logits: np.ndarray | torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The float64 distribution [vocab] a sampled request draws its next token from, given its scores (float64 from
    the request's pipeline, or the engine's row): temperature, min_p, top-k, top-p. Speculative verification
    (rejection.py) takes its target probabilities p from here, so sampling and verification share one definition.
    Temperature 0 has no distribution here: the token is the argmax (`sample`)."""
    if params.temperature == 0:
        raise ValueError("temperature 0 samples no distribution: its token is the argmax")
    scores = logits.double() if isinstance(logits, torch.Tensor) else torch.from_numpy(np.asarray(logits, np.float64))
    scores = (scores - scores.max()) / params.temperature  # max first: a tiny temperature cannot overflow to inf
    if params.min_p > 0:  # the largest score is 0 here, so p / p_max = exp(score): below min_p <=> score < log(min_p)
        scores = scores.masked_fill(scores < math.log(params.min_p), float("-inf"))
    if params.top_k and params.top_k < scores.numel():  # exactly k tokens, ties at the k-th broken by index
        keep = torch.zeros_like(scores, dtype=torch.bool)
        keep[torch.topk(scores, params.top_k).indices] = True
        scores = scores.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1.0:
        ordered, index = torch.sort(probs, descending=True)
        before = torch.cumsum(ordered, 0) - ordered  # mass strictly above each token: keep while < top_p
        ordered = ordered.masked_fill(before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(0, index, ordered)
    return probs / probs.sum()


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token id from `distribution`'s probabilities, with the request's generator (one multinomial draw)."""
    return int(torch.multinomial(probs, 1, generator=generator))


def sample(logits: np.ndarray | torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token id from logits [vocab] (float64 scores from the request's pipeline, or the engine's row)."""
    if params.temperature == 0:
        return int(torch.argmax(logits)) if isinstance(logits, torch.Tensor) else int(np.argmax(logits))
    return draw(distribution(logits, params), generator)
