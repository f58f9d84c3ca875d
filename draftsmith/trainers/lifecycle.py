"""What every trainer does around its own work, in the order that matters: start a run, put the
trainable module into the engine (resume preparation before ``accelerate.prepare``), resume,
record the run, close. Functions, not a base class: a trainer's ``setup()`` reads top to bottom
and calls them between its own steps::

    lifecycle.start(self)                     # accelerator, seed, the checkpoint to resume from
    ... the trainer's own target, data, model ...
    lifecycle.prepare(self, module, params)   # optimizer, scheduler, engine; metrics log
    state = lifecycle.resume(self)            # None on a fresh run
    lifecycle.record(self, description)       # recipe.yaml and command.txt beside the run; one log line

and ``close()`` is ``lifecycle.close(self)``. What run_loop and the test helpers need of a trainer
is the Trainer protocol of trainers/loop.py.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn

from draftsmith.runs import log
from draftsmith.trainers import checkpoint, engine
from draftsmith.trainers.loop import MetricsLog


def start(trainer) -> None:
    """The accelerator (one process, DDP or DeepSpeed per the recipe), the seed, the output folder
    held for this run (``trainer.run_lock``: another run writing there is refused), and the
    checkpoint to resume from (``trainer.resume_from``; half-written ones are dropped). Nothing
    an earlier run left is changed yet."""
    r = trainer.recipe
    trainer.accelerator = engine.make_accelerator(r.train, r.deepspeed)
    torch.manual_seed(r.train.seed)
    trainer.resume_from, trainer.run_lock = checkpoint.open_run(trainer.accelerator, trainer.output_dir, r.train.resume)
    if trainer.resume_from is not None:
        checkpoint.check_resumable(r, trainer.resume_from)
    trainer.last_checkpoint = trainer.resume_from
    trainer.last_eval = None


def prepare(trainer, module: nn.Module, params: Iterable[nn.Parameter], adapter_only: bool = False) -> None:
    """Optimizer and scheduler for `params`, `module` wrapped by the engine (``trainer.model``,
    ``trainer.optimizer``, ``trainer.scheduler``), and the metrics log. A checkpoint of another
    world size or ZeRO stage is converted before the engine is built, as DeepSpeed needs.
    ``adapter_only``: checkpoints keep the LoRA adapter, not the frozen base weights."""
    acc, r = trainer.accelerator, trainer.recipe
    optimizer = engine.build_optimizer(params, r.train)
    trainer.scheduler = engine.build_scheduler(optimizer, r.train)
    trainer.load_from = checkpoint.prepare_resume(acc, trainer.resume_from) if trainer.resume_from is not None else None
    trainer.model, trainer.optimizer = acc.prepare(module, optimizer)
    acc.register_for_checkpointing(trainer.scheduler)
    if adapter_only:
        acc.register_save_state_pre_hook(checkpoint.keep_adapter_weights)
    trainer.metrics = MetricsLog(trainer.output_dir, enabled=acc.is_main_process)


def resume(trainer, strict: bool = True) -> Optional[dict]:
    """Restore the engine's states from ``trainer.resume_from`` and return its trainer state, or
    None on a fresh run. The metrics log forgets what came after the checkpoint (the resumed run
    writes it again). `strict` False when checkpoints hold only the trainable part (a LoRA adapter)."""
    if trainer.resume_from is None:
        return None
    state = checkpoint.load_checkpoint(trainer.accelerator, trainer.resume_from, trainer.load_from, strict=strict)
    trainer.metrics.truncate_after(int(state["step"]))
    log(f"resumed from {trainer.resume_from} at {state['step']}")
    return state


def record(trainer, description: str) -> None:
    """Once set-up has succeeded: the resolved recipe and the command line beside the run, and one
    line saying what trains on what (with the engine)."""
    checkpoint.record_run(trainer.accelerator, trainer.recipe, trainer.output_dir, trainer.argv)
    log(f"{description}; {engine.describe_engine(trainer.accelerator, trainer.recipe)}")


def trainable_parameters(module: nn.Module) -> int:
    """Trainable parameters of `module` (in full, also when ZeRO-3 partitions them)."""
    return sum(int(getattr(p, "ds_numel", p.numel())) for p in module.parameters() if p.requires_grad)


def close(trainer) -> None:
    """Release the engine and the process group so every rank exits cleanly (also after a failed
    set-up): the wrapped module, optimizer and step module go first (a rank otherwise sometimes
    aborts at exit, docs/ENVIRONMENT.md), then the metrics log and the accelerator; the output
    folder is let go last."""
    acc = getattr(trainer, "accelerator", None)
    lock, trainer.run_lock = getattr(trainer, "run_lock", None), None
    trainer.model = trainer.optimizer = trainer.step_module = None
    try:
        if getattr(trainer, "metrics", None) is not None:
            trainer.metrics.close()
        if acc is not None:
            engine.teardown(acc)
    finally:
        if lock is not None:
            lock.release()


__all__ = ["close", "prepare", "record", "resume", "start", "trainable_parameters"]
