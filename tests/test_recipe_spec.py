"""A recipe's `speculative:` section (issue 30, D10): the `draft` stage builds `draft/` (a stand-in of the model's
layers, quantized when asked, with the target's limits), its cache key is its own settings and sources, so
re-quantizing only the draft re-runs the draft and eval alone; refusals name the key."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from toolchain.engine.api import open_engine
from toolchain.errors import UserError
from toolchain.pipeline import _stage_keys
from toolchain.recipe import load_recipe
from toolchain.runtime.draft import check_draft

DATA = Path(__file__).resolve().parents[1] / "recipes" / "data"
BUILD = (
    "build:\n  backend: onnxruntime\n  max_batch_size: 4\n  max_num_tokens: 64\n  max_seq_len: 128\n"
    "  tokens_per_block: 4\n"
)


def recipe(tmp_path: Path, model: Path, speculative: str, eval_: bool = False, name: str = "r.yaml") -> Path:
    text = f"model:\n  path: {model}\n  dtype: float32\n{BUILD}speculative:\n{speculative}"
    if eval_:
        text += f"eval:\n  data: {DATA / 'demo.txt'}\n  golden: {DATA / 'demo-golden.jsonl'}\n"
    path = tmp_path / name
    path.write_text(text)
    return path


DRAFT = "  method: draft\n  draft:\n    layers: [0, 1, 2, 4]\n"


def test_only_the_draft_and_eval_keys_follow_the_drafts_settings(stories: Path, tmp_path: Path) -> None:
    base = _stage_keys(load_recipe(recipe(tmp_path, stories, DRAFT, eval_=True)).recipe)
    assert list(base) == ["convert", "build", "draft", "eval"]

    def changed(speculative: str) -> set[str]:
        keys = _stage_keys(load_recipe(recipe(tmp_path, stories, speculative, eval_=True, name="s.yaml")).recipe)
        return {k for k in keys.keys() | base.keys() if keys.get(k) != base.get(k)}

    assert changed(DRAFT + "    quantize:\n      method: w8a16\n") == {"draft", "eval"}
    assert changed("  method: draft\n  draft:\n    layers: [0, 1, 2]\n") == {"draft", "eval"}
    assert changed(DRAFT + "    build:\n      max_batch_size: 8\n") == {"draft", "eval"}
    assert changed(DRAFT + "  num_speculative_tokens: 2\n") == {"eval"}
    assert changed("  method: ngram\n") == {"draft", "eval"}  # no draft stage at all
    assert "draft" not in _stage_keys(load_recipe(recipe(tmp_path, stories, "  method: ngram\n")).recipe)


def test_the_draft_stage_builds_a_draft_the_target_accepts(cli: Any, stories: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = cli("run", recipe(tmp_path, stories, DRAFT), "-o", out, "--json")
    assert done.exit_code == 0, done.stderr
    assert json.loads(done.stdout)["rerun"] == ["convert", "build", "draft"]
    target, draft = open_engine(out / "engine"), open_engine(out / "draft")
    assert draft.spec.num_layers == 4 and draft.spec.limits == target.spec.limits  # the target's limits
    check_draft(target, draft)
    details = json.loads((out / "draft" / "manifest.json").read_text())["details"]
    assert details["draft"]["layers"] == [0, 1, 2, 4] and details["draft"]["quantize"] is None
    inputs = json.loads((out / "draft" / "manifest.json").read_text())["inputs"]
    assert {"config.json", "model.safetensors"} <= {e["path"] for e in inputs if e["root"] == str(stories)}
    assert not any(p.name.startswith(".draft-") for p in out.iterdir())  # the scratch checkpoints are gone
    assert cli("verify", out).exit_code == 0

    # only the draft's quantization changes: the draft alone runs again
    done = cli("run", recipe(tmp_path, stories, DRAFT + "    quantize:\n      method: w8a16\n"), "-o", out, "--json")
    assert done.exit_code == 0, done.stderr
    assert json.loads(done.stdout)["rerun"] == ["draft"]
    assert open_engine(out / "draft").spec.quant_algo == "W8A16"
    assert open_engine(out / "engine").spec.quant_algo == "none"


def test_a_bad_layer_selection_names_the_recipe_key(cli: Any, stories: Path, tmp_path: Path) -> None:
    done = cli(
        "run", recipe(tmp_path, stories, "  method: draft\n  draft:\n    layers: [0, 7]\n"), "-o", tmp_path / "o"
    )
    assert done.exit_code == 1
    assert "speculative.draft: --layers 0,7: layer 7 does not exist" in done.stderr, done.stderr
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "speculative, words",
    [
        ("  method: ngram\n  draft:\n    layers: [0]\n", ["speculative", "belongs to method draft"]),
        ("  method: ngram\n  prompt_lookup_min: 5\n", ["prompt_lookup_min 5 > prompt_lookup_max 4"]),
        ("  method: beam\n", ["speculative.method", "'draft' or 'ngram'"]),
        ("  method: draft\n  draft:\n    build:\n      tokens_per_block: 8\n", ["draft.build.tokens_per_block 8"]),
    ],
)
def test_refusals_name_the_key(stories: Path, tmp_path: Path, speculative: str, words: list[str]) -> None:
    with pytest.raises(UserError) as e:
        _stage_keys(load_recipe(recipe(tmp_path, stories, speculative)).recipe)
    for w in words:
        assert w in str(e.value), str(e.value)
