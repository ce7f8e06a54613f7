"""Incremental detokenization with stop strings, for streaming.

Decoding the whole output again for every new token costs O(n^2) over a long answer. Instead each step decodes a
short window: the tokens from `prefix` (a few tokens back, for the tokenizer's context: SentencePiece's leading
space, byte-level merges) to the end, minus the same window without the new tokens; the difference is the new
text. While the window's text ends in U+FFFD the new tokens may be an incomplete UTF-8 sequence (a multi-byte
character split across byte tokens): nothing is released until it completes (vLLM's detokenizer works the same
way). A character spans at most 4 tokens, so once 4 new tokens still end in U+FFFD, that U+FFFD may be invalid
bytes or the replacement character itself, which no later token changes: the text before the last character is
released then, so that a degenerate output (a model emitting stray bytes) neither stalls the stream nor widens
the window with its length.

The window starts in the prompt: the detokenizer is seeded with the prompt's last tokens (vLLM seeds its incremental
detokenizer the same way), so the first token's text is what it adds to the prompt's text. A SentencePiece token
that starts a word carries its space ("▁Max" after "named"), which decoding drops at the start of a text: decoded
alone the completion would be "Max." where the model wrote " Max.". With the seed, the streamed text equals
decode(prompt + output) minus decode(prompt).

Stop strings are searched only where a new match can be: the new text plus the last (longest stop - 1) characters
before it. The text released to the client holds back that many characters, so a stop string split across tokens
is never streamed in part; OpenAI's API excludes the stop string from the output. vLLM's two extensions
(vllm/v1/engine/detokenizer.py `IncrementalDetokenizer.update` and `check_stop_strings`):
`include_stop_str_in_output` keeps the stop string (and what follows it in the same token is still cut) and holds
nothing back; `min_tokens` leaves the text of the first `min_tokens` tokens out of the search.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

_CONTEXT = 6  # tokens of left context re-decoded with each new one
_INCOMPLETE = "\ufffd"
_MAX_CHAR_TOKENS = 4  # a UTF-8 character has at most 4 bytes, so it is split over at most 4 tokens


def _common_prefix(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


class Decoder(Protocol):
    def decode(
        self, ids: list[int], skip_special_tokens: bool = ..., clean_up_tokenization_spaces: bool = ...
    ) -> str: ...


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Decoder,
        stop_strings: tuple[str, ...] = (),
        skip_special_tokens: bool = True,
        prompt: Sequence[int] = (),
        include_stop: bool = False,
        min_tokens: int = 0,
    ):
        self.tokenizer, self.stops, self.skip = tokenizer, tuple(s for s in stop_strings if s), skip_special_tokens
        self.include_stop, self.min_tokens = include_stop, min_tokens
        self.added = 0  # generated tokens taken
        self.ids: list[int] = [int(t) for t in prompt[max(0, len(prompt) - _CONTEXT) :]]  # left context
        self.prefix = 0  # window start
        self.read = len(self.ids)  # tokens whose text is in self.text (or is the prompt's)
        self.text = ""  # decoded so far (complete characters only)
        self.sent = 0  # characters of self.text released
        self.stopped: str | None = None  # the stop string that matched
        self._reach = max((len(s) for s in self.stops), default=1) - 1  # a stop may start this far back
        self._hold = 0 if include_stop else self._reach

    def _decode(self, ids: list[int]) -> str:
        # no clean-up: it rewrites text before the new tokens ("Hello ." -> "Hello."), which a window cannot follow
        return str(self.tokenizer.decode(ids, skip_special_tokens=self.skip, clean_up_tokenization_spaces=False))

    def add(self, token: int) -> str:
        """Take one generated token; return the text newly safe to stream ('' while a character is incomplete or
        a stop string may be starting). After a stop string matched, `stopped` is set and nothing more comes."""
        if self.stopped is not None:
            return ""
        self.added += 1
        self.ids.append(token)
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        end = len(self.ids)
        if after.endswith(_INCOMPLETE):
            cut = self._final_cut(after) if end - self.read >= _MAX_CHAR_TOKENS else None
            if cut is None:
                return ""  # wait for the rest of the character
            end, after = cut, self._decode(self.ids[self.prefix : cut])
        # a decoder that still rewrites earlier text: stream what follows the common part, never stall
        common = len(before) if after.startswith(before) else _common_prefix(before, after)
        self.prefix, self.read = max(self.prefix, end - _CONTEXT), end
        return self._append(after[common:])

    def _final_cut(self, after: str) -> int | None:
        """The latest token boundary among the last few that ends text no later token can change: its window's
        text is a prefix of `after` without its last character (the only one that may still be incomplete)."""
        for cut in range(len(self.ids) - 1, max(self.read, len(self.ids) - _MAX_CHAR_TOKENS), -1):
            if after[:-1].startswith(self._decode(self.ids[self.prefix : cut])):
                return cut
        return None

    def _append(self, new: str) -> str:
        start = max(0, len(self.text) - self._reach)
        self.text += new
        if self.stops:
            searched = self.added > self.min_tokens
            hits = [(self.text.find(s, start), s) for s in self.stops] if searched else []
            found = [(at, s) for at, s in hits if at >= 0]
            if found:
                at, self.stopped = min(found)
                self.text = self.text[: at + len(self.stopped) if self.include_stop else at]
                return self._release(len(self.text))
            return self._release(max(self.sent, len(self.text) - self._hold))
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        out, self.sent = self.text[self.sent : upto], upto
        return out

    def flush(self) -> str:
        """At the end of the request: everything not yet released (held-back characters; an incomplete character
        left by a cut-off output comes out as U+FFFD, as a full decode would give)."""
        if self.stopped is None and self.read < len(self.ids):
            tail = self._decode(self.ids[self.prefix :])[len(self._decode(self.ids[self.prefix : self.read])) :]
            self.read = len(self.ids)
            self.text += tail
        return self._release(len(self.text))
