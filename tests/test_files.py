"""read_text_capped (files.py): what is not a regular file, or is over the limit, is refused before it is read, in one
line naming the file."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import NOT_A_FILE_ERRORS, deadline, not_a_file

from toolchain.errors import UserError
from toolchain.files import JSON_LIMIT, read_text_capped


@pytest.mark.parametrize("kind", sorted(NOT_A_FILE_ERRORS))
def test_read_text_capped_refuses_before_reading(kind: str, tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    not_a_file(path, kind)
    with deadline(20), pytest.raises(UserError, match=r"config\.json: ") as e:
        read_text_capped(path, JSON_LIMIT, "JSON config")
    assert NOT_A_FILE_ERRORS[kind] in str(e.value)


def test_read_text_capped_reads_a_file_and_stops_at_the_limit(tmp_path: Path) -> None:
    path = tmp_path / "a.json"
    path.write_bytes(b'{"a": 1}\r\n')
    assert read_text_capped(path, 64, "JSON config") == '{"a": 1}\n'  # newlines as Path.read_text gives them
    with pytest.raises(UserError, match="over the 8 bytes limit for a JSON config"):
        read_text_capped(path, 8, "JSON config")
