"""The quality report and the summaries around it: golden continuations shown with their token ids and every byte
accounted for (no silent U+FFFD), what was built in the report's header and report.json, plots from 0 %, the
golden exact-match rate beside the gates in `run` and `eval`, and `inspect RUN_DIR` showing the verdict."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
from conftest import reseal

from toolchain.checkpoint.tiny import byte_level_tokenizer
from toolchain.evaluate.golden import TokenBytes, readable
from toolchain.evaluate.report import markdown, page, write_reports
from toolchain.quality import QualityReport

ROOT = Path(__file__).resolve().parents[2]
DEMO_TEXT = ROOT / "recipes" / "data" / "demo.txt"
DEMO_GOLDEN = ROOT / "recipes" / "data" / "demo-golden.jsonl"


# ---- rendering bytes and tokens ---------------------------------------------------------------------------------


def test_readable_escapes_invalid_utf8_and_keeps_valid_text() -> None:
    assert readable(b"\xe2\x96") == "\\xe2\\x96"  # a character cut short: its bytes, not U+FFFD
    assert readable("▁é€ ok".encode()) == "▁é€ ok"
    assert readable(b"a\xe2\x96\x81b\xff") == "a▁b\\xff"
    assert readable(b"line\nnext\ttab\\") == "line\\nnext\\ttab\\\\"  # a lone backslash always starts an escape
    assert readable(b"\x18\x7f") == "\\x18\\x7f" and readable("\u0085".encode()) == "\\u0085"
    assert readable("\ufffd".encode()) == "\ufffd"  # a real U+FFFD in the output is still shown as one
    for data in (bytes(range(256)), b"\xc3", b"\xf0\x9f\x98", b"\xed\xa0\x80"):
        assert "\ufffd" not in readable(data)


def test_byte_level_tokens_render_joined_and_escaped() -> None:
    tok = byte_level_tokenizer()
    tb = TokenBytes(tok)
    ids = tok("é€", add_special_tokens=False)["input_ids"]
    assert len(ids) == 5  # one token per byte
    assert tb.render(ids) == tok.decode(ids) == "é€"  # a character split across tokens is joined first
    assert "\ufffd" in tok.decode(ids[:4]) and tb.render(ids[:4]) == "é\\xe2\\x82"
    assert [tb.render([t]) for t in ids] == ["\\xc3", "\\xa9", "\\xe2", "\\x82", "\\xac"]
    assert tb.render([1, *ids[:2], 2]) == "<s>é</s>"  # special tokens as their text
    assert tb.render([ids[0], 300, ids[1]]) == "\\xc3\\[id 300]\\xa9"  # an id with no token in the vocabulary


def _byte_fallback_tokenizer() -> Any:
    """A SentencePiece-style BPE with byte fallback, as Llama 2 / Mistral tokenizers are."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "▁", "a", "b", "▁a", "▁ab"]
    vocab = {p: k for k, p in enumerate(pieces)}
    model = models.BPE(vocab=vocab, merges=[("▁", "a"), ("▁a", "b")], unk_token="<unk>", byte_fallback=True)
    tok = Tokenizer(model)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_byte_fallback_tokens_render_their_bytes() -> None:
    tok = _byte_fallback_tokenizer()
    tb = TokenBytes(tok)
    ids = tok("ab €", add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == ["▁ab", "▁", "<0xE2>", "<0x82>", "<0xAC>"]
    assert tok.decode(ids) == "ab €" and tb.render(ids) == " ab €"  # the continuation's leading space is kept
    assert "\ufffd" in tok.decode(ids[:-1]) and tb.render(ids[:-1]) == " ab \\xe2\\x82"


def test_byte_fallback_on_the_shared_stories_tokenizer(stories: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(stories)
    tb = TokenBytes(tok)
    ids = tok("Once upon a time, ☃ sang", add_special_tokens=False)["input_ids"]
    assert tb.render(ids) == " " + tok.decode(ids)
    cut = next(k for k in range(len(ids)) if "\ufffd" in tok.decode(ids[:k]))
    assert "\ufffd" not in tb.render(ids[:cut]) and "\\xe2" in tb.render(ids[:cut])


# ---- the report from a result -------------------------------------------------------------------------------------


def _result(golden: list[dict[str, Any]], top1: list[float]) -> dict[str, Any]:
    quality = QualityReport(100, 2, 10.0, 10.1, 1.01, 1e-3, 1e-3, 2e-3, 3e-3, 4e-3, 0.97, 0.0, 1e-3).to_dict()
    tb = TokenBytes(byte_level_tokenizer())
    entries = [
        {
            "prompt": prompt,
            "prompt_ids": [1],
            "tokens": len(want),
            "exact": got == want,
            "first_divergence": next((k for k, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None),
            "engine": tb.render(got),
            "reference": tb.render(want),
            "engine_ids": got,
            "reference_ids": want,
            "engine_tokens": [tb.render([t]) for t in got],
            "reference_tokens": [tb.render([t]) for t in want],
        }
        for prompt, got, want in golden
    ]
    built = {
        "method": "W4A16_AWQ",
        "group_size": 64,
        "kv_cache": "fp8",
        "dtype": "float16",
        "backend": "tensorrt",
        "engine_manifest_sha256": "ab" * 32,
        "trtbuild_version": "9.9.9",
        "git_commit": "0123456789abcdef0123",
        "git_dirty": False,
        "tensorrt": "10.13.0",
        "gpu": "NVIDIA H200",
        "sm": "90",
        "onnxruntime": None,
    }
    return {
        "engine_dir": "/e",
        "reference": "/hf",
        "data": "/d.txt",
        "window": 64,
        "quality": quality,
        "golden_exact": sum(g["exact"] for g in entries) / len(entries) if entries else None,
        "golden_prompts": len(entries),
        "golden": entries,
        "gates": [{"gate": "top1_min", "metric": "same_top1", "limit": 0.9, "value": 0.97, "pass": True}],
        "passed": True,
        "kld_histogram": {"edges": [1e-6, 1e-4, 1e-2], "counts": [3.0, 1.0]},
        "top1_by_position": top1,
        "built": built,
        "evaluated_with": {
            "backend": "onnxruntime",
            "trtbuild_version": "9.9.9",
            "git_commit": None,
            "git_dirty": None,
            "tensorrt": None,
            "gpu": None,
        },
    }


def _ids(tok: Any, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def test_report_shows_diverging_continuations_with_ids_and_escaped_bytes(tmp_path: Path) -> None:
    tok = byte_level_tokenizer()
    same = _ids(tok, "ok")
    cut = _ids(tok, "ab€")[:-1]  # "ab" + the first two bytes of "€": not valid UTF-8
    ref = _ids(tok, "ab`|")  # as long as the engine's: both ran for the same max_new_tokens
    result = _result([("fine", same, same), ("a|b `x`\n", cut, ref)], [1.0, 0.5])
    write_reports(result, tmp_path)
    md, html = (tmp_path / "report.md").read_text(), (tmp_path / "report.html").read_text()
    assert "\ufffd" not in md and "\ufffd" not in html
    assert "## Golden prompts that diverged" in md and "`fine`" not in md  # only the diverging prompt is listed
    k = 2
    assert f"first divergence at token {k} of {len(ref)}, engine {cut[k]} `\\xe2` vs reference {ref[k]} `` ` ``" in md
    assert "- prompt ``a|b `x`\\n``:" in md  # backticks fenced, the newline escaped
    assert "  - engine: `ab\\xe2\\x82`" in md and "  - reference: ``ab`|``" in md
    assert f"  - engine ids: {cut[0]} {cut[1]} **{cut[2]}** {cut[3]}" in md
    assert f"  - reference ids: {ref[0]} {ref[1]} **{ref[2]}** {ref[3]}" in md
    assert "ab\\xe2\\x82" in html and f"<mark title='\\xe2'>{cut[2]}</mark>" in html
    assert f"token {k} of {len(ref)}: {cut[k]} vs {ref[k]}" in html
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["golden"][1]["engine_ids"] == cut and saved["golden"][1]["engine"] == "ab\\xe2\\x82"


def test_report_header_says_what_was_built(tmp_path: Path) -> None:
    result = _result([], [1.0])
    md, html = markdown(result), page(result)
    header = html.split("<h2>")[0]  # before the first section: the page's header
    for text in (
        "W4A16_AWQ, group size 64",
        "fp8",
        "tensorrt (TensorRT 10.13.0, NVIDIA H200, SM 90)",
        "ab" * 32,
        "9.9.9, commit 0123456789ab",
        "onnxruntime backend, GPU none",
    ):
        assert text in header and text in md, text
    assert md.index("| method | W4A16_AWQ, group size 64 |") < md.index("| metric | value |")
    unquantized = {**result["built"], "method": None, "group_size": None, "backend": "onnxruntime"}
    unquantized.update(tensorrt=None, gpu=None, sm=None, onnxruntime="1.22.0")
    md = markdown({**result, "built": unquantized})
    assert "| method | unquantized |" in md and "| backend | onnxruntime (onnxruntime 1.22.0, CPU) |" in md
    assert "group size" not in md and "TensorRT" not in md


def _polyline(svg_page: str) -> list[tuple[float, float]]:
    points = re.search(r'<polyline points="([^"]+)"', svg_page)
    assert points is not None
    return [(float(x), float(y)) for x, y in (p.split(",") for p in points[1].split())]


def test_plots_start_at_zero() -> None:
    html = page(_result([], [1.0, 0.5, 0.0, 0.99]))
    top, middle, bottom, high = (y for _, y in _polyline(html))
    assert middle == pytest.approx((top + bottom) / 2)  # 50 % halfway between 0 % and 100 %
    assert high == pytest.approx(bottom + 0.99 * (top - bottom))  # 99 % sits near the top, not mid-plot
    assert ">0%</text>" in html and ">100%</text>" in html
    assert html.count(">0</text>") == 1  # the KLD histogram's count axis starts at 0 too


# ---- end to end on the demo tiny model ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run_dir(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    """A recipe run of the tiny model, W4A16 (its golden continuations diverge), with golden prompts and gates."""
    from typer.testing import CliRunner

    from toolchain.cli import app

    tmp = tmp_path_factory.mktemp("run")
    recipe = tmp / "r.yaml"
    recipe.write_text(
        f"model:\n  path: {tiny}\nquantize:\n  method: w4a16\n  group_size: 64\nbuild:\n  max_seq_len: 256\n"
        f"eval:\n  data: {DEMO_TEXT}\n  golden: {DEMO_GOLDEN}\n  max_tokens: 1200\n"
        "  gates:\n    kld_mean_max: 0.01\n    top1_min: 0.5\n"
    )
    result = CliRunner().invoke(app, ["run", str(recipe), "-o", str(tmp / "out")])
    assert result.exit_code == 0, result.stderr
    return recipe, tmp / "out", result.stdout


def _golden_then_gates(stdout: str) -> None:
    lines = [ln.strip() for ln in stdout.splitlines()]
    at = next(k for k, ln in enumerate(lines) if ln.startswith("golden exact"))
    assert re.fullmatch(r"golden exact +\d+\.\d % of 3 prompts", lines[at])
    assert lines[at + 1].startswith("gate kld_mean_max") and lines[at + 2].startswith("gate top1_min")


def test_run_summary_prints_golden_exact_beside_the_gates(cli: Any, run_dir: tuple[Path, Path, str]) -> None:
    recipe, out, stdout = run_dir
    _golden_then_gates(stdout)
    again = cli("run", recipe, "-o", out)  # every stage reused: the cached summary still has it
    assert again.exit_code == 0 and "nothing to do" in again.stderr
    _golden_then_gates(again.stdout)


def test_run_report_names_the_engine_it_scored(cli: Any, run_dir: tuple[Path, Path, str]) -> None:
    _, out, _ = run_dir
    report = json.loads((out / "report" / "report.json").read_text())
    built, engine_manifest = report["built"], (out / "engine" / "manifest.json").read_bytes()
    assert built["engine_manifest_sha256"] == hashlib.sha256(engine_manifest).hexdigest()
    assert (built["method"], built["group_size"], built["kv_cache"], built["backend"]) == (
        "W4A16",
        64,
        "float32",
        "onnxruntime",
    )
    assert built["trtbuild_version"] == json.loads(engine_manifest)["toolchain"]["version"]
    assert built["tensorrt"] is None and built["gpu"] is None  # a CPU engine: no plan to be tied to either
    assert "| method | W4A16, group size 64 |" in (out / "report" / "report.md").read_text()
    tb = TokenBytes(byte_level_tokenizer())
    diverged = [g for g in report["golden"] if not g["exact"]]
    assert diverged, "the W4A16 tiny engine's greedy continuations diverge from the reference's"
    for g in report["golden"]:
        assert g["engine"] == tb.render(g["engine_ids"]) and g["reference"] == tb.render(g["reference_ids"])
        assert "\ufffd" not in g["engine"] + g["reference"] and len(g["engine_ids"]) == g["tokens"]
    assert cli("verify", out / "report").exit_code == 0


def test_inspect_run_dir_shows_the_verdict(cli: Any, run_dir: tuple[Path, Path, str]) -> None:
    _, out, _ = run_dir
    shown = cli("inspect", out)
    assert shown.exit_code == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[1].strip().startswith("eval          PASS: mean KLD")  # right under the run's own line
    assert "same top-1" in lines[1] and "PPL ratio" in lines[1] and "of 3 prompts" in lines[1]
    assert re.fullmatch(r" +gate +kld_mean_max [\d.e-]+ vs 0.01: pass", lines[2])
    assert re.fullmatch(r" +gate +top1_min [\d.e-]+ vs 0.5: pass", lines[3])
    assert "W4A16, group size 64, KV cache float32" in lines[4]
    assert sum("eval          PASS" in ln for ln in lines) == 1  # not repeated under the report stage
    info = json.loads(cli("inspect", out, "--json").stdout)
    assert info["eval"]["passed"] is True and [g["gate"] for g in info["eval"]["gates"]] == ["kld_mean_max", "top1_min"]
    assert info["eval"]["metrics"]["golden_prompts"] == 3 and 0 <= info["eval"]["metrics"]["golden_exact"] <= 1
    assert info["stages"]["report"]["eval"] == info["eval"]


def test_eval_report_of_a_tensorrt_engine_run_on_the_cpu(
    cli: Any, tiny: Path, run_dir: tuple[Path, Path, str], tmp_path: Path
) -> None:
    _, out, _ = run_dir
    engine = tmp_path / "engine"
    shutil.copytree(out / "engine", engine)
    path = engine / "build_config.json"
    config = json.loads(path.read_text())
    config["backend"] = "tensorrt"  # as if built by TensorRT 10.13 on an H200
    config["compatibility"] = {"tensorrt": "10.13.0", "sm": "90", "gpu": "NVIDIA H200", "driver": "570", "cuda": "12.8"}
    path.write_text(json.dumps(config))
    reseal(engine)  # as that build would have recorded it
    args = ["eval", engine, "--reference", tiny, "--data", DEMO_TEXT, "--max-tokens", "600", "--golden", DEMO_GOLDEN]
    result = cli(*args, "--backend", "onnxruntime", "-o", tmp_path / "r", "--gate", "golden_exact_min=0")
    assert result.exit_code == 0, result.stderr
    lines = [ln.strip() for ln in result.stdout.splitlines()]
    at = next(k for k, ln in enumerate(lines) if ln.startswith("golden exact"))
    assert lines[at + 1].startswith("gate golden_exact_min")
    header = (tmp_path / "r" / "report.html").read_text().split("<h2>")[0]
    assert "tensorrt (TensorRT 10.13.0, NVIDIA H200, SM 90)" in header and "onnxruntime backend" in header
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert report["evaluated_with"]["backend"] == "onnxruntime" and report["built"]["backend"] == "tensorrt"
    inspected = cli("inspect", tmp_path / "r").stdout
    assert "gate          golden_exact_min" in inspected and "pass" in inspected
