"""The server tests' fixtures: the tiny Llama checkpoint, its engines (batch 16, and batch 1 for queue tests), its
tokenizer, an API-keys file, and in-process servers over them (helpers.py has the rest). A plugin that
tests/conftest.py loads (a conftest.py here would shadow the root one's `from conftest import ...`); module-scoped,
so each test module that asks gets its own engine and server."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.serve.helpers import KEYS, LIMITS, Running, build_serving_engine, running
from toolchain.checkpoint.convert import convert
from toolchain.checkpoint.tiny import make_tiny_llama
from toolchain.engine.api import load_tokenizer


# -- fixtures ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("serve")
    make_tiny_llama(tmp / "hf")
    convert(tmp / "hf", tmp / "ckpt")
    return tmp / "ckpt"


@pytest.fixture(scope="module")
def engine_dir(checkpoint: Path) -> Path:
    return build_serving_engine(checkpoint, "engine", max_batch_size=16)


@pytest.fixture(scope="module")
def one_at_a_time(checkpoint: Path) -> Path:
    """An engine that runs one sequence at a time: a second request waits, a third finds the queue full."""
    return build_serving_engine(checkpoint, "engine-batch1", max_batch_size=1)


@pytest.fixture(scope="module")
def engine_sha256(engine_dir: Path) -> str:
    return hashlib.sha256((engine_dir / "manifest.json").read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def tokenizer(engine_dir: Path) -> Any:
    return load_tokenizer(engine_dir)


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "api-keys"
    lines = [f"{kid}:{hashlib.sha256(key.encode()).hexdigest()}{LIMITS[kid]}" for kid, key in KEYS.items()]
    path.write_text("# id:sha256hex(key)[:limits]\n" + "\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def server(engine_dir: Path) -> Iterator[Running]:
    with running(engine_dir) as r:
        yield r


@pytest.fixture(scope="module")
def keyed(engine_dir: Path, keys_file: Path) -> Iterator[Running]:
    with running(engine_dir, api_keys=keys_file) as r:
        yield r
