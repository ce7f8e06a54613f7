"""What a fuzzing pass found (issue 13): files that are not files, files far too large, traces with impossible
times, engines with impossible limits. Each is refused in one line naming the file (and line, key or field),
with exit 1 and nothing written; none may hang, which `deadline` turns into a failure instead of a stuck run."""

from __future__ import annotations

import json
import os
import shutil
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from conftest import nothing_written, one_line_error, reseal

from toolchain.errors import UserError
from toolchain.files import JSON_LIMIT, RECIPE_LIMIT, read_text_capped


@contextmanager
def deadline(seconds: int) -> Iterator[None]:
    """Fail (rather than hang) if the block takes longer: SIGALRM interrupts a blocking open or read."""

    def expire(signum: int, frame: Any) -> None:
        raise TimeoutError(f"still running after {seconds} s: the input was not refused before reading")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def not_a_file(path: Path, kind: str) -> None:
    """Make `path` one of the things a fuzzer puts where a file should be."""
    path.unlink(missing_ok=True)
    if kind == "dev-zero":
        path.symlink_to("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "huge":
        with path.open("wb") as f:
            f.truncate(JSON_LIMIT + 1)  # sparse: no disk used, but larger than any config
    else:
        raise AssertionError(kind)


EXPECTED = {
    "dev-zero": "not a regular file (a character device through a symlink to /dev/zero)",
    "fifo": "not a regular file (a FIFO",
    "directory": "not a regular file (a directory",
    "huge": "over the 64.0 MiB limit",
}


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_read_text_capped_refuses_before_reading(kind: str, tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    not_a_file(path, kind)
    with deadline(20), pytest.raises(UserError, match=r"config\.json: ") as e:
        read_text_capped(path, JSON_LIMIT, "JSON config")
    assert EXPECTED[kind] in str(e.value)


def test_read_text_capped_reads_a_file_and_stops_at_the_limit(tmp_path: Path) -> None:
    path = tmp_path / "a.json"
    path.write_bytes(b'{"a": 1}\r\n')
    assert read_text_capped(path, 64, "JSON config") == '{"a": 1}\n'  # newlines as Path.read_text gives them
    with pytest.raises(UserError, match="over the 8 bytes limit for a JSON config"):
        read_text_capped(path, 8, "JSON config")


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_convert_refuses_a_config_that_is_not_a_file(kind: str, cli: Any, make_llama: Any, tmp_path: Path) -> None:
    hf = make_llama()
    not_a_file(hf / "config.json", kind)
    out = tmp_path / "ckpt"
    with deadline(60):
        line = one_line_error(cli("convert", hf, "-o", out))
    assert f"{hf / 'config.json'}: " in line and EXPECTED[kind] in line
    nothing_written(out)


@pytest.mark.parametrize("kind", ["dev-zero", "fifo"])
def test_convert_refuses_a_tokenizer_file_that_is_not_a_file(
    kind: str, cli: Any, make_llama: Any, tmp_path: Path
) -> None:
    hf = make_llama()
    not_a_file(hf / "tokenizer.json", kind)
    out = tmp_path / "ckpt"
    with deadline(60):
        line = one_line_error(cli("convert", hf, "-o", out))
    assert "tokenizer.json: not a regular file" in line and "pass the tokenizer file itself" in line
    nothing_written(out)


@pytest.mark.parametrize("kind", ["huge", "fifo", "dev-zero"])
def test_a_recipe_that_is_huge_or_not_a_file_is_refused_at_once(kind: str, cli: Any, tmp_path: Path) -> None:
    recipe = tmp_path / "recipe.yaml"
    if kind == "huge":
        with recipe.open("wb") as f:
            f.truncate(2 << 30)  # the fuzzer's recipe parsed for minutes; this one is refused unread
    else:
        not_a_file(recipe, kind)
    out = tmp_path / "run"
    with deadline(30):
        line = one_line_error(cli("run", recipe, "-o", out))
    assert str(recipe) in line
    if kind == "huge":
        assert "limit for a recipe" in line and f"{RECIPE_LIMIT >> 20}.0 MiB" in line
    nothing_written(out)


# -- engines ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from toolchain.checkpoint.convert import convert
    from toolchain.checkpoint.tiny import make_tiny_llama
    from toolchain.engine.build import BuildOptions, build_engine

    tmp = tmp_path_factory.mktemp("fuzz-engine")
    make_tiny_llama(tmp / "hf", seed=0)
    convert(tmp / "hf", tmp / "ckpt")
    build_engine(tmp / "ckpt", tmp / "engine", BuildOptions(backend="onnxruntime", max_seq_len=128, max_batch_size=4))
    return tmp / "engine"


def engine_copy(engine: Path, dst: Path) -> Path:
    shutil.copytree(engine, dst)
    return dst


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("max_batch_size", 0),
        ("max_num_tokens", 0),
        ("max_num_tokens", -8),
        ("max_seq_len", 1),
        ("num_blocks", 0),
        ("tokens_per_block", 3),
        ("max_batch_size", 2.5),
        ("max_batch_size", "4"),
        ("max_batch_size", True),
        ("num_blocks", 1 << 40),
    ],
)
def test_engine_limits_are_checked_when_the_engine_is_opened(
    key: str, value: Any, cli: Any, tiny_engine: Path, tmp_path: Path
) -> None:
    config_path = tiny_engine / "build_config.json"
    config = json.loads(config_path.read_text())
    config["limits"][key] = value
    engine = engine_copy(tiny_engine, tmp_path / "engine")
    (engine / "build_config.json").write_text(json.dumps(config))
    reseal(engine)  # as if a build had written these limits: the spec's own checks, past the integrity check
    with deadline(60):
        line = one_line_error(cli("generate", engine, "--prompt", "Once upon", "--max-new-tokens", "2"))
    assert f"{engine / 'build_config.json'}: " in line and f"limits.{key} is {value!r}" in line
    assert "rebuild the engine" in line


def test_a_missing_engine_limit_is_named(cli: Any, tiny_engine: Path, tmp_path: Path) -> None:
    config = json.loads((tiny_engine / "build_config.json").read_text())
    del config["limits"]["max_num_tokens"]
    engine = engine_copy(tiny_engine, tmp_path / "engine")
    (engine / "build_config.json").write_text(json.dumps(config))
    reseal(engine)
    line = one_line_error(cli("bench", engine, "--trace", tmp_path / "t.jsonl"))
    assert "build_config.json: key 'max_num_tokens' is missing" in line


@pytest.mark.parametrize("kind", ["dev-zero", "fifo", "directory"])
def test_engine_files_that_are_not_files(kind: str, cli: Any, tiny_engine: Path, tmp_path: Path) -> None:
    # build_config.json: no engine dir to check (exit 1); the others: an engine not as recorded (exit 4, integrity)
    for name, code in (("build_config.json", 1), ("manifest.json", 4), ("tokenizer.json", 4)):
        engine = engine_copy(tiny_engine, tmp_path / f"{name}-engine")
        not_a_file(engine / name, kind)
        with deadline(60):
            result = cli("generate", engine, "--prompt", "Once upon", "--max-new-tokens", "2")
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert result.exit_code == code and len(errors) == 1, (name, result.exit_code, result.stderr)
        assert f"{engine / name}: not a regular file" in errors[0] or f"not a regular file: {name}" in errors[0]


# -- traces -----------------------------------------------------------------------------------------------------


def mooncake(path: Path, *records: dict[str, Any] | str) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


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
