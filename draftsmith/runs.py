"""What a training run leaves on disk, read back: its checkpoints and what each one records.

Layout of a run folder (``output_dir`` of a recipe)::

    recipe.yaml, command.txt          the resolved recipe and the command that ran it
    metrics.jsonl, final_metrics.json
    checkpoints/step-000200/
        model.safetensors             the drafter's trainable weights
        trainer_state.json            written last: step, engine, what was trained (``trainer``,
                                      ``drafter.kind``), data position, last metrics, and a
                                      manifest of every file with its size and sha256
        ... engine states (optimizer, RNG; DeepSpeed shards), recipe.yaml, command.txt

The trainers write checkpoints (trainers/checkpoint.py); export, eval and resume read them through
this module, so nothing downstream imports a trainer or guesses what a folder holds.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from draftsmith.atomic import sha256_file

CHECKPOINT_PREFIX = "step-"
STATE_FILE = "trainer_state.json"
WEIGHTS_NAME = "model.safetensors"


class RunFolderError(ValueError):
    """A folder that is not a run or checkpoint draftsmith can read. The message names it."""


class MalformedStateError(RunFolderError):
    """A trainer_state.json that parses but is not what draftsmith writes (a key missing or mistyped)."""


def log(message: str, stream=None) -> None:
    """Print on the main process only (rank from the launcher's environment), to stdout unless
    `stream` says otherwise (diagnostics go to stderr where stdout carries a result)."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(message, flush=True, file=stream or sys.stdout)


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def checkpoint_step(path: Path) -> int:
    return int(path.name[len(CHECKPOINT_PREFIX) :])


@dataclass(frozen=True)
class CheckpointState(Mapping):
    """trainer_state.json of a checkpoint, parsed and checked once (``read_state``).

    The fields every checkpoint has are typed: ``step``, ``trainer``, ``drafter_kind`` (a head
    kind, "standalone" or "early_exit"; None where a checkpoint does not record it, which resume
    does not need and export refuses), ``engine``, and the manifest (``files``: sizes, ``sha256``).
    What a trainer records of its own (its data position, head config, last evaluation, ...) is
    read like a dict: ``state["data"]``, ``state.get("last_eval")``.
    """

    path: Path
    step: int
    trainer: str
    drafter_kind: Optional[str]
    engine: dict
    files: dict
    sha256: dict
    record: dict = field(repr=False)

    @classmethod
    def parse(cls, path: Path, record: Any) -> "CheckpointState":
        """RunFolderError (one line naming the file and the key) unless `record` is a checkpoint's state."""

        def bad(what: str) -> RunFolderError:
            return MalformedStateError(f"{path} is not a checkpoint state draftsmith wrote ({what}): restore the checkpoint or resume from another")

        if not isinstance(record, dict):
            raise bad(f"a JSON {type(record).__name__}, not an object")
        step, drafter = record.get("step"), record.get("drafter")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise bad(f"'step' is {step!r}, not a step number")
        if drafter is not None and (not isinstance(drafter, dict) or not isinstance(drafter.get("kind"), str)):
            raise bad(f"'drafter' is {drafter!r}, not {{'kind': ...}} naming what was trained")
        files, digests = record.get("files", {}), record.get("sha256", {})
        if not isinstance(files, dict) or not all(isinstance(v, int) for v in files.values()):
            raise bad("'files' is not a manifest of file sizes")
        if not isinstance(digests, dict) or not all(isinstance(v, str) for v in digests.values()):
            raise bad("'sha256' is not a manifest of digests")
        engine = record.get("engine", {"kind": "accelerate", "zero_stage": None, "world_size": 1})
        return cls(path, step, str(record.get("trainer", "")), drafter and drafter["kind"], engine, files, digests, record)

    def __getitem__(self, key: str) -> Any:
        return self.record[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.record)

    def __len__(self) -> int:
        return len(self.record)


# States already parsed in this process, by file and its (mtime, size): a checkpoint opened for
# export or eval is verified, listed and read without parsing its state again.
_STATES: dict[tuple[str, int, int], CheckpointState] = {}


def read_state(checkpoint: str | Path) -> CheckpointState:
    """trainer_state.json of a checkpoint folder (CheckpointState); RunFolderError, one line, when it
    is missing, unreadable or malformed."""
    path = Path(checkpoint) / STATE_FILE
    try:
        stat = path.stat()
        key = (str(path.resolve()), stat.st_mtime_ns, stat.st_size)
        if key not in _STATES:
            _STATES[key] = CheckpointState.parse(path, json.loads(path.read_text()))
        return _STATES[key]
    except (OSError, ValueError) as err:
        if isinstance(err, RunFolderError):
            raise
        raise RunFolderError(f"{path} is unreadable ({type(err).__name__}): not a complete checkpoint") from None


def checkpoint_problem(path: Path, verify_contents: bool = False) -> Optional[str]:
    """Why `path` is not a complete checkpoint, or None when it is: trainer_state.json must be
    readable and well formed, and every file of its manifest present with the recorded size and,
    with `verify_contents`, the recorded sha256 (a file damaged in place keeps its size)."""
    # What the folder holds decides, not its name: a copy called `best`, or a link to a step, is one.
    if not (path / STATE_FILE).is_file():
        return f"no readable {STATE_FILE}"
    try:
        state = read_state(path)
    except MalformedStateError:
        return f"malformed {STATE_FILE}"
    except RunFolderError:
        return f"no readable {STATE_FILE}"
    for rel, size in state.files.items():
        file = path / rel
        if not file.is_file():
            return f"{rel} is missing"
        if file.stat().st_size != size:
            return f"{rel} has {file.stat().st_size} bytes, {size} were written"
    if verify_contents:
        for rel, digest in state.sha256.items():
            if sha256_file(path / rel) != digest:
                return f"{rel} does not match the sha256 recorded when it was written"
    return None


def list_checkpoints(output_dir: str | Path, warn: Callable[[str], None] = log) -> list[Path]:
    """Complete checkpoints of a run, oldest first. Incomplete or corrupt ones are skipped with a warning."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        if not (path.is_dir() and path.name.startswith(CHECKPOINT_PREFIX)):
            continue
        try:
            checkpoint_step(path)  # the run's own checkpoints are ordered by the step in their names
        except ValueError:
            warn(f"warning: skipping {path} (not named {CHECKPOINT_PREFIX}<step>)")
            continue
        problem = checkpoint_problem(path)
        if problem:
            warn(f"warning: skipping incomplete or corrupt checkpoint {path} ({problem})")
            continue
        found.append(path)
    return sorted(found, key=checkpoint_step)


def is_checkpoint(path: str | Path) -> bool:
    return (Path(path) / STATE_FILE).is_file()


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder, or a run folder's newest complete checkpoint."""
    path = Path(path)
    if is_checkpoint(path):
        return path
    found = list_checkpoints(path)
    if not found:
        raise RunFolderError(f"{path} is neither a draftsmith checkpoint nor a run folder with checkpoints")
    return found[-1]


def _command_of(folder: Path) -> list[str]:
    """The first two words of the folder's command.txt (``draftsmith train``), or []."""
    try:
        return (folder / "command.txt").read_text(errors="replace").split()[:2]
    except OSError:
        return []


def is_run_folder(folder: str | Path) -> bool:
    """Whether `folder` is a training run: `draftsmith train` wrote its command.txt, or its
    checkpoints/ holds a draftsmith checkpoint (a bare checkpoints/ folder, as other tools make
    one, is not enough)."""
    folder = Path(folder)
    if _command_of(folder) == ["draftsmith", "train"]:
        return True
    root = checkpoint_root(folder)
    return root.is_dir() and any(is_checkpoint(p) for p in root.glob(f"{CHECKPOINT_PREFIX}*"))


def is_data_cache(folder: str | Path) -> bool:
    """Whether `folder` is a data cache: `draftsmith prepare` wrote its command.txt, or it holds the
    data step's files (tokenized examples, regenerated answers, a feature cache's index)."""
    folder = Path(folder)
    if _command_of(folder) == ["draftsmith", "prepare"]:
        return True
    return any(folder.glob("examples-*.pt")) or any(folder.glob("regenerated-*.jsonl")) or any(folder.glob("features*/index.json"))


def work_in(folder: str | Path) -> Optional[str]:
    """What draftsmith work `folder` holds that no command may replace, even when told to
    overwrite: "a training run (its checkpoints)" or "a data cache (regenerated answers,
    tokenized examples, features)"; None for anything else."""
    if is_run_folder(folder):
        return "a draftsmith training run (its checkpoints)"
    if is_data_cache(folder):
        return "a draftsmith data cache (regenerated answers, tokenized examples, features)"
    return None


# Beside a run's files (and a data cache's) while a process writes there: who holds the folder.
LOCK_NAME = ".draftsmith.lock"


class FolderInUseError(RunFolderError):
    """Another process writes into the folder a command would write into."""


# Folders this process holds, by resolved path: a second set-up in the same process (a test, a
# notebook) shares the hold instead of refusing itself.
_HELD: dict[Path, "FolderLock"] = {}


class FolderLock:
    """This process's hold on a folder it writes into (a run's output_dir, a data cache): the file
    LOCK_NAME, locked with flock for as long as the process lives (the kernel lets go when it dies,
    however it dies) and holding the pid, host and command line that a refusal names. A lock file
    left by a process that is gone is taken over with a warning. Use `hold_folder`."""

    def __init__(self, folder: Path, what: str, created: bool, fd: int) -> None:
        self.folder, self.what, self.created, self.fd, self.holders = folder, what, created, fd, 1

    def release(self) -> None:
        """Let go (once every set-up of this process that took it has let go): the lock file goes,
        and so does the folder when taking the lock created it and nothing else was written there."""
        self.holders -= 1
        if self.holders > 0 or self.fd < 0:
            return
        _HELD.pop(self.folder.resolve(), None)
        try:
            (self.folder / LOCK_NAME).unlink(missing_ok=True)
            if self.created:
                self.folder.rmdir()
        except OSError:  # the folder holds files now, or is already gone
            pass
        finally:
            os.close(self.fd)  # unlinked first: nobody takes a lock on a file about to vanish
            self.fd = -1

    def __enter__(self) -> "FolderLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _holder(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        return {}


def holder_of(folder: str | Path) -> Optional[dict]:
    """Who holds `folder` now (pid, host, command, started), when a live process does; None when
    nobody does. Reads only: a lock it can take, it lets go at once."""
    import fcntl

    try:
        fd = os.open(Path(folder) / LOCK_NAME, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as err:
        return _holder(fd) if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES) else None
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def hold_folder(folder: str | Path, what: str = "output_dir", warn: Callable[[str], None] = log) -> FolderLock:
    """Take `folder` (created if absent) for this process's writes, or refuse in one line
    (FolderInUseError) naming the process that holds it. `what` names the folder in messages
    (the recipe key it comes from)."""
    import fcntl

    folder = Path(folder)
    key = folder.resolve()
    if key in _HELD:
        _HELD[key].holders += 1
        return _HELD[key]
    created = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_NAME
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                # A file system without locks (some network mounts): the run goes on unguarded.
                os.close(fd)
                warn(f"warning: cannot lock {path} ({err.strerror}): nothing stops a second process from writing into {folder}")
                return FolderLock(folder, what, False, -1)
            other = _holder(fd)
            os.close(fd)
            who = f"pid {other.get('pid', '?')} on {other.get('host', '?')}"
            since = f", since {other['started']}" if "started" in other else ""
            raise FolderInUseError(
                f"{what} {folder} is in use by another draftsmith process ({who}{since}: {other.get('command', 'unknown command')}): "
                "wait for it to finish, or choose another folder"
            ) from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # its holder let go and removed the file between our open and lock: again
    stale = _holder(fd)
    if stale:
        warn(
            f"warning: {what} {folder} was held by pid {stale.get('pid', '?')} on {stale.get('host', '?')}, which is gone "
            "(it stopped without letting go): taking it over"
        )
    record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv)}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
    lock = _HELD[key] = FolderLock(folder, what, created, fd)
    return lock


__all__ = [
    "CHECKPOINT_PREFIX",
    "CheckpointState",
    "FolderInUseError",
    "FolderLock",
    "LOCK_NAME",
    "MalformedStateError",
    "RunFolderError",
    "STATE_FILE",
    "WEIGHTS_NAME",
    "checkpoint_problem",
    "checkpoint_root",
    "checkpoint_step",
    "hold_folder",
    "is_checkpoint",
    "list_checkpoints",
    "log",
    "read_state",
    "resolve_checkpoint",
]
