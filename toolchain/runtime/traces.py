"""Public request traces (../shared/data/traces) as requests for a given model: arrival times kept, lengths scaled.

Scaling: production traces have prompts of thousands of tokens; a small engine has a context of hundreds. Every
prompt and output length is multiplied by one factor s = (max_seq_len - 1) / (99th percentile of prompt + output)
(never above 1), rounded, at least 1, and each request clipped to max_seq_len — the arrival process and the
prompt/output ratios are the trace's. Prompt tokens are random ids (seeded by request); for Mooncake, each of a
request's `hash_ids` (512-token prefix blocks in the original) becomes the same run of round(512 s) ids wherever it
appears, so requests that shared prefixes in production share them here.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np

from toolchain.errors import UserError


@dataclass(frozen=True)
class TraceRequest:
    arrival: float  # seconds after the first request
    prompt: list[int]
    output_tokens: int


@dataclass(frozen=True)
class _Raw:
    arrival: float
    prompt_len: int
    output_len: int
    hash_ids: tuple[int, ...]


def _read(path: Path) -> list[_Raw]:
    if not path.is_file():
        raise UserError(f"--trace {path}: no such file")
    raw: list[_Raw] = []
    if path.suffix == ".csv":
        with path.open(newline="") as f:
            rows = list(csv.DictReader(f))
        if not rows or not {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} <= set(rows[0]):
            raise UserError(f"{path}: expected Azure columns TIMESTAMP, ContextTokens, GeneratedTokens")
        stamps = [datetime.fromisoformat(r["TIMESTAMP"][:26]) for r in rows]
        raw = [
            _Raw((t - stamps[0]).total_seconds(), int(r["ContextTokens"]), int(r["GeneratedTokens"]), ())
            for t, r in zip(stamps, rows, strict=True)
        ]
    elif path.suffix == ".jsonl":
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
                raw.append(
                    _Raw(
                        item["timestamp"] / 1000,
                        int(item["input_length"]),
                        int(item["output_length"]),
                        tuple(item.get("hash_ids", ())),
                    )
                )
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise UserError(f"{path}:{n}: not a Mooncake record (timestamp, input_length, output_length)") from e
    else:
        raise UserError(f"--trace {path}: expected an Azure .csv or a Mooncake .jsonl trace")
    if not raw:
        raise UserError(f"{path}: no requests")
    start = min(r.arrival for r in raw)
    return sorted(
        (_Raw(r.arrival - start, r.prompt_len, r.output_len, r.hash_ids) for r in raw), key=lambda r: r.arrival
    )


def load_trace(
    path: Path,
    max_seq_len: int,
    vocab_size: int,
    max_requests: int | None = None,
    rate_scale: float = 1.0,
    seed: int = 0,
) -> tuple[list[TraceRequest], float]:
    """(requests, length scale factor)."""
    raw = _read(path)[:max_requests]
    totals = np.array([r.prompt_len + r.output_len for r in raw])
    scale = min(1.0, (max_seq_len - 1) / float(np.percentile(totals, 99)))
    low = 3 if vocab_size > 3 else 0  # keep clear of the usual special ids
    block_len = max(1, round(512 * scale))
    blocks: dict[int, list[int]] = {}
    out = []
    for i, r in enumerate(raw):
        prompt_len = min(max(1, round(r.prompt_len * scale)), max_seq_len - 1)
        output = max(1, min(round(r.output_len * scale), max_seq_len - prompt_len))
        rng = np.random.default_rng([seed, i])
        prompt: list[int] = []
        for h in r.hash_ids:  # shared prefixes stay shared
            if h not in blocks:
                blocks[h] = np.random.default_rng([seed, 1 << 40, h]).integers(low, vocab_size, block_len).tolist()
            prompt += blocks[h]
        prompt = prompt[:prompt_len]
        prompt += rng.integers(low, vocab_size, prompt_len - len(prompt)).tolist()
        out.append(TraceRequest(r.arrival / rate_scale, prompt, output))
    return out, scale
