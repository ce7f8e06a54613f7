"""Evaluation and calibration text: a plain text file or a JSONL of {"text": ...}, tokenized with the model's
own tokenizer (the files `convert` copies next to the weights)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from toolchain.errors import UserError


def read_text(path: Path) -> str:
    if not path.is_file():
        raise UserError(f"text file {path} does not exist; pass a .txt or .jsonl file")
    try:
        raw = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text (byte {e.start})") from e
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

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    except (OSError, ValueError) as e:
        raise UserError(
            f"{tokenizer_dir}: no usable tokenizer ({type(e).__name__}); convert a model that has one"
        ) from e
    ids = tokenizer(read_text(path), add_special_tokens=False)["input_ids"]
    tokens = torch.tensor(ids[:max_tokens] if max_tokens else ids, dtype=torch.int64)
    return tokens
