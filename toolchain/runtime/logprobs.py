"""Logprobs (issue 29, item 1): the raw log-softmax of the engine's logits (vLLM's default `raw_logprobs`:
vllm/config `logprobs_mode`, vllm/v1/sample/sampler.py computes them before any logits processor), for the
generated tokens of requests that ask (`SamplingParams.logprobs`) and for the prompt positions of requests that ask
`prompt_logprobs` (the engine then returns every position's logits for that sequence's prefill chunks). Computed
only for the rows that ask: a request without them costs nothing here.

Prompt logprobs: position p's logprob comes from the logits after position p - 1, so position 0 has none (None, as
vLLM's `prompt_logprobs[0]`). A prompt-logprobs request skips the prefix cache (scheduler.py, as vLLM: a cached
block has no logits), and after a preemption it recomputes from its first token: the positions already collected
are kept and the recomputed rows for them ignored.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from toolchain.runtime.request import Request, TokenLogprob

MAX_LOGPROBS = 20  # alternatives per position: vLLM's default --max-logprobs (vllm/config ModelConfig.max_logprobs)


def log_softmax(row: np.ndarray) -> np.ndarray:
    """The log-softmax of a logits row, in float64 (the engine's row is float32: rounding here stays far below its
    own)."""
    x = np.asarray(row, dtype=np.float64)
    top = x.max()
    if not np.isfinite(top):
        raise ValueError(f"logits row has no finite maximum ({top})")
    out: np.ndarray = x - (top + np.log(np.exp(x - top).sum()))
    return out


def token_logprob(row: np.ndarray, token: int, top: int) -> TokenLogprob:
    """`token`'s raw logprob in the logits `row` [vocab], with the `top` best alternatives (best first; equal
    logprobs in token-id order) and the token's rank: how many tokens are at least as likely, itself included
    (vLLM's, vllm/v1/sample/ops/logprobs.py `batched_count_greater_than`)."""
    lp = log_softmax(row)
    chosen = float(lp[token])
    rank = int(np.count_nonzero(lp >= chosen))
    best: tuple[tuple[int, float], ...] = ()
    if top > 0:
        k = min(top, lp.shape[0])
        threshold = float(torch.topk(torch.from_numpy(lp), k, sorted=False).values.min())  # ~6x np.argpartition
        candidates = np.flatnonzero(lp >= threshold)  # every tie at the threshold, so the id order decides them
        ordered = candidates[np.lexsort((candidates, -lp[candidates]))][:k]
        best = tuple((int(t), float(lp[t])) for t in ordered)
    return TokenLogprob(token, chosen, best, rank)


def wants_prompt_rows(request: Request, context_len: int, new_tokens: int) -> bool:
    """Whether this step's chunk of `request` (`new_tokens` tokens after `context_len` cached ones) needs every
    position's logits: it asked for prompt logprobs and the chunk covers prompt positions not collected yet."""
    if request.params.prompt_logprobs is None:
        return False
    # the chunk's rows give positions context_len + 1 .. context_len + new_tokens (and the first chunk position 0)
    last = min(context_len + new_tokens, len(request.prompt) - 1)
    return len(request.prompt_lps) <= last


def collect_prompt(request: Request, context_len: int, rows: Sequence[np.ndarray]) -> None:
    """Store the prompt logprobs this chunk's `rows` (one per new token, the logits after it) give into
    `request.prompt_lps` (position 0 has none: None)."""
    collected = request.prompt_lps
    if context_len > len(collected):  # the positions between were never computed here: a cached prefix
        raise RuntimeError(f"prompt logprobs: chunk at {context_len} after only {len(collected)} positions")
    if not collected:
        collected.append(None)
    k = request.params.prompt_logprobs or 0
    prompt = request.prompt
    for j, row in enumerate(rows):
        position = context_len + j + 1
        if position >= len(prompt):
            break
        if position == len(collected):  # earlier positions: recomputed after a preemption, already kept
            collected.append(token_logprob(row, prompt[position], k))
