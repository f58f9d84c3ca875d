"""What every trainer does around its own work, written once: the ``Trainer`` base class.

A trainer subclasses it and keeps only what is its own: the models it loads, its forward and its
loss (``advance``), its held-out figures (``evaluate``) and what its checkpoints add
(``checkpoint_state``). The base owns the rest, in the order that matters, and a trainer's
``setup()`` reads top to bottom, calling it between its own steps::

    self.start_run()                          # accelerator, seed, the checkpoint to resume from
    ... the trainer's own target, data, model ...
    self.prepare_engine(module, params)       # optimizer, scheduler, engine; metrics log
    self.stream = self.batch_stream(examples, collator)
    self.resume()                             # a fresh run: nothing; else step, stream, restore()
    self.record(description)                  # recipe.yaml and command.txt beside the run; one log line

``save()`` writes a checkpoint of the stream's position, ``checkpoint_state()`` and the last
evaluation; ``close()`` releases everything (``release()`` first, for what the trainer holds);
``eval_rounds`` hands each rank its share of held-out examples in the same number of rounds on
every rank. The command line calls ``setup()``, ``train()`` and, whatever happened, ``close()``;
``draftsmith prepare`` calls ``prepare(recipe)`` (the data step alone, on the class). The loop
(trainers/loop.py) drives ``advance``, ``evaluate``, ``describe`` and ``save``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

import torch
from torch import nn

from draftsmith.runs import STATE_FILE, CheckpointState, log
from draftsmith.trainers import checkpoint, engine, loop


class Trainer:
    """The base of every trainer (see the module docstring for the order of set-up)."""

    def __init__(self, recipe, argv: Optional[list[str]] = None) -> None:
        self.recipe = recipe
        self.argv = argv if argv is not None else loop.command_line()
        self.output_dir = Path(recipe.output_dir)
        self.step = 0  # optimizer steps (the loop's position unless ``position`` says otherwise)
        self.stream = None  # a BatchStream: its position travels with every checkpoint
        self.accelerator: Any = None
        self.model = self.optimizer = self.scheduler = self.step_module = None
        self.adapter_only = False  # checkpoints keep a LoRA adapter, not the frozen base (prepare_engine)
        self.metrics: Optional[loop.MetricsLog] = None
        # The checkpoint resumed from (None on a fresh run), the newest one written since, and the
        # checkpoint folder the engine loads (converted for another world size or ZeRO stage).
        self.resume_from: Optional[Path] = None
        self.last_checkpoint: Optional[Path] = None
        self.load_from: Optional[Path] = None
        self.last_eval: Optional[dict] = None
        self.first_eval: Optional[dict] = None  # where a fresh run started (loop.train_from_first_eval)
        self.run_lock = None
        self.stopped_by: Optional[str] = None
        self.nothing_to_train = False  # resumed at or past train.max_steps: the run's record stays as it was
        # Seconds the run trained before the checkpoint it resumed from (0 on a fresh run), and when
        # this process's loop started (loop.run_loop): a checkpoint records the two summed.
        self.seconds_before = 0.0
        self.loop_started: Optional[float] = None

    # ------------------------------------------------------------------ what a trainer writes

    @staticmethod
    def prepare(recipe) -> dict:
        """``draftsmith prepare``: the data step of `recipe` on its own; returns summary counts."""
        raise NotImplementedError

    def setup(self) -> "Trainer":
        raise NotImplementedError

    def train(self) -> dict:
        """Run to the end of the schedule; returns the summary written to final_metrics.json."""
        raise NotImplementedError

    def advance(self) -> tuple[int, dict]:
        """One unit of work (an optimizer step, a round of requests): (new position, logged values)."""
        raise NotImplementedError

    def evaluate(self) -> dict:
        raise NotImplementedError

    def describe(self, position: int, evaluation: dict) -> str:
        raise NotImplementedError

    @property
    def watched(self) -> nn.Module:
        """The model whose weights a test compares before and after training: the frozen target
        (``self.target``), which training and serving must leave as it was; a trainer that trains
        the target itself watches that model instead."""
        return self.target.model

    def drafter_kind(self) -> str:
        """What the checkpoints hold, as trainer_state.json records it: a head kind, "standalone"
        or "early_exit"."""
        raise NotImplementedError

    def checkpoint_state(self) -> dict:
        """The trainer's own entries of trainer_state.json (the stream's position and the last
        evaluation are added by ``save``)."""
        return {}

    def checkpoint_weights(self) -> Optional[dict[str, torch.Tensor]]:
        """The drafter's full weights where the engine's own files do not hold them (under
        DeepSpeed: the trained module's trainable weights, only the adapter when ``prepare_engine``
        was told ``adapter_only``), else None. A collective: every rank calls it."""
        return checkpoint.draft_checkpoint_weights(self.accelerator, self.step_module, self.adapter_only)

    def restore(self, state: CheckpointState) -> None:
        """Take back what ``checkpoint_state`` wrote (the step, the stream's position and the last
        evaluation are restored already)."""

    def release(self) -> None:
        """Let go of what the trainer itself holds (a feature cache's files), before the engine."""

    @property
    def position(self) -> int:
        """Where the loop stands and what checkpoints are numbered by: optimizer steps, unless a
        trainer counts something else (the online trainer: requests served)."""
        return self.step

    # ------------------------------------------------------------------ set-up, in order

    def start_run(self) -> None:
        """The accelerator (one process, DDP or DeepSpeed per the recipe), the seed, the output
        folder held for this run (another run writing there is refused), and the checkpoint to
        resume from (half-written ones are dropped). Nothing an earlier run left is changed yet."""
        r = self.recipe
        self.accelerator = engine.make_accelerator(r.train, r.deepspeed)
        torch.manual_seed(r.train.seed)
        self.resume_from, self.run_lock = checkpoint.open_run(self.accelerator, self.output_dir, r.train.resume)
        if self.resume_from is not None:
            checkpoint.check_resumable(r, self.resume_from)
        self.last_checkpoint = self.resume_from

    def prepare_engine(self, module: nn.Module, params: Iterable[nn.Parameter], adapter_only: bool = False) -> None:
        """Optimizer and scheduler for `params`, `module` wrapped by the engine (``self.model``),
        and the metrics log. A checkpoint of another world size or ZeRO stage is converted before
        the engine is built, as DeepSpeed needs. ``adapter_only``: checkpoints keep the LoRA
        adapter, not the frozen base weights."""
        acc, r = self.accelerator, self.recipe
        self.step_module, self.adapter_only = module, adapter_only
        optimizer = engine.build_optimizer(params, r.train)
        self.scheduler = engine.build_scheduler(optimizer, r.train)
        self.load_from = checkpoint.prepare_resume(acc, self.resume_from) if self.resume_from is not None else None
        self.model, self.optimizer = acc.prepare(module, optimizer)
        acc.register_for_checkpointing(self.scheduler)
        if adapter_only:
            acc.register_save_state_pre_hook(checkpoint.keep_adapter_weights)
        self.metrics = loop.MetricsLog(self.output_dir, enabled=acc.is_main_process)

    def batch_stream(self, examples: list, collator):
        """This rank's shuffled micro-batches of `examples`, in the recipe's order and size."""
        from draftsmith.data import BatchStream

        r, acc = self.recipe, self.accelerator
        return BatchStream(
            examples, batch_size=r.train.micro_batch_size, collator=collator, seed=r.data.seed,
            shuffle=True, rank=acc.process_index, world_size=acc.num_processes,
        )  # fmt: skip

    def resume(self, strict: bool = True) -> Optional[CheckpointState]:
        """On a resumed run: the engine's states from ``resume_from``, then the step, the stream's
        position, the last evaluation and the trainer's own entries (``restore``); the metrics log
        forgets what came after the checkpoint (the resumed run writes it again). Returns the
        checkpoint's state, None on a fresh run. `strict` False when checkpoints hold only the
        trainable part (a LoRA adapter)."""
        if self.resume_from is None:
            return None
        state = checkpoint.load_checkpoint(self.accelerator, self.resume_from, self.load_from, strict=strict)
        self.step = int(state["step"])
        # A report figure, not training state: an absent or damaged one does not stop the run.
        seconds = state.get("train_seconds")
        if "train_seconds" not in state:
            log(f"note: {self.resume_from / STATE_FILE} records no train_seconds (written before checkpoints kept them); the run's seconds count from this checkpoint")
        elif isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and seconds >= 0:
            self.seconds_before = float(seconds)
        else:
            log(f"note: {self.resume_from / STATE_FILE} has train_seconds {seconds!r}, not a number of seconds; the run's seconds count from this checkpoint")
        if self.stream is not None:
            self.stream.load_state_dict(state["data"])
        self.last_eval = state.get("last_eval")
        self.restore(state)
        self.metrics.truncate_after(int(state["step"]))
        log(f"resumed from {self.resume_from} at {state['step']}")
        # The loaded groups are the stepping optimizer's own now (a copy of ours under DeepSpeed's
        # optimizer offload): the schedule sets its learning rate there.
        self.scheduler.optimizer = engine.stepping_optimizer(self.optimizer)
        changed = engine.apply_optimizer_settings(self.scheduler, self.recipe.train)
        if changed:
            log(f"the recipe changed the optimizer since that checkpoint: {'; '.join(changed)} from here on (its Adam moments are kept)")
        return state

    # Whether the loop's position is ``step`` against train.max_steps (the online trainer counts
    # served requests instead).
    counts_steps = True

    def record(self, description: str) -> None:
        """Once set-up has succeeded: the resolved recipe and the command line beside the run, and
        one line saying what trains on what (with the engine). A resumed run that train.max_steps
        does not take past its checkpoint trains nothing: that is said, and the run's recipe.yaml,
        which records the schedule its checkpoints came from, is left as it was."""
        max_steps = self.recipe.train.max_steps
        if self.counts_steps and self.resume_from is not None and self.step >= max_steps:
            self.nothing_to_train = True
            where = "train.max_steps" if self.step == max_steps else f"past train.max_steps={max_steps}"
            log(f"{self.output_dir} is already at step {self.step}, {where}: nothing to train (raise train.max_steps to train on); its recipe.yaml and final_metrics.json are left as they were")
        else:
            checkpoint.record_run(self.accelerator, self.recipe, self.output_dir, self.argv)
        log(f"{description}; {engine.describe_engine(self.accelerator, self.recipe)}")

    # ------------------------------------------------------------------ during the run

    def eval_rounds(self, examples: list) -> Iterator[tuple[list, bool]]:
        """This rank's share of held-out `examples`, a micro-batch a round, as (chunk, counted).
        Every rank runs the same number of rounds (ZeRO-3 gathers weights collectively in each
        forward): a rank short of examples gets the first example as a stand-in, counted False,
        whose forward runs and whose figures are left out."""
        acc, size = self.accelerator, self.recipe.train.micro_batch_size
        mine = examples[acc.process_index :: acc.num_processes]
        per_rank = -(-len(examples) // acc.num_processes)
        for b in range(-(-per_rank // size)):
            chunk = mine[b * size : (b + 1) * size]
            yield (chunk, True) if chunk else (examples[:1], False)

    def save(self) -> Path:
        """A checkpoint at ``position`` (every rank calls this): the engine's states, the drafter's
        weights where the engine does not hold them, and trainer_state.json."""
        state = {
            **({"data": self.stream.state_dict()} if self.stream is not None else {}), **self.checkpoint_state(), "last_eval": self.last_eval,
            "train_seconds": round(self.train_seconds(), 3),
        }  # fmt: skip
        path = checkpoint.save_checkpoint(
            self.accelerator, self.output_dir, self.position, state, self.recipe, self.drafter_kind(), self.checkpoint_weights(), self.argv
        )
        self.last_checkpoint = path
        return path

    def train_seconds(self, elapsed: Optional[float] = None) -> float:
        """Seconds the run has trained: before the checkpoint it resumed from, then this process's
        loop (``elapsed``, or counted from its start). What the lost part of an interrupted run
        trained after its last checkpoint is not counted: the resumed run trains it again."""
        if elapsed is None:
            elapsed = 0.0 if self.loop_started is None else time.time() - self.loop_started
        return self.seconds_before + elapsed

    def close(self) -> None:
        """Release the engine and the process group so every rank exits cleanly (also after a
        failed set-up): the trainer's own holdings, then the wrapped module, optimizer and step
        module (a rank otherwise sometimes aborts at exit, docs/ENVIRONMENT.md), then the metrics
        log and the accelerator; the output folder is let go last."""
        acc = self.accelerator
        lock, self.run_lock = self.run_lock, None
        try:
            self.release()
        finally:
            self.model = self.optimizer = self.step_module = None
            try:
                if self.metrics is not None:
                    self.metrics.close()
                if acc is not None:
                    engine.teardown(acc)
            finally:
                if lock is not None:
                    lock.release()


def trainable_parameters(module: nn.Module) -> int:
    """Trainable parameters of `module` (in full, also when ZeRO-3 partitions them)."""
    return sum(int(getattr(p, "ds_numel", p.numel())) for p in module.parameters() if p.requires_grad)


__all__ = ["Trainer", "trainable_parameters"]
