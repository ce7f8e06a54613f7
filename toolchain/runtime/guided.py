"""Structured output (issue 29, item 3): one grammar matcher per constrained request; each step the allowed-token
masks of the constrained rows are computed on a worker thread while the engine runs (`begin` before the engine
call, `wait` after it), then applied to the host rows (`mask`), and the chosen token advances the matcher
(`accept`).

Speculative decoding (issue 30): a constrained request's drafts are first cut to the prefix its grammar accepts
(`valid_prefix`: `LLMatcher.validate_tokens`, llguidance/_lib.pyi), before the engine call — a refused draft has
p = 0 and could only be rejected. `begin` then gets each request's drafts and fills k + 1 masks per request in the
same worker call (`llguidance.numpy.fill_next_token_bitmask_par_with_draft_tokens`: the mask after the accepted
tokens, then after each draft token, the matcher rolled back afterwards; llguidance/_lib.pyi
`LLExecutor.unsafe_compute_mask_ptr_with_draft_token`). The runtime verifies positions left to right and moves to
position j + 1 only when position j emitted draft j, so `accept` steps to the next precomputed row and the matcher
consumes only emitted tokens (no rollback needed).

The grammar engine is llguidance (docs/serving.md says why, with the figures): `llguidance.hf.from_tokenizer`
builds its tokenizer once per runtime from the HF fast tokenizer; `LLMatcher` follows one request;
`llguidance.numpy.fill_next_token_bitmask_par` fills the masks of a step's rows in one call that releases the GIL
(llguidance/_lib.pyi: `LLExecutor.unsafe_compute_mask_ptr`), so the worker thread overlaps the engine call. Bit
`t % 32` of word `t // 32` of a row's mask allows token t (llguidance/torch.py `apply_token_bitmask_inplace_kernel`).
A matcher whose grammar is complete allows only the EOS token, so a finished constrained answer stops there.

JSON schemas compile with compact whitespace (`whitespace_flexible: false`, llguidance/_lib.pyi
`JsonCompileOptions`): with flexible whitespace a weak model can emit blanks up to its token limit.
"""

from __future__ import annotations

import functools
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.numpy
import numpy as np
import torch

from toolchain.runtime.request import GrammarSpec, Request

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # a TypedDict of the stub only

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}  # compact JSON: see the module docstring
CACHE_SIZE = 64  # compiled grammars kept per runtime (matchers are copied from them)


class GrammarError(ValueError):
    """A constraint that does not compile: the message is llguidance's (or names the kind)."""


@functools.lru_cache(maxsize=256)
def compile_grammar(spec: GrammarSpec) -> str:
    """`spec` as an llguidance grammar (its JSON text), checked; GrammarError with llguidance's message if not valid.
    Needs no tokenizer, so the server checks a request before admitting it."""
    kind, text = spec.kind, spec.text
    try:
        if kind == "json_schema":
            schema = json.loads(text)
            if not isinstance(schema, dict):
                raise GrammarError(f"a JSON schema must be an object, not {type(schema).__name__}")
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
        elif kind == "json_object":
            grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
        elif kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(text)
        elif kind == "choice":
            choices = json.loads(text)
            if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
                raise GrammarError("choice: a non-empty list of strings")
            grammar = llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in choices)  # Lark string literals are JSON-quoted
            )
        elif kind == "grammar":
            grammar = llguidance.LLMatcher.grammar_from_lark(text)
        else:
            raise GrammarError(f"unknown grammar kind {kind!r}: one of {', '.join(KINDS)}")
    except ValueError as e:  # json.loads, or llguidance refusing the schema's JSON
        raise GrammarError(str(e)) from e
    problem = llguidance.LLMatcher.validate_grammar(grammar)
    if problem:
        raise GrammarError(problem.strip())
    return grammar


