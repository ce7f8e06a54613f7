"""The Triton kernels compiled ahead of time without a GPU (toolchain/plugins/compile.py): every kernel of every
variant compiles for every SM with no register spill, to a PTX whose entry takes exactly what TensorRT passes
(the hidden scratch parameters stripped, ptx.py) and a cubin built from that PTX; and the test vectors still say
what the reference ops compute.

pytest runs with TRITON_INTERPRET=1 (conftest), under which triton.compile cannot work: the compiles run in a
subprocess without it, `trtbuild plugins compile --json` into the plugin cache (conftest's plugin_cache), so a
repeated run compiles nothing (cold, every SM: about a minute on 2 cores)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch
from conftest import one_line_error

from toolchain.engine.ops import OP_FIELDS, AttentionAttrs, MoEAttrs, kv_cache_write, paged_attention
from toolchain.errors import UserError
from toolchain.plugins import compile as aot
from toolchain.plugins import ptx as ptxtext
from toolchain.plugins.kernels import COMPILED, KERNELS, common, moe, moe_sort

ROOT = Path(__file__).resolve().parents[2]
VECTORS = sorted((ROOT / "tests" / "vectors").glob("*.npz"))
HALF = {"f16": torch.float16, "bf16": torch.bfloat16}
POOL = {"f16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.uint8, "int8": torch.int8}
CUOBJDUMP = Path(aot._ptxas(80)[0]).with_name("cuobjdump")


def _compile(*args: str | Path, timeout: int = 900) -> subprocess.CompletedProcess[str]:
    """`trtbuild plugins compile ARGS` in a process without TRITON_INTERPRET (the kernels then are jit functions)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "toolchain.cli", "plugins", "compile", *map(str, args)]
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture(scope="module")
def compiled(plugin_cache: Path) -> dict[str, Any]:
    """Every variant on every SM, --json; compiles only what the cache lacks."""
    start = time.perf_counter()
    result = _compile("--json", "--out", plugin_cache)
    assert result.returncode == 0, result.stderr[-3000:]
    info: dict[str, Any] = json.loads(result.stdout)
    info["wall_s"] = time.perf_counter() - start
    return info


def _records(info: dict[str, Any]) -> list[tuple[str, str, str, dict[str, Any]]]:
    return [(a, v, op, r) for a, vs in info["archs"].items() for v, ops in vs.items() for op, r in ops.items()]


def _expected_params(op: str, variant: aot.Variant) -> list[str]:
    """What TensorRT passes, from the kernel module's signature: pointers (u64), then int32 scalars, in order."""
    sig = COMPILED[op].signature(variant.attrs, variant.activation)
    return ["u64 ptr" if t.startswith("*") else "u32" for t in sig.values() if t != "constexpr"]


@pytest.mark.slow
def test_every_variant_compiles_for_every_sm_without_spills(compiled: dict[str, Any]) -> None:
    assert set(compiled["archs"]) == set(aot.ARCHS) == {"sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120"}
    for arch, variants in compiled["archs"].items():
        assert set(variants) == {v.name for v in aot.VARIANTS}, arch
        assert all(set(ops) == set(v.ops) for v in aot.VARIANTS for ops in [variants[v.name]]), arch
    records = _records(compiled)
    assert compiled["kernels"] == len(records) == len(aot.ARCHS) * sum(len(v.ops) for v in aot.VARIANTS)
    spilling = [(a, v, op, r["spill_stores"], r["spill_loads"]) for a, v, op, r in records if r["spills"]]
    assert not spilling and compiled["spills"] == 0
    fields = {"name", "registers", "spill_stores", "spill_loads", "spills", "shared_bytes", "static_shared_bytes"}
    fields |= {"stack_bytes", "threads", "num_warps", "params", "ptx_version", "cached", "compile_s", "key", "ptx"}
    for arch, _, op, r in records:
        assert set(r) == fields | {"cubin"}, set(r) ^ (fields | {"cubin"})
        assert r["threads"] == r["num_warps"] * 32 == COMPILED[op].NUM_WARPS * 32
        assert r["registers"] > 0 and r["static_shared_bytes"] == 0 and r["stack_bytes"] == 0
        # beyond 48 KiB of dynamic shared memory a launch needs cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)
        # first, which TensorRT's ahead-of-time launch is not known to make (docs/kernels.md)
        assert r["shared_bytes"] <= 48 * 1024, (arch, op, r["shared_bytes"])
        assert r["ptx_version"] == "{}.{}".format(*divmod(aot.PTX_ISA[int(arch[3:])], 10))
    assert compiled["triton"] == "3.9.0"


