"""All-or-nothing writes: a file or folder appears under its final name only once it is complete.

Everything draftsmith leaves on disk for later (checkpoints, exports, feature-cache shards, data
caches, dequantized models) is written under a temporary name in the same folder and renamed into
place, so an interrupted run leaves either the old complete thing or the new one, plus at most a
``.tmp-*`` leftover that the next run removes or ignores.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
from pathlib import Path
from typing import Iterator, Union

TMP_PREFIX = ".tmp-"


class DiskFullError(OSError):
    """No space was left where draftsmith writes `filename`; what it had written is gone."""

    def __init__(self, path: Union[str, Path]) -> None:
        super().__init__(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    def __str__(self) -> str:
        return (
            f"the disk is full: no space left on device writing {self.filename}{_free_space(Path(self.filename))}: "
            "free some space and run the same command again"
        )


def _free_space(path: Path) -> str:
    for folder in (path, *path.parents):
        try:
            return f" ({shutil.disk_usage(folder).free / 2**20:.1f} MiB free there)"
        except OSError:
            continue
    return ""


def is_disk_full(err: Union[BaseException, None]) -> bool:
    """Whether `err` (or what it was raised from) says the disk or the quota is full: errno
    ENOSPC/EDQUOT, safetensors' "No space left on device (os error 28)", or torch.save's
    "[enforce fail at inline_container.cc] unexpected pos" (its zip writer hides the errno)."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        text = str(err)
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in text or "Disk quota exceeded" in text:
            return True
        if "inline_container.cc" in text and ("unexpected pos" in text or "file write failed" in text):
            return True
        err = err.__cause__ or err.__context__
    return False


@contextlib.contextmanager
def full_disk_names(path: Union[str, Path]) -> Iterator[None]:
    """Re-raise a full disk met inside the block as DiskFullError naming `path` (what was being
    written); other errors pass unchanged."""
    try:
        yield
    except DiskFullError:
        raise
    except Exception as err:
        if is_disk_full(err):
            raise DiskFullError(path) from err
        raise


def honour_umask(path: Path) -> None:
    """Give `path` (and everything under a folder) the permissions the user's umask asks for: some
    writers (safetensors, tempfile) create files 0600, which other users serving an export cannot
    read. Executable bits are kept as they were."""
    mask = current_umask()
    for item in (path, *path.rglob("*")) if path.is_dir() and not path.is_symlink() else (path,):
        if item.is_symlink():
            continue
        mode = item.stat().st_mode & 0o777
        want = (0o777 if item.is_dir() or mode & 0o111 else 0o666) & ~mask
        if mode != want:
            item.chmod(want)


def current_umask() -> int:
    """The process's umask, read without changing it where /proc says it."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # elsewhere: set and restore (not thread-safe, hence last)
    os.umask(mask)
    return mask


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
        with full_disk_names(path):
            yield tmp
            commit(tmp, path, replace)
    finally:
        _remove(tmp)


def commit(tmp: Path, path: Path, replace: bool = True) -> None:
    """Rename the finished `tmp` (file or folder) to `path`, with the permissions the umask asks
    for. With ``replace=False`` an existing `path` is kept and `tmp` deleted."""
    honour_umask(tmp)
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


# Beside every folder draftsmith exports: the size and sha256 of each file in it, written last.
MANIFEST_NAME = "draftsmith-manifest.json"


def write_manifest(folder: Union[str, Path]) -> Path:
    """Record the size and sha256 of every file under `folder` (the manifest itself excluded)."""
    import json

    folder = Path(folder)
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST_NAME)
    record = {str(p.relative_to(folder)): {"bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in files}
    return write_atomic(folder / MANIFEST_NAME, json.dumps({"files": record}, indent=1) + "\n")


def manifest_problem(folder: Union[str, Path]) -> Union[str, None]:
    """Why the files of `folder` differ from its manifest (one line naming the file), or None when
    every file it lists is there with the recorded size and sha256. A folder without a manifest
    has no problem here: the caller decides what that means."""
    import json

    folder = Path(folder)
    try:
        listed = json.loads((folder / MANIFEST_NAME).read_text())["files"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"{folder / MANIFEST_NAME} is unreadable ({type(err).__name__})"
    for rel, want in listed.items():
        path = folder / rel
        if not path.is_file():
            return f"{path} is missing (listed in {MANIFEST_NAME})"
        if path.stat().st_size != want["bytes"]:
            return f"{path} has {path.stat().st_size} bytes, {want['bytes']} were written"
        if sha256_file(path) != want["sha256"]:
            return f"{path} does not match the sha256 recorded when it was written (damaged or edited)"
    return None


class DestinationError(ValueError):
    """A folder a command must not write into (it would replace what the user did not ask to)."""


def manifest_files(folder: Union[str, Path]) -> Union[set[str], None]:
    """The files `folder`'s manifest lists (the manifest itself included), or None without a readable one."""
    import json

    try:
        listed = json.loads((Path(folder) / MANIFEST_NAME).read_text())["files"]
        return {*listed, MANIFEST_NAME}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def previous_output(folder: Union[str, Path]) -> bool:
    """Whether `folder` holds exactly what a draftsmith command wrote there (its manifest lists
    every file in it): replacing it loses nothing the user made."""
    folder = Path(folder)
    listed = manifest_files(folder)
    present = {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}
    return listed is not None and present <= listed


