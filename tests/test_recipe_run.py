"""Recipes: validation with key paths and lines, overrides, path resolution, and `trtbuild run` outputs."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import deadline, not_a_file, nothing_written, one_line_error
from safetensors.torch import load_file

from toolchain.errors import UserError
from toolchain.files import RECIPE_LIMIT
from toolchain.recipe import RecipeLoader, load_recipe


def write_recipe(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_run_converts_with_relative_paths_and_records_recipe(cli: Any, make_llama: Any, tmp_path: Path) -> None:
    hf = make_llama()
    recipe = write_recipe(tmp_path / "recipes" / "r.yaml", f"model:\n  path: ../{hf.name}\noutput: ../out\n")
    result = cli("run", recipe, "--json")
    assert result.exit_code == 0, result.stderr
    out = tmp_path / "out"
    summary = json.loads(result.stdout)
    assert summary["output_dir"] == str(out)
    resolved = yaml.safe_load((out / "recipe.yaml").read_text())
    assert resolved["model"]["path"] == str(hf)
    # the sha256 is of the recipe with its paths as written, relative to the recipe file: not of where it lives
    written = {**resolved, "model": {**resolved["model"], "path": f"../{hf.name}"}, "output": "../out"}
    sha = hashlib.sha256(json.dumps(written, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    for manifest_path in (out / "manifest.json", out / "checkpoint" / "manifest.json"):
        manifest = json.loads(manifest_path.read_text())
        assert manifest["recipe"] == resolved and manifest["recipe_sha256"] == sha == summary["recipe_sha256"]
    assert (out / "checkpoint" / "rank0.safetensors").is_file()
    assert cli("verify", out).exit_code == 0


def test_set_overrides_and_cli_output_wins(cli: Any, make_llama: Any, tmp_path: Path) -> None:
    hf = make_llama()
    recipe = write_recipe(tmp_path / "r.yaml", f"model:\n  path: {hf}\n  dtype: float32\noutput: never\n")
    result = cli("run", recipe, "-o", tmp_path / "o", "--set", "model.dtype=bfloat16", "--set", "name=x")
    assert result.exit_code == 0, result.stderr
    weights = load_file(str(tmp_path / "o" / "checkpoint" / "rank0.safetensors"))
    assert {str(t.dtype) for t in weights.values()} == {"torch.bfloat16"}
    assert yaml.safe_load((tmp_path / "o" / "recipe.yaml").read_text())["name"] == "x"
    assert not (tmp_path / "never").exists()


def test_yaml_syntax_error_names_line(cli: Any, tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path / "r.yaml", "model:\n  path: x\n   dtype: [\n")
    line = one_line_error(cli("run", recipe, "-o", tmp_path / "o"))
    assert f"{recipe}:3:" in line and "YAML syntax error" in line


def test_unknown_key_names_path_line_and_allowed(cli: Any, tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path / "r.yaml", "model:\n  path: x\n  dtpye: float16\n")
    line = one_line_error(cli("run", recipe, "-o", tmp_path / "o"))
    assert f"{recipe}:3" in line and "'model.dtpye'" in line and "path, dtype, allow_pickle" in line


def test_wrong_type_names_key_and_value(cli: Any, tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path / "r.yaml", "seed: 1\nmodel:\n  path: x\n  dtype: float64\n")
    line = one_line_error(cli("run", recipe, "-o", tmp_path / "o"))
    assert f"{recipe}:4" in line and "model.dtype" in line and "'float64'" in line


def test_bad_override_is_attributed_to_set(cli: Any, tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path / "r.yaml", "model:\n  path: x\n")
    line = one_line_error(cli("run", recipe, "-o", tmp_path / "o", "--set", "model.colour=red"))
    assert "--set model.colour" in line
    line = one_line_error(cli("run", recipe, "--set", "novalue"))
    assert "dotted.key=value" in line


def test_missing_recipe_and_missing_output(cli: Any, tmp_path: Path, make_llama: Any) -> None:
    line = one_line_error(cli("run", tmp_path / "absent.yaml", "-o", tmp_path / "o"))
    assert "absent.yaml does not exist" in line
    recipe = write_recipe(tmp_path / "r.yaml", f"model:\n  path: {make_llama()}\n")
    assert "-o OUT_DIR" in one_line_error(cli("run", recipe))


def test_eval_without_build_is_refused(cli: Any, tmp_path: Path, make_llama: Any) -> None:
    recipe = write_recipe(tmp_path / "r.yaml", f"model:\n  path: {make_llama()}\neval:\n  data: t.txt\n")
    line = one_line_error(cli("run", recipe, "-o", tmp_path / "o"))
    assert "'build:'" in line
    assert not (tmp_path / "o").exists()


def test_schema_is_json_schema_of_the_recipe(cli: Any) -> None:
    result = cli("recipe", "schema")
    assert result.exit_code == 0
    schema = json.loads(result.stdout)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["$id"] == "urn:trtbuild:recipe:v1"
    assert schema["additionalProperties"] is False
    assert {"model", "quantize", "build", "eval"} <= set(schema["properties"])
    assert "model" in schema["required"]
    refs = set(re.findall(r'"\$ref": "#/\$defs/(\w+)"', result.stdout))  # draft 2020-12 keeps them in $defs
    assert refs and refs <= set(schema["$defs"])


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1e-9", 1e-9),
        ("1e-2", 0.01),
        ("5e3", 5000.0),
        ("-1E-4", -1e-4),
        ("+2.5e+1", 25.0),
        ("-.5", -0.5),
        ("0.5", 0.5),
        ("1_000.5", 1000.5),
        (".inf", float("inf")),
        ("3", 3),
        ("0x10", 16),
        ('"1e-9"', "1e-9"),
        ("'5e3'", "5e3"),
        ("1e", "1e"),
        ("e5", "e5"),
        ("1.2.3", "1.2.3"),
    ],
)
def test_yaml_numbers_follow_yaml_1_2(text: str, value: object) -> None:
    loaded = yaml.load(f"x: {text}", Loader=RecipeLoader)["x"]
    assert loaded == value and type(loaded) is type(value)


def test_exponent_floats_in_files_and_set_and_quoted_strings(tmp_path: Path) -> None:
    text = "name: \"1e-9\"\ndescription: '5e3'\nmodel:\n  path: m\nquantize:\n  method: w8a8_sq\n  sq_alpha: 5e-1\n"
    text += "build:\neval:\n  data: d.txt\n  gates:\n    kld_mean_max: 1e-2\n    top1_min: 9.5E-1\n"
    recipe = write_recipe(tmp_path / "r.yaml", text)
    loaded = load_recipe(recipe).recipe
    assert loaded.name == "1e-9" and loaded.description == "5e3"  # quoted: strings, as written
    assert loaded.quantize is not None and loaded.quantize.sq_alpha == 0.5
    assert loaded.eval is not None and loaded.eval.gates.kld_mean_max == 0.01 and loaded.eval.gates.top1_min == 0.95
    overridden = load_recipe(recipe, ["eval.gates.kld_mean_max=1e-9", "name='5e3'", "eval.gates.ppl_ratio_max=5e0"])
    gates = overridden.recipe.eval.gates if overridden.recipe.eval else None
    assert gates is not None and gates.kld_mean_max == 1e-9 and gates.ppl_ratio_max == 5.0
    assert overridden.recipe.name == "5e3"
    with pytest.raises(UserError, match=r"--set eval.gates.kld_mean_max: .*greater than or equal to 0.*-0.0001"):
        load_recipe(recipe, ["eval.gates.kld_mean_max=-1E-4"])


RECIPES = sorted((Path(__file__).resolve().parents[1] / "recipes").glob("*.yaml"))


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_shipped_recipes_validate(path: Path) -> None:
    loaded = load_recipe(path)
    assert loaded.recipe.name and loaded.recipe.output is not None
    if loaded.recipe.eval is not None:
        assert loaded.recipe.build is not None


def test_recipe_convert_section_splits_the_checkpoint(cli: Any, make_llama: Any, tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path / "r.yaml", f"model:\n  path: {make_llama()}\nconvert:\n  tp: 2\n  pp: 2\n")
    assert cli("run", recipe, "-o", tmp_path / "o").exit_code == 0
    assert len(list((tmp_path / "o" / "checkpoint").glob("rank*.safetensors"))) == 4
    line = one_line_error(cli("run", recipe, "-o", tmp_path / "o2", "--set", "convert.tp=0"))
    assert "--set convert.tp" in line and "greater than or equal to 1" in line


def test_empty_convert_section_means_defaults(cli: Any, make_llama: Any, tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path / "r.yaml", f"model:\n  path: {make_llama()}\nconvert:\n  # tp: 2\n")
    assert cli("run", recipe, "-o", tmp_path / "o").exit_code == 0


def test_recipe_quantize_stage(cli: Any, stories: Path, tmp_path: Path) -> None:
    wiki = stories.parents[1] / "wikitext-2"
    (tmp_path / "data").symlink_to(wiki)  # relative calibration path, resolved against the recipe
    text = f"seed: 3\nmodel:\n  path: {stories}\nquantize:\n  method: fp8\n  kv_cache: int8\n"
    text += "  calib_data: data/valid.txt\n  calib_samples: 4\n  calib_seq_len: 64\n"
    text += "  eval_data: data/test.txt\n  eval_tokens: 1024\n"
    recipe = write_recipe(tmp_path / "r.yaml", text)
    result = cli("run", recipe, "-o", tmp_path / "o", "--json")
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert list(summary["stages"]) == ["convert", "quantize"]
    assert summary["stages"]["quantize"]["quant_algo"] == "FP8"
    assert summary["stages"]["quantize"]["calibration"]["seed"] == 3
    assert summary["stages"]["quantize"]["quality"]["tokens"] > 0
    manifest = json.loads((tmp_path / "o" / "quantized" / "manifest.json").read_text())
    assert manifest["stage"] == "quantize" and manifest["details"]["quant_algo"] == "FP8"
    assert cli("verify", tmp_path / "o").exit_code == 0
    line = one_line_error(cli("run", recipe, "-o", tmp_path / "o2", "--set", "quantize.method=int3"))
    assert "--set quantize.method" in line


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


def test_recipe_edge_cases(cli: Any, make_llama: Any, tmp_path: Path) -> None:
    hf = make_llama()
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model:\n  path: {hf}\n")
    assert "--set model.nope.deep" in one_line_error(
        cli("run", recipe, "-o", tmp_path / "o", "--set", "model.nope.deep=1")
    )
    assert "--set model.path.x" in one_line_error(cli("run", recipe, "-o", tmp_path / "o", "--set", "model.path.x=1"))
    assert "'build:'" in one_line_error(cli("run", recipe, "-o", tmp_path / "o", "--set", "eval.data=t.txt"))
    for bad in ("seed: '7'", "seed: 7.0", "model:\n  path: x\n  allow_pickle: 'yes'"):
        recipe.write_text(f"{bad}\n" if bad.startswith("model") else f"model:\n  path: {hf}\n{bad}\n")
        one_line_error(cli("run", recipe, "-o", tmp_path / "o"))
    recipe.write_bytes(b"model:\n  path: \xff\n")
    assert "not UTF-8" in one_line_error(cli("run", recipe, "-o", tmp_path / "o"))
    nothing_written(tmp_path / "o")
