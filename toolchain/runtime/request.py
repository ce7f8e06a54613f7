"""A request's state through the runtime: waiting -> running -> finished / cancelled / failed, and why it ended
(`FinishReason`, with the OpenAI name and HTTP status the server answers with)."""

from __future__ import annotations

import enum
import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from toolchain.runtime.detokenizer import IncrementalDetokenizer
from toolchain.runtime.speculative import SpecStats


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 32
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: no limit
    top_p: float = 1.0
    seed: int | None = None  # None: a fresh random seed per request
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    # issue 29: fields after this line are keyword-only in practice (cli.py builds the first seven positionally)
    logprobs: int | None = None  # raw logprobs of each generated token with this many alternatives (0: the token's)
    prompt_logprobs: int | None = None  # the same for every prompt position after the first
    presence_penalty: float = 0.0  # OpenAI: minus this once for every token already generated
    frequency_penalty: float = 0.0  # OpenAI: minus this times how often it was generated
    repetition_penalty: float = 1.0  # HF/vLLM: over prompt and output, logit > 0 divided by it, else multiplied
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    min_tokens: int = 0  # stop tokens are masked until this many tokens are generated
    min_p: float = 0.0  # vLLM: drop tokens whose probability is below min_p times the largest
    grammar: GrammarSpec | None = None  # structured output: every token must keep the text inside the grammar
    include_stop_str_in_output: bool = False  # vLLM: the matched stop string (or stop token's text) stays in the text
    skip_special_tokens: bool = True  # special tokens' text left out of the output (vLLM's default)
    # whether the token is chosen on the host from the full logits row: anything beyond a plain argmax. A plain greedy
    # request keeps the engine's own argmax (no logits leave the device for it). Derived from the fields above.
    needs_host_logits: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError("temperature >= 0, 0 < top_p <= 1 and top_k >= 0")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise ValueError(f"seed {self.seed}: must be in [0, 2**64)")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} {value}: must be >= 0")
        if self.repetition_penalty <= 0 or not 0 <= self.min_p <= 1 or self.min_tokens < 0:
            raise ValueError("repetition_penalty > 0, 0 <= min_p <= 1 and min_tokens >= 0")
        object.__setattr__(self, "needs_host_logits", self._needs_host_logits())  # read per row per step: kept

    def _needs_host_logits(self) -> bool:
        return (
            self.temperature != 0
            or self.logprobs is not None
            or self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
            or bool(self.logit_bias)
            or (self.min_tokens > 0 and bool(self.stop_token_ids))  # AIPerf's ignore_eos + min_tokens: nothing to mask
            or (self.min_p > 0 and self.temperature != 0)  # min_p cannot change a greedy pick
            or self.grammar is not None
        )


@dataclass(frozen=True)
class GrammarSpec:
    """A structured-output constraint, compiled by runtime/guided.py: `kind` is one of guided.KINDS (json_schema,
    json_object, regex, choice, grammar), `text` its source (a JSON schema as JSON text, a regex, choices as a JSON
    list, a Lark grammar)."""

    kind: str
    text: str