def previous_report(folder: Union[str, Path]) -> bool:
    """Whether `folder` is a previous output of eval (its manifest lists every file, report.json
    among them): eval's to replace, not export's."""
    return previous_output(folder) and "report.json" in manifest_files(folder)


def check_destination(
    out: Union[str, Path], inputs=(), overwrite: bool = False, owned=previous_output, flag: str = "--overwrite", around=(), keep=None
) -> None:
    """Refuse, before any work, to write `out` where that would delete what the user did not ask
    to replace: `out` must neither contain nor lie inside one of `inputs` (the folders a command
    reads), must not contain one of `around` (a folder it may write into, such as a run folder),
    and an existing non-empty folder must be a previous output of the same command (`owned`) or be
    given with `flag` (None: a command without such an option); what `keep(out)` describes (work
    no flag replaces, such as a training run: runs.work_in) is refused even with `flag`.
    DestinationError, one line, otherwise; then the OSError that writing there would meet
    (check_writable)."""
    out = Path(out)
    where = out.resolve()
    for source, inside_ok in [*((p, False) for p in inputs), *((p, True) for p in around)]:
        source = Path(source).resolve()
        if where == source or where in source.parents or (source in where.parents and not inside_ok):
            how = "is" if where == source else "contains" if where in source.parents else "is inside"
            raise DestinationError(f"{out} {how} the input {source}: write somewhere else")
    if out.exists() or out.is_symlink():
        if not out.is_dir():
            raise DestinationError(f"{out} exists and is not a folder: choose another destination")
        if os.path.ismount(out):
            # A folder is written whole beside its destination and renamed into place; a mount point
            # cannot be renamed over ("Device or resource busy" after all the work).
            raise DestinationError(f"{out} is a mount point, which draftsmith cannot replace: write into a folder inside it (e.g. {out / 'out'})")
        entries = sorted(p.name for p in out.iterdir())
        work = keep(out) if entries and keep is not None and not owned(out) else None
        if work:
            raise DestinationError(
                f"{out} is {work}, which draftsmith never replaces" + (f", not even with {flag}" if flag else "")
                + ": choose another destination (or delete it yourself if it is no longer wanted)"
            )
        if entries and not owned(out) and not overwrite:
            what = "another draftsmith command's output (an export, or an eval report)" if previous_output(out) else "files draftsmith did not write there"
            raise DestinationError(
                f"{out} already exists and holds {what} ({len(entries)} entries, e.g. {entries[0]!r}): "
                f"choose another destination" + (f", or pass {flag} to replace it" if flag else "")
            )
    check_writable(out)


def check_writable(out: Union[str, Path]) -> None:
    """Raise the OSError (PermissionError, read-only file system) that writing `out` atomically
    would meet, before any work: a folder is made and removed where the temporary copy of `out`
    goes (beside it, in the nearest folder that exists)."""
    out = Path(out).absolute()
    where = next(p for p in out.parents if p.exists() or p == Path(p.anchor))
    probe = where / f"{TMP_PREFIX}writable-{os.getpid()}"
    try:
        probe.mkdir()
    except OSError as err:
        raise type(err)(err.errno, f"{err.strerror}: cannot write in {where}", str(out)) from None
    probe.rmdir()


__all__ = [
    "DestinationError", "DiskFullError",
    "MANIFEST_NAME", "TMP_PREFIX", "atomic_path", "check_destination", "check_writable", "commit", "current_umask", "full_disk_names", "honour_umask", "is_disk_full",
    "manifest_files", "manifest_problem", "previous_output", "previous_report", "sha256_file", "temporary_name", "write_atomic", "write_manifest",
]
