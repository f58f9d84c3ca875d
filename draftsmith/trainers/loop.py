"""Machinery every trainer shares: engine, optimizer, schedule, checkpoints, logging, signals.

Functions, not a base class: a trainer reads top to bottom and calls what it needs.

Checkpoint layout (one folder per optimizer step, written atomically)::

    <output_dir>/checkpoints/step-000200/
        model.safetensors, optimizer.bin, scheduler.bin, random_states_*.pkl   (accelerate)
        trainer_state.json   step, data position, last metrics; written last
        recipe.yaml, command.txt

A checkpoint is written into a hidden temporary folder and renamed into place, so a folder named
step-N is always complete; a crash mid-write leaves only a temporary folder, removed on the next start.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional

import torch
from torch import nn

from draftsmith.recipe import Recipe, TrainConfig, save_resolved

CHECKPOINT_PREFIX = "step-"
STATE_FILE = "trainer_state.json"


class TrainingError(RuntimeError):
    """A run that cannot go on. The message names the step and the last good checkpoint."""


def log(message: str) -> None:
    """Print on the main process only (rank from the launcher's environment)."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(message, flush=True)


def make_accelerator(train: TrainConfig):
    """An accelerate engine for one CPU process, DDP, or DeepSpeed, as the launcher set it up."""
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    handlers = []
    if not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # Several CPU processes talk over gloo. In one process, naming a backend would make
        # accelerate believe it is distributed, so it is set only under a launcher.
        handlers.append(InitProcessGroupKwargs(backend="gloo"))
    return Accelerator(
        mixed_precision=train.mixed_precision,
        gradient_accumulation_steps=train.grad_accum_steps,
        kwargs_handlers=handlers,
        cpu=not torch.cuda.is_available(),
    )


def build_optimizer(params: Iterable[nn.Parameter], train: TrainConfig) -> torch.optim.Optimizer:
    params = [p for p in params if p.requires_grad]
    if not params:
        raise TrainingError("the draft model has no trainable parameters")
    return torch.optim.AdamW(
        params, lr=train.lr, weight_decay=train.weight_decay, betas=(train.adam_beta1, train.adam_beta2)
    )


def lr_factor(step: int, train: TrainConfig) -> float:
    """Multiplier of train.lr at optimizer step `step` (0-based): linear warmup, then the schedule."""
    if train.warmup_steps > 0 and step < train.warmup_steps:
        return (step + 1) / train.warmup_steps
    if train.lr_schedule == "constant":
        return 1.0
    span = max(1, train.max_steps - train.warmup_steps)
    progress = min(1.0, (step - train.warmup_steps) / span)
    floor = train.min_lr_ratio
    if train.lr_schedule == "linear":
        return floor + (1.0 - floor) * (1.0 - progress)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, train: TrainConfig):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, train))


# ----------------------------------------------------------------------------- checkpoints


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def checkpoint_step(path: Path) -> int:
    return int(path.name[len(CHECKPOINT_PREFIX) :])


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first. Folders without a readable trainer_state.json are skipped."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        if not (path.is_dir() and path.name.startswith(CHECKPOINT_PREFIX)):
            continue
        try:
            checkpoint_step(path)
            json.loads((path / STATE_FILE).read_text())
        except (ValueError, OSError):
            log(f"warning: skipping incomplete or corrupt checkpoint {path}")
            continue
        found.append(path)
    return sorted(found, key=checkpoint_step)


def find_resume_checkpoint(output_dir: str | Path, resume: str) -> Optional[Path]:
    """The checkpoint to continue from, per train.resume ("auto", "never" or a folder)."""
    if resume == "never":
        if list_checkpoints(output_dir):
            raise TrainingError(
                f"{checkpoint_root(output_dir)} already holds checkpoints and train.resume=never; "
                "choose another output_dir or set train.resume=auto"
            )
        return None
    if resume == "auto":
        found = list_checkpoints(output_dir)
        return found[-1] if found else None
    path = Path(resume)
    if not (path / STATE_FILE).is_file():
        raise TrainingError(f"train.resume: {path} is not a complete checkpoint (no {STATE_FILE})")
    return path


