"""Every supported family, converted from random tiny configs with its distinctive features switched on, matches
transformers through the reference forward (float32: max abs < 1e-4, identical argmax); the cases are models.PARITY."""

from __future__ import annotations

from pathlib import Path

import pytest
from models import PARITY, compare, hf_classes, save_case

from toolchain.checkpoint.convert import convert
from toolchain.checkpoint.registry import supported_architectures


@pytest.mark.parametrize("name", [name for name, case in PARITY.items() if not case.engine])
def test_family_matches_transformers(name: str, tmp_path: Path) -> None:
    hf = save_case(tmp_path / "hf", name)
    convert(hf, tmp_path / "ckpt")
    max_abs, same_top1 = compare(hf, tmp_path / "ckpt", seq=PARITY[name].seq)
    assert max_abs < 1e-4
    assert same_top1 == 1.0


def test_every_registered_family_has_a_parity_case() -> None:
    """A family registered without a case here would convert without ever being compared with transformers."""
    covered = {hf_classes(case.arch)[1].__name__ for case in PARITY.values()}
    missing = sorted(set(supported_architectures()) - covered)
    assert not missing, (
        f"registered architectures without a parity case: {', '.join(missing)}; "
        "add a tiny config of each to PARITY in tests/models.py"
    )
