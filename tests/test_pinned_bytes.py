"""The bytes are pinned: every quantization method's checkpoint and engine graph, on four families built here from
fixed seeds, hash to the sha256 recorded in tests/pins/bytes.json, on any machine.

Two promises in one file. Refactors keep the bytes (recorded first at 1240021, before issue 12's model description
and method registry). And the bytes do not depend on the machine (issue 22): the test models come from
toolchain.seeded's integer generator, calibration and the searches run in float64 and round once
(docs/conversion.md, "Same bytes on any CPU"), and `test_bytes_do_not_depend_on_the_machine` makes every case again
in fresh processes under each kernel set torch can dispatch to on this CPU (ATEN_CPU_CAPABILITY default, avx2,
avx512 where the CPU has it) with 1 thread, and under default with 2 threads and MKL_CBWR=COMPATIBLE (MKL,
which does the float64 matmuls, picks its own code path by CPU).

What it cannot cover: instruction sets this runner lacks (an AVX-512 kernel on an AVX2-only runner, aarch64's NEON
and SVE kernels, AMX), other BLAS builds than the pinned torch wheel's, and other torch versions (the pins are of
torch 2.13.0, as `make setup` installs it). CI runners of other CPU models cover some of that by running this same
file against the same pins.

Record again only for a change meant to alter the output, and say why in the commit:
    .venv/bin/python tests/test_pinned_bytes.py --record
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from toolchain import seeded
from toolchain.checkpoint.convert import convert
from toolchain.checkpoint.tiny import make_tiny_llama
from toolchain.engine.build import BuildOptions, build_engine
from toolchain.quantize.scheme import DEFAULT_EXCLUDE
from toolchain.quantize.stage import QuantizeOptions, quantize_checkpoint

PINS = Path(__file__).parent / "pins" / "bytes.json"
FILES = ("config.json", "rank0.safetensors")

# name -> (family, method, kv cache, group size, sq alpha, excluded modules)
CASES: dict[str, tuple[str, str, str, int, Any, tuple[str, ...]]] = {
    "llama-w8a16": ("llama", "w8a16", "none", 128, 0.5, DEFAULT_EXCLUDE),
    "llama-w4a16-g32": ("llama", "w4a16", "none", 32, 0.5, DEFAULT_EXCLUDE),
    "llama-w4a16_awq-g64": ("llama", "w4a16_awq", "none", 64, 0.5, DEFAULT_EXCLUDE),
    "llama-w8a8_sq-int8kv": ("llama", "w8a8_sq", "int8", 128, 0.5, DEFAULT_EXCLUDE),
    "llama-w8a8_sq-auto": ("llama", "w8a8_sq", "none", 128, "auto", DEFAULT_EXCLUDE),
    "llama-fp8-fp8kv": ("llama", "fp8", "fp8", 128, 0.5, DEFAULT_EXCLUDE),
    "gpt2-w8a8_sq": ("gpt2", "w8a8_sq", "none", 128, 0.5, DEFAULT_EXCLUDE),
    "gpt2-fp8": ("gpt2", "fp8", "none", 128, 0.5, DEFAULT_EXCLUDE),
    "qwen3-w4a16_awq-int8kv": ("qwen3", "w4a16_awq", "int8", 32, 0.5, DEFAULT_EXCLUDE),
    "qwen2-w8a16": ("qwen2", "w8a16", "none", 128, 0.5, DEFAULT_EXCLUDE),
    # recorded later, at 04ba690 (before the review fixes of issue 12 they guard): a streamable method with KV
    # calibration, lm_head quantized (AWQ's lm_head group), one SmoothQuant group left float. Every AWQ case was
    # re-recorded at 169e7f5, when AWQ's scale search took on the weight-term candidates on purpose.
    "llama-w8a16-int8kv": ("llama", "w8a16", "int8", 128, 0.5, DEFAULT_EXCLUDE),
    "llama-w4a16_awq-lm_head": ("llama", "w4a16_awq", "none", 64, 0.5, ()),
    "llama-w8a8_sq-float_proj": ("llama", "w8a8_sq", "none", 128, 0.5, ("lm_head", "mlp.proj")),
    # recorded with issue 23: Phi-3's fused [up; gate] mlp.fc, smoothed as one linear, with an int8 KV cache
    "phi3-w8a8_sq-int8kv": ("phi3", "w8a8_sq", "int8", 128, 0.5, DEFAULT_EXCLUDE),
}
FAMILIES = ("llama", "gpt2", "qwen3", "qwen2", "phi3")


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _text(path: Path) -> Path:
    """Calibration text the byte-level tokenizer reads: fixed, varied, a few thousand bytes."""
    g = torch.Generator().manual_seed(7)
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "then", "ran", "far", "away", "from", "home", "!", ","]
    picks = torch.randint(len(words), (3000,), generator=g).tolist()
    path.write_text(" ".join(words[i] for i in picks) + "\n")
    return path


def _hf(root: Path, family: str) -> Path:
    """A tiny HF model of `family` with the demo's byte-level tokenizer (vocab 320)."""
    demo = root / "demo-hf"
    if not demo.exists():
        make_tiny_llama(demo)
    if family == "llama":
        return demo
    import transformers

    out = root / f"{family}-hf"
    if out.exists():
        return out
    small = {"vocab_size": 320, "max_position_embeddings": 128}
    qwen = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4}
    config = {
        "gpt2": lambda: transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=128, vocab_size=320),
        "qwen3": lambda: transformers.Qwen3Config(**qwen, num_key_value_heads=2, head_dim=24, **small),
        "qwen2": lambda: transformers.Qwen2Config(**qwen, num_key_value_heads=2, **small),
        "phi3": lambda: transformers.Phi3Config(
            **qwen, num_key_value_heads=2, pad_token_id=None, bos_token_id=1, eos_token_id=2, **small
        ),
    }[family]()
    model_cls = {
        "gpt2": transformers.GPT2LMHeadModel,
        "qwen3": transformers.Qwen3ForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM,
        "phi3": transformers.Phi3ForCausalLM,
    }[family]
    model = model_cls(config)
    seeded.fill_(list(model.named_parameters()), 1, seeded.matrices(0.02))
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(demo / name, out / name)
    return out


