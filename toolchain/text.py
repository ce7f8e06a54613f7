"""Evaluation and calibration text: a plain text file or a JSONL of {"text": ...}, tokenized with the model's
own tokenizer (the files `convert` copies next to the weights)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from toolchain.errors import UserError, read_utf8
from toolchain.files import check_tokenizer_dir

_MARGIN = 64


def read_text(path: Path) -> str:
    if not path.is_file():
        raise UserError(f"text file {path} does not exist; pass a .txt or .jsonl file")
    raw = read_utf8(path)
    if path.suffix == ".jsonl":
        texts = []
        for number, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                texts.append(str(record["text"]))
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise UserError(f'{path}:{number}: expected a JSON object with a "text" field') from e
        raw = "\n".join(texts)
    if not raw.strip():
        raise UserError(f"{path} holds no text")
    return raw


def tokenize(path: Path, tokenizer_dir: Path, max_tokens: int | None = None) -> torch.Tensor:
    """Token ids of the whole file (1-D int64), cut to `max_tokens`."""
    from transformers import AutoTokenizer

    check_tokenizer_dir(tokenizer_dir)  # no FIFO or /dev/zero handed to transformers
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    except (OSError, ValueError) as e:
        raise UserError(
            f"{tokenizer_dir}: no usable tokenizer ({type(e).__name__}); convert a model that has one"
        ) from e
    tokenizer.model_max_length = 1 << 62  # we cut the ids into windows ourselves; silences the length warning
    text = read_text(path)
    if max_tokens:
        # Tokenize a prefix generous enough for max_tokens (a token is rarely over 16 characters) rather than a
        # whole corpus; the margin keeps the cut, which can split a word, away from the tokens returned.
        ids = tokenizer(text[: (max_tokens + _MARGIN) * 16], add_special_tokens=False)["input_ids"]
        if len(ids) < max_tokens + _MARGIN and len(text) > (max_tokens + _MARGIN) * 16:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return torch.tensor(ids[:max_tokens], dtype=torch.int64)
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.int64)
