"""Public request traces (../shared/data/traces) as requests for a given model: arrival times kept, lengths scaled.

Scaling: production traces have prompts of thousands of tokens; a small engine has a context of hundreds. Every
prompt and output length is multiplied by one factor s = (max_seq_len - 1) / (99th percentile of prompt + output)
(never above 1), rounded, at least 1, and each request clipped to max_seq_len — the arrival process and the
prompt/output ratios are the trace's, except that a gap between arrivals longer than `max_gap_s` (after
`rate_scale`) is shortened to it. Every record is checked as it is read (finite, non-negative times; whole,
non-negative token counts), and an error names the file, line and field; rows are replayed in arrival order.
Prompt tokens are random ids (seeded by request); for Mooncake, each of a
request's `hash_ids` (512-token prefix blocks in the original) becomes the same run of round(512 s) ids wherever it
appears, so requests that shared prefixes in production share them here.
"""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from toolchain import console
from toolchain.errors import UserError
from toolchain.files import TRACE_LIMIT, read_text_capped

MAX_GAP_S = 60.0  # load_trace's default; `bench --max-gap-s` repeats it (cli.py imports no runtime module eagerly)
_MAX_LEN = (1 << 31) - 1  # token counts beyond int32 are not a trace's


@dataclass(frozen=True)
class TraceRequest:
    arrival: float  # seconds after the first request
    prompt: list[int]
    output_tokens: int
    gap_cut_s: float = 0.0  # seconds taken out of the gap before this arrival (max_gap_s)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.arrival) and self.arrival >= 0):
            raise ValueError(f"arrival {self.arrival!r}: expected a finite number of seconds >= 0")


@dataclass(frozen=True)
class _Raw:
    arrival: float
    prompt_len: int
    output_len: int
    hash_ids: tuple[int, ...]


def _count(where: str, field: str, value: Any) -> int:
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MAX_LEN:
        raise UserError(f"{where}: {field} is {value!r}; expected a whole number of tokens from 0 to {_MAX_LEN}")
    return value


def _seconds(where: str, field: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise UserError(f"{where}: {field} is {value!r}; expected a finite, non-negative number")
    return float(value)


def _read_azure(path: Path, text: str) -> list[_Raw]:
    reader = csv.reader(io.StringIO(text))
    header = next(reader, [])
    columns = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
    if not set(columns) <= set(header):
        raise UserError(f"{path}: expected Azure columns TIMESTAMP, ContextTokens, GeneratedTokens")
    at = [header.index(c) for c in columns]
    raw: list[_Raw] = []
    first: datetime | None = None
    for row in reader:
        if not row:
            continue
        where = f"{path}:{reader.line_num}"
        if len(row) != len(header):
            raise UserError(f"{where}: {len(row)} fields, the header has {len(header)}")
        stamp, context, generated = (row[i] for i in at)
        try:
            t = datetime.fromisoformat(stamp[:26])
        except ValueError as e:
            raise UserError(f"{where}: TIMESTAMP {stamp!r} is not a date and time (YYYY-MM-DD HH:MM:SS.ffffff)") from e
        first = first or t
        arrival = (t - first).total_seconds()  # may be negative: rows are sorted by arrival below
        raw.append(
            _Raw(arrival, _count(where, "ContextTokens", context), _count(where, "GeneratedTokens", generated), ())
        )
    return raw


def _read_mooncake(path: Path, text: str) -> list[_Raw]:
    raw: list[_Raw] = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            item = json.loads(line)
            stamp, prompt, output = item["timestamp"], item["input_length"], item["output_length"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise UserError(f"{where}: not a Mooncake record (timestamp, input_length, output_length)") from e
        hash_ids = item.get("hash_ids", [])
        if not isinstance(hash_ids, list) or not all(type(h) is int and h >= 0 for h in hash_ids):
            raise UserError(f"{where}: hash_ids is {hash_ids!r}; expected a list of non-negative integers")
        arrival = _seconds(where, "timestamp", stamp) / 1000  # milliseconds in Mooncake traces
        raw.append(
            _Raw(
                arrival, _count(where, "input_length", prompt), _count(where, "output_length", output), tuple(hash_ids)
            )
        )
    return raw


def _read(path: Path) -> list[_Raw]:
    if path.suffix not in (".csv", ".jsonl"):
        raise UserError(f"--trace {path}: expected an Azure .csv or a Mooncake .jsonl trace")
    try:
        text = read_text_capped(path, TRACE_LIMIT, "request trace")
    except FileNotFoundError as e:
        raise UserError(f"--trace {path}: no such file") from e
    raw = _read_azure(path, text) if path.suffix == ".csv" else _read_mooncake(path, text)
    if not raw:
        raise UserError(f"{path}: no requests")
    start = min(r.arrival for r in raw)
    return sorted(
        (_Raw(r.arrival - start, r.prompt_len, r.output_len, r.hash_ids) for r in raw), key=lambda r: r.arrival
    )


def _cut_gaps(arrivals: list[float], max_gap_s: float) -> tuple[list[float], list[float]]:
    """Arrivals with every gap longer than max_gap_s shortened to it, and the seconds cut before each."""
    out, cuts = [], []
    previous_in, previous_out = 0.0, 0.0
    for t in arrivals:
        gap = t - previous_in
        cuts.append(max(0.0, gap - max_gap_s))
        previous_in, previous_out = t, previous_out + min(gap, max_gap_s)
        out.append(previous_out)
    return out, cuts


def load_trace(
    path: Path,
    max_seq_len: int,
    vocab_size: int,
    max_requests: int | None = None,
    rate_scale: float = 1.0,
    seed: int = 0,
    max_gap_s: float | None = MAX_GAP_S,
) -> tuple[list[TraceRequest], float]:
    """(requests, length scale factor). Arrivals are divided by `rate_scale`; then a gap between two arrivals
    longer than `max_gap_s` is shortened to it (the request's `gap_cut_s` says by how much), with a line on
    stderr, so that a trace with a quiet night in it does not make a benchmark wait through the night."""
    if not (math.isfinite(rate_scale) and rate_scale > 0):
        raise UserError(f"--rate-scale {rate_scale}: expected a finite number above 0")
    if max_gap_s is not None and not (math.isfinite(max_gap_s) and max_gap_s > 0):
        raise UserError(f"--max-gap-s {max_gap_s}: expected a finite number of seconds above 0")
    raw = _read(path)[:max_requests]
    arrivals = [r.arrival / rate_scale for r in raw]
    cuts = [0.0] * len(raw)
    if max_gap_s is not None:
        arrivals, cuts = _cut_gaps(arrivals, max_gap_s)
        if any(cuts):
            console.info(
                f"{path.name}: {sum(c > 0 for c in cuts)} gap(s) between arrivals longer than {max_gap_s:g} s "
                f"shortened to {max_gap_s:g} s ({sum(cuts):.1f} s taken out; --max-gap-s changes the limit)"
            )
    totals = np.array([r.prompt_len + r.output_len for r in raw])
    scale = min(1.0, (max_seq_len - 1) / max(1.0, float(np.percentile(totals, 99))))
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
            if len(prompt) >= prompt_len:
                break
            if h not in blocks:
                blocks[h] = np.random.default_rng([seed, 1 << 40, h]).integers(low, vocab_size, block_len).tolist()
            prompt += blocks[h]
        prompt = prompt[:prompt_len]
        prompt += rng.integers(low, vocab_size, prompt_len - len(prompt)).tolist()
        out.append(TraceRequest(arrivals[i], prompt, output, cuts[i]))
    return out, scale
