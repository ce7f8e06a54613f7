"""Shared fixtures: tiny random HF Llamas written by transformers, the shared real model, a CLI runner."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

# The Triton kernels (toolchain/plugins/kernels) run on CPU tensors under Triton's interpreter, which `triton.jit`
# chooses when it decorates: set before anything imports them. Compiling them to PTX needs the opposite, so the
# tests that compile do it in a subprocess without this variable.
os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from toolchain import seeded
from toolchain.cli import app
from toolchain.files import JSON_LIMIT
from toolchain.manifest import file_entry, read_manifest, write_manifest

# the server tests' fixtures (tests/serve/fixtures.py says why they are a plugin)
pytest_plugins = ("tests.serve.fixtures",)

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"
STORIES = SHARED / "models" / "stories260K-hf"
WIKI = SHARED / "wikitext-2"

BASE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "vocab_size": 97,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}


def wide_init(is_norm: Callable[[str], bool]) -> seeded.Init:
    """Test models' weights, the same bytes on every CPU (toolchain.seeded): norm weights around 1 (std 0.2),
    everything else std 0.15."""

    def value(name: str, p: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        if is_norm(name):
            return seeded.normal(p.shape, gen, std=0.2, mean=1.0, dtype=p.dtype)
        return seeded.normal(p.shape, gen, std=0.15, dtype=p.dtype)

    return value


def save_random_llama(path: Path, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any) -> Path:
    """A random Llama saved by transformers. Weights are drawn wide (norms around 1, not exactly 1) so that a
    swapped tensor or a wrong rotary changes the logits and their argmax by a clear margin."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**{**BASE, **overrides}))
    seeded.fill_(list(model.named_parameters()), seed, wide_init(lambda name: name.endswith("norm.weight")))
    model.to(dtype).save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture
def make_llama(tmp_path: Path) -> Callable[..., Path]:
    counter = iter(range(1000))

    def make(**overrides: Any) -> Path:
        return save_random_llama(tmp_path / f"hf{next(counter)}", **overrides)

    return make


@pytest.fixture(scope="session")
def stories() -> Path:
    if not (STORIES / "config.json").is_file():
        pytest.skip(f"shared data absent: {STORIES} (present in CI; a fresh clone has no ../shared)")
    return STORIES


@pytest.fixture(scope="session")
def plugin_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the tests compile the Triton kernels ahead of time: a cache kept across runs,
    $XDG_CACHE_HOME/trtbuild/plugins (~/.cache/trtbuild/plugins), or a temporary dir where that is not writable.
    compile_kernel names each entry by a hash of the kernel sources, Triton version, variant, SM and options, so a
    changed kernel or compiler compiles afresh and an unchanged one is not recompiled on every run."""
    path = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trtbuild" / "plugins"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError:
        return tmp_path_factory.mktemp("plugins")
    return path


@pytest.fixture
def cli() -> Callable[..., Any]:
    runner = CliRunner()

    def invoke(*args: str) -> Any:
        return runner.invoke(app, [str(a) for a in args])

    return invoke


def reseal(directory: Path) -> Path:
    """Record `directory`'s files as they are now in its manifest (sizes, hashes, seal): what a stage that had
    written them so would have recorded. For tests of what lies beyond the integrity check (integrity.py)."""
    manifest = read_manifest(directory)
    manifest["outputs"] = [file_entry(directory / e["path"], directory) for e in manifest["outputs"]]
    write_manifest(directory, manifest)
    return directory


def one_line_error(result: Any) -> str:
    """Assert the user-error contract: exit 1, exactly one line on stderr starting with 'error:'."""
    assert result.exit_code == 1, (result.exit_code, result.stdout, result.stderr)
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error:")]
    assert len(errors) == 1, result.stderr
    assert "Traceback" not in result.stderr
    return errors[0]


def nothing_written(out: Path) -> None:
    """Assert that a refused stage left neither `out` nor its temporary sibling behind."""
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


def edit_config(hf_dir: Path, **changes: Any) -> None:
    """Change fields of a Hugging Face model's config.json in place."""
    path = hf_dir / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def edit_weights(hf_dir: Path, fn: Any) -> None:
    """Apply `fn` to a Hugging Face model's tensors and save them back."""
    path = hf_dir / "model.safetensors"
    tensors = load_file(str(path))
    fn(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def convert_fails(cli: Any, hf_dir: Path, out: Path, *extra: str) -> str:
    """Convert, assert the user-error contract and that nothing was written; the error line."""
    line = one_line_error(cli("convert", hf_dir, "-o", out, *extra))
    nothing_written(out)
    return line


@contextmanager
def deadline(seconds: int) -> Iterator[None]:
    """Fail (rather than hang) if the block takes longer: SIGALRM interrupts a blocking open or read."""

    def expire(signum: int, frame: Any) -> None:
        raise TimeoutError(f"still running after {seconds} s: the input was not refused before reading")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def not_a_file(path: Path, kind: str) -> None:
    """Make `path` one of the things a fuzzer puts where a file should be."""
    path.unlink(missing_ok=True)
    if kind == "dev-zero":
        path.symlink_to("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "huge":
        with path.open("wb") as f:
            f.truncate(JSON_LIMIT + 1)  # sparse: no disk used, but larger than any config
    else:
        raise AssertionError(kind)


# What the one-line refusal says for each kind of not_a_file.
NOT_A_FILE_ERRORS = {
    "dev-zero": "not a regular file (a character device through a symlink to /dev/zero)",
    "fifo": "not a regular file (a FIFO",
    "directory": "not a regular file (a directory",
    "huge": "over the 64.0 MiB limit",
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny demo Llama (Hugging Face format), made once per test module."""
    from toolchain.checkpoint.tiny import make_tiny_llama

    hf = tmp_path_factory.mktemp("tiny") / "hf"
    make_tiny_llama(hf, seed=0)
    return hf


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CPU engine of the tiny demo Llama, built once per test module (tests copy it before damaging it)."""
    from toolchain.checkpoint.convert import convert
    from toolchain.checkpoint.tiny import make_tiny_llama
    from toolchain.engine.build import BuildOptions, build_engine

    tmp = tmp_path_factory.mktemp("fuzz-engine")
    make_tiny_llama(tmp / "hf", seed=0)
    convert(tmp / "hf", tmp / "ckpt")
    build_engine(tmp / "ckpt", tmp / "engine", BuildOptions(backend="onnxruntime", max_seq_len=128, max_batch_size=4))
    return tmp / "engine"


def mooncake(path: Path, *records: dict[str, Any] | str) -> Path:
    """Write a Mooncake-style JSONL trace: one line per record, a dict as JSON or a string as it is."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path
