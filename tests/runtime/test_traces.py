"""Request traces (runtime/traces.py, a fuzzer's findings): impossible times and lengths are refused naming the file,
line and field; a gap of days is cut to the limit and said; `trtbuild bench` refuses a bad trace in one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import deadline, mooncake, not_a_file, one_line_error

from toolchain.errors import UserError

OK = {"timestamp": 0, "input_length": 40, "output_length": 4}


@pytest.mark.parametrize(
    ("record", "field"),
    [
        ('{"timestamp": NaN, "input_length": 40, "output_length": 4}', "timestamp is nan"),
        ('{"timestamp": Infinity, "input_length": 40, "output_length": 4}', "timestamp is inf"),
        ('{"timestamp": -5, "input_length": 40, "output_length": 4}', "timestamp is -5"),
        ('{"timestamp": "soon", "input_length": 40, "output_length": 4}', "timestamp is 'soon'"),
        ('{"timestamp": 9, "input_length": -40, "output_length": 4}', "input_length is -40"),
        ('{"timestamp": 9, "input_length": 40.5, "output_length": 4}', "input_length is 40.5"),
        ('{"timestamp": 9, "input_length": 40, "output_length": 1e300}', "output_length is 1e+300"),
        ('{"timestamp": 9, "input_length": 40, "output_length": 4, "hash_ids": [-1]}', "hash_ids is [-1]"),
        ('{"timestamp": 9, "input_length": 40, "output_length": 4, "hash_ids": "abc"}', "hash_ids is 'abc'"),
    ],
)
def test_trace_records_are_checked_naming_file_line_and_field(record: str, field: str, tmp_path: Path) -> None:
    from toolchain.runtime.traces import load_trace

    path = mooncake(tmp_path / "t.jsonl", OK, record)
    with deadline(20), pytest.raises(UserError) as e:
        load_trace(path, max_seq_len=128, vocab_size=100)
    assert str(e.value).startswith(f"{path}:2: {field}")


def test_azure_rows_are_checked(tmp_path: Path) -> None:
    from toolchain.runtime.traces import load_trace

    path = tmp_path / "t.csv"
    head = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"
    for row, field in (
        ("yesterday,374,44", "TIMESTAMP 'yesterday'"),
        ("2023-11-16 18:15:47.0,-3,44", "ContextTokens is '-3'"),
        ("2023-11-16 18:15:47.0,374,nan", "GeneratedTokens is 'nan'"),
        ("2023-11-16 18:15:47.0,374", "2 fields"),
    ):
        path.write_text(head + row + "\n")
        with pytest.raises(UserError) as e:
            load_trace(path, max_seq_len=128, vocab_size=100)
        assert str(e.value).startswith(f"{path}:3: {field}")


def test_a_ten_day_gap_is_cut_to_the_limit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from toolchain.runtime.traces import load_trace

    ten_days_ms = 10 * 86400 * 1000
    path = mooncake(tmp_path / "t.jsonl", OK, {**OK, "timestamp": ten_days_ms}, {**OK, "timestamp": ten_days_ms + 500})
    reqs, _ = load_trace(path, max_seq_len=128, vocab_size=100)
    assert [r.arrival for r in reqs] == pytest.approx([0.0, 60.0, 60.5])  # the gap after it is kept
    assert reqs[1].gap_cut_s == pytest.approx(864000 - 60) and reqs[2].gap_cut_s == 0
    assert "1 gap(s) between arrivals longer than 60 s shortened to 60 s" in capsys.readouterr().err
    reqs, _ = load_trace(path, max_seq_len=128, vocab_size=100, rate_scale=2.0, max_gap_s=1.0)
    assert [r.arrival for r in reqs] == pytest.approx([0.0, 1.0, 1.25])  # rate first, then the limit


def test_bench_with_a_ten_day_gap_finishes_and_says_so(cli: Any, tiny_engine: Path, tmp_path: Path) -> None:
    path = mooncake(tmp_path / "t.jsonl", OK, {**OK, "timestamp": 10 * 86400 * 1000})
    with deadline(120):
        result = cli("bench", tiny_engine, "--trace", path, "--max-gap-s", "0.2", "--json")
    assert result.exit_code == 0, result.stderr
    assert "shortened to 0.2 s" in result.stderr
    report = json.loads(result.stdout)
    assert report["gaps_cut"] == 1 and report["gap_seconds_cut"] == pytest.approx(864000 - 0.2)
    assert report["settings"]["max_gap_s"] == 0.2 and report["completed"] == 2


def test_bench_refuses_a_nan_trace_in_one_line(cli: Any, tiny_engine: Path, tmp_path: Path) -> None:
    path = mooncake(tmp_path / "t.jsonl", OK, '{"timestamp": NaN, "input_length": 4, "output_length": 4}')
    with deadline(60):
        line = one_line_error(cli("bench", tiny_engine, "--trace", path))
    assert f"{path}:2: timestamp is nan" in line


@pytest.mark.parametrize("kind", ["dev-zero", "fifo"])
def test_bench_refuses_a_trace_that_is_not_a_file(kind: str, cli: Any, tiny_engine: Path, tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    not_a_file(path, kind)
    with deadline(60):
        line = one_line_error(cli("bench", tiny_engine, "--trace", path))
    assert f"{path}: not a regular file" in line
