"""Every command that opens an engine refuses one whose bytes are not what its manifest records (exit 4, naming the
file and both hashes): one byte flipped in each of the engine's files in turn, the manifest itself included, for
diff, eval, generate, bench and serve; and the hash cache that keeps repeated opens cheap never hides a change."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

import toolchain.integrity as integrity
from toolchain.checkpoint.convert import convert
from toolchain.checkpoint.tiny import make_tiny_llama
from toolchain.engine.build import BuildOptions, build_engine
from toolchain.integrity import IntegrityError, check_engine
from toolchain.manifest import MANIFEST_NAME

REPO = Path(__file__).resolve().parents[1]
DEMO_TEXT = REPO / "recipes" / "data" / "demo.txt"


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("integrity")
    make_tiny_llama(root / "hf")
    convert(root / "hf", root / "ckpt")
    build_engine(root / "ckpt", root / "engine", BuildOptions("onnxruntime", max_batch_size=2, max_seq_len=128))
    trace = root / "trace.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.0,8,2\n2023-11-16 18:15:46.5,6,2\n")
    return {"root": root, "hf": root / "hf", "engine": root / "engine", "trace": trace}


@pytest.fixture(autouse=True)
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def flip(path: Path) -> None:
    """One bit of the byte in the middle of `path`, size and name unchanged."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def engine_files(engine: Path) -> list[str]:
    return sorted(p.relative_to(engine).as_posix() for p in engine.rglob("*") if p.is_file())


def commands(b: dict[str, Path], engine: Path) -> dict[str, list[Any]]:
    return {
        "diff": ["diff", b["engine"], engine, "--changes-only"],
        "eval": ["eval", engine, "--reference", b["hf"], "--data", DEMO_TEXT, "--max-tokens", "300"],
        "generate": ["generate", engine, "--prompt", "The build farm", "--max-new-tokens", "2"],
        "bench": ["bench", engine, "--trace", b["trace"], "--max-requests", "2"],
        "serve": ["serve", engine, "--port", "0"],
    }


def test_the_engine_as_built_passes(built: dict[str, Path]) -> None:
    check_engine(built["engine"])
    assert {"manifest.json", "model.onnx", "build_config.json"} <= set(engine_files(built["engine"]))


