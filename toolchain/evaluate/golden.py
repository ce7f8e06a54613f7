"""Golden prompts: the prompts file, and each greedy continuation of the engine beside the reference's, token by
token. Text is rendered from the bytes the tokens stand for, so that bytes which are not valid UTF-8 (a character
cut between tokens, a model emitting stray bytes) show as `\\xNN` escapes instead of a silent U+FFFD.

Rendering (`readable`): valid UTF-8 as text; an invalid byte as `\\xNN`; a backslash as `\\\\`; newline, tab and
carriage return as `\\n`, `\\t`, `\\r`; other control characters as `\\xNN` (ASCII) or `\\uNNNN`; a token id the
tokenizer has no token for as `\\[id N]`. A single backslash therefore always starts an escape."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from toolchain.errors import UserError, read_utf8

_ESCAPES = {"\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r"}
# what each escape of `readable` means, for the reports' legend
LEGEND = (
    ("\\xNN", "one byte in hex: 80-ff is not valid UTF-8 where it stands, 00-1f and 7f are control characters"),
    ("\\n \\t \\r", "newline, tab, carriage return"),
    ("\\\\", "a backslash"),
    ("\\[id N]", "a token id the tokenizer has no token for"),
)
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte fallback (Llama, Mistral, ...)


@dataclass(frozen=True)
class GoldenPrompt:
    prompt: str
    max_new_tokens: int


def read_golden(path: Path) -> list[GoldenPrompt]:
    prompts = []
    for number, line in enumerate(read_utf8(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f'{path}:{number}: not JSON ({e.msg}); one {{"prompt": ...}} object per line') from e
        if not isinstance(item, dict) or not isinstance(item.get("prompt"), str):
            raise UserError(f'{path}:{number}: expected {{"prompt": "...", "max_new_tokens": N}}')
        n = item.get("max_new_tokens", 32)
        if not isinstance(n, int) or n < 1:
            raise UserError(f"{path}:{number}: max_new_tokens must be a positive integer, got {n!r}")
        prompts.append(GoldenPrompt(item["prompt"], n))
    if not prompts:
        raise UserError(f"{path}: no prompts")
    return prompts


def _char(ch: str) -> str:
    code = ord(ch)
    if 0xDC80 <= code <= 0xDCFF:  # surrogateescape: a byte that is not part of valid UTF-8
        return f"\\x{code - 0xDC00:02x}"
    if ch in _ESCAPES:
        return _ESCAPES[ch]
    if ch.isprintable():
        return ch
    return f"\\x{code:02x}" if code < 0x80 else f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def readable(data: bytes) -> str:
    """`data` as text, every byte accounted for (see the module docstring)."""
    return "".join(_char(ch) for ch in data.decode("utf-8", errors="surrogateescape"))


def _is_byte_level(tokenizer: Any) -> bool:
    """Whether the tokenizer's decoder maps pieces to bytes through GPT-2's byte-to-unicode table."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False

    def has(node: Any) -> bool:
        if isinstance(node, dict):
            return node.get("type") == "ByteLevel" or any(has(v) for v in node.values())
        return isinstance(node, list) and any(has(v) for v in node)

    return has(json.loads(backend.to_str()).get("decoder"))


class TokenBytes:
    """The bytes each token id stands for, as llama.cpp's token_to_piece gives them: a byte-fallback piece
    `<0xE2>` is that byte, a byte-level BPE piece maps back through GPT-2's table, a SentencePiece `▁` is a space,
    a special token is its text; None for an id the tokenizer has no token for."""

    def __init__(self, tokenizer: Any):
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        self.tokenizer = tokenizer
        self.special = set(tokenizer.all_special_ids)
        table: dict[int, str] = bytes_to_unicode() if _is_byte_level(tokenizer) else {}  # type: ignore[no-untyped-call]
        self.byte_of = {c: b for b, c in table.items()}

    def __call__(self, token_id: int) -> bytes | None:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return None
        if token_id in self.special:
            return str(piece).encode()
        if match := _BYTE_PIECE.fullmatch(piece):
            return bytes([int(match[1], 16)])
        if self.byte_of and all(c in self.byte_of for c in piece):
            return bytes(self.byte_of[c] for c in piece)
        return str(piece).replace("\u2581", " ").encode()

    def render(self, ids: list[int]) -> str:
        """The text of `ids` together: a character split across tokens is joined before it is decoded."""
        out, run = [], b""
        for token_id in ids:
            data = self(token_id)
            if data is None:
                out += [readable(run), f"\\[id {token_id}]"]
                run = b""
            else:
                run += data
        return "".join(out) + readable(run)


def compare(
    token_bytes: TokenBytes, prompt: str, prompt_ids: list[int], got: list[int], want: list[int]
) -> dict[str, Any]:
    """One golden prompt's entry in report.json: the engine's continuation beside the reference's."""
    diverge = next((k for k, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
    return {
        "prompt": prompt,
        "prompt_ids": prompt_ids,
        "tokens": len(want),
        "exact": diverge is None,
        "first_divergence": diverge,
        "engine": token_bytes.render(got),
        "reference": token_bytes.render(want),
        "engine_ids": got,
        "reference_ids": want,
        "engine_tokens": [token_bytes.render([t]) for t in got],
        "reference_tokens": [token_bytes.render([t]) for t in want],
    }
