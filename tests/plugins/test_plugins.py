"""The CUDA plugins without a GPU: every kernel compiles through NVRTC for every target SM with no register spill
and no warning (the CI gate), and the test vectors still say what the reference ops compute."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch
from conftest import one_line_error

from toolchain.engine.ops import OP_FIELDS, AttentionAttrs, kv_cache_write, paged_attention
from toolchain.errors import UserError
from toolchain.plugins import compile as plugin_compile
from toolchain.plugins.compile import ARCHS, compile_plugins

VECTORS = sorted((Path(__file__).resolve().parents[1] / "vectors").glob("*.npz"))
HALF = {"f16": torch.float16, "bf16": torch.bfloat16}
POOL = {"f16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.uint8, "int8": torch.int8}


@pytest.fixture(scope="module")
def build_dir(plugin_cache: Path) -> Path:
    compile_plugins(ARCHS, plugin_cache)  # NVRTC runs only for a source, SM or compiler not compiled before
    return plugin_cache


def _sm90_ptx(build_dir: Path) -> str:
    """The PTX of the current sources (the cache also keeps builds of earlier ones, under other hashes)."""
    return compile_plugins(("sm_90",), build_dir)[0].ptx.read_text()


@pytest.mark.slow
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


def test_compiling_leaves_the_interpreter_intact() -> None:
    """NVRTC writes into the buffers it is given; an empty log once overwrote Python's cached b" " object,
    which then corrupted every safetensors header padded afterwards in the same process. A kernel that compiles
    without a word gives that empty log (a one-byte buffer), through the same NVRTC call as the plugins."""
    ptx, log = plugin_compile._compile_one(
        b'extern "C" __global__ void k(int* x) { *x = 1; }', "tiny.cu", ["--gpu-architecture=compute_80"]
    )
    assert log == "" and b".entry k" in ptx  # NVRTC really ran and its log was empty
    assert bytes([0x20]) == b" " * 1 and bytes([0x20] * 3) == b" " * 3


@pytest.mark.parametrize("arch", ["sm_75", "sm_70", "sm_8", "sm_999"])
def test_an_unsupported_sm_is_refused_in_one_line_naming_the_supported_ones(
    arch: str, cli: Any, tmp_path: Path
) -> None:
    line = one_line_error(cli("plugins", "compile", "--arch", f"sm_90,{arch}", "--out", tmp_path / "out"))
    assert f"--arch {arch}" in line and "sm_80 and newer" in line
    assert re.search(r"sm_80, sm_86, .*sm_89, sm_90", line), line
    assert not (tmp_path / "out").exists()  # refused before anything was compiled or written


def test_compile_errors_name_the_plugin_file_and_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lines = (plugin_compile.PLUGIN_DIR / "attention.cu").read_text().splitlines()
    lines[19] = "int not_a_device_variable = undefined_name;"  # line 20
    (tmp_path / "attention.cu").write_text("\n".join(lines))
    monkeypatch.setattr(plugin_compile, "PLUGIN_DIR", tmp_path)
    with pytest.raises(UserError, match=r"plugins/attention\.cu: compilation failed for compute_80") as e:
        compile_plugins(("sm_80",), tmp_path / "out")
    assert "plugins/attention.cu(20): error" in str(e.value)
    assert not list((tmp_path / "out").iterdir())  # nothing cached from a failed compile


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


@pytest.mark.parametrize("path", VECTORS, ids=[p.stem for p in VECTORS])
def test_reference_ops_agree_with_float64(path: Path) -> None:
    """The vectors pin the float32 reference to 1e-6, which a change of summation order moves (the fused attention
    did, 2.4e-6 at most): what holds the reference to its meaning is this, the same call in float64 (rotary, scores,
    softmax and the weighted sum all in float64; the same stored K / V), within a few float32 ulps."""
    v = np.load(path)
    meta = json.loads(str(v["attrs"]))
    act, kv = meta.pop("activation"), meta.pop("kv")
    a = AttentionAttrs(**meta)
    qkv = _unbits(v["qkv"], act).float()
    args = [torch.from_numpy(v[k]) for k in ("position_ids", "context_lens", "new_lens", "block_tables")]
    pool32, pool64 = _unbits(v["kv_in"], kv), _unbits(v["kv_in"], kv)
    out32 = paged_attention(a, kv_cache_write(a, qkv, *args, pool32), *args, pool32)
    q64 = kv_cache_write(a, qkv.double(), *args, pool64)
    out64 = paged_attention(a, q64, *args, pool64)
    assert q64.dtype == out64.dtype == torch.float64
    scale = float(out64.abs().max())
    assert float((out32.double() - out64).abs().max()) < 4e-6 * max(scale, 1.0)


def test_decode_attention_never_reads_stale_pool_bytes() -> None:
    """Decodes of different lengths share one gather of whole blocks: the slots past each sequence's position hold
    whatever the block held before (here NaN, as a diverged request would leave it) and must not reach the output
    (not as NaN + -inf in a masked score, nor as 0 * NaN in the weighted sum)."""
    a = AttentionAttrs(layer=0, num_heads=4, num_kv_heads=2, head_size=8, tokens_per_block=4)
    gen = torch.Generator().manual_seed(3)
    ctx = [0, 2, 5, 11]
    tables = torch.randperm(16, generator=gen).reshape(4, 4).to(torch.int32)
    args = [
        torch.tensor(ctx, dtype=torch.int32),
        torch.tensor(ctx, dtype=torch.int32),
        torch.ones(4, dtype=torch.int32),
    ]
    outs = []
    for fill in (0.0, float("nan")):
        pool = torch.full((1, 16, 2, 2, 4, 8), fill)
        for s, c in enumerate(ctx):  # each sequence's own tokens, the same in both pools
            qkv = torch.randn(c + 1, 64, generator=torch.Generator().manual_seed(s))
            one = torch.tensor([c + 1], dtype=torch.int32)
            kv_cache_write(a, qkv, torch.arange(c + 1, dtype=torch.int32), one * 0, one, tables[s : s + 1], pool)
        q = torch.randn(4, 32, generator=torch.Generator().manual_seed(9))
        outs.append(paged_attention(a, q, *args, tables, pool))
    assert torch.isfinite(outs[1]).all()
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("window", [0, 5])
def test_paged_attention_equals_a_naive_loop_over_sequences(window: int) -> None:
    """Decodes of very different lengths (gathered in groups of similar length) beside prefill chunks over cached
    prefixes, against a float64 loop that reads each sequence's keys token by token through its block table."""
    a = AttentionAttrs(layer=1, num_heads=6, num_kv_heads=2, head_size=8, tokens_per_block=4, sliding_window=window)
    gen = torch.Generator().manual_seed(11)
    ctx, new = [0, 1, 3, 4, 7, 30, 61, 5, 12, 0], [1, 1, 1, 1, 1, 1, 1, 6, 3, 9]
    per = 17
    tables = torch.randperm(2 * 10 * per, generator=gen)[: 10 * per].reshape(10, per).to(torch.int32)
    pool = torch.randn(2, 2 * 10 * per, 2, 2, 4, 8, generator=gen)
    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(ctx, new, strict=True)]).to(torch.int32)
    args = [positions, torch.tensor(ctx, dtype=torch.int32), torch.tensor(new, dtype=torch.int32), tables]
    q = torch.randn(sum(new), 48, generator=gen)
    out = paged_attention(a, q, *args, pool)
    row = 0
    for s, (c, n) in enumerate(zip(ctx, new, strict=True)):
        keys = torch.stack([pool[1, tables[s, p // 4], 0, :, p % 4] for p in range(c + n)]).double()  # [L, kvh, d]
        values = torch.stack([pool[1, tables[s, p // 4], 1, :, p % 4] for p in range(c + n)]).double()
        for i in range(n):
            pos = c + i
            seen = [p for p in range(pos + 1) if not window or pos - p < window]
            for head in range(6):
                kv = head // 3
                scores = keys[seen, kv] @ q[row, head * 8 : head * 8 + 8].double() / math.sqrt(8)
                expected = scores.softmax(0) @ values[seen, kv]
                torch.testing.assert_close(out[row, head * 8 : head * 8 + 8].double(), expected, rtol=0, atol=1e-5)
            row += 1


def test_memo_shared_by_layers_with_other_attributes_changes_nothing() -> None:
    """The engine hands one memo to every layer of a call (rotary angles, pool rows, attention geometry worked out
    once): layers that differ in rotary base, scaling, window or block size must still get their own results."""
    gen = torch.Generator().manual_seed(5)
    base = AttentionAttrs(layer=0, num_heads=4, num_kv_heads=2, head_size=16, tokens_per_block=4)
    layers = [
        base,
        dataclasses.replace(base, layer=1, rotary_base=500.0, sliding_window=3),
        dataclasses.replace(base, layer=2, rotary_scaling_type="linear", rotary_scaling_factor=4.0, q_scaling=1.3),
        dataclasses.replace(base, layer=3, rotary_style="none", sliding_window=6),
    ]
    ctx, new = [5, 17, 9, 0], [4, 1, 1, 1]
    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(ctx, new, strict=True)]).to(torch.int32)
    tables = torch.randperm(28, generator=gen).reshape(4, 7).to(torch.int32)
    args = [positions, torch.tensor(ctx, dtype=torch.int32), torch.tensor(new, dtype=torch.int32), tables]
    pools = [torch.randn(4, 28, 2, 2, 4, 16, generator=torch.Generator().manual_seed(1)) for _ in range(2)]
    memo: dict[Any, Any] = {}
    for a in layers:
        qkv = torch.randn(7, 128, generator=gen)
        shared = paged_attention(a, kv_cache_write(a, qkv, *args, pools[0], memo=memo), *args, pools[0], memo=memo)
        alone = paged_attention(a, kv_cache_write(a, qkv, *args, pools[1]), *args, pools[1])
        assert torch.equal(shared, alone), a
    assert torch.equal(pools[0], pools[1])
    assert len({k for k in memo if k[0] == "cos_sin"}) == 3  # three rotary settings, three entries


def _entry_params(ptx: str, kernel: str) -> list[str]:
    """The parameter types of one kernel's .entry in PTX (u64 pointers, u32 ints)."""
    match = re.search(rf"\.entry {kernel}\((.*?)\)", ptx, re.S)
    assert match, kernel
    return re.findall(r"\.param \.(\w+)", match.group(1))


@pytest.mark.slow
@pytest.mark.parametrize(
    "attrs",
    [
        AttentionAttrs(layer=3, num_heads=32, num_kv_heads=8, head_size=128, tokens_per_block=32, kv_cache_dtype="fp8"),
        AttentionAttrs(layer=0, num_heads=8, num_kv_heads=4, head_size=8, tokens_per_block=16, kv_cache_dtype="int8"),
        AttentionAttrs(layer=1, num_heads=64, num_kv_heads=2, head_size=64, tokens_per_block=64),
        AttentionAttrs(layer=2, num_heads=8, num_kv_heads=2, head_size=24, tokens_per_block=16, q_scaling=1.7),
    ],
)
def test_launch_description_matches_the_compiled_kernels(build_dir: Path, attrs: AttentionAttrs) -> None:
    """What TensorRT's registration passes (launch.py) is what each kernel takes: name, and inputs + scalars +
    outputs in order — checked against the PTX signatures, without TensorRT."""
    from toolchain.plugins import launch

    ptx = _sm90_ptx(build_dir)
    activation = "bfloat16"
    if attrs.kv_cache_dtype == "float32":  # the CPU default; the kernels take the activation dtype
        attrs = AttentionAttrs(**{**attrs.__dict__, "kv_cache_dtype": activation})
    write = _entry_params(ptx, launch.kv_write_kernel(attrs, activation))
    assert write == ["u64"] * 6 + ["u32"] * len(launch.kv_write_scalars(attrs, 5, 2, 4, 40)) + ["u64"]
    attention = _entry_params(ptx, launch.attention_kernel(attrs, activation))
    assert attention == ["u64"] * 6 + ["u32"] * len(launch.attention_scalars(attrs, 5, 2, 4, 40)) + ["u64"]
    assert launch.attention_scalars(attrs, 5, 2, 4, 40)[-2:] == [
        launch.float_bits(attrs.kv_scale),
        launch.float_bits(attrs.q_scaling),
    ]
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


def _gpu_check() -> Any:
    path = Path(__file__).resolve().parents[2] / "plugins" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.parametrize("path", VECTORS, ids=[p.stem for p in VECTORS])
def test_gpu_check_launches_what_the_compiled_kernels_take(path: Path, build_dir: Path) -> None:
    """plugins/gpu_check.py (run on a lent GPU) launches through launch.py, as TensorRT's registration does: run
    here on CPU with a stand-in that records each launch, every kernel it names exists in the PTX and takes
    exactly the pointers and int32 scalars it is given, in that order, with the block launch.py declares."""
    import ctypes

    from toolchain.plugins import launch

    gpu_check = _gpu_check()
    ptx = _sm90_ptx(build_dir)

    class Recorder:
        def __init__(self) -> None:
            self.torch, self.calls = torch, []

        def launch(self, name: str, grid: tuple[int, int, int], args: list[tuple[Any, Any]]) -> None:
            self.calls.append((name, grid, ["u64" if t is ctypes.c_void_p else "u32" for _, t in args]))

    data = dict(np.load(path))
    meta = json.loads(str(data["attrs"]))
    attrs = AttentionAttrs(**{k: v for k, v in meta.items() if k not in ("activation", "kv")})
    activation = {"f16": "float16", "bf16": "bfloat16"}[meta["activation"]]
    for splits in (1, 3):
        rec = Recorder()
        gpu_check.run_case(rec, data, splits, dev="cpu")
        for name, _, params in rec.calls:
            assert params == _entry_params(ptx, name), name
        names = [name for name, _, _ in rec.calls]
        tokens = data["qkv"].shape[0]
        assert rec.calls[0][:2] == (launch.kv_write_kernel(attrs, activation), launch.kv_write_grid(tokens))
        if splits == 1:
            assert rec.calls[1][:2] == (
                launch.attention_kernel(attrs, activation),
                launch.attention_grid(attrs, tokens),
            )
        else:
            assert names[1:] == [launch.attention_split_kernel(attrs, activation), launch.reduce_kernel(activation)]
            assert rec.calls[1][1] == launch.attention_split_grid(attrs, tokens, splits)
    assert f".maxntid {launch.BLOCK_THREADS}, 1, 1" in ptx


def _mixed_batch(a: AttentionAttrs, dtype: torch.dtype) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """q after KVCacheWrite, the op arguments and the pool, for a prefill chunk over a cached prefix and two decodes."""
    gen = torch.Generator().manual_seed(7)
    ctx, new = [5, 17, 9], [4, 1, 1]
    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(ctx, new, strict=True)]).to(torch.int32)
    tables = torch.randperm(12, generator=gen).reshape(3, 4).to(torch.int32)
    args = [positions, torch.tensor(ctx, dtype=torch.int32), torch.tensor(new, dtype=torch.int32), tables]
    pool = torch.zeros(1, 12, 2, a.num_kv_heads, a.tokens_per_block, a.head_size, dtype=dtype)
    for s, c in enumerate(ctx):  # the cached prefixes
        qkv = torch.randn(c, (a.num_heads + 2 * a.num_kv_heads) * a.head_size, generator=gen, dtype=dtype)
        one = torch.tensor([c], dtype=torch.int32)
        kv_cache_write(a, qkv, torch.arange(c, dtype=torch.int32), one * 0, one, tables[s : s + 1], pool)
    qkv = torch.randn(sum(new), (a.num_heads + 2 * a.num_kv_heads) * a.head_size, generator=gen, dtype=dtype)
    return kv_cache_write(a, qkv, *args, pool), args, pool


@pytest.mark.parametrize("q_scaling", [2.0, 1.7, 0.6])
def test_q_scaling_divides_the_scores_as_a_prescaled_q_would(q_scaling: float) -> None:
    """PagedAttention with q_scaling s computes what q_scaling 1 computes on q / s (TensorRT-LLM's definition:
    scores = q.k / (sqrt(head_size) * q_scaling)), on the prefill path and the decode path alike: bit for bit where s
    is a power of two (every step scales exactly), to float64 rounding otherwise."""
    base = AttentionAttrs(layer=0, num_heads=4, num_kv_heads=2, head_size=16, tokens_per_block=8, rotary_style="none")
    scaled = AttentionAttrs(**{**base.__dict__, "q_scaling": q_scaling})
    q, args, pool = _mixed_batch(base, torch.float64)
    out = paged_attention(scaled, q, *args, pool)
    expected = paged_attention(base, q / q_scaling, *args, pool)
    if q_scaling == 2.0:
        assert torch.equal(out, expected)
    else:
        torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    unscaled = paged_attention(base, q, *args, pool)
    for rows in (slice(0, 4), slice(4, 6)):  # the prefill chunk, the decodes: both really change
        assert (out[rows] - unscaled[rows]).abs().max() > 1e-3


def test_q_scaling_is_left_out_of_the_graph_at_1_and_kept_otherwise() -> None:
    """The byte rule: a PagedAttention node built without q_scaling has the attributes it had before the field
    existed (tests/test_pinned_bytes.py pins those graphs); any other value is written, and both read back."""
    a = AttentionAttrs(layer=2, num_heads=8, num_kv_heads=2, head_size=64, tokens_per_block=16, sliding_window=4)
    plain = a.to_attributes("PagedAttention")
    assert list(plain) == [
        "layer",
        "num_heads",
        "num_kv_heads",
        "head_size",
        "tokens_per_block",
        "sliding_window",
        "kv_cache_dtype",
        "kv_scale",
    ]
    assert AttentionAttrs.from_attributes("PagedAttention", plain).q_scaling == 1.0
    gemma = AttentionAttrs(**{**a.__dict__, "q_scaling": 1.7})
    assert gemma.to_attributes("PagedAttention") == {**plain, "q_scaling": 1.7}
    assert "q_scaling" not in gemma.to_attributes("KVCacheWrite")
    back = AttentionAttrs.from_attributes("PagedAttention", gemma.to_attributes("PagedAttention"))
    assert back.q_scaling == 1.7 and back.sliding_window == 4
    with pytest.raises(ValueError, match="unknown attributes"):
        AttentionAttrs.from_attributes("KVCacheWrite", {**plain, "q_scaling": 1.7})


@pytest.mark.parametrize("bad", [0.0, -1.7, float("nan"), float("inf"), True, "1.7"])
def test_q_scaling_must_be_a_finite_positive_number(bad: Any) -> None:
    with pytest.raises(ValueError, match=r"q_scaling .*expected a finite number > 0"):
        AttentionAttrs(layer=0, num_heads=4, num_kv_heads=2, head_size=16, tokens_per_block=16, q_scaling=bad)


def test_tensorrt_parses_plugin_nodes_with_every_field() -> None:
    """tensorrt.plugin takes no default field values, so what TensorRT parses carries q_scaling even where the graph
    left it out; the graph itself is not changed."""
    from onnx import helper

    from toolchain.engine.onnx_fields import complete_plugin_fields

    a = AttentionAttrs(layer=0, num_heads=4, num_kv_heads=2, head_size=16, tokens_per_block=16)
    ins = ["q", "position_ids", "context_lens", "new_lens", "block_tables", "kv_cache"]
    nodes = [
        helper.make_node("KVCacheWrite", ins, ["q0"], domain="trtbuild", **a.to_attributes("KVCacheWrite")),
        helper.make_node("PagedAttention", ins, ["o0"], domain="trtbuild", **a.to_attributes("PagedAttention")),
        helper.make_node(
            "PagedAttention",
            ins,
            ["o1"],
            domain="trtbuild",
            **AttentionAttrs(**{**a.__dict__, "q_scaling": 1.7}).to_attributes("PagedAttention"),
        ),
        helper.make_node("Relu", ["o1"], ["y"]),
    ]
    model = helper.make_model(helper.make_graph(nodes, "g", [], []))
    before = model.SerializeToString()
    done = complete_plugin_fields(model)
    assert model.SerializeToString() == before
    assert [done.graph.node[i] for i in (0, 2, 3)] == [model.graph.node[i] for i in (0, 2, 3)]  # nothing to add
    added = done.graph.node[1].attribute
    assert added[:-1] == model.graph.node[1].attribute and {f.name for f in added} == OP_FIELDS["PagedAttention"]
    assert added[-1].name == "q_scaling" and added[-1].type == onnx.AttributeProto.FLOAT and added[-1].f == 1.0


def test_tensorrt_registration_declares_the_op_fields() -> None:
    """The TensorRT plugin fields (register and aot_impl signatures of tensorrt_registration.py, read without
    TensorRT) are each op's OP_FIELDS, in AttentionAttrs' order, the same in both functions."""
    import ast

    source = (Path(plugin_compile.__file__).parent / "tensorrt_registration.py").read_text()
    order = [f.name for f in dataclasses.fields(AttentionAttrs)]
    seen = {}
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, ast.FunctionDef):
            continue
        for deco in fn.decorator_list:
            if isinstance(deco, ast.Call) and isinstance(deco.func, ast.Attribute):
                kind = deco.func.attr
                if kind not in ("register", "aot_impl"):
                    continue
                op = ast.literal_eval(deco.args[0]).split("::")[1]
                names = [
                    p.arg
                    for p in fn.args.args
                    if "TensorDesc" not in ast.unparse(p.annotation) and p.arg not in ("outputs", "tactic")
                ]
                assert names == sorted(OP_FIELDS[op], key=order.index), (fn.name, op)
                seen[(op, kind)] = names
    assert len(seen) == 4 and "q_scaling" in seen[("PagedAttention", "aot_impl")]
