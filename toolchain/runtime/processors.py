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

from collections.abc import Sequence

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
        # prompt ∪ output, for the repetition penalty: a membership mask and the ids in it (the rule touches only
        # those, so a step costs O(distinct tokens seen), not O(vocab))
        self.seen = _IdSet(vocab, prompt) if self.repetition != 1 else None
        # how often each token was generated, for presence / frequency
        self.output = _IdSet(vocab, ()) if self.presence or self.frequency else None
        self.counts = torch.zeros(vocab, dtype=torch.float64) if self.output is not None else None

    def apply(self, scores: torch.Tensor, request: Request) -> torch.Tensor:
        """The processed scores for `request`'s next token (may modify `scores` in place and return it)."""
        if self.generated < self.min_tokens and self.stop_ids.numel():
            scores[self.stop_ids] = float("-inf")
        if self.bias_ids is not None and self.bias_values is not None:
            scores.index_add_(0, self.bias_ids, self.bias_values)
        if self.seen is not None and self.seen.ids:
            index = self.seen.index()
            values = scores[index]
            scores[index] = torch.where(values > 0, values / self.repetition, values * self.repetition)
        if self.output is not None and self.counts is not None and self.output.ids:
            index = self.output.index()
            scores[index] -= self.frequency * self.counts[index] + self.presence
        return scores

    def accepted(self, token: int) -> None:
        """`token` was chosen: update what the penalties count (incrementally, never recounted)."""
        self.generated += 1
        if self.seen is not None:
            self.seen.add(token)
        if self.output is not None and self.counts is not None:
            self.output.add(token)
            self.counts[token] += 1


class _IdSet:
    """Distinct token ids in first-seen order, with their index tensor made again only when one was added."""

    def __init__(self, vocab: int, ids: Sequence[int]) -> None:
        self.member = bytearray(vocab)
        self.ids: list[int] = []
        self._index: torch.Tensor | None = None
        for token in ids:
            self.add(token)

    def add(self, token: int) -> None:
        if not self.member[token]:
            self.member[token] = 1
            self.ids.append(token)
            self._index = None

    def index(self) -> torch.Tensor:
        if self._index is None:
            self._index = torch.tensor(self.ids, dtype=torch.long)
        return self._index


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