def produce(root: Path, name: str) -> dict[str, str]:
    family, method, kv, group, alpha, exclude = CASES[name]
    ckpt = root / f"{family}-ckpt"
    if not ckpt.exists():
        convert(_hf(root, family), ckpt)
    text = root / "calib.txt"
    if not text.exists():
        _text(text)
    opts = QuantizeOptions(
        method, kv, group, calib_data=text, calib_samples=8, calib_seq_len=64, exclude=exclude, sq_alpha=alpha
    )
    quantize_checkpoint(ckpt, root / name / "ckpt", opts)
    build_engine(root / name / "ckpt", root / name / "engine", BuildOptions("onnxruntime", tokens_per_block=8))
    hashes = {f: _sha(root / name / "ckpt" / f) for f in FILES}
    hashes["model.onnx"] = _sha(root / name / "engine" / "model.onnx")
    return hashes


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pinned")


@pytest.mark.parametrize("name", list(CASES))
def test_bytes_are_pinned(name: str, root: Path) -> None:
    pinned = json.loads(PINS.read_text())[name]
    assert produce(root, name) == pinned


def _capabilities() -> list[str]:
    """The kernel sets torch can dispatch to on this CPU (ATEN_CPU_CAPABILITY only lowers it), lowest first."""
    x86 = ["default", "avx2", "avx512"]
    best = torch.backends.cpu.get_cpu_capability().lower()
    return x86[: x86.index(best) + 1] if best in x86 else sorted({"default", best})


@pytest.mark.slow
@pytest.mark.parametrize(  # with `test_bytes_are_pinned` (the best kernel set, torch's default thread count)
    ("capability", "threads", "mkl"), [*((c, 1, "") for c in _capabilities()), ("default", 2, "COMPATIBLE")]
)
def test_bytes_do_not_depend_on_the_machine(capability: str, threads: int, mkl: str, tmp_path: Path) -> None:
    """ATEN_CPU_CAPABILITY picks torch's own kernels; the float64 matmuls of calibration go to MKL, which picks its
    code path by CPU on its own: MKL_CBWR=COMPATIBLE makes it take another one (it changes most dgemm results in
    their last bits), as a CPU of another model would."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability, "OMP_NUM_THREADS": str(threads)}
    if mkl:
        env["MKL_CBWR"] = mkl
    done = subprocess.run(
        [sys.executable, __file__, "--print", str(tmp_path)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    ran = json.loads(done.stdout.splitlines()[-1])
    assert (ran["capability"], ran["threads"]) == (capability.upper(), threads)  # the setting took effect
    pinned = json.loads(PINS.read_text())
    differ = sorted(name for name in CASES if ran["hashes"][name] != pinned[name])
    assert not differ, f"under ATEN_CPU_CAPABILITY={capability}, {threads} thread(s): {differ} differ from the pins"


if __name__ == "__main__" and sys.argv[1:2] == ["--print"]:  # the machine test's child: every case, as JSON
    hashes = {name: produce(Path(sys.argv[2]), name) for name in CASES}
    capability, threads = torch.backends.cpu.get_cpu_capability(), torch.get_num_threads()
    print(json.dumps({"capability": capability, "threads": threads, "hashes": hashes}))
elif __name__ == "__main__" and sys.argv[1:] == ["--record"]:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        pins = {name: produce(Path(tmp), name) for name in CASES}
    PINS.write_text(json.dumps(pins, indent=2) + "\n")
    print(f"recorded {len(pins)} cases in {PINS}")
