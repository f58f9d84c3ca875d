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

import json
import os
import sys
from pathlib import Path
from typing import Callable, Optional

from draftsmith.atomic import sha256_file

CHECKPOINT_PREFIX = "step-"
STATE_FILE = "trainer_state.json"
WEIGHTS_NAME = "model.safetensors"


class RunFolderError(ValueError):
    """A folder that is not a run or checkpoint draftsmith can read. The message names it."""


def log(message: str, stream=None) -> None:
    """Print on the main process only (rank from the launcher's environment), to stdout unless
    `stream` says otherwise (diagnostics go to stderr where stdout carries a result)."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(message, flush=True, file=stream or sys.stdout)


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def checkpoint_step(path: Path) -> int:
    return int(path.name[len(CHECKPOINT_PREFIX) :])


def read_state(checkpoint: str | Path) -> dict:
    """trainer_state.json of a checkpoint folder."""
    path = Path(checkpoint) / STATE_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise RunFolderError(f"{path} is unreadable ({type(err).__name__}): not a complete checkpoint") from None


def checkpoint_problem(path: Path, verify_contents: bool = False) -> Optional[str]:
    """Why `path` is not a complete checkpoint, or None when it is: trainer_state.json must be
    readable and every file of its manifest present with the recorded size and, with
    `verify_contents`, the recorded sha256 (a file damaged in place keeps its size)."""
    try:
        checkpoint_step(path)
        state = json.loads((path / STATE_FILE).read_text())
    except (ValueError, OSError):
        return f"no readable {STATE_FILE}"
    for rel, size in state.get("files", {}).items():
        file = path / rel
        if not file.is_file():
            return f"{rel} is missing"
        if file.stat().st_size != size:
            return f"{rel} has {file.stat().st_size} bytes, {size} were written"
    if verify_contents:
        for rel, digest in state.get("sha256", {}).items():
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


def drafter_kind(state: dict) -> str:
    """What a checkpoint trained: a head kind ("medusa", "eagle3", ...), "standalone" (a draft LM)
    or "early_exit" (a model that drafts with its own first layers)."""
    return state["drafter"]["kind"]


__all__ = [
    "CHECKPOINT_PREFIX",
    "RunFolderError",
    "STATE_FILE",
    "WEIGHTS_NAME",
    "checkpoint_problem",
    "checkpoint_root",
    "checkpoint_step",
    "drafter_kind",
    "is_checkpoint",
    "list_checkpoints",
    "log",
    "read_state",
    "resolve_checkpoint",
]
