"""Everything downstream of a mixture-of-experts engine, unchanged (issue 26): the CI recipe recipes/tiny-moe.yaml
runs convert -> build -> eval with its gates on the tiny Qwen3-MoE (`trtbuild tiny-model --moe`); eval, diff of two
MoE builds, generate (equal to transformers' greedy generation), bench with a trace, serve answering the official
openai client, inspect and verify; `--backend auto` never picks TensorRT for a MoE graph; the registry refuses the
MoE families that need more than we have (DeepSeek-V3, Llama 4, Qwen3-Next) in one line each."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import convert_fails, edit_config, one_line_error

from toolchain.checkpoint.tiny import MOE_CONFIG, make_tiny_moe
from toolchain.engine import backends
from toolchain.manifest import StageRecord
from toolchain.recipe import load_recipe

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "tiny-moe.yaml"
DEMO_TEXT = REPO / "recipes" / "data" / "demo.txt"
PROMPT = "The build farm"


def _serve_helpers() -> Any:
    """tests/serve/test_serve.py's in-process server (`running`) and request helpers, loaded by path: pytest's
    prepend import mode puts each test folder on sys.path under no package name, so no import statement finds it
    both alone and in a full run."""
    spec = importlib.util.spec_from_file_location("moe_serve_helpers", REPO / "tests" / "serve" / "test_serve.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The CI recipe run as written (but for the model's path) and once more with another batch limit: two MoE
    builds of one model."""
    from typer.testing import CliRunner

    from toolchain.cli import app

    root = tmp_path_factory.mktemp("moe")
    made = make_tiny_moe(root / "tiny-moe")
    runner = CliRunner()
    results = {}
    for name, extra in (("a", []), ("b", ["--set", "build.max_batch_size=4"])):
        args = ["run", str(RECIPE), "-o", str(root / name), "--set", f"model.path={root / 'tiny-moe'}", *extra]
        results[name] = runner.invoke(app, [*args, "--json"])
    return {"root": root, "hf": root / "tiny-moe", "made": made, **results}