@pytest.mark.slow
def test_ptx_entries_take_exactly_what_tensorrt_passes(compiled: dict[str, Any]) -> None:
    """The attention-pool kernels: 6 input pointers (7 with attention sinks), the int32 scalars (common.SCALARS), 1
    output pointer; the MoE
    kernel: 5 input pointers (6 with biases), no scalar, 1 output pointer — derived from each kernel module's
    signature — in the PTX TensorRT loads and in the cubin ptxas made of it (cuobjdump's parameter sizes)."""
    variants = {v.name: v for v in aot.VARIANTS}
    seen = set()
    for arch, name, op, r in _records(compiled):
        expected = _expected_params(op, variants[name])
        if op in KERNELS:
            inputs = 6 + (op == "PagedAttention" and variants[name].attrs.sinks)
            assert expected == ["u64 ptr"] * inputs + ["u32"] * len(common.SCALARS) + ["u64 ptr"]
        elif op == moe_sort.OP:  # the routing's experts, the token count, assignments and offsets
            assert expected == ["u64 ptr", "u32", "u64 ptr", "u64 ptr"]
        else:
            assert expected == ["u64 ptr"] * (6 + variants[name].attrs.moe.use_bias)
        text = Path(r["ptx"]).read_text()
        entry, params = ptxtext.entry(text)
        assert entry == r["name"] and [str(p) for p in params] == expected == r["params"], (arch, name, op)
        assert f".reqntid {r['threads']}" in text and ptxtext.version(text) == r["ptx_version"]
        cubin = Path(r["cubin"])
        if (arch, op) not in seen:  # one cubin per SM and kernel: cuobjdump costs ~50 ms each
            seen.add((arch, op))
            elf = subprocess.run([CUOBJDUMP, "-elf", cubin], capture_output=True, text=True, check=True).stdout
            sizes = dict(re.findall(r"Ordinal : (0x[0-9a-f]+)\s+Offset\s+: 0x[0-9a-f]+\s+Size\s+: (0x[0-9a-f]+)", elf))
            assert [int(sizes[k], 16) for k in sorted(sizes, key=lambda o: int(o, 16))] == [
                8 if t.startswith("u64") else 4 for t in expected
            ], (arch, op)
        assert cubin.read_bytes()[:4] == b"\x7fELF"


@pytest.mark.slow
def test_a_second_run_compiles_nothing(compiled: dict[str, Any], plugin_cache: Path) -> None:
    start = time.perf_counter()
    result = _compile("--json", "--out", plugin_cache, "--strict")
    warm = time.perf_counter() - start
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["compiled"] == 0 and all(r["cached"] for *_, r in _records(info))
    assert {k: v for k, v in info.items() if k not in ("archs", "compiled", "compile_s")} == {
        k: v for k, v in compiled.items() if k not in ("archs", "compiled", "compile_s", "wall_s")
    }
    assert warm < 60, warm  # a subprocess importing torch and triton, hashing, reading the records