@dataclass(frozen=True)
class TokenLogprob:
    """One position's raw logprob (log-softmax of the engine's logits, before any penalty, bias, mask or
    temperature): the token, its logprob, the `top` alternatives (id, logprob), best first, and its rank."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None  # how many tokens are at least as likely, itself included (vLLM's Logprob.rank)


class FinishReason(str, enum.Enum):
    """Why a request ended. The value is the runtime's own name, the one events, logs, replay and bench JSON carry:
    a member is that string wherever it is printed, compared or serialized (`enum.StrEnum`, which Python 3.10
    lacks)."""

    LENGTH = "length"  # max_new_tokens reached
    STOP_TOKEN = "stop_token"
    STOP_STRING = "stop_string"
    CANCELLED = "cancelled"  # aborted by its caller (the server: its client went away)
    TIMEOUT = "timeout"  # past its deadline
    SHUTDOWN = "shutdown"  # still live when the engine loop closed
    ERROR = "error"  # refused at admission, sampling failed, or the engine call raised

    def __str__(self) -> str:
        return str.__str__(self)

    def __format__(self, spec: str) -> str:
        return str.__format__(self, spec)

    @property
    def openai(self) -> str:
        """OpenAI's `finish_reason` (vLLM's extension adds abort and error), also vLLM's `finished_reason` metric
        label."""
        return _WIRE[self][0]

    @property
    def http_status(self) -> int:
        """The HTTP status the server records for a request that ended so (499: the client closed it, nginx's
        code)."""
        return _WIRE[self][1]

    @property
    def is_error(self) -> bool:
        """The server answers with an error (`http_status`) instead of a completion."""
        return _WIRE[self][2]


# reason -> (OpenAI name, HTTP status, answered with an error)
_WIRE: dict[FinishReason, tuple[str, int, bool]] = {
    FinishReason.LENGTH: ("length", 200, False),
    FinishReason.STOP_TOKEN: ("stop", 200, False),
    FinishReason.STOP_STRING: ("stop", 200, False),
    FinishReason.CANCELLED: ("abort", 499, False),  # nobody is left to answer
    FinishReason.TIMEOUT: ("abort", 408, True),
    FinishReason.SHUTDOWN: ("abort", 503, True),
    FinishReason.ERROR: ("error", 500, True),
}


@dataclass(frozen=True)
class TokenEvent:
    """What a request's stream receives: a new token with the text it completes, and on the last event the
    finish reason. A request that ends without a new token (cancelled, timed out, refused) gets one event with
    token None."""

    request_id: str
    token: int | None
    text: str
    finish_reason: FinishReason | None = None
    error: str | None = None
    prompt_tokens: int = 0
    generated_tokens: int = 0
    logprob: TokenLogprob | None = None  # the new token's, when its request asked for logprobs
    # on the request's first event, when it asked for prompt_logprobs: one per prompt position, None for the first
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    # the runtime step that emitted it (Runtime.steps): with speculation several tokens share a step, and vLLM's
    # inter-token latency is observed per step, not per token
    step: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    CANCELLED = "cancelled"
    FAILED = "failed"


_ids = itertools.count()


@dataclass(eq=False)
class Request:
    prompt: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    arrival: float = 0.0  # runtime clock when it was added
    deadline: float | None = None  # runtime clock after which it fails with a timeout
    on_event: Callable[[TokenEvent], None] | None = None  # streaming: each new token, then the finish
    detok: IncrementalDetokenizer | None = None  # text and stop strings, when the runtime has a tokenizer
    status: Status = Status.WAITING
    generated: list[int] = field(default_factory=list)
    # the KV state: the BlockManager's to change (allocate_for, share_prefix, advance, free), everyone's to read
    blocks: list[int] = field(default_factory=list)  # the block table
    num_computed: int = 0  # tokens whose K/V are in the cache
    finish_reason: FinishReason | None = None
    error: str | None = None
    first_scheduled: float | None = None
    num_cached: int = 0  # prompt tokens found in the prefix cache when first scheduled
    first_token: float | None = None
    finished_at: float | None = None
    preemptions: int = 0
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of full blocks, grown as they fill
    registered: int = 0  # full blocks already offered to the prefix cache (BlockManager's, like `blocks`)
    # host-side token choice (issue 29): built at admission by processors.build_pipeline; None for plain requests
    pipeline: Any = None
    guide_state: Any = None  # the grammar matcher, runtime/guided.py's
    prompt_lps: list[TokenLogprob | None] = field(default_factory=list)  # prompt logprobs collected so far
    prompt_lps_sent: bool = False
    admitted: bool = False  # counted among the runtime's live prompt-logprob requests
    spec_state: Any = None  # the speculative proposer's per-request state (issue 30)
    spec: SpecStats = field(default_factory=SpecStats)  # this request's drafts and accepted tokens
    tokens: list[int] = field(init=False)  # prompt + generated: what the model must have seen before the next sample
    seed: int = field(init=False)
    _generator: torch.Generator | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt)
        self.seed = self.params.seed if self.params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1

    @property
    def generator(self) -> torch.Generator:
        """The request's own random stream, made on first use (greedy requests never need one)."""
        if self._generator is None:
            self._generator = torch.Generator().manual_seed(self.seed)
        return self._generator

    def append(self, token: int) -> None:
        self.generated.append(token)
        self.tokens.append(token)

    @property
    def pending(self) -> int:
        """Tokens still to feed to the engine before the next token can be sampled."""
        return len(self.tokens) - self.num_computed

    @property
    def done(self) -> bool:
        return self.status in (Status.FINISHED, Status.CANCELLED, Status.FAILED)
