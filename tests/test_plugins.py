"""The CUDA plugins without a GPU: every kernel compiles through NVRTC for every target SM with no register spill
and no warning (the CI gate), and the test vectors still say what the reference ops compute."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from toolchain.engine.ops import AttentionAttrs, kv_cache_write, paged_attention
from toolchain.plugins.compile import ARCHS, compile_plugins

VECTORS = sorted((Path(__file__).parent / "vectors").glob("*.npz"))
HALF = {"f16": torch.float16, "bf16": torch.bfloat16}
POOL = {"f16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.uint8, "int8": torch.int8}


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("plugins")
    compile_plugins(ARCHS, out)
    return out


def test_every_kernel_compiles_for_every_sm_without_spills(build_dir: Path, cli: Any) -> None:
    result = cli("plugins", "compile", "--out", build_dir, "--strict", "--json")
    assert result.exit_code == 0, result.stderr
    info = json.loads(result.stdout)
    assert set(info["archs"]) == set(ARCHS) and info["spills"] == 0 and info["warnings"] == 0
    for arch, build in info["archs"].items():
        names = {k["name"] for k in build["kernels"]}
        assert len(names) == 44, arch
        assert {"trtbuild_kv_write_bf16_fp8", "trtbuild_attention_f16_int8_hd128_split"} <= names
        assert Path(build["cubin"]).stat().st_size > 0 and b".entry" in Path(build["ptx"]).read_bytes()
    assert all(b["cached"] for b in info["archs"].values())  # cached by source hash: nothing recompiled


def test_compiling_leaves_the_interpreter_intact(tmp_path: Path) -> None:
    """NVRTC writes into the buffers it is given; an empty log once overwrote Python's cached b" " object,
    which then corrupted every safetensors header padded afterwards in the same process."""
    compile_plugins(("sm_80",), tmp_path)  # not cached here: NVRTC really runs
    assert bytes([0x20]) == b" " * 1 and bytes([0x20] * 3) == b" " * 3


def _unbits(array: np.ndarray, kind: str) -> torch.Tensor:
    t = torch.from_numpy(array.copy())
    return t.view(HALF[kind]) if kind in HALF else t


@pytest.mark.parametrize("path", VECTORS, ids=[p.stem for p in VECTORS])
def test_vectors_match_the_reference_ops(path: Path) -> None:
    v = np.load(path)
    meta = json.loads(str(v["attrs"]))
    act, kv = meta.pop("activation"), meta.pop("kv")
    a = AttentionAttrs(**meta)
    qkv = _unbits(v["qkv"], act).float()
    pool = _unbits(v["kv_in"], kv)
    args = [torch.from_numpy(v[k]) for k in ("position_ids", "context_lens", "new_lens", "block_tables")]
    q = kv_cache_write(a, qkv, *args, pool)
    out = paged_attention(a, q, *args, pool)
    assert torch.equal(pool.view(torch.uint8), _unbits(v["kv_ref"], kv).view(torch.uint8))
    np.testing.assert_allclose(q.numpy(), v["q_ref"], rtol=0, atol=1e-6)
    np.testing.assert_allclose(out.numpy(), v["out_ref"], rtol=0, atol=1e-6)
    assert np.isfinite(v["out_ref"]).all() and v["new_lens"].max() > 1 and (v["new_lens"] == 1).any()


def _entry_params(ptx: str, kernel: str) -> list[str]:
    """The parameter types of one kernel's .entry in PTX (u64 pointers, u32 ints)."""
    match = re.search(rf"\.entry {kernel}\((.*?)\)", ptx, re.S)
    assert match, kernel
    return re.findall(r"\.param \.(\w+)", match.group(1))


@pytest.mark.parametrize(
    "attrs",
    [
        AttentionAttrs(layer=3, num_heads=32, num_kv_heads=8, head_size=128, tokens_per_block=32, kv_cache_dtype="fp8"),
        AttentionAttrs(layer=0, num_heads=8, num_kv_heads=4, head_size=8, tokens_per_block=16, kv_cache_dtype="int8"),
        AttentionAttrs(layer=1, num_heads=64, num_kv_heads=2, head_size=64, tokens_per_block=64),
    ],
)
def test_launch_description_matches_the_compiled_kernels(build_dir: Path, attrs: AttentionAttrs) -> None:
    """What TensorRT's registration passes (launch.py) is what each kernel takes: name, and inputs + scalars +
    outputs in order — checked against the PTX signatures, without TensorRT."""
    from toolchain.plugins import launch

    ptx = next(build_dir.glob("plugins-sm_90-*.ptx")).read_text()
    activation = "bfloat16"
    if attrs.kv_cache_dtype == "float32":  # the CPU default; the kernels take the activation dtype
        attrs = AttentionAttrs(**{**attrs.__dict__, "kv_cache_dtype": activation})
    write = _entry_params(ptx, launch.kv_write_kernel(attrs, activation))
    assert write == ["u64"] * 6 + ["u32"] * len(launch.kv_write_scalars(attrs, 5, 2, 4, 40)) + ["u64"]
    attention = _entry_params(ptx, launch.attention_kernel(attrs, activation))
    assert attention == ["u64"] * 6 + ["u32"] * len(launch.attention_scalars(attrs, 5, 2, 4, 40)) + ["u64"]
    grid = launch.attention_grid(attrs, 7)
    group, per_block = attrs.num_heads // attrs.num_kv_heads, 4 if attrs.head_size not in (64, 128) else 8
    assert grid == (7, attrs.num_kv_heads * -(-group // per_block), 1)
    assert launch.output_width(attrs) == attrs.num_heads * attrs.head_size
    assert launch.float_bits(1.0) == 0x3F800000


def test_launch_refuses_what_no_kernel_does() -> None:
    from toolchain.plugins import launch

    a = AttentionAttrs(layer=0, num_heads=4, num_kv_heads=2, head_size=320, tokens_per_block=16)
    with pytest.raises(ValueError, match="head_size 320"):
        launch.attention_kernel(AttentionAttrs(**{**a.__dict__, "kv_cache_dtype": "float16"}), "float16")
    with pytest.raises(ValueError, match="no kernel"):
        launch.kv_write_kernel(AttentionAttrs(**{**a.__dict__, "kv_cache_dtype": "bfloat16"}), "float16")