def test_tiny_moe_is_a_qwen3_moe_with_a_dense_layer(runs: dict[str, Any]) -> None:
    config = json.loads((runs["hf"] / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["mlp_only_layers"] == [1]
    assert config.get("num_experts", config.get("num_local_experts")) == MOE_CONFIG["num_experts"] == 8
    assert (runs["hf"] / "tokenizer.json").is_file() and runs["made"]["num_parameters"] > 0


def test_ci_recipe_converts_builds_and_passes_its_gates(runs: dict[str, Any]) -> None:
    result = runs["a"]
    assert result.exit_code == 0, result.stderr
    out = runs["root"] / "a"
    build = json.loads((out / "engine" / "build_config.json").read_text())
    assert build["backend"] == "onnxruntime" and build["architecture"] == "Qwen3MoeForCausalLM"
    report = json.loads((out / "report" / "report.json").read_text())
    assert report["passed"] is True
    assert {g["gate"] for g in report["gates"]} == {"kld_mean_max", "top1_min", "golden_exact_min"}
    assert all(g["pass"] for g in report["gates"]) and report["golden_exact"] == 1.0
    graph = (out / "engine" / "model.onnx").read_bytes()
    assert b"MoE" in graph  # the sparse layers ran as the plugin op, not a dense stand-in


def test_eval_cli_on_the_moe_engine(cli: Any, runs: dict[str, Any], tmp_path: Path) -> None:
    engine = runs["root"] / "a" / "engine"
    args = ["eval", engine, "--reference", runs["hf"], "--data", DEMO_TEXT, "-o", tmp_path / "r", "--json"]
    result = cli(*args, "--gate", "top1_min=0.999")
    assert result.exit_code == 0, result.stderr
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert report["passed"] is True
    assert {"report.json", "report.md", "report.html"} <= {p.name for p in (tmp_path / "r").iterdir()}


def test_diff_of_two_moe_builds_names_the_limit_and_nothing_else(cli: Any, runs: dict[str, Any]) -> None:
    assert runs["b"].exit_code == 0, runs["b"].stderr
    result = cli("diff", runs["root"] / "a", runs["root"] / "b", "--changes-only", "--json")
    assert result.exit_code == 0, result.stderr
    r = json.loads(result.stdout)
    rows = {(row["section"], row["key"]): (row["old"], row["new"]) for row in r["changes"] if row["changed"]}
    assert rows[("recipe", "build.max_batch_size")] == (8, 4)
    assert not r["same_build"]
    assert not [key for key in rows if key[0] in ("weights", "quantization", "versions")], rows


def test_generate_equals_transformers_greedy(cli: Any, runs: dict[str, Any]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    engine = runs["root"] / "a" / "engine"
    result = cli("generate", engine, "--prompt", PROMPT, "--max-new-tokens", "12", "--json")
    assert result.exit_code == 0, result.stderr
    out = json.loads(result.stdout)
    tok = AutoTokenizer.from_pretrained(runs["hf"])
    model = AutoModelForCausalLM.from_pretrained(runs["hf"], dtype=torch.float32)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert out["tokens"] == expected[0, ids.shape[1] :].tolist() and out["finish_reason"] == "length"


def test_bench_replays_a_trace_on_the_moe_engine(cli: Any, runs: dict[str, Any], tmp_path: Path) -> None:
    trace = tmp_path / "trace.csv"
    trace.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        + "".join(f"2023-11-16 18:15:{46 + i // 4:02d}.{i % 10}000000,{30 + 7 * i},{4 + i}\n" for i in range(6))
    )
    result = cli("bench", runs["root"] / "a" / "engine", "--trace", trace, "--rate-scale", "50", "--json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["requests"] == report["completed"] == 6 and report["failed"] == 0 and report["output_tokens"] > 0


def test_serve_answers_the_openai_client_from_the_moe_engine(cli: Any, runs: dict[str, Any]) -> None:
    serve = _serve_helpers()
    engine = runs["root"] / "a" / "engine"
    alone = json.loads(cli("generate", engine, "--prompt", PROMPT, "--max-new-tokens", "10", "--json").stdout)
    with serve.running(engine) as server:
        client = server.client()
        done = client.completions.create(prompt=PROMPT, **serve.greedy(10))
        assert done.choices[0].text == alone["text"] and done.usage is not None
        assert done.usage.completion_tokens == 10
        chat = client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], **serve.greedy(5))
        assert chat.choices[0].message.content and chat.choices[0].finish_reason == "length"


def test_inspect_and_verify_the_moe_run(cli: Any, runs: dict[str, Any]) -> None:
    out = runs["root"] / "a"
    info = cli("inspect", out, "--json")
    assert info.exit_code == 0, info.stderr
    stages = json.loads(info.stdout)["stages"]
    assert stages["checkpoint"]["architecture"] == "Qwen3MoeForCausalLM"
    assert stages["checkpoint"]["experts"] == "top-2 of 8 (softmax_topk_renormalise), 64 wide, in 3 of 4 layers"
    assert "MoE: its reference op on the CPU engine" in stages["engine"]["engine"]["plugins"]
    text = cli("inspect", out).stdout
    assert "experts       top-2 of 8" in text and "MoE:" in text
    for directory in (out, out / "checkpoint", out / "engine", out / "report"):
        assert cli("verify", directory).exit_code == 0, directory
    (out / "engine" / "build_config.json").write_text("{}")
    assert cli("verify", out / "engine").exit_code == 1


# -- the backend choice -------------------------------------------------------------------------------------------
@pytest.fixture
def tensorrt_here(monkeypatch: pytest.MonkeyPatch) -> backends.Backend:
    """TensorRT as if it and a GPU were present (it is only stubs here)."""
    present = dataclasses.replace(backends.TENSORRT, unavailable=lambda: None)
    monkeypatch.setattr(backends, "AUTO_ORDER", (present, backends.ONNXRUNTIME))
    monkeypatch.setitem(backends.BACKENDS, "tensorrt", present)
    return present


def test_auto_and_tensorrt_take_moe_where_tensorrt_can_build(tensorrt_here: backends.Backend) -> None:
    """The MoE op runs on TensorRT as split plugins (engine/moe_split.py): auto and --backend tensorrt choose it
    for an MoE model as for a dense one, with no warning; where TensorRT cannot build, auto falls back as before."""
    record = StageRecord("build")
    assert backends.choose("auto", record, experts=0) is tensorrt_here and not record.warnings  # dense: unchanged
    assert backends.choose("auto", record, experts=3) is tensorrt_here and not record.warnings
    assert backends.choose("tensorrt", record, experts=3) is tensorrt_here
    assert backends.TENSORRT.experts_why_not is None


# -- what is refused meanwhile ------------------------------------------------------------------------------------
NEXT = {
    "DeepseekV3ForCausalLM": "multi-head latent attention",
    "Llama4ForCausalLM": "chunked attention",
    "Llama4ForConditionalGeneration": "chunked attention",
    "Qwen3NextForCausalLM": "gated DeltaNet",
}


def with_architecture(hf: Path, arch: str, out: Path) -> Path:
    shutil.copytree(hf, out)
    edit_config(out, architectures=[arch])
    return out


@pytest.mark.parametrize("arch", sorted(NEXT))
def test_next_families_are_refused_in_one_line_naming_what_is_missing(
    arch: str, cli: Any, runs: dict[str, Any], tmp_path: Path
) -> None:
    src = with_architecture(runs["hf"], arch, tmp_path / "hf")
    line = convert_fails(cli, src, tmp_path / "out")
    assert arch in line and NEXT[arch] in line and "docs/conversion.md" in line
    assert "supported:" in line and "Qwen3MoeForCausalLM" in line


def test_unknown_architecture_message_is_unchanged(cli: Any, runs: dict[str, Any], tmp_path: Path) -> None:
    src = with_architecture(runs["hf"], "MadeUpForCausalLM", tmp_path / "hf")
    line = one_line_error(cli("convert", src, "-o", tmp_path / "out"))
    assert "'MadeUpForCausalLM' is not supported; supported:" in line and "docs/conversion.md" not in line


# -- memory, at a small scale (bench/convert.py --moe measures the ~1 GB model) -------------------------------------
_MEASURE = """
import resource, subprocess, sys
subprocess.run(sys.argv[1:], check=True, capture_output=True)
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
"""


def _moe_model(path: Path, layers: int) -> int:
    sys.path.insert(0, str(REPO / "bench"))
    from convert import write_model  # bench/convert.py: streams a random sharded checkpoint to disk

    fields = {"hidden": 512, "intermediate": 1024, "vocab": 4000, "heads": 8, "kv_heads": 2, "shards": 3}
    moe = {"moe": True, "experts": 16, "top_k": 2, "moe_intermediate": 256}
    return int(write_model(path, argparse.Namespace(layers=layers, **fields, **moe)))


def _peak_rss_of_convert(src: Path, out: Path) -> int:
    """From a fresh parent: RUSAGE_CHILDREN is a max over every child a process ever waited for."""
    trtbuild = str(Path(sys.executable).with_name("trtbuild"))
    cmd = [sys.executable, "-c", _MEASURE, trtbuild, "convert", str(src), "-o", str(out)]
    return int(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)


@pytest.mark.slow
def test_moe_convert_memory_grows_with_a_layer_not_the_model(tmp_path: Path) -> None:
    small, big = _moe_model(tmp_path / "small", layers=1), _moe_model(tmp_path / "big", layers=10)  # 21 / 140 MiB
    growth = max(
        _peak_rss_of_convert(tmp_path / "big", tmp_path / "o2")
        - _peak_rss_of_convert(tmp_path / "small", tmp_path / "o1"),
        0,
    )
    # holding the experts would add the 119 MiB between the two; streaming holds one layer's stacked fc at a time
    # (16 x 512 x 512 x 2 B = 8 MiB) whatever the layer count (measured once: 12 MiB grown)
    assert growth < 0.25 * (big - small), (growth, big - small)


# -- the recipes --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["tiny-moe.yaml", "qwen3-30b-a3b-gpu.yaml", "gpt-oss-20b-gpu.yaml"])
def test_moe_recipes_validate(name: str) -> None:
    """Through the pydantic model the recipe's JSON Schema is generated from (`trtbuild recipe schema`); the GPU
    recipes are not run here (no such model, no GPU; see their comments)."""
    loaded = load_recipe(REPO / "recipes" / name)
    assert loaded.recipe.build is not None and loaded.recipe.eval is not None
    assert loaded.recipe.quantize is None  # float recipes; their comments say how to quantize the experts
    assert loaded.recipe.build.backend == ("auto" if name == "tiny-moe.yaml" else "tensorrt")


def test_tiny_model_cli_makes_the_moe(cli: Any, tmp_path: Path) -> None:
    result = cli("tiny-model", tmp_path / "m", "--moe", "--seed", "1")
    assert result.exit_code == 0, result.stderr
    assert "tiny Qwen3-MoE" in result.stdout and "seed 1" in result.stdout
    assert json.loads((tmp_path / "m" / "config.json").read_text())["architectures"] == ["Qwen3MoeForCausalLM"]
