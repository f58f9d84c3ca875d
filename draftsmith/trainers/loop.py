"""The step loop every trainer runs, with its metrics log and its Ctrl-C / SIGTERM handling.

What the loop needs of a trainer (``advance``, ``evaluate``, ``describe``, ``save`` and the run's
accelerator, metrics log and checkpoints) is the Trainer base class of trainers/base.py, which
imports this module (so ``trainer`` is not annotated here).
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from torch import Tensor

from draftsmith.atomic import write_atomic
from draftsmith.runs import log
from draftsmith.trainers.engine import TrainingError, any_rank, gather_objects, world_size


# ----------------------------------------------------------------------------- logging


class MetricsLog:
    """Metrics as JSONL (<output_dir>/metrics.jsonl), and TensorBoard when it is installed. The
    TensorBoard writer opens at the first record: a run that stops before it has anything to log
    (bad input found on resume) leaves no new events file in the user's folder."""

    def __init__(self, output_dir: str | Path, enabled: bool = True) -> None:
        self.enabled = enabled
        self.output_dir = Path(output_dir)
        self.path = self.output_dir / "metrics.jsonl"
        self._tb = None
        self._tb_tried = False
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def _tensorboard(self):
        if not self._tb_tried:
            self._tb_tried = True
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.output_dir / "tensorboard"))
            except ImportError:
                self._tb = None
        return self._tb

    def write(self, step: int, kind: str, values: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"step": step, "kind": kind, "time": round(time.time(), 3), **values}
        with open(self.path, "a") as fh:
            fh.write(json.dumps(record) + "\n")
        tb = self._tensorboard()
        if tb is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)):
                    tb.add_scalar(f"{kind}/{key}", value, step)
                elif isinstance(value, list):
                    for i, v in enumerate(value):
                        if isinstance(v, (int, float)):
                            tb.add_scalar(f"{kind}/{key}_{i + 1}", v, step)

    def truncate_after(self, step: int) -> None:
        """Drop records past `step`: a resumed run rewrites them, so the log stays one run's history."""
        if not (self.enabled and self.path.is_file()):
            return
        kept = []
        for line in self.path.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:  # a line cut short by the crash being resumed from
                continue
            if record.get("step", step + 1) <= step:
                kept.append(line)
        write_atomic(self.path, "".join(line + "\n" for line in kept))

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


# ----------------------------------------------------------------------------- the loop


@dataclass(frozen=True)
class Schedule:
    """How a trainer's work is counted and when the loop acts on it.

    The loop runs until the position reaches ``total`` (optimizer steps, or requests served for the
    online trainer). An action due every N units runs whenever the position passes a multiple of
    N, so a trainer that advances several units at a time (one request per rank) keeps the cadence.
    """

    total: int
    unit: str  # "step" or "request": progress bar and messages
    log_every: int
    save_every: int
    eval_every: Optional[int] = None  # None: the trainer has no held-out evaluation
    log_kind: str = "train"  # metrics.jsonl record kind of the logged values

    @classmethod
    def steps(cls, train) -> "Schedule":
        """Optimizer steps per a recipe's train: section."""
        return cls(train.max_steps, "step", train.log_every, train.save_every, train.eval_every)


def crossed(before: int, after: int, every: int) -> bool:
    """True when going from `before` to `after` passes a multiple of `every`."""
    return after // every > before // every


def run_loop(trainer, schedule: Schedule, start: int, desc: str) -> tuple[dict, float]:
    """Advance `trainer` from position `start` to ``schedule.total``. Returns (the last evaluation
    or {}, seconds spent).

    Values that ``advance()`` returns holding a "loss" are logged (at the first position
    and then every ``log_every``); a NaN or infinite loss raises TrainingError naming the position
    and the last good checkpoint. Evaluates every ``eval_every`` and at the end; saves every
    ``save_every``, at the end and when a SIGINT/SIGTERM reached any rank (then stops, every rank at
    the same position).
    """
    from tqdm.auto import tqdm

    acc = trainer.accelerator
    stop = StopFlag()
    restore = install_stop_handlers(stop)
    bar = tqdm(total=schedule.total, initial=start, desc=desc, unit=schedule.unit, disable=not acc.is_main_process, dynamic_ncols=True)
    started, result, position = time.time(), {}, start
    trainer.loop_started = started  # a checkpoint records the seconds trained so far
    try:
        while position < schedule.total:
            before = position
            position, values = trainer.advance()
            bar.update(position - before)
            if "loss" in values:
                if not math.isfinite(values["loss"]):
                    where = f"; the last good checkpoint is {trainer.last_checkpoint}" if trainer.last_checkpoint else ""
                    raise TrainingError(f"loss became {values['loss']} at {schedule.unit} {position}{where}")
                if before == 0 or crossed(before, position, schedule.log_every):
                    trainer.metrics.write(position, schedule.log_kind, values)
            bar.set_postfix({k: f"{values[k]:.4g}" for k in ("loss", "lr", "acceptance") if k in values})
            done = position >= schedule.total
            if schedule.eval_every and (crossed(before, position, schedule.eval_every) or done):
                result = trainer.last_eval = trainer.evaluate()
                trainer.metrics.write(position, "eval", result)
                if acc.is_main_process:
                    bar.write(trainer.describe(position, result))
            stopping = any_rank(acc, stop.requested)
            if crossed(before, position, schedule.save_every) or done or stopping:
                trainer.save()
            if stopping:
                names = [name for name in gather_objects(acc, stop.signal_name) if name]
                if done:  # the schedule ended with this save: a finished run, not a stopped one
                    log(f"{names[0] if names else 'SIGINT'} arrived as the last {schedule.unit} ended: the run is complete. Checkpoint: {trainer.last_checkpoint}")
                    break
                # The command line exits 130 (SIGINT) or 143 (SIGTERM) after this save, on every
                # rank alike, whichever rank the signal reached.
                trainer.stopped_by = names[0] if names else "SIGINT"
                log(f"stopped at {schedule.unit} {position}; resume with the same command. Checkpoint: {trainer.last_checkpoint}")
                break
    finally:
        bar.close()
        restore()
    return result, time.time() - started


