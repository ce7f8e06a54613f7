"""The host-side logits pipeline of one request (issue 29, item 2): what turns the engine's raw logits row into the
scores a token is chosen from — logit_bias, min_tokens, repetition / presence / frequency penalties — in vLLM's
order (vllm/v1/sample/sampler.py). Built once at admission; plain requests have none and keep the device argmax.

FRAME STUB: `build_pipeline` returns None and `Pipeline.apply` returns the scores unchanged. Slice B fills both.
"""

from __future__ import annotations

import torch

from toolchain.runtime.request import Request, SamplingParams


class Pipeline:
    """The row functions of one request, applied in order to a float64 scores row [vocab] (the grammar mask and
    temperature / top-k / top-p / min-p are not here: guided.py and sampler.py own them)."""

    def apply(self, scores: torch.Tensor, request: Request) -> torch.Tensor:
        """The processed scores for `request`'s next token (may modify `scores` in place and return it)."""
        return scores

    def accepted(self, token: int) -> None:
        """`token` was chosen: update what the penalties count (incrementally, never recounted)."""


def build_pipeline(params: SamplingParams, prompt: list[int], vocab: int) -> Pipeline | None:
    """The request's pipeline, or None when its parameters change nothing (then the row is used as it is)."""
    return None
