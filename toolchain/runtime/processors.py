"""The host-side logits pipeline of one request (issue 29, item 2): what turns the engine's raw logits row into the
scores a token is chosen from — min_tokens, logit_bias, repetition / presence / frequency penalties — in vLLM's
order. Built once at admission; plain requests have none and keep the device argmax.

vLLM's V1 sampler (vllm/v1/sample/sampler.py, `Sampler` docstring and `forward`) applies, after the raw logprobs
are taken: the non-argmax-invariant logits processors, in the order of `BUILTIN_LOGITS_PROCESSORS`
(vllm/v1/sample/logits_processor/__init__.py): min_tokens (-inf on the stop token ids while fewer than
`min_tokens` tokens are generated, vllm/v1/sample/logits_processor/builtin.py `MinTokensLogitsProcessor`), then
logit_bias (added, `LogitBiasLogitsProcessor`); then the penalties (vllm/model_executor/layers/utils.py
`apply_penalties`: repetition over prompt ∪ output — a logit > 0 divided by the penalty, else multiplied, as HF's
`RepetitionPenaltyLogitsProcessor`; then `logits -= frequency * output_counts` and `logits -= presence *
(output_counts > 0)`, OpenAI's definition), then temperature, min_p and top-k/top-p (sampler.py here).

The scores are float64 (the engine's float32 row widened), computed in place. What the penalties count is kept
incrementally (`accepted`), never recounted from the request's tokens.
"""

from __future__ import annotations

import torch

from toolchain.runtime.request import Request, SamplingParams


class Pipeline:
    """The row functions of one request, applied in order to a float64 scores row [vocab] (the grammar mask and
    temperature / top-k / top-p / min-p are not here: guided.py and sampler.py own them)."""

    def __init__(self, params: SamplingParams, prompt: list[int], vocab: int) -> None:
        self.bias_ids = self.bias_values = None
        if params.logit_bias:
            ids, values = zip(*params.logit_bias, strict=True)
            self.bias_ids = torch.tensor(ids, dtype=torch.long)
            self.bias_values = torch.tensor(values, dtype=torch.float64)
        self.min_tokens = params.min_tokens
        self.stop_ids = torch.tensor(sorted({t for t in params.stop_token_ids if 0 <= t < vocab}), dtype=torch.long)
        self.repetition = params.repetition_penalty
        self.presence, self.frequency = params.presence_penalty, params.frequency_penalty
        self.generated = 0  # tokens accepted so far
        # prompt ∪ output, for the repetition penalty
        self.seen = torch.zeros(vocab, dtype=torch.bool) if self.repetition != 1 else None
        if self.seen is not None and prompt:
            self.seen[torch.tensor(prompt, dtype=torch.long)] = True
        # how often each token was generated, for presence / frequency
        self.counts = torch.zeros(vocab, dtype=torch.float64) if self.presence or self.frequency else None

    def apply(self, scores: torch.Tensor, request: Request) -> torch.Tensor:
        """The processed scores for `request`'s next token (may modify `scores` in place and return it)."""
        if self.generated < self.min_tokens and self.stop_ids.numel():
            scores[self.stop_ids] = float("-inf")
        if self.bias_ids is not None and self.bias_values is not None:
            scores.index_add_(0, self.bias_ids, self.bias_values)
        if self.seen is not None:
            penalised = torch.where(scores > 0, scores / self.repetition, scores * self.repetition)
            scores = torch.where(self.seen, penalised, scores)
        if self.counts is not None:
            if self.frequency:
                scores -= self.frequency * self.counts
            if self.presence:
                scores -= self.presence * (self.counts > 0).to(torch.float64)
        return scores

    def accepted(self, token: int) -> None:
        """`token` was chosen: update what the penalties count (incrementally, never recounted)."""
        self.generated += 1
        if self.seen is not None:
            self.seen[token] = True
        if self.counts is not None:
            self.counts[token] += 1


def build_pipeline(params: SamplingParams, prompt: list[int], vocab: int) -> Pipeline | None:
    """The request's pipeline, or None when its parameters change nothing (then the row is used as it is)."""
    neutral = (
        not params.logit_bias
        and (params.min_tokens == 0 or not params.stop_token_ids)  # no stop token to mask
        and params.repetition_penalty == 1
        and params.presence_penalty == 0
        and params.frequency_penalty == 0
    )
    return None if neutral else Pipeline(params, prompt, vocab)
