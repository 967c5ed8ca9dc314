"""workshop/files.py: the one atomic write every file of the project goes through."""

import os
import stat

import pytest
from conftest import names_in

from workshop import files


def test_a_write_that_fails_half_way_keeps_the_old_file_and_leaves_no_temporary(
    tmp_path,
):
    path = files.atomic_write_text(tmp_path / "results.json", "old")

    def half_then_fail(f):
        f.write(b"half of the new")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        files.atomic_write(path, half_then_fail)
    assert path.read_text() == "old" and names_in(tmp_path) == ["results.json"]
    files.atomic_write_text(path, "new")
    assert path.read_text() == "new" and names_in(tmp_path) == ["results.json"]


def test_a_written_file_gets_the_umasks_mode_or_keeps_the_one_it_replaces(tmp_path):
    shared = tmp_path / "shared.txt"
    shared.write_text("old")
    shared.chmod(0o664)
    umask = os.umask(0o022)
    try:
        new = files.atomic_write_text(tmp_path / "new.txt", "x")
        files.atomic_write_text(shared, "new")
    finally:
        os.umask(umask)
    assert stat.S_IMODE(new.stat().st_mode) == 0o644
    assert stat.S_IMODE(shared.stat().st_mode) == 0o664
