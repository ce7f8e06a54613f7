"""What `convert` refuses in a ModelOpt unified HF checkpoint: each one error line naming the setting or tensor,
a non-zero exit through the CLI, nothing written. The checkpoints are hand-made in ModelOpt's layout from a random
Llama (names, shapes and dtypes as modelopt/torch/export/unified_export_hf.py `_export_quantized_weight` writes
them; tests/prequant/test_modelopt_hf.py reads real exports), so no ModelOpt is needed.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from conftest import save_random_llama
from safetensors.numpy import load_file, save_file

from tests.prequant.harness import HF_LINEARS
from toolchain.checkpoint.convert import convert

Tensors = dict[str, np.ndarray]


def modelopt_nvfp4(float_dir: Path, out: Path, edit: Callable[[Tensors, dict[str, Any]], None] | None = None) -> Path:
    """A ModelOpt-layout NVFP4 checkpoint (random codes; the reading, not the values, is under test)."""
    out.mkdir()
    rng = np.random.default_rng(0)
    t: Tensors = {}
    for name, w in load_file(str(float_dir / "model.safetensors")).items():
        prefix = name.removesuffix(".weight")
        if not any(prefix.endswith(lin) for lin in HF_LINEARS):
            t[name] = w
            continue
        o, i = w.shape
        t[name] = rng.integers(0, 256, (o, i // 2), dtype=np.uint8)
        t[f"{prefix}.weight_scale"] = np.full((o, i // 16), 0.5, ml_dtypes.float8_e4m3fn)
        t[f"{prefix}.weight_scale_2"] = np.array(0.01, np.float32)
        t[f"{prefix}.input_scale"] = np.array(0.02, np.float32)
    hq: dict[str, Any] = {
        "producer": {"name": "modelopt", "version": "0.47.0"},
        "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                         "exclude_modules": ["lm_head"]},
    }  # fmt: skip
    if edit:
        edit(t, hq)
    save_file(t, str(out / "model.safetensors"))
    (out / "config.json").write_text((float_dir / "config.json").read_text())
    (out / "hf_quant_config.json").write_text(json.dumps(hq))
    return out


QKV0 = "model.layers.0.self_attn.k_proj"


def _algo(name: str) -> Callable[[Tensors, dict[str, Any]], None]:
    def edit(t: Tensors, hq: dict[str, Any]) -> None:
        hq["quantization"]["quant_algo"] = name

    return edit


def _wrong_shape(t: Tensors, hq: dict[str, Any]) -> None:
    t[f"{QKV0}.weight_scale"] = t[f"{QKV0}.weight_scale"][:, :2].copy()


def _no_scale_2(t: Tensors, hq: dict[str, Any]) -> None:
    del t[f"{QKV0}.weight_scale_2"]


def _mixed(t: Tensors, hq: dict[str, Any]) -> None:
    hq["quantization"]["quant_algo"] = "MIXED_PRECISION"
    hq["quantization"]["quantized_layers"] = {"model.layers.0.self_attn.q_proj": {"quant_algo": "FP8"},
                                              "model.layers.1.self_attn.q_proj": {"quant_algo": "NVFP4"}}  # fmt: skip


def _nan_scale(t: Tensors, hq: dict[str, Any]) -> None:
    t[f"{QKV0}.input_scale"] = np.array(np.nan, np.float32)


def _nan_block_scale(t: Tensors, hq: dict[str, Any]) -> None:
    s = t[f"{QKV0}.weight_scale"].astype(np.float32)
    s[1, 0] = np.nan
    t[f"{QKV0}.weight_scale"] = s.astype(ml_dtypes.float8_e4m3fn)


def _experts(t: Tensors, hq: dict[str, Any]) -> None:
    t["model.layers.0.mlp.experts.0.up_proj.weight_scale"] = np.ones((4, 1), ml_dtypes.float8_e4m3fn)


CASES = {
    "unknown quant_algo": (_algo("W4A16_FOO"), "ModelOpt quant_algo 'W4A16_FOO' is not one trtbuild reads; "
                           "supported: FP8, W4A16_AWQ, W4A8_AWQ, NVFP4"),
    "scale of the wrong shape": (_wrong_shape, f"tensor {QKV0}.weight_scale is float8_e4m3fn[16, 2], ModelOpt NVFP4 "
                                 "stores float8_e4m3fn[16, 4] there"),
    "missing weight_scale_2": (_no_scale_2, f"{QKV0}.weight_scale_2 missing"),
    "mixed precision": (_mixed, "a mixed-precision ModelOpt checkpoint (quant_algo MIXED_PRECISION, per-layer algos "
                        "FP8, NVFP4)"),
    "NaN input scale": (_nan_scale, f"tensor {QKV0}.input_scale = [nan]; a per-tensor scale must be one finite "
                        "positive value"),
    "NaN block scale": (_nan_block_scale, f"tensor {QKV0}.weight_scale has NaN/Inf values"),
    "experts": (_experts, "quantized experts in a ModelOpt NVFP4 checkpoint (model.layers.0.mlp.experts.0.up_proj"
                ".weight_scale, ...): not yet"),
}  # fmt: skip


@pytest.fixture(scope="module")
def float_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_random_llama(tmp_path_factory.mktemp("float") / "llama")


def test_the_unedited_checkpoint_converts(float_llama: Path, tmp_path: Path) -> None:
    """The refusals below are the edits', not the hand-made layout's."""
    convert(modelopt_nvfp4(float_llama, tmp_path / "hf"), tmp_path / "ckpt")
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert config["quantization"]["quant_algo"] == "NVFP4"


@pytest.mark.parametrize("case", list(CASES))
def test_refused_in_one_line_naming_it(case: str, float_llama: Path, tmp_path: Path, cli: Any) -> None:
    edit, message = CASES[case]
    hf = modelopt_nvfp4(float_llama, tmp_path / "hf", edit)
    r = cli("convert", hf, "-o", tmp_path / "ckpt")
    assert r.exit_code == 1, r.output
    errors = [line for line in r.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], r.output
    assert not (tmp_path / "ckpt").exists()
