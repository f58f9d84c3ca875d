"""All-or-nothing writes: a file or folder appears under its final name only once it is complete.

Everything draftsmith leaves on disk for later (checkpoints, exports, feature-cache shards, data
caches, dequantized models) is written under a temporary name in the same folder and renamed into
place, so an interrupted run leaves either the old complete thing or the new one, plus at most a
``.tmp-*`` leftover that the next run removes or ignores.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
from pathlib import Path
from typing import Iterator, Union

TMP_PREFIX = ".tmp-"


def temporary_name(path: Path) -> Path:
    """A sibling of `path` that no other process writes to: .tmp-<name>-<pid>."""
    return path.with_name(f"{TMP_PREFIX}{path.name}-{os.getpid()}")


@contextlib.contextmanager
def atomic_path(path: Union[str, Path], replace: bool = True, folder: bool = False) -> Iterator[Path]:
    """Yield a temporary path to write; on success it is renamed to `path`.

    ``folder=True`` creates the temporary folder first (for writers that fill a folder). With
    ``replace=False`` an existing `path` wins: the new copy is discarded (another process wrote the
    same thing first). On an exception the temporary copy is deleted and `path` is untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_name(path)
    _remove(tmp)
    if folder:
        tmp.mkdir()
    try:
        yield tmp
        commit(tmp, path, replace)
    finally:
        _remove(tmp)


def commit(tmp: Path, path: Path, replace: bool = True) -> None:
    """Rename the finished `tmp` (file or folder) to `path`. With ``replace=False`` an existing
    `path` is kept and `tmp` deleted."""
    if not replace:
        try:
            if not path.exists():
                os.replace(tmp, path)
        except OSError:  # another process got there between the check and the rename
            if not path.exists():
                raise
        _remove(tmp)
        return
    if path.is_dir() and tmp.is_dir():
        # A folder cannot be renamed over a non-empty one: move the old one aside first, so there
        # is never a moment without a complete copy under some name.
        old = path.with_name(f"{TMP_PREFIX}old-{path.name}-{os.getpid()}")
        _remove(old)
        os.replace(path, old)
        os.replace(tmp, path)
        _remove(old)
    else:
        os.replace(tmp, path)


def write_atomic(path: Union[str, Path], data: Union[str, bytes]) -> Path:
    """Write text or bytes to `path` atomically (flushed to disk before the rename)."""
    path = Path(path)
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as fh:
            fh.write(data.encode() if isinstance(data, str) else data)
            fh.flush()
            os.fsync(fh.fileno())
    return path


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink(missing_ok=True)


def sha256_file(path: Union[str, Path]) -> str:
    """sha256 of a file, read in 16 MB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 24), b""):
            digest.update(chunk)
    return digest.hexdigest()


__all__ = ["TMP_PREFIX", "atomic_path", "commit", "sha256_file", "temporary_name", "write_atomic"]