def clear_partial_checkpoints(output_dir: str | Path) -> None:
    root = checkpoint_root(output_dir)
    if root.is_dir():
        for path in root.glob(".tmp-*"):
            shutil.rmtree(path, ignore_errors=True)


def save_checkpoint(accelerator, output_dir: str | Path, step: int, state: dict, recipe: Recipe, keep_last: int) -> Path:
    """Write checkpoint step-N atomically (every rank calls this) and prune old ones. Returns its path."""
    root = checkpoint_root(output_dir)
    final = root / f"{CHECKPOINT_PREFIX}{step:06d}"
    tmp = root / f".tmp-{CHECKPOINT_PREFIX}{step:06d}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp), safe_serialization=True)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        save_resolved(recipe, tmp)
        # trainer_state.json goes last: its presence marks the folder complete.
        payload = json.dumps({"step": step, **state}, indent=2)
        with open(tmp / STATE_FILE, "w") as fh:
            fh.write(payload)
            fh.flush()
            os.fsync(fh.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in list_checkpoints(output_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator, path: Path) -> dict:
    """Restore model, optimizer, scheduler and RNG states; return trainer_state.json."""
    accelerator.load_state(str(path))
    return json.loads((path / STATE_FILE).read_text())


# ----------------------------------------------------------------------------- logging


class MetricsLog:
    """Metrics as JSONL (<output_dir>/metrics.jsonl), and TensorBoard when it is installed."""

    def __init__(self, output_dir: str | Path, enabled: bool = True) -> None:
        self.enabled = enabled
        self.path = Path(output_dir) / "metrics.jsonl"
        self._tb = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(Path(output_dir) / "tensorboard"))
            except ImportError:
                self._tb = None

    def write(self, step: int, kind: str, values: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"step": step, "kind": kind, "time": round(time.time(), 3), **values}
        with open(self.path, "a") as fh:
            fh.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)):
                    self._tb.add_scalar(f"{kind}/{key}", value, step)
                elif isinstance(value, list):
                    for i, v in enumerate(value):
                        if isinstance(v, (int, float)):
                            self._tb.add_scalar(f"{kind}/{key}_{i + 1}", v, step)

    def truncate_after(self, step: int) -> None:
        """Drop records past `step`: a resumed run rewrites them, so the log stays one run's history."""
        if not (self.enabled and self.path.is_file()):
            return
        kept = [line for line in self.path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
        self.path.write_text("".join(line + "\n" for line in kept))

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


# ----------------------------------------------------------------------------- signals


@dataclass
class StopFlag:
    """Set by SIGINT/SIGTERM; the loop saves a checkpoint at the end of the current step and exits."""

    requested: bool = False
    signal_name: str = ""


def install_stop_handlers(flag: StopFlag):
    """First Ctrl-C or SIGTERM asks for a clean stop; a second Ctrl-C interrupts at once."""
    previous = {}

    def handler(signum, _frame):
        if flag.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        flag.requested = True
        flag.signal_name = signal.Signals(signum).name
        log(f"\n{flag.signal_name} received: saving a checkpoint after this step (Ctrl-C again to abort)")

    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            previous[sig] = signal.signal(sig, handler)
        except ValueError:  # not the main thread (e.g. inside a test runner thread)
            pass

    def restore():
        for sig, old in previous.items():
            signal.signal(sig, old)

    return restore


def any_rank(accelerator, flag: bool) -> bool:
    """True on every rank when `flag` is true on any rank, so all ranks stop at the same step."""
    if accelerator.num_processes == 1:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=accelerator.device)
    return bool(accelerator.reduce(t, reduction="sum").item() > 0)


def teardown(accelerator) -> None:
    """Free the engine before the process group goes, so ranks exit cleanly.

    The caller drops its own references to the wrapped model and optimizer first. Without that and a
    garbage collection, a rank sometimes aborts at interpreter exit after a successful DDP run (see
    docs/ENVIRONMENT.md).
    """
    import gc

    accelerator.free_memory()
    gc.collect()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def command_line() -> list[str]:
    return [Path(sys.argv[0]).name, *sys.argv[1:]]