@pytest.mark.slow
def test_the_table_names_every_kernel_on_every_sm(compiled: dict[str, Any], plugin_cache: Path) -> None:
    result = _compile("--arch", "sm_100", "--arch", "sm_80,sm_89", "--out", plugin_cache)
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines() if line.startswith("sm_")]
    expected = [
        [arch, v.name, r["name"], *(str(r[f]) for f in ("registers", "spills", "shared_bytes", "threads"))]
        for arch in ("sm_100", "sm_80", "sm_89")
        for v in aot.VARIANTS
        for r in (compiled["archs"][arch][v.name][op] for op in v.ops)
    ]
    assert rows == expected


def test_strict_fails_on_a_spill_and_names_it(cli: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """--strict turns any spill into exit 1 naming kernel, variant and SM; without it the table shows them."""
    variant = aot.VARIANTS[0]
    job = aot.Job("PagedAttention", variant.name, variant.activation, variant.attrs, "sm_86")
    params = _expected_params(job.op, variant)
    kernel = aot.CompiledKernel(
        op=job.op, name="attention_kernel", arch="sm_86", activation=variant.activation, ptx="", cubin=b"",
        registers=255, spill_stores=24, spill_loads=16, shared_bytes=1024, static_shared_bytes=0, stack_bytes=40,
        num_warps=4, threads=128, params=params, ptx_version="8.0", triton_version="3.9.0", ptxas_version="12.9",
        key="0" * 20,
    )  # fmt: skip
    monkeypatch.setattr(aot, "compile_variants", lambda *a, **k: [(job, kernel)])
    line = one_line_error(cli("plugins", "compile", "--out", tmp_path, "--strict"))
    assert "40 bytes of register spills" in line and f"attention_kernel {variant.name} sm_86" in line
    result = cli("plugins", "compile", "--out", tmp_path, "--json")
    assert result.exit_code == 0 and json.loads(result.stdout)["spills"] == 40


@pytest.mark.parametrize("arch", ["sm_75", "sm_70", "sm_8", "sm_999", "compute_90", "sm_90a"])
def test_an_unsupported_sm_is_refused_in_one_line_naming_the_supported_ones(
    arch: str, cli: Any, tmp_path: Path
) -> None:
    line = one_line_error(cli("plugins", "compile", "--arch", f"sm_90,{arch}", "--out", tmp_path / "out"))
    assert f"--arch {arch}" in line and "sm_80, sm_86, sm_89, sm_90, sm_100, sm_120" in line
    assert not (tmp_path / "out").exists()  # refused before anything was compiled or written


def test_compiling_under_the_interpreter_is_refused_clearly() -> None:
    """In this process TRITON_INTERPRET=1 made every kernel an interpreted function: triton.compile cannot take it."""
    v = aot.VARIANTS[0]
    with pytest.raises(UserError, match=r"TRITON_INTERPRET is set in this process.*without TRITON_INTERPRET"):
        aot.compile_kernel("PagedAttention", v.attrs, v.activation, "sm_90")


def test_the_variants_take_every_code_path_of_the_attributes() -> None:
    """Every activation x pool dtype on the standard layer, and each other shape or option at least once; both MoE
    stages of a Qwen3-30B-A3B-like layer in fp16 and bf16, of a small one and of gpt-oss-20b's (clamped SwiGLU),
    whose YaRN attention layer is a variant too."""
    attention = [v for v in aot.VARIANTS if v.ops == tuple(KERNELS)]
    pairs = {(v.activation, v.attrs.kv_cache_dtype) for v in attention}
    for act in ("float16", "bfloat16"):
        assert {(act, act), (act, "int8"), (act, "fp8")} <= pairs
    experts = [v for v in aot.VARIANTS if v.ops == (moe.OP,)]
    sorts = [v for v in aot.VARIANTS if v.ops == (moe_sort.OP,)]
    assert len(attention) + len(experts) + len(sorts) == len(aot.VARIANTS)
    # the sort: 128 experts (E_BLOCK = E), 32, and 8; top 2 to 8
    assert {(v.attrs.number_of_experts, v.attrs.top_k) for v in sorts} == {(128, 8), (32, 4), (8, 2)}
    qwen3 = MoEAttrs(number_of_experts=128, top_k=8, expert_hidden_size=2048, expert_inter_size=768)
    for act in ("float16", "bfloat16"):
        assert {(act, moe.Stage(qwen3, s)) for s in moe.STAGES} <= {(v.activation, v.attrs) for v in experts}
    small = [v.attrs.moe for v in experts if v.attrs.moe != qwen3 and not v.attrs.moe.clamped_swiglu]
    assert small and all(m.use_bias and m.activation == "gelu" and m.expert_inter_size % 16 for m in small)
    assert any(v.attrs.moe.clamped_swiglu and v.attrs.moe.swiglu_limit for v in experts)  # gpt-oss's SwiGLU
    attrs = [v.attrs for v in attention]
    assert {a.head_size for a in attrs} >= {128, 64, 8} and any(a.head_size & (a.head_size - 1) for a in attrs)
    assert {a.tokens_per_block for a in attrs} >= {16, 32, 64}
    assert {a.rotary_style for a in attrs} == {"neox", "none"}
    assert {a.rotary_scaling_type for a in attrs} == {"none", "linear", "llama3", "yarn"}
    assert any(a.sliding_window for a in attrs) and any(a.num_heads == a.num_kv_heads for a in attrs)
    # gpt-oss's attention sinks on both of its layer kinds: the sliding window and full attention
    assert {a.sliding_window > 0 for a in attrs if a.sinks} == {True, False}
    assert len({v.name for v in aot.VARIANTS}) == len(aot.VARIANTS)
    for v in aot.VARIANTS:
        for op in v.ops:
            COMPILED[op].check(v.attrs, v.activation)  # no variant is one the kernels refuse


def _ptx(num: int, body: str) -> str:
    """A Triton-shaped PTX entry: `num` own parameters (pointers, then u32), then the two hidden u64 pointers."""
    pointer = ".param .u64 .ptr .global .align 1 k_param_{}".format
    own = [pointer(i) for i in range(num - 1)] + [f".param .u32 k_param_{num - 1}"]
    decl = ",\n\t".join([*own, pointer(num), pointer(num + 1)])
    return f".version 8.0\n.target sm_80\n.visible .entry k(\n\t{decl}\n)\n.reqntid 128\n{{\n{body}\n\tret;\n}}\n"


def test_the_hidden_scratch_parameters_are_stripped_when_unused() -> None:
    body = "\tld.param.b64 %rd1, [k_param_1];\n\tld.param.b32 %r1, [k_param_12];"  # k_param_1: a prefix of 14, 15
    text = _ptx(13, body)
    assert [str(p) for p in ptxtext.entry(text)[1]][-2:] == ["u64 ptr", "u64 ptr"]
    stripped = ptxtext.strip_hidden_params(text, 13)
    name, params = ptxtext.entry(stripped)
    assert name == "k" and [p.name for p in params] == [f"k_param_{i}" for i in range(13)]
    declaration = re.compile(r"\(.*?\)", re.S)
    assert declaration.sub("()", stripped) == declaration.sub("()", text)  # nothing but the declaration changed
    assert "k_param_13" not in stripped and "k_param_14" not in stripped


@pytest.mark.parametrize(("param", "what"), [(13, "global scratch"), (14, "profile scratch")])
def test_a_kernel_that_reads_its_scratch_is_refused(param: int, what: str) -> None:
    text = _ptx(13, f"\tld.param.b64 %rd1, [k_param_{param}];\n\tld.param.b64 %rd2, [k_param_0];")
    with pytest.raises(ptxtext.ScratchError, match=f"kernel k reads its {what} parameter k_param_{param}: "):
        ptxtext.strip_hidden_params(text, 13)


def test_an_entry_without_the_two_hidden_parameters_is_refused() -> None:
    text = _ptx(13, "")
    with pytest.raises(ValueError, match="15 PTX parameters where its signature has 14"):
        ptxtext.strip_hidden_params(text, 14)  # the u32 would be taken for a hidden pointer
    with pytest.raises(ValueError, match="15 PTX parameters where its signature has 12"):
        ptxtext.strip_hidden_params(text, 12)


def test_ptxas_report_is_read_per_entry() -> None:
    log = (
        "ptxas info    : 0 bytes gmem\n"
        "ptxas info    : Compiling entry function 'other' for 'sm_90a'\n"
        "ptxas info    : Function properties for other\n"
        "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
        "ptxas info    : Used 12 registers, used 0 barriers, 384 bytes cmem[0]\n"
        "ptxas info    : Compiling entry function 'k' for 'sm_90a'\n"
        "ptxas info    : Function properties for k\n"
        "    48 bytes stack frame, 24 bytes spill stores, 16 bytes spill loads\n"
        "ptxas info    : Used 255 registers, used 1 barriers, 1024 bytes smem, 464 bytes cmem[0]\n"
    )
    assert ptxtext.parse_ptxas(log, "k") == ptxtext.PtxasReport(255, 24, 16, 1024, 48)
    assert ptxtext.parse_ptxas(log, "other") == ptxtext.PtxasReport(12, 0, 0, 0, 0)
    with pytest.raises(ValueError, match="reported nothing for entry missing"):
        ptxtext.parse_ptxas(log, "missing")


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
    """tensorrt.plugin takes no default field values, so what TensorRT parses carries q_scaling, sinks and the YaRN
    fields even where the graph left them out; attention with sinks (seven inputs) is renamed the plugin that takes
    them, PagedAttentionSinks; the graph itself is not changed."""
    from onnx import helper

    from toolchain.engine.onnx_fields import complete_plugin_fields

    a = AttentionAttrs(layer=0, num_heads=4, num_kv_heads=2, head_size=16, tokens_per_block=16)
    yarn = {"rotary_scaling_type": "yarn", "rotary_beta_fast": 8.0, "rotary_beta_slow": 2.0, "rotary_truncate": 0}
    every = AttentionAttrs(**{**a.__dict__, **yarn, "rotary_attention_factor": 1.1, "q_scaling": 1.7, "sinks": 1})
    ins = ["q", "position_ids", "context_lens", "new_lens", "block_tables", "kv_cache"]
    nodes = [
        helper.make_node("KVCacheWrite", ins, ["q0"], domain="trtbuild", **every.to_attributes("KVCacheWrite")),
        helper.make_node("PagedAttention", ins, ["o0"], domain="trtbuild", **a.to_attributes("PagedAttention")),
        helper.make_node(
            "PagedAttention", [*ins, "sinks"], ["o1"], domain="trtbuild", **every.to_attributes("PagedAttention")
        ),
        helper.make_node("Relu", ["o1"], ["y"]),
    ]
    model = helper.make_model(helper.make_graph(nodes, "g", [], []))
    before = model.SerializeToString()
    done = complete_plugin_fields(model)
    assert model.SerializeToString() == before
    assert [done.graph.node[i] for i in (0, 3)] == [model.graph.node[i] for i in (0, 3)]  # nothing to add
    renamed = onnx.NodeProto()
    renamed.CopyFrom(model.graph.node[2])
    renamed.op_type = "PagedAttentionSinks"
    assert done.graph.node[2] == renamed and model.graph.node[2].op_type == "PagedAttention"
    added = done.graph.node[1].attribute
    assert added[:-2] == model.graph.node[1].attribute and {f.name for f in added} == OP_FIELDS["PagedAttention"]
    assert added[-2].name == "q_scaling" and added[-2].type == onnx.AttributeProto.FLOAT and added[-2].f == 1.0
    assert added[-1].name == "sinks" and added[-1].type == onnx.AttributeProto.INT and added[-1].i == 0