def train_from_first_eval(trainer, desc: str) -> dict:
    """run_loop over ``train.max_steps`` for a trainer whose figures compare with where its model
    started (distill, layerskip): a fresh run evaluates before the first step (logged as step 0 and
    printed), a resumed run does not. Writes final_metrics.json and returns that summary."""
    acc = trainer.accelerator
    first = {}
    if trainer.step == 0:
        first = trainer.first_eval = trainer.evaluate()
        trainer.metrics.write(0, "eval", first)
        if acc.is_main_process:
            print(trainer.describe(0, first), flush=True)
    result, elapsed = run_loop(trainer, Schedule.steps(trainer.recipe.train), trainer.step, desc)
    summary = {"step": trainer.step, "seconds": round(trainer.train_seconds(elapsed), 1), **(result or first or trainer.last_eval or {}), "checkpoint": str(trainer.last_checkpoint)}
    if acc.is_main_process and not trainer.nothing_to_train:
        write_atomic(trainer.output_dir / "final_metrics.json", json.dumps(summary, indent=2))
    return summary


def optimizer_step(trainer, micro_batches: Iterable[Callable[[], Tensor]], params: Iterable[Tensor]) -> float:
    """One optimizer step over micro-batches: each callable returns its micro-batch's loss to
    backpropagate; gradients accumulate (and, on several ranks, average) until accelerate says the
    step is due, then they are clipped to train.max_grad_norm and applied. Returns the gradient
    norm before clipping (NaN when no step was taken)."""
    acc, train = trainer.accelerator, trainer.recipe.train
    params = list(params)
    grad_norm = None
    for compute_loss in micro_batches:
        with acc.accumulate(trainer.model):
            acc.backward(compute_loss())
            if acc.sync_gradients:
                grad_norm = acc.clip_grad_norm_(params, train.max_grad_norm)
                trainer.optimizer.step()
                trainer.scheduler.step()
                trainer.optimizer.zero_grad(set_to_none=True)
    return float(grad_norm) if grad_norm is not None else float("nan")


# ----------------------------------------------------------------------------- signals


@dataclass
class StopFlag:
    """Set by SIGINT/SIGTERM; the loop saves a checkpoint at the end of the current step and exits."""

    requested: bool = False
    signal_name: str = ""
    since: float = 0.0


# A launcher forwards the Ctrl-C its workers already got from the terminal (torchrun sends the
# same signal to every worker): a second SIGINT this soon is that copy, not a second keypress.
SECOND_CTRL_C_AFTER_S = 2.0


def install_stop_handlers(flag: StopFlag):
    """First Ctrl-C or SIGTERM asks for a clean stop; a second Ctrl-C (seconds later) interrupts at once."""
    previous = {}

    def handler(signum, _frame):
        if flag.requested:
            if signum == signal.SIGINT and time.monotonic() - flag.since > SECOND_CTRL_C_AFTER_S:
                raise KeyboardInterrupt
            return
        flag.requested = True
        flag.since = time.monotonic()
        flag.signal_name = signal.Signals(signum).name
        # Printed by the rank that got the signal, which need not be the main one.
        rank = f"[rank {os.environ['RANK']}] " if world_size() > 1 else ""
        print(f"\n{rank}{flag.signal_name} received: saving a checkpoint after this step (Ctrl-C again to abort)", flush=True)

    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            previous[sig] = signal.signal(sig, handler)
        except ValueError:  # not the main thread (e.g. inside a test runner thread)
            pass

    def restore():
        for sig, old in previous.items():
            signal.signal(sig, old)

    return restore


def command_line() -> list[str]:
    return [Path(sys.argv[0]).name, *sys.argv[1:]]
