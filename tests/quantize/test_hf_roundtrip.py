"""`quantize --format hf` (toolchain/quantize/hf_export.py): ModelOpt's unified Hugging Face checkpoint.

What holds it: the family inverse maps give back, through our own convert, the very checkpoint they were written
from (config and every tensor, bit for bit) and a model transformers loads to the same logits; each quantized
method's HF tensors are exactly our checkpoint's, re-fused by the family's own weight table, in ModelOpt's
encoding (int4 nibbles unpacked here from `pack_int4_in_uint8`'s definition); and the files have the names, dtypes,
shapes and quantization configs ModelOpt 0.47's own `export_hf_checkpoint` writes for the same model (a subprocess
in a python with modelopt; skipped, saying so, without one). Reading the quantized export back with our convert
needs the ModelOpt reader (checkpoint/prequant/modelopt.py)."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import STORIES, WIKI, one_line_error, save_random_llama
from models import PARITY, save_case, save_random
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from toolchain import __version__
from toolchain.checkpoint.convert import convert
from toolchain.checkpoint.registry import family_for
from toolchain.checkpoint.trtllm import read_config
from toolchain.quantize.hf_export import HF_QUANT_CONFIG, write_hf
from toolchain.quantize.methods.base import Stored
from toolchain.quantize.methods.registry import METHODS
from toolchain.quantize.stage import QuantizeOptions, quantize_checkpoint

HERE = Path(__file__).parent
GROUP = 32
TOKENIZER = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
# method -> (KV cache, ModelOpt's config name in modelopt_hf_layout.py)
METHOD_CASES = {
    "fp8": ("fp8", "fp8"),
    "w4a16_awq": ("none", "int4_awq"),
    "w8a16": ("none", "int8_wo"),
    "nvfp4": ("none", "nvfp4"),
    "w4a8_awq": ("none", "w4a8_awq"),
}


# -- float checkpoints: the inverse name and config maps ----------------------------------------------------------

FAMILY_CASES = ["llama-llama3-rope", "llama-tied", "llama-biases", "mistral-sliding-window", "qwen2-biases"]
FAMILY_CASES += ["qwen2-tied", "qwen3-qk-norm", "qwen3-windows"]


@pytest.mark.parametrize("case", FAMILY_CASES)
def test_float_checkpoint_round_trips_through_convert(case: str, tmp_path: Path) -> None:
    hf = save_case(tmp_path / "hf", case)
    convert(hf, tmp_path / "ckpt")
    (tmp_path / "out").mkdir()
    assert write_hf(tmp_path / "ckpt", tmp_path / "out") == ["model.safetensors", "config.json"]
    convert(tmp_path / "out", tmp_path / "back")
    assert read_config(tmp_path / "back") == read_config(tmp_path / "ckpt")
    ours, back = (load_file(str(tmp_path / d / "rank0.safetensors")) for d in ("ckpt", "back"))
    assert ours.keys() == back.keys() and all(torch.equal(ours[n], back[n]) for n in ours)
    # transformers reads the written config as the model it was: same logits
    ids = torch.randint(0, 97, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()(ids).logits
        got = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()(ids).logits
    assert torch.equal(got, want), PARITY[case]


# -- quantized checkpoints ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A random Llama with stories260K's tokenizer (calibration needs one) and untied lm_head, and its checkpoint."""
    root = tmp_path_factory.mktemp("hf-export")
    hf = save_random_llama(
        root / "hf", vocab_size=512, intermediate_size=128, num_key_value_heads=4, max_position_embeddings=256
    )
    for name in TOKENIZER:
        shutil.copyfile(STORIES / name, hf / name)
    convert(hf, root / "ckpt")
    # calibration: the head of WikiText-2's valid split (tokenizing all of it would cost the most of this file)
    (root / "calib.txt").write_text((WIKI / "valid.txt").read_text(encoding="utf-8")[:20000], encoding="utf-8")
    return hf, root / "ckpt"


def _quantize(ckpt: Path, out: Path, method: str, fmt: str) -> Path:
    kv = METHOD_CASES[method][0]
    opts = QuantizeOptions(method, kv, GROUP, ckpt.parent / "calib.txt", 2, 64, format=fmt)
    quantize_checkpoint(ckpt, out, opts)
    return out


