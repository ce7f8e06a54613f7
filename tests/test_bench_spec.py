"""The speculation surfaces of the CLI on stories260K (issue 30): `bench --ngram --prompts` replays a trace without
and with speculation and reports both runs, acceptance, mean accepted length and the GPU projection with its c and v;
`generate --ngram --json` prints what plain greedy prints; the proposer options refuse contradictions in one line.

The n-gram proposer is replaced here by a one-token lookup (the tokens that followed the last token's earliest
earlier occurrence), so these tests see real drafts whatever runtime/ngram.py proposes; its own tests are slice A's.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import one_line_error
from toolchain.runtime.replay import speculation_table
from toolchain.runtime.request import Request
from toolchain.runtime.scheduler import Scheduled
from toolchain.runtime.speculative import Draft

STORY = "Once upon a time, there was a little girl named Lily. She loved to play with her ball in the park."


class Lookup:
    """Drafts the tokens after the earliest earlier occurrence of the last token (an n-gram lookup with n = 1)."""

    drafted = 0

    def __init__(self, config: Any) -> None:
        self.config = config

    def propose(self, scheduled: Sequence[Scheduled]) -> list[Draft | None]:
        out: list[Draft | None] = []
        for s in scheduled:
            tokens = s.request.tokens
            first = tokens.index(tokens[-1]) if s.spec else len(tokens) - 1
            follow = tokens[first + 1 : first + 1 + s.spec] if first < len(tokens) - 1 else []
            Lookup.drafted += len(follow)
            out.append(Draft(list(follow)) if follow else None)
        return out

    def release(self, request: Request) -> None:
        pass


@pytest.fixture(autouse=True)
def lookup(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr("toolchain.runtime.ngram.NgramProposer", Lookup)
    Lookup.drafted = 0
    yield


@pytest.fixture(scope="module")
def engine(stories: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from toolchain.checkpoint.convert import convert
    from toolchain.engine.build import BuildOptions, build_engine

    tmp = tmp_path_factory.mktemp("spec-bench")
    convert(stories, tmp / "ckpt")
    opts = BuildOptions(backend="onnxruntime", max_seq_len=128, max_batch_size=4, tokens_per_block=4)
    build_engine(tmp / "ckpt", tmp / "engine", opts)
    return tmp / "engine"


@pytest.mark.slow  # four replays (two warm-ups) in real time: ~2.5 s on 2 shared cores
def test_bench_ngram_with_prompts_reports_both_runs_acceptance_and_the_projection(
    cli: Any, engine: Path, tmp_path: Path
) -> None:
    trace = tmp_path / "trace.csv"
    rows = [f"2023-11-16 18:15:{10 + i:02d}.0,{20 + 3 * i},{30 + i}" for i in range(4)]
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(rows) + "\n")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": STORY}) + "\n" + json.dumps({"text": "One day, a big dog"}) + "\n")
    done = cli("bench", engine, "--trace", trace, "--rate-scale", "100", "--ngram", "--prompts", prompts, "--json")
    assert done.exit_code == 0, done.stderr
    r = json.loads(done.stdout)
    plain, spec = r["plain"], r["speculative"]
    assert plain["completed"] == spec["completed"] == 4
    assert spec["output_tokens"] == plain["output_tokens"] == sum(30 + i for i in range(4))
    assert r["prompts"].startswith(str(prompts))
    s = r["speculation"]
    assert s["method"] == "ngram" and s["num_speculative_tokens"] == 4
    assert (s["prompt_lookup_min"], s["prompt_lookup_max"]) == (2, 4)
    assert s["drafts"] > 0 and 0 < s["accepted_tokens"] <= s["draft_tokens"]
    assert s["acceptance_rate"] == s["accepted_tokens"] / s["draft_tokens"]
    assert s["mean_accepted_length"] == 1 + s["accepted_tokens"] / s["drafts"]
    assert r["ratios"]["steps"] == spec["steps"] / plain["steps"]  # batch steps: timing-dependent, not asserted
    assert r["ratios"]["throughput"] == spec["output_tok_s"] / plain["output_tok_s"]
    p = r["projection"]
    assert p["label"] == "projection, not a measurement" and p["c"] == 0  # n-gram: no draft weights to read
    k = s["draft_tokens"] / s["drafts"]
    assert p["k"] == pytest.approx(k) and p["weight_bytes"] > 0 and p["kv_bytes"] > 0
    w, kv = p["weight_bytes"], p["kv_bytes"]
    assert p["v"] == pytest.approx((w + (k + 1) * kv) / (w + kv)) and p["v"] > 1
    assert p["speedup"] == pytest.approx(s["mean_accepted_length"] / (k * p["c"] + p["v"]))
    # the table (what bench prints without --json) says what the projection is, with c and v beside it
    text = "\n".join(speculation_table(r))
    assert f"GPU speedup   {p['speedup']:.2f}x: projection, not a measurement" in text
    assert f"c 0.000 draft/target weight bytes, v {p['v']:.3f}" in text and "random ids" not in text
    random_ids = "\n".join(speculation_table({**r, "prompts": "the trace's (random ids)"}))
    assert "trace prompts are random ids: unrepresentative of text (--prompts FILE.jsonl)" in random_ids


def test_generate_with_ngram_prints_what_plain_greedy_prints(cli: Any, engine: Path) -> None:
    args = ("generate", engine, "--prompt", STORY, "--max-new-tokens", "48", "--json")
    plain = cli(*args)
    assert plain.exit_code == 0, plain.stderr
    assert Lookup.drafted == 0
    spec = cli(*args, "--ngram", "--num-speculative-tokens", "3")
    assert spec.exit_code == 0, spec.stderr
    assert Lookup.drafted > 0  # drafts were verified, and the output is the same
    assert spec.stdout == plain.stdout


def test_generate_with_a_draft_prints_what_plain_greedy_prints(cli: Any, engine: Path) -> None:
    """The engine as its own draft (same tokenizer and limits: check_draft passes; a draft that always agrees)."""
    args = ("generate", engine, "--prompt", STORY, "--max-new-tokens", "24", "--json")
    plain = cli(*args)
    spec = cli(*args, "--draft", engine, "--num-speculative-tokens", "2")
    assert plain.exit_code == 0 and spec.exit_code == 0, (plain.stderr, spec.stderr)
    assert spec.stdout == plain.stdout


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--ngram", "--draft", "DRAFT"], "choose one proposer"),
        (["--num-speculative-tokens", "3"], "--num-speculative-tokens 3 needs a proposer"),
        (["--ngram-min", "3"], "--ngram-min sets the n-gram proposer's match length: add --ngram"),
        (["--ngram", "--ngram-min", "4", "--ngram-max", "3"], "--ngram-min 4 > --ngram-max 3"),
        (["--draft", "NOWHERE"], "no such engine directory"),
    ],
)
def test_speculation_options_refuse_in_one_line(
    cli: Any, engine: Path, tmp_path: Path, args: list[str], said: str
) -> None:
    args = [str(tmp_path / "missing") if a == "NOWHERE" else str(engine) if a == "DRAFT" else a for a in args]
    for command in (["generate", engine, "--prompt", "x"], ["serve", engine, "--port", "0"]):
        line = one_line_error(cli(*command, *args))
        assert said in line, line


def test_a_draft_that_check_draft_refuses_exits_naming_it(
    cli: Any, engine: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from toolchain.errors import UserError

    closed: list[Path] = []

    def refuse(target: Any, draft: Any) -> None:
        raise UserError(f"--draft {draft.spec.engine_dir}: another tokenizer than {target.spec.engine_dir}'s")

    def close(engine: Any) -> None:
        closed.append(engine.spec.engine_dir)

    monkeypatch.setattr("toolchain.runtime.draft.check_draft", refuse)
    monkeypatch.setattr("toolchain.engine.api.close_engine", close)
    line = one_line_error(cli("generate", engine, "--prompt", "x", "--draft", engine))
    assert f"--draft {engine}: another tokenizer" in line
    assert closed.count(engine) == 2  # the draft when refused, then the target
