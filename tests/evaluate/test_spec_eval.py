"""Speculative decoding in `trtbuild eval` and `trtbuild diff` (issue 30): the golden prompts replayed speculating
report spec_equal (token-identical to plain greedy) and vLLM's acceptance counters; the spec gates exit 3 naming
themselves; the options are refused before any work when they cannot be measured. On stories260K (a real model:
n-gram drafts are accepted at a realistic rate)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import WIKI, one_line_error

STORY_PROMPTS = [
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park.",
    "One day, a little boy named Tim went to the park with his mom. He saw a big red ball.",
    "Once upon a time, there was a big dog. The dog liked to run and jump. One day, the dog saw a cat.",
    "Lily and Ben were friends. They liked to play with their toys. One day, they found a box.",
    "Tom had a red car. He liked to drive his car in the garden. One day, his car broke.",
    "Sue wanted to bake a cake for her mom. She got some eggs and some milk.",
]


@pytest.fixture(scope="module")
def stories_run(stories: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from toolchain.checkpoint.convert import convert
    from toolchain.engine.build import BuildOptions, build_engine

    root = tmp_path_factory.mktemp("spec-eval")
    convert(stories, root / "ckpt")
    for name, tpb in (("engine", 4), ("engine2", 8)):  # two builds of one model: a diff with identical greedy output
        build_engine(
            root / "ckpt", root / name, BuildOptions(backend="onnxruntime", max_seq_len=256, tokens_per_block=tpb)
        )
    convert(stories, root / "draft-ckpt", layers=[0, 1, 2, 4])  # a stand-in draft from the target's own layers
    build_engine(
        root / "draft-ckpt", root / "draft", BuildOptions(backend="onnxruntime", max_seq_len=256, tokens_per_block=4)
    )
    golden = root / "golden.jsonl"
    golden.write_text("".join(json.dumps({"prompt": p, "max_new_tokens": 48}) + "\n" for p in STORY_PROMPTS))
    return {"engine": root / "engine", "engine2": root / "engine2", "draft": root / "draft", "golden": golden}


def eval_args(run: dict[str, Path], stories: Path, out: Path) -> list[Any]:
    return [
        "eval", run["engine"], "--reference", stories, "--data", WIKI / "test.txt", "--max-tokens", 300,
        "--golden", run["golden"], "-o", out,
    ]  # fmt: skip


@pytest.mark.slow
def test_eval_with_ngram_reports_spec_equal_and_acceptance_and_gates_them(
    cli: Any, stories: Path, stories_run: dict[str, Path], tmp_path: Path
) -> None:
    args = eval_args(stories_run, stories, tmp_path / "r")
    args += ["--ngram", "--num-speculative-tokens", 4, "--json"]
    result = cli(*args, "--gate", "spec_equal_min=1.0", "--gate", "acceptance_rate_min=0.99")
    assert result.exit_code == 3, result.stderr  # the acceptance gate: n-gram drafts on stories are not 99 % right
    assert "a gate failed" in result.stderr
    r = json.loads(result.stdout)
    sp = r["speculative"]
    assert sp["method"] == "ngram" and (sp["prompt_lookup_min"], sp["prompt_lookup_max"]) == (2, 4)
    assert sp["spec_equal"] == 1.0 and sp["prompts"] == len(STORY_PROMPTS)
    assert sp["sampled_equal"] == 1.0  # seeded sampling, with and without n-gram speculation: the same tokens
    assert all(p["equal"] and p["first_divergence"] is None for p in sp["per_prompt"])
    assert 0 < sp["accepted_tokens"] < sp["draft_tokens"] and sp["drafts"] > 0
    assert sp["acceptance_rate"] == pytest.approx(sp["accepted_tokens"] / sp["draft_tokens"])
    assert sp["mean_accepted_length"] == pytest.approx(1 + sp["accepted_tokens"] / sp["drafts"])
    assert len(sp["per_position_rate"]) == 4 and sp["per_position_rate"] == sorted(sp["per_position_rate"])[::-1]
    assert sum(p["accepted_tokens"] for p in sp["per_prompt"]) == sp["accepted_tokens"]
    assert r["gates"] == [
        {"gate": "spec_equal_min", "metric": "spec_equal", "limit": 1.0, "value": 1.0, "pass": True},
        {
            "gate": "acceptance_rate_min",
            "metric": "acceptance_rate",
            "limit": 0.99,
            "value": sp["acceptance_rate"],
            "pass": False,
        },
    ]
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert report["speculative"]["acceptance_rate"] == sp["acceptance_rate"] and not report["passed"]
    md = (tmp_path / "r" / "report.md").read_text()
    assert "## Speculative decoding" in md and "n-gram [2, 4], k 4" in md and "| acceptance_rate_min |" in md
    details = json.loads((tmp_path / "r" / "manifest.json").read_text())
    assert '"spec_equal": 1.0' in json.dumps(details)  # the stage record keeps the figures
    figures = {k: v for k, v in sp.items() if k != "per_prompt"}
    print(f"eval --ngram on stories260K, {len(STORY_PROMPTS)} prompts x 48 tokens: {json.dumps(figures)}")


@pytest.mark.slow
def test_a_draft_run_reports_acceptance_and_a_high_bar_fails_it(
    cli: Any, stories: Path, stories_run: dict[str, Path], tmp_path: Path
) -> None:
    """eval --draft with a stand-in (layers 0, 1, 2, 4 of the target): token-identical greedy output, its acceptance
    reported, and a gate above it exits 3; a draft of another block size is refused in one line before any work."""
    args = eval_args(stories_run, stories, tmp_path / "r")
    result = cli(*args, "--draft", stories_run["draft"], "--gate", "acceptance_rate_min=0.99", "--json")
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    sp = report["speculative"]
    assert sp["method"] == "draft" and sp["spec_equal"] == 1.0 and sp["sampled_equal"] is None
    assert sp["draft_tokens"] > 0 and 0 < sp["acceptance_rate"] < 0.99
    assert result.exit_code == 3 and report["gates"][0]["value"] == sp["acceptance_rate"]
    refused = cli(*eval_args(stories_run, stories, tmp_path / "r2"), "--draft", stories_run["engine2"])
    assert refused.exit_code != 0 and "tokens_per_block" in one_line_error(refused)
    assert not (tmp_path / "r2" / "report.json").exists()


def test_spec_options_are_refused_before_any_work(cli: Any, stories: Path, tmp_path: Path, make_llama: Any) -> None:
    engine = tmp_path / "no-engine"  # never opened: every refusal comes first
    base = ["eval", engine, "--reference", stories, "--data", WIKI / "test.txt", "-o", tmp_path / "r"]
    cases = {
        ("--ngram", "--draft", tmp_path): "choose one proposer",
        ("--ngram-min", 3): "add --ngram",
        ("--num-speculative-tokens", 3): "needs a proposer",
        ("--ngram", "--ngram-min", 5, "--ngram-max", 3): "--ngram-min 5 > --ngram-max 3",
    }
    for extra, message in cases.items():
        line = one_line_error(cli(*base, *extra))
        assert message in line, line
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
def test_spec_gates_need_golden_prompts_and_a_proposer(
    cli: Any, stories: Path, stories_run: dict[str, Path], tmp_path: Path
) -> None:
    base = ["eval", stories_run["engine"], "--reference", stories, "--data", WIKI / "test.txt", "-o", tmp_path / "r"]
    line = one_line_error(cli(*base, "--golden", stories_run["golden"], "--gate", "spec_equal_min=1"))
    assert "gate spec_equal_min needs speculation" in line and "--ngram or --draft" in line
    line = one_line_error(cli(*base, "--ngram"))
    assert "--golden" in line
    line = one_line_error(cli(*base, "--ngram", "--golden", stories_run["golden"], "--gate", "acceptance_rate_min=2"))
    assert "<= 1 for a fraction" in line
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
def test_diff_reports_both_sides_acceptance_and_gates_new(
    cli: Any, stories_run: dict[str, Path], tmp_path: Path
) -> None:
    args = ["diff", stories_run["engine"], stories_run["engine2"], "--golden", stories_run["golden"], "--ngram"]
    args += ["-o", tmp_path / "d", "--json", "--gate", "new_spec_equal_min=1.0"]
    result = cli(*args, "--gate", "acceptance_ratio_vs_old_min=0.5", "--gate", "new_acceptance_rate_min=0.99")
    assert result.exit_code == 3, result.stderr
    r = json.loads(result.stdout)
    new, old = r["speculative"]["new"], r["speculative"]["old"]
    assert new["spec_equal"] == old["spec_equal"] == 1.0
    assert new["acceptance_rate"] is not None and old["acceptance_rate"] is not None
    gates = {g["gate"]: g for g in r["gates"]}
    assert gates["new_spec_equal_min"]["pass"] and gates["acceptance_ratio_vs_old_min"]["pass"]
    assert gates["acceptance_ratio_vs_old_min"]["value"] == pytest.approx(
        new["acceptance_rate"] / old["acceptance_rate"]
    )
    assert not gates["new_acceptance_rate_min"]["pass"]
    assert "## Speculative decoding" in (tmp_path / "d" / "report.md").read_text()
    assert "Speculative decoding (golden prompts)</h2>" in (tmp_path / "d" / "report.html").read_text()
    line = one_line_error(cli("diff", stories_run["engine"], stories_run["engine2"], "--gate", "new_spec_equal_min=1"))
    assert "new_spec_equal_min" in line


def test_a_recipes_spec_gates_need_golden_prompts_and_a_speculative_section(tmp_path: Path) -> None:
    from toolchain.errors import UserError
    from toolchain.recipe import load_recipe

    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: {path: hf}\neval:\n  data: t.txt\n  gates: {acceptance_rate_min: 0.5}\n")
    with pytest.raises(UserError, match=r"r.yaml:4: eval.gates.acceptance_rate_min .* add eval.golden"):
        load_recipe(recipe)
    with pytest.raises(UserError, match=r"eval.gates.spec_equal_min needs a proposer .* add a speculative: section"):
        load_recipe(
            recipe, ["eval.golden=g.jsonl", "eval.gates.acceptance_rate_min=null", "eval.gates.spec_equal_min=1"]
        )


def test_a_divergence_is_reported_with_the_targets_top2_margin(monkeypatch: pytest.MonkeyPatch) -> None:
    from fakes import FakeEngine, expected_output

    from toolchain.evaluate import engine_eval
    from toolchain.evaluate.engine_eval import EngineSession, SpecOptions, spec_golden
    from toolchain.runtime.speculative import SpecConfig

    prompts = [[5, 6, 7, 5, 6], [9, 8, 9, 8]]
    plain = [expected_output(p, 6) for p in prompts]
    real = EngineSession.speculative

    def broken(self: EngineSession, *args: Any) -> Any:  # a speculative path that changes token 3 of prompt 1
        outs, per_prompt, total = real(self, *args)
        outs[1] = [*outs[1][:3], outs[1][3] + 1, *outs[1][4:]]
        return outs, per_prompt, total

    monkeypatch.setattr(engine_eval.EngineSession, "speculative", broken)
    sp = spec_golden(FakeEngine(), prompts, [6, 6], plain, SpecOptions(SpecConfig("ngram")))
    assert sp["spec_equal"] == 0.5 and sp["per_prompt"][0]["equal"]
    bad = sp["per_prompt"][1]
    assert (bad["first_divergence"], bad["plain_token"], bad["speculative_token"]) == (3, plain[1][3], plain[1][3] + 1)
    assert bad["target_top2"][0] == plain[1][3] and bad["margin"] == 1.0  # the fake's one-hot row: a clear margin


def test_the_acceptance_ratio_gate_passes_when_old_accepted_nothing() -> None:
    from toolchain.evaluate.diff import _old_accepted_nothing, check_gates

    gates = {"acceptance_ratio_vs_old_min": 0.9, "new_acceptance_rate_min": 0.2}
    metrics = {"acceptance_ratio": None, "acceptance_rate": 0.5}
    checked = check_gates(gates, metrics)  # type: ignore[arg-type]
    assert [g.passed for g in checked] == [False, True]  # no ratio: fails by itself ...
    spec = {"old": {"acceptance_rate": 0.0}, "new": {"acceptance_rate": 0.5}}
    assert [g.passed for g in _old_accepted_nothing(checked, spec)] == [True, True]  # ... unless OLD had none
    spec["old"]["acceptance_rate"] = None  # type: ignore[assignment]
    assert [g.passed for g in _old_accepted_nothing(checked, spec)] == [False, True]  # OLD not measured: still fails
