"""A request's state through the runtime: waiting -> running -> finished / cancelled / failed, and why it ended
(`FinishReason`, with the OpenAI name and HTTP status the server answers with)."""

from __future__ import annotations

import enum
import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from toolchain.runtime.detokenizer import IncrementalDetokenizer


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 32
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: no limit
    top_p: float = 1.0
    seed: int | None = None  # None: a fresh random seed per request
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError("temperature >= 0, 0 < top_p <= 1 and top_k >= 0")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise ValueError(f"seed {self.seed}: must be in [0, 2**64)")


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
