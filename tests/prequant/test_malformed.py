"""Malformed pre-quantized checkpoints (a shape, type or value no producer writes) are refused in one line naming
the file and tensor or key, with nothing written — never a traceback from inside a reader."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import save_random_llama
from safetensors.numpy import load_file, save_file

from tests.prequant.test_compressed import ct_config, int4_group, write_ct
from tests.prequant.test_gptq import gptq_config, write_gptq
from toolchain.checkpoint.convert import convert
from toolchain.errors import UserError

INT4 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 16}
Q = "model.layers.0.self_attn.q_proj"
OPROJ = "model.layers.0.self_attn.o_proj"


def edit_tensors(hf: Path, fn: Callable[[dict[str, Any]], None]) -> None:
    path = hf / "model.safetensors"
    tensors = load_file(str(path))
    fn(tensors)
    save_file(tensors, str(path))


def edit_config(hf: Path, fn: Callable[[dict[str, Any]], None]) -> None:
    cfg = json.loads((hf / "config.json").read_text())
    fn(cfg["quantization_config"])
    (hf / "config.json").write_text(json.dumps(cfg))


def ct_int4(hf: Path, actorder: bool = False, **extra: Any) -> Path:
    scheme = {**INT4, "actorder": "group"} if actorder else INT4
    write_ct(hf, int4_group(True, actorder), ct_config(scheme, None, "pack-quantized", **extra))
    return hf


def negative_g_idx(hf: Path) -> None:
    ct_int4(hf, actorder=True)

    def edit(t: dict[str, Any]) -> None:
        for name in [n for n in t if n.endswith("weight_g_idx")]:
            t[name] = t[name].copy()
            t[name][0] = -1

    edit_tensors(hf, edit)


def one_d(name: str) -> Callable[[dict[str, Any]], None]:
    def edit(t: dict[str, Any]) -> None:
        t[name] = t[name].reshape(-1)

    return edit


CASES: dict[str, tuple[Callable[[Path], None], str]] = {
    "CT act-order with a negative g_idx": (negative_g_idx, "weight_g_idx: groups must hold 16 columns"),
    "CT kv_cache_scheme a string": (
        lambda hf: (ct_int4(hf, kv_cache_scheme="fp8"), None)[-1],
        "kv_cache_scheme must be an object",
    ),
    "CT config group a list": (
        lambda hf: (ct_int4(hf), edit_config(hf, lambda q: q.update(config_groups={"group_0": ["x"]})))[-1],
        "config_groups must map names to objects",
    ),
    "CT weight_packed 1-D": (
        lambda hf: (ct_int4(hf), edit_tensors(hf, one_d(f"{OPROJ}.weight_packed")))[-1],
        "weight_packed has shape",
    ),
    "GPTQ qweight 1-D": (
        lambda hf: (write_gptq(hf, gptq_config()), edit_tensors(hf, one_d(f"{Q}.qweight")))[-1],
        "qweight shapes",
    ),
    "GPTQ checkpoint_format a list": (
        lambda hf: (write_gptq(hf, gptq_config()), edit_config(hf, lambda q: q.update(checkpoint_format=["gptq"])))[-1],
        r"checkpoint_format \['gptq'\] is not read",
    ),
    "GPTQ zero scales": (
        lambda hf: (
            write_gptq(hf, gptq_config()),
            edit_tensors(hf, lambda t: t.update({f"{OPROJ}.scales": np.zeros_like(t[f"{OPROJ}.scales"])})),
        )[-1],
        f"{OPROJ}.scales has .* not finite and positive",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_malformed_checkpoint_is_refused_in_one_line(case: str, tmp_path: Path) -> None:
    make, words = CASES[case]
    make(tmp_path / "hf")
    with pytest.raises(UserError, match=words) as e:
        convert(tmp_path / "hf", tmp_path / "out")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()


def test_modelopt_weight_of_the_wrong_rank_is_refused(tmp_path: Path) -> None:
    from tests.prequant.test_refusals import modelopt_nvfp4

    def edit(t: dict[str, Any], _: dict[str, Any]) -> None:
        t[f"{Q}.weight"] = t[f"{Q}.weight"].reshape(-1)

    hf = modelopt_nvfp4(save_random_llama(tmp_path / "float"), tmp_path / "hf", edit)
    with pytest.raises(UserError, match="disagree in input width"):
        convert(hf, tmp_path / "out")
    assert not (tmp_path / "out").exists()