class Guide:
    """The runtime's grammar engine, built once per runtime from its tokenizer (None: no structured output)."""

    def __init__(self, tokenizer: object | None, vocab: int) -> None:
        self.tokenizer, self.vocab = tokenizer, vocab
        self._lltok: Any = None  # llguidance's tokenizer, built on the first constrained request
        self._executor: Any = None
        self._compiled: OrderedDict[GrammarSpec, Any] = OrderedDict()  # LRU of fresh matchers, copied per request
        self._worker: ThreadPoolExecutor | None = None
        self._pending: Future[None] | None = None
        self._failed: str | None = None  # why the last fill failed, for its rows
        # request id -> (its drafts, the position its next mask is for) from the last `begin`: the position's row of
        # `_masks` is the request's first row + the position
        self._rows: dict[str, tuple[list[int], list[int]]] = {}
        self._masks = np.zeros((0, (vocab + 31) // 32), dtype=np.int32)
        self._unusable: str | None = None  # why llguidance refused the tokenizer
        self._lock = threading.Lock()  # add() may build the tokenizer from another thread than the step loop's
        self.mask_seconds = 0.0  # time the worker spent computing masks (reported by tests and benchmarks)

    # -- requests -----------------------------------------------------------------------------------------------
    def add(self, request: Request) -> str | None:
        """Start `request`'s matcher (its params.grammar); why it cannot be constrained, or None."""
        spec = request.params.grammar
        if spec is None:
            return None
        if self.tokenizer is None:
            return "structured output needs the engine's tokenizer"
        try:
            template = self._template(spec)
        except GrammarError as e:
            return f"the {spec.kind} constraint does not compile: {e}"
        request.guide_state = template.deep_copy()
        return None

    def prepare(self) -> str | None:
        """Build llguidance's tokenizer now (0.5 s for a 32k vocabulary: the server does it while warming up, not on
        the step loop at the first constrained request); why this tokenizer cannot drive a grammar, or None."""
        if self.tokenizer is None:
            return "structured output needs the engine's tokenizer"
        with self._lock:
            self._build_tokenizer()
        return self._unusable

    def check(self, spec: GrammarSpec) -> str | None:
        """Compile `spec` for this tokenizer (cached for `add`): why it cannot constrain a request, or None. Safe from
        any thread; the server calls it before admission so that such a request is refused, not failed."""
        if self.tokenizer is None:
            return "structured output needs the engine's tokenizer"
        try:
            self._template(spec)
        except GrammarError as e:
            return str(e)
        return None

    def _build_tokenizer(self) -> None:
        """Under `_lock`: llguidance's tokenizer, built once; a tokenizer it refuses is remembered, not retried."""
        if self._lltok is not None or self._unusable is not None:
            return
        import llguidance.hf  # imports transformers: only when structured output is used

        try:
            self._lltok = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab)  # type: ignore[arg-type]
        except ValueError as e:  # "Only fast tokenizers are supported"
            self._unusable = f"this tokenizer cannot drive a grammar ({e})"
            return
        self._executor = llguidance.LLExecutor()

    def _template(self, spec: GrammarSpec) -> Any:
        with self._lock:
            self._build_tokenizer()
            if self._unusable is not None:
                raise GrammarError(self._unusable)
            matcher = self._compiled.get(spec)
            if matcher is not None:
                self._compiled.move_to_end(spec)
                return matcher
            matcher = llguidance.LLMatcher(self._lltok, compile_grammar(spec))
            if matcher.is_error():
                raise GrammarError(matcher.get_error())
            self._compiled[spec] = matcher
            while len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
            return matcher

    def release(self, request: Request) -> None:
        """`request` ended: drop its matcher."""
        request.guide_state = None
        self._rows.pop(request.id, None)

    # -- one step -----------------------------------------------------------------------------------------------
    def valid_prefix(self, request: Request, tokens: Sequence[int]) -> int:
        """How many of `tokens` (a draft) `request`'s grammar accepts in a row from its current state."""
        matcher = request.guide_state
        return len(tokens) if matcher is None else int(matcher.validate_tokens(list(tokens)))

    def begin(self, requests: Sequence[Request], drafts: Sequence[Sequence[int]] | None = None) -> None:
        """Start computing the next-token masks of `requests` (off the caller's thread): with `drafts` (each
        request's drafted tokens, issue 30) also the masks after each drafted token."""
        self.wait()
        self._failed = None
        todo = [(r, list(d)) for r, d in zip(requests, drafts or [()] * len(requests), strict=True)]
        live = [(r, d) for r, d in todo if r.guide_state is not None]
        if not live:
            return
        rows = sum(1 + len(d) for _, d in live)
        if self._masks.shape[0] < rows:
            self._masks = np.zeros((rows, self._masks.shape[1]), dtype=np.int32)
        self._rows = {}
        pairs: list[tuple[Any, ...]] = []
        at = 0
        for r, d in live:
            self._rows[r.id] = (d, [at, 0])
            pairs.append((r.guide_state, at, d) if d else (r.guide_state, at))
            at += 1 + len(d)
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="trtbuild-guide")
        self._pending = self._worker.submit(self._fill, pairs, self._masks[:rows])

    def _fill(self, pairs: list[tuple[Any, ...]], masks: np.ndarray) -> None:
        started = time.perf_counter()
        plain = [p for p in pairs if len(p) == 2]
        drafted = [p for p in pairs if len(p) == 3]  # llguidance refuses empty drafts in the draft call
        if drafted:  # llguidance leaves a row unwritten after a draft it refuses: zero (`mask` computes it alone)
            masks[:] = 0
            llguidance.numpy.fill_next_token_bitmask_par_with_draft_tokens(self._executor, drafted, masks)
        if plain or not drafted:
            llguidance.numpy.fill_next_token_bitmask_par(self._executor, plain, masks)
        self.mask_seconds += time.perf_counter() - started

    def wait(self) -> None:
        """Wait for the masks `begin` started. A fill that raised fails the rows it was for (`mask` raises
        ValueError for them: the loop ends those requests alone), not the step."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            try:
                pending.result()
            except Exception as e:  # llguidance refusing a call: a bug to report, not a reason to stop serving
                self._failed = f"computing the grammar mask failed ({type(e).__name__}: {e})"

    def mask(self, request: Request, scores: torch.Tensor) -> None:
        """Set the scores of the tokens `request`'s grammar forbids to -inf, in place."""
        matcher = request.guide_state
        if matcher is None:
            return
        slot = self._rows.get(request.id)
        if slot is not None and self._failed is not None:
            raise ValueError(self._failed)
        mask = self._masks[slot[1][0]] if slot is not None else None
        if mask is None or not mask.any():  # not in this step's `begin` (or a draft row llguidance left unwritten)
            words = np.zeros((1, self._masks.shape[1]), dtype=np.int32)
            llguidance.numpy.fill_next_token_bitmask(matcher, words, 0)
            mask = words[0]
        bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[: scores.numel()]
        scores.masked_fill_(torch.from_numpy(bits == 0), float("-inf"))

    def accept(self, request: Request, token: int) -> str | None:
        """Advance `request`'s matcher by `token`; why the grammar refuses it, or None."""
        matcher = request.guide_state
        if matcher is None:
            return None
        slot = self._rows.get(request.id)
        if slot is not None:  # its mask is spent; the next row is valid only when `token` is the position's draft
            drafts, (row, position) = slot
            if position < len(drafts) and drafts[position] == token:
                slot[1][:] = [row + 1, position + 1]
            else:
                del self._rows[request.id]
        if not matcher.consume_token(token):
            return str(matcher.get_error() or f"token {token} does not continue the grammar")
        return None

    def rollback(self, request: Request, tokens: int) -> None:
        """Undo the last `tokens` accepted tokens (issue 30: drafted tokens the target model rejected)."""
        matcher = request.guide_state
        if matcher is not None and not matcher.rollback(tokens):
            raise ValueError(f"cannot roll the grammar back {tokens} tokens: {matcher.get_error()}")
        self._rows.pop(request.id, None)

    def close(self) -> None:
        self.wait()
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