@pytest.mark.slow
def test_a_byte_flipped_in_any_file_is_refused_by_every_command(
    cli: Any, built: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import toolchain.serve.server as server

    def never_listen(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("serve got as far as listening with a tampered engine")

    monkeypatch.setattr(server.DrainingServer, "run", never_listen)
    files = engine_files(built["engine"])
    for name in files:
        engine = tmp_path / name.replace("/", "_")
        shutil.copytree(built["engine"], engine)
        flip(engine / name)
        for command, args in commands(built, engine).items():
            result = cli(*args)
            where = f"{command} with {name} flipped"
            assert result.exit_code == integrity.EXIT_CODE, f"{where}: exit {result.exit_code}\n{result.stderr}"
            errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
            assert len(errors) == 1 and "Traceback" not in result.stderr, f"{where}: {result.stderr}"
            error = errors[0]
            assert f"changed: {name}" in error, f"{where}: the file is not named: {error}"
            if name != MANIFEST_NAME:  # both hashes: the one on disk and the one the manifest records
                listed = {e["path"]: e["sha256"] for e in json.loads((engine / MANIFEST_NAME).read_text())["outputs"]}
                assert listed[name] in error and error.count("sha256") >= 1, f"{where}: {error}"


def test_an_unlisted_or_missing_file_is_refused(built: dict[str, Path], tmp_path: Path) -> None:
    extra, missing = tmp_path / "extra", tmp_path / "missing"
    for engine in (extra, missing):
        shutil.copytree(built["engine"], engine)
    (extra / "model.onnx.data").write_bytes(b"weights from elsewhere")
    (missing / "build_config.json").unlink()
    with pytest.raises(IntegrityError, match=r"unlisted: model\.onnx\.data"):
        check_engine(extra)
    (missing / "build_config.json").write_text("{}")  # an engine dir again, just not this engine's
    with pytest.raises(IntegrityError, match=r"changed: build_config\.json"):
        check_engine(missing)


def test_a_manifest_edited_in_place_is_refused_even_when_it_still_parses(
    built: dict[str, Path], tmp_path: Path
) -> None:
    engine = tmp_path / "engine"
    shutil.copytree(built["engine"], engine)
    manifest = json.loads((engine / MANIFEST_NAME).read_text())
    manifest["details"]["backend"] = "tensorrt"  # a claim no file hash covers
    (engine / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
    with pytest.raises(IntegrityError, match=r"changed: manifest\.json \(its seal says"):
        check_engine(engine)


def test_the_hash_cache_skips_unchanged_files_and_never_hides_a_change(
    built: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(integrity, "RACY_NS", 0)  # the copy's ctime is now: cacheable here all the same
    engine = tmp_path / "engine"
    shutil.copytree(built["engine"], engine)
    big = [n for n in engine_files(engine) if (engine / n).stat().st_size >= integrity.CACHE_MIN_BYTES]
    assert big, "the test engine should have a file large enough to be cached"
    hashed: list[str] = []
    real = integrity.sha256_file
    monkeypatch.setattr(integrity, "sha256_file", lambda p, *a: hashed.append(p.name) or real(p, *a))
    check_engine(engine)
    assert set(big) <= set(hashed)
    hashed.clear()
    check_engine(engine)  # unchanged: the large files come from the cache
    assert not set(big) & set(hashed)
    target = engine / big[0]
    before = target.stat()
    flip(target)
    os.utime(target, ns=(before.st_atime_ns, before.st_mtime_ns))  # same size, same mtime: only ctime moved
    assert target.stat().st_mtime_ns == before.st_mtime_ns
    with pytest.raises(IntegrityError, match=re.escape(f"changed: {big[0]}")):
        check_engine(engine)


def test_the_cache_can_be_turned_off(built: dict[str, Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TRTBUILD_HASH_CACHE", "0")
    check_engine(built["engine"])
    assert not (tmp_path / "cache" / "trtbuild" / "sha256-cache.json").exists()


def test_a_file_written_just_now_is_not_cached(built: dict[str, Path], tmp_path: Path) -> None:
    """Within a timestamp's tick of a write, a rewrite could keep the stat key: such a hash is not kept (racy)."""
    engine = tmp_path / "engine"
    shutil.copytree(built["engine"], engine)  # ctime: now
    integrity._checked.clear()
    check_engine(engine)
    assert not any(name.startswith(str(engine.resolve())) for name in integrity._checked)
    assert not (tmp_path / "cache" / "trtbuild" / "sha256-cache.json").exists()


def test_a_manifest_with_other_line_endings_is_refused(built: dict[str, Path], tmp_path: Path) -> None:
    engine = tmp_path / "engine"
    shutil.copytree(built["engine"], engine)
    path = engine / MANIFEST_NAME
    path.write_bytes(path.read_bytes().replace(b"\n", b"\r\n"))  # same JSON, other bytes: another manifest sha256
    with pytest.raises(IntegrityError, match=r"changed: manifest\.json \(same content, other bytes"):
        check_engine(engine)


@pytest.mark.parametrize("damage", [b"\xff", b"}"])  # not UTF-8 any more; not JSON any more
def test_a_manifest_damaged_past_parsing_is_named(damage: bytes, built: dict[str, Path], tmp_path: Path) -> None:
    engine = tmp_path / "engine"
    shutil.copytree(built["engine"], engine)
    path = engine / MANIFEST_NAME
    raw = path.read_bytes()
    assert raw.startswith(b"{")  # right after the brace: never inside a string, wherever the keys fall
    path.write_bytes(raw[:1] + damage + raw[1:])
    with pytest.raises(IntegrityError, match=r"changed: manifest\.json \(not valid JSON any more"):
        check_engine(engine)
