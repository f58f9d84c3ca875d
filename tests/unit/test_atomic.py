"""The one atomic write (draftsmith/atomic.py): a file or folder appears complete or not at all."""

import pytest

from draftsmith.atomic import TMP_PREFIX, atomic_path, write_atomic


def test_a_failed_write_leaves_the_old_copy_and_no_leftover(tmp_path):
    target = tmp_path / "export"
    with atomic_path(target, folder=True) as tmp:
        (tmp / "weights").write_text("old")
    with pytest.raises(RuntimeError, match="crash"):
        with atomic_path(target, folder=True) as tmp:
            (tmp / "weights").write_text("new, half written")
            raise RuntimeError("crash")
    assert (target / "weights").read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["export"]  # no .tmp-* left behind


def test_a_new_folder_replaces_the_old_one_whole(tmp_path):
    target = tmp_path / "export"
    with atomic_path(target, folder=True) as tmp:
        (tmp / "a").write_text("1")
        (tmp / "stale").write_text("only in the old copy")
    with atomic_path(target, folder=True) as tmp:
        (tmp / "a").write_text("2")
    assert sorted(p.name for p in target.iterdir()) == ["a"] and (target / "a").read_text() == "2"
    assert not list(tmp_path.glob(f"{TMP_PREFIX}*"))


def test_replace_false_keeps_the_first_writers_copy(tmp_path):
    target = tmp_path / "cache"
    with atomic_path(target, replace=False, folder=True) as tmp:
        (tmp / "model").write_text("first")
    with atomic_path(target, replace=False, folder=True) as tmp:
        (tmp / "model").write_text("second")
    assert (target / "model").read_text() == "first" and not list(tmp_path.glob(f"{TMP_PREFIX}*"))


def test_write_atomic_text_and_bytes(tmp_path):
    assert write_atomic(tmp_path / "a.json", '{"x": 1}').read_text() == '{"x": 1}'
    assert write_atomic(tmp_path / "b.bin", b"\x00\x01").read_bytes() == b"\x00\x01"
    write_atomic(tmp_path / "a.json", "replaced")
    assert (tmp_path / "a.json").read_text() == "replaced"


def test_a_committed_file_gets_the_umask_s_permissions_even_when_written_0600(tmp_path):
    """safetensors and tempfile create files 0600; what draftsmith leaves must be readable as the
    user's umask says (0640 under 027), folders included, executable bits kept."""
    import os

    from draftsmith.atomic import atomic_path

    old = os.umask(0o027)
    try:
        with atomic_path(tmp_path / "out", folder=True) as tmp:
            (tmp / "model.safetensors").write_bytes(b"x")
            os.chmod(tmp / "model.safetensors", 0o600)
            (tmp / "run.sh").write_text("#!/bin/sh\n")
            os.chmod(tmp / "run.sh", 0o700)
    finally:
        os.umask(old)
    out = tmp_path / "out"
    assert oct(out.stat().st_mode & 0o777) == oct(0o750)
    assert oct((out / "model.safetensors").stat().st_mode & 0o777) == oct(0o640)
    assert oct((out / "run.sh").stat().st_mode & 0o777) == oct(0o750)