@pytest.fixture(scope="module")
def exports(model: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """Per method: (its ModelOpt HF checkpoint, our checkpoint it was written from). The HF one is `write_hf` of
    ours, what `quantize --format hf` writes (test_quantize_format_hf_is_write_hf_of_the_checkpoint)."""
    root = tmp_path_factory.mktemp("exports")
    made = {}
    for method in METHOD_CASES:
        ours, hf = _quantize(model[1], root / method, method, "trtllm"), root / f"{method}-hf"
        hf.mkdir()
        write_hf(ours, hf)
        for name in (*TOKENIZER, "generation_config.json"):
            shutil.copyfile(ours / name, hf / name)
        made[method] = (hf, ours)
    return made


def test_quantize_format_hf_is_write_hf_of_the_checkpoint(
    model: tuple[Path, Path], exports: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    """The stage's --format hf: the same files, byte for byte, as our checkpoint of the same options rewritten, plus
    the tokenizer and a manifest; no trace of the intermediate checkpoint."""
    out = _quantize(model[1], tmp_path / "fp8-hf", "fp8", "hf")
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["config.json", HF_QUANT_CONFIG, "manifest.json", "model.safetensors", "generation_config.json", *TOKENIZER]
    )
    for name in ("config.json", HF_QUANT_CONFIG, "model.safetensors"):
        assert (out / name).read_bytes() == (exports["fp8"][0] / name).read_bytes(), name
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["details"]["format"]["files"] == ["model.safetensors", "config.json", HF_QUANT_CONFIG]
    assert {o["path"] for o in manifest["outputs"]} >= {"model.safetensors", "config.json", HF_QUANT_CONFIG}


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """int4 codes [out, in] of ModelOpt's `pack_int4_in_uint8` bytes [out/2, in] from its definition: output row 2j
    in the low nibble of byte row j, row 2j+1 in the high one, two's complement."""
    raw = packed.to(torch.int16)
    rows = torch.stack([raw & 0xF, raw >> 4], dim=1).reshape(-1, packed.shape[1])
    return torch.where(rows > 7, rows - 16, rows)


@pytest.mark.parametrize("method", list(METHOD_CASES))
def test_hf_tensors_are_our_checkpoints_in_modelopts_encoding(
    method: str, exports: dict[str, tuple[Path, Path]]
) -> None:
    hf_dir, ours_dir = exports[method]
    cfg = read_config(ours_dir)
    algo, kv = cfg.quantization.quant_algo, cfg.quantization.kv_cache_quant_algo
    hf_quant = json.loads((hf_dir / HF_QUANT_CONFIG).read_text())
    body: dict[str, Any] = {"quant_algo": algo, "kv_cache_quant_algo": kv}
    if algo in ("W4A16_AWQ", "W4A8_AWQ"):
        body.update(group_size=GROUP, has_zero_point=False, pre_quant_scale=True)
    if algo == "NVFP4":
        body["group_size"] = 16
    body["exclude_modules"] = ["lm_head", "model.embed_tokens"]
    assert hf_quant == {"producer": {"name": "trtbuild", "version": __version__}, "quantization": body}
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "modelopt"
    assert config["quantization_config"]["quant_algo"] == algo

    hf, ours = load_file(str(hf_dir / "model.safetensors")), load_file(str(ours_dir / "rank0.safetensors"))
    _, family = family_for(config, "config.json")
    used: set[str] = set()
    qm = METHODS[method]
    for rule in family.weight_table(cfg, set(hf)):
        prefix = rule.dst.removesuffix(".weight")
        heads = [s.removesuffix(".weight") for s in rule.srcs]
        if not rule.dst.endswith(".weight") or f"{prefix}.weights_scaling_factor" not in ours:
            assert torch.equal(torch.cat([hf[s] for s in rule.srcs]), ours[rule.dst])  # float: as it was
            used.update(rule.srcs)
            continue
        suffixes = ("weight", "weight_scale", "weight_scale_2", "input_scale", "pre_quant_scale")
        names = {f"{h}.{t}" for h in heads for t in suffixes}
        used.update(names & set(hf))
        scale = ours[f"{prefix}.weights_scaling_factor"]
        weight = torch.cat([hf[f"{h}.weight"] for h in heads])
        if algo == "FP8":
            assert weight.dtype == torch.float8_e4m3fn and torch.equal(
                weight.view(torch.uint8), ours[rule.dst].view(torch.uint8)
            )
            for h in heads:
                assert hf[f"{h}.weight_scale"].shape == () and hf[f"{h}.weight_scale"] == scale
                assert (
                    hf[f"{h}.input_scale"].shape == ()
                    and hf[f"{h}.input_scale"] == ours[f"{prefix}.activation_scaling_factor"]
                )
        elif algo == "W8A16":
            assert weight.dtype == torch.int8 and torch.equal(weight, ours[rule.dst])
            assert torch.equal(torch.cat([hf[f"{h}.weight_scale"] for h in heads]), scale)
        elif algo == "NVFP4":  # our bytes: E2M1 pairs, E4M3 block scales; both global scales multiply in both
            assert weight.dtype == torch.uint8 and torch.equal(weight, ours[rule.dst])
            blocks = torch.cat([hf[f"{h}.weight_scale"] for h in heads])
            assert blocks.dtype == torch.float8_e4m3fn and torch.equal(
                blocks.view(torch.uint8), scale.view(torch.uint8)
            )
            for h in heads:
                for name, ours_name in (
                    ("weight_scale_2", "weights_scaling_factor_2"),
                    ("input_scale", "activation_scaling_factor"),
                ):
                    assert hf[f"{h}.{name}"].shape == () and hf[f"{h}.{name}"] == ours[f"{prefix}.{ours_name}"]
        else:
            assert weight.dtype == torch.uint8
            codes = _unpack_nibbles(weight)
            scales = torch.cat([hf[f"{h}.weight_scale"] for h in heads])
            dequantized = (codes.float().reshape(codes.shape[0], -1, GROUP) * scales[..., None]).reshape(codes.shape)
            stored = Stored(prefix, ours, codes.shape[1], GROUP)
            if algo == "W4A16_AWQ":  # ModelOpt's w = q · weight_scale, ours alike
                assert torch.equal(dequantized, qm.dequantize(stored))
            else:  # W4A8_AWQ: then the FP8 stage at weight_scale_2, as ModelOpt's fake quant and ours (w4a8_awq.py)
                ws2 = ours[f"{prefix}.weights_scaling_factor_2"]
                fp8 = (dequantized / ws2).clamp(-448, 448).to(torch.float8_e4m3fn).float() * ws2
                assert torch.equal(fp8, qm.dequantize(stored))
            for h in heads:
                assert torch.equal(hf[f"{h}.pre_quant_scale"], ours[f"{prefix}.prequant_scaling_factor"])
                if algo == "W4A8_AWQ":
                    assert hf[f"{h}.weight_scale_2"].shape == () and hf[f"{h}.weight_scale_2"] == ws2
                    assert hf[f"{h}.input_scale"] == ours[f"{prefix}.activation_scaling_factor"]
    if kv:
        for i in range(cfg.num_hidden_layers):
            p, want = f"model.layers.{i}.self_attn", ours[f"transformer.layers.{i}.attention.kv_cache_scaling_factor"]
            assert (
                hf[f"{p}.k_proj.k_scale"].shape == () and hf[f"{p}.k_proj.k_scale"] == want == hf[f"{p}.v_proj.v_scale"]
            )
            used.update({f"{p}.k_proj.k_scale", f"{p}.v_proj.v_scale"})
    assert used == set(hf)  # nothing else written


def _modelopt_layouts(hf: Path, out: Path) -> Path:
    from test_modelopt_interop import PEER_VENV, modelopt_python

    python = modelopt_python()
    if python is None:
        pytest.skip(
            "nvidia-modelopt not importable (pip install -e .[peers], or a venv at "
            f"{PEER_VENV.parent.parent}, or TRTBUILD_MODELOPT_PYTHON): ModelOpt's own export is not there to compare"
        )
    cmd = [python, str(HERE / "modelopt_hf_layout.py"), str(hf), str(out), str(hf.parent / "calib.txt"), str(GROUP)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.mark.slow
def test_layout_is_modelopts_own(
    model: tuple[Path, Path], exports: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    """Names, dtypes and shapes of every tensor, hf_quant_config.json and config.json's quantization_config equal
    what ModelOpt 0.47's `export_hf_checkpoint` writes for the same model and method, but for the producer and
    the AWQ methods' pre_quant_scale on q/k/v and gate/up: ModelOpt folds those into the preceding norms
    (`requantize_resmooth_fused_llm_layers`), we keep them on the linears (the layout allows either)."""
    theirs_root = _modelopt_layouts(model[0], tmp_path / "modelopt")
    for method, (_, modelopt_name) in METHOD_CASES.items():
        hf_dir = exports[method][0]
        theirs = json.loads((theirs_root / modelopt_name / "layout.json").read_text())
        their_config = theirs.pop("__quantization_config__")
        from safetensors import safe_open

        with safe_open(str(hf_dir / "model.safetensors"), "pt") as f:
            ours = {n: [f.get_slice(n).get_dtype(), list(f.get_slice(n).get_shape())] for n in f.keys()}  # noqa: SIM118
        extra = set(ours) - set(theirs)
        if method in ("w4a16_awq", "w4a8_awq"):
            folded = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
            assert extra == {f"model.layers.{i}.{m}.pre_quant_scale" for i in range(2) for m in folded}
        else:
            assert not extra
        assert {n: theirs[n] for n in theirs} == {n: ours[n] for n in theirs}, method
        our_config = json.loads((hf_dir / "config.json").read_text())["quantization_config"]
        assert {**our_config, "producer": None} == {**their_config, "producer": None}, method
        their_quant = json.loads((theirs_root / modelopt_name / HF_QUANT_CONFIG).read_text())["quantization"]
        assert json.loads((hf_dir / HF_QUANT_CONFIG).read_text())["quantization"] == their_quant


# -- refusals ------------------------------------------------------------------------------------------------------


def test_what_modelopts_layout_cannot_hold_is_refused_before_quantizing(
    cli: Any, model: tuple[Path, Path], tmp_path: Path
) -> None:
    ckpt, out = model[1], tmp_path / "out"
    calib = ("--calib-data", str(ckpt.parent / "calib.txt"), "--calib-samples", "2", "--calib-seq-len", "16")
    cases = [
        (("--method", "w8a8_sq", *calib), "not W8A8_SQ_PER_CHANNEL"),
        (("--method", "w4a16"), "not W4A16;"),
        (("--method", "fp8", "--kv-cache", "int8", *calib), "not INT8"),
        # hidden 64 is not whole groups of 128: ModelOpt's int4 packing has no partial group
        (("--method", "w4a16_awq", "--group-size", "128", *calib), "not whole groups of 128"),
    ]
    for args, expected in cases:
        line = one_line_error(cli("quantize", ckpt, "-o", out, "--format", "hf", *args))
        assert expected in line and "--format trtllm" in line, line
        assert not out.exists()
    convert(save_random_llama(tmp_path / "tied", tie_word_embeddings=True), tmp_path / "tied-ckpt")
    tied = ("quantize", tmp_path / "tied-ckpt", "-o", out, "--format", "hf", "--method", "w8a16", "--exclude", "none")
    line = one_line_error(cli(*tied))
    assert "lm_head is tied" in line and "tied-ckpt" in line and "--format trtllm" in line, line
    assert not out.exists()
    convert(save_random(tmp_path / "gpt2", "gpt2"), tmp_path / "gpt2-ckpt")
    line = one_line_error(cli("quantize", tmp_path / "gpt2-ckpt", "-o", out, "--format", "hf", "--method", "w8a16"))
    assert "GPT2LMHeadModel" in line and "LlamaForCausalLM" in line and "--format trtllm" in line, line
    assert not out.exists()


@pytest.mark.parametrize("method", list(METHOD_CASES))
def test_convert_reads_the_hf_export_back_bit_for_bit(
    method: str, exports: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    """What `quantize --format hf` writes, read back by our own convert (checkpoint/prequant/modelopt.py): the same
    config (quantization included) and the same tensors, byte for byte."""
    hf_dir, ours = exports[method]
    convert(hf_dir, tmp_path / "back")
    a, b = read_config(ours), read_config(tmp_path / "back")
    assert a.quantization.quant_algo == b.quantization.quant_algo
    assert a.quantization.kv_cache_quant_algo == b.quantization.kv_cache_quant_algo
    assert dataclasses.replace(a, quantization=b.quantization) == b
    want, got = load_file(str(ours / "rank0.safetensors")), load_file(str(tmp_path / "back" / "rank0.safetensors"))
    assert want.keys() == got.keys()
    for name in want:
        same = want[name].dtype == got[name].dtype and torch.equal(
            want[name].view(torch.uint8), got[name].view(torch.uint8)
        )
        assert same, name
