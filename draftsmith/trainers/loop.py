"""Machinery every trainer shares: engine, optimizer, schedule, checkpoints, logging, signals.

Functions, not a base class: a trainer reads top to bottom and calls what it needs.

Engines: one plain process, DDP under torchrun / accelerate launch, or DeepSpeed ZeRO 0-3 when the
recipe has a ``deepspeed:`` section (under any of those launchers or the ``deepspeed`` launcher).
Batch sizes, accumulation and precision always come from the recipe's ``train:`` section.

Checkpoint layout (one folder per optimizer step, written atomically)::

    <output_dir>/checkpoints/step-000200/
        model.safetensors      the drafter's trainable weights (full, float32 under DeepSpeed)
        optimizer.bin, random_states_*.pkl, custom_checkpoint_*.pkl      (accelerate), or
        pytorch_model/ + latest                                          (DeepSpeed, per-rank shards)
        trainer_state.json     step, data position, engine, last metrics, and a manifest of every
                               file with its size and sha256; written last
        recipe.yaml, command.txt

A checkpoint is written into a hidden temporary folder and renamed into place, so a folder named
step-N is always complete; a crash mid-write leaves only a temporary folder, removed on the next
start. A folder whose files no longer match its manifest (truncated, deleted; when resuming, also
a sha256 that differs) is skipped with a warning, and the previous complete one is used.
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
from typing import Any, Callable, Iterable, Optional

import torch
from torch import nn

from draftsmith.recipe import DeepSpeedConfig, Recipe, RecipeError, TrainConfig, save_resolved
from draftsmith.target import sha256_file

CHECKPOINT_PREFIX = "step-"
STATE_FILE = "trainer_state.json"


class TrainingError(RuntimeError):
    """A run that cannot go on. The message names the step and the last good checkpoint."""


def log(message: str) -> None:
    """Print on the main process only (rank from the launcher's environment)."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(message, flush=True)


def world_size() -> int:
    """Processes in this run, from the launcher's environment (1 without a launcher)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def configure_threads() -> Optional[int]:
    """Split the cores between the ranks on this machine when the launcher did not.

    torchrun sets OMP_NUM_THREADS=1; the deepspeed launcher sets nothing, and every rank then
    spreads over all cores (about 70x slower training on 2 cores). Returns the threads set, if any.
    """
    if world_size() <= 1 or "OMP_NUM_THREADS" in os.environ:
        return None
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or world_size())
    threads = max(1, (os.cpu_count() or 1) // max(1, local))
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    return threads


def resolve_grad_accum(train: TrainConfig, world: int) -> int:
    """Micro-batches per optimizer step. With train.global_batch_size it is derived for this world
    size (and written back into `train`, so every trainer and the saved recipe see it)."""
    if train.global_batch_size is None:
        return train.grad_accum_steps
    per_pass = train.micro_batch_size * world
    if train.global_batch_size % per_pass:
        raise RecipeError(
            f"recipe key 'train.global_batch_size'={train.global_batch_size} is not divisible by "
            f"train.micro_batch_size={train.micro_batch_size} x {world} processes; change one of them"
        )
    train.grad_accum_steps = train.global_batch_size // per_pass
    return train.grad_accum_steps


def deepspeed_config(train: TrainConfig, ds: DeepSpeedConfig, world: int) -> dict:
    """The DeepSpeed config dict of a recipe: batch sizes, accumulation and clipping from train:,
    ZeRO settings from deepspeed:, then deepspeed.config merged over it. Precision is added by
    accelerate from train.mixed_precision."""
    zero: dict[str, Any] = {"stage": ds.zero_stage}
    if ds.offload_optimizer != "none":
        zero["offload_optimizer"] = {"device": ds.offload_optimizer, **({"nvme_path": ds.nvme_path} if ds.offload_optimizer == "nvme" else {})}
    if ds.offload_param != "none":
        zero["offload_param"] = {"device": ds.offload_param, **({"nvme_path": ds.nvme_path} if ds.offload_param == "nvme" else {})}
    config = {
        "train_micro_batch_size_per_gpu": train.micro_batch_size,
        "gradient_accumulation_steps": train.grad_accum_steps,
        "train_batch_size": train.micro_batch_size * train.grad_accum_steps * world,
        "gradient_clipping": train.max_grad_norm,
        "zero_optimization": zero,
        # The optimizer is a torch AdamW built from train:, not DeepSpeed's fused Adam (which
        # compiles for minutes on first use).
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**12,
        "wall_clock_breakdown": False,
    }
    return _merge(config, ds.config or {})


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _check_launcher(ds: Optional[DeepSpeedConfig]) -> None:
    """Refuse DeepSpeed settings that come from the launcher instead of the recipe."""
    env_ds = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    use_ds = ds is not None and ds.zero_stage is not None
    if env_ds and not use_ds:
        raise RecipeError(
            "the launcher asks for DeepSpeed (ACCELERATE_USE_DEEPSPEED=true) but the recipe has no deepspeed.zero_stage: "
            "merge recipes/deepspeed/zero2.yaml (or zero1/zero3) into the recipe instead"
        )
    if not use_ds:
        return
    if os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none") not in ("", "none"):
        raise RecipeError(
            f"the launcher passes a DeepSpeed config file ({os.environ['ACCELERATE_DEEPSPEED_CONFIG_FILE']}); "
            "draftsmith takes DeepSpeed settings from the recipe's deepspeed: section only"
        )
    stage = os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE")
    if stage not in (None, "") and int(stage) != ds.zero_stage:
        raise RecipeError(f"the launcher asks for ZeRO stage {stage} but the recipe has deepspeed.zero_stage={ds.zero_stage}; drop the launcher's setting")


def _single_process_env() -> None:
    """DeepSpeed always runs in a process group: give a plain process a group of one."""
    if "RANK" in os.environ or "LOCAL_RANK" in os.environ:
        return
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def _skip_cpu_shm_op() -> None:
    """Keep DeepSpeed's CPU backend from compiling its shared-memory all-reduce (23-52 s and a C++
    compiler on first use): only inference_all_reduce uses it, and training never calls that."""
    import deepspeed.ops

    compatible = deepspeed.ops.__compatible_ops__
    if "deepspeed_shm_comm" in compatible:
        compatible["deepspeed_shm_comm"] = False


def make_accelerator(train: TrainConfig, deepspeed: Optional[DeepSpeedConfig] = None):
    """An accelerate engine for one process, DDP, or DeepSpeed ZeRO (when `deepspeed.zero_stage` is
    set), under whichever launcher started this process.

    Derives train.grad_accum_steps from train.global_batch_size when that is set, and raises
    RecipeError (before anything is written) when the world size does not divide the global batch
    or the launcher's DeepSpeed settings contradict the recipe.
    """
    threads = configure_threads()
    if threads:
        log(f"OMP_NUM_THREADS was not set by the launcher: {threads} thread(s) per process")
    _check_launcher(deepspeed)
    world = world_size()
    accum = resolve_grad_accum(train, world)
    from accelerate.utils import InitProcessGroupKwargs

    handlers = []
    cpu = not torch.cuda.is_available()
    if deepspeed is not None and deepspeed.zero_stage is not None:
        if cpu:
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
            # accelerate ignores DeepSpeed when told to use the CPU, but DeepSpeed runs on CPU.
            os.environ["ACCELERATE_USE_CPU"] = "false"
            handlers.append(InitProcessGroupKwargs(backend="gloo"))
            _skip_cpu_shm_op()
        _single_process_env()
        from accelerate import Accelerator
        from accelerate.utils import DeepSpeedPlugin

        plugin = DeepSpeedPlugin(hf_ds_config=deepspeed_config(train, deepspeed, world), zero3_init_flag=deepspeed.shard_target)
        accelerator = Accelerator(
            mixed_precision=train.mixed_precision,
            gradient_accumulation_steps=accum,
            deepspeed_plugin=plugin,
            kwargs_handlers=handlers,
        )
        if not deepspeed.shard_target:
            # transformers reads a global ZeRO-3 config to load models with zero.Init and to sync
            # generate() across ranks; a replicated target must be neither.
            from transformers.integrations import unset_hf_deepspeed_config

            unset_hf_deepspeed_config()
        return accelerator

    from accelerate import Accelerator

    if cpu and world > 1:
        # Several CPU processes talk over gloo. In one process, naming a backend would make
        # accelerate believe it is distributed, so it is set only under a launcher.
        handlers.append(InitProcessGroupKwargs(backend="gloo"))
    return Accelerator(
        mixed_precision=train.mixed_precision,
        gradient_accumulation_steps=accum,
        kwargs_handlers=handlers,
        cpu=cpu,
    )


def uses_deepspeed(accelerator) -> bool:
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.DEEPSPEED


def engine_info(accelerator) -> dict:
    """What wrote a checkpoint: {"kind": "deepspeed" | "accelerate", "zero_stage", "world_size"}."""
    if uses_deepspeed(accelerator):
        stage = accelerator.state.deepspeed_plugin.deepspeed_config["zero_optimization"]["stage"]
        return {"kind": "deepspeed", "zero_stage": int(stage), "world_size": accelerator.num_processes}
    return {"kind": "accelerate", "zero_stage": None, "world_size": accelerator.num_processes}


def full_state_dict(
    accelerator, module: nn.Module, prefix: str = "", trainable_only: bool = False
) -> dict[str, torch.Tensor]:
    """`module`'s complete weights on every rank (a collective under DeepSpeed: all ranks call it):
    its parameters (only those that train, with `trainable_only`) and persistent buffers.

    Under DeepSpeed the trainable parameters come from the optimizer's float32 master copy, gathered
    from the ranks' partitions; elsewhere they are the module's own tensors.
    """
    if not uses_deepspeed(accelerator):
        keep = {n for n, p in module.named_parameters() if p.requires_grad} if trainable_only else None
        return {
            prefix + k: v.detach().cpu().contiguous()
            for k, v in module.state_dict().items()
            if keep is None or k in keep
        }
    from deepspeed.utils import safe_get_full_fp32_param

    out = {}
    for name, param in module.named_parameters():
        if trainable_only and not param.requires_grad:
            continue
        full = safe_get_full_fp32_param(param) if param.requires_grad else None
        if full is None:
            from draftsmith.data.features import gathered_parameters

            with gathered_parameters([param]):
                full = param.detach().to(torch.float32).clone()
        out[prefix + name] = full.detach().cpu().contiguous()
    if not trainable_only:
        for owner_name, owner in module.named_modules():
            for name, buffer in owner.named_buffers(recurse=False):
                if name not in owner._non_persistent_buffers_set:  # state_dict() leaves those out too
                    out[prefix + (f"{owner_name}.{name}" if owner_name else name)] = buffer.detach().cpu().contiguous()
    return out


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


def checkpoint_problem(path: Path, verify_contents: bool = False) -> Optional[str]:
    """Why `path` is not a complete checkpoint, or None when it is: trainer_state.json must be
    readable and every file of its manifest present with the recorded size (either format) and,
    with `verify_contents`, the recorded sha256 (a file damaged in place keeps its size)."""
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


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first. Incomplete or corrupt ones are skipped with a warning."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        if not (path.is_dir() and path.name.startswith(CHECKPOINT_PREFIX)):
            continue
        problem = checkpoint_problem(path)
        if problem:
            log(f"warning: skipping incomplete or corrupt checkpoint {path} ({problem})")
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
        # Newest first; only the one resumed from is read in full, to check its contents.
        for path in reversed(list_checkpoints(output_dir)):
            problem = checkpoint_problem(path, verify_contents=True)
            if problem is None:
                return path
            log(f"warning: skipping corrupt checkpoint {path} ({problem}); trying the one before it")
        return None
    path = Path(resume)
    if not (path / STATE_FILE).is_file():
        raise TrainingError(f"train.resume: {path} is not a complete checkpoint (no {STATE_FILE})")
    problem = checkpoint_problem(path, verify_contents=True)
    if problem:
        raise TrainingError(f"train.resume: {path} is not a complete checkpoint ({problem})")
    return path


def open_run(accelerator, output_dir: Path, resume: str) -> Optional[Path]:
    """Start or continue a run in `output_dir`: drop half-written checkpoints, return the one to
    resume from (per train.resume). Writes nothing else: what an earlier run left there stays as it
    was until `record_run`, so a run that fails while setting up loses nothing."""
    if accelerator.is_main_process:
        clear_partial_checkpoints(output_dir)
    accelerator.wait_for_everyone()
    return find_resume_checkpoint(output_dir, resume)


def record_run(accelerator, recipe: Recipe, output_dir: Path, argv: list[str]) -> None:
    """Save the resolved recipe and the command line beside the run, once setup has succeeded."""
    if accelerator.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        save_resolved(recipe, output_dir, argv)


def clear_partial_checkpoints(output_dir: str | Path) -> None:
    root = checkpoint_root(output_dir)
    if root.is_dir():
        for path in root.glob(".tmp-*"):
            shutil.rmtree(path, ignore_errors=True)


def save_checkpoint(
    accelerator,
    output_dir: str | Path,
    step: int,
    state: dict,
    recipe: Recipe,
    keep_last: int,
    weights: Optional[dict[str, torch.Tensor]] = None,
    argv: Optional[list[str]] = None,
) -> Path:
    """Write checkpoint step-N atomically (every rank calls this) and prune old ones. Returns its path.

    Under DeepSpeed the engine's shards never hold frozen parameters (the target), and `weights`
    (the drafter's full weights, from full_state_dict) become model.safetensors, so exports read
    every checkpoint the same way.
    """
    from safetensors.torch import save_file

    root = checkpoint_root(output_dir)
    final = root / f"{CHECKPOINT_PREFIX}{step:06d}"
    tmp = root / f".tmp-{CHECKPOINT_PREFIX}{step:06d}"
    deepspeed = uses_deepspeed(accelerator)
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    if deepspeed:
        accelerator.save_state(str(tmp), exclude_frozen_parameters=True)
    else:
        accelerator.save_state(str(tmp), safe_serialization=True)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if deepspeed and weights is not None:
            save_file(weights, str(tmp / "model.safetensors"))
        save_resolved(recipe, tmp, argv or command_line())
        files = [p for p in sorted(tmp.rglob("*")) if p.is_file()]
        manifest = {str(p.relative_to(tmp)): p.stat().st_size for p in files}
        digests = {str(p.relative_to(tmp)): sha256_file(p) for p in files}
        # trainer_state.json goes last: its presence marks the folder complete.
        payload = json.dumps(
            {"step": step, "engine": engine_info(accelerator), **state, "files": manifest, "sha256": digests}, indent=2
        )
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


def prepare_resume(accelerator, path: Path) -> Path:
    """Check that checkpoint `path` fits this run's engine; return the folder load_checkpoint reads.

    Call before accelerator.prepare(). A DeepSpeed checkpoint written by another world size or ZeRO
    stage is converted once into DeepSpeed's universal format (in <path>/universal) and the engine
    is configured to load it, so a 2-process run resumes in 1 process and vice versa. A DDP or
    single-process checkpoint loads at any world size as it is.
    """
    state = json.loads((path / STATE_FILE).read_text())
    saved = state.get("engine", {"kind": "accelerate", "zero_stage": None, "world_size": 1})
    now = engine_info(accelerator)
    if saved["kind"] != now["kind"]:
        how = f"DeepSpeed ZeRO-{saved['zero_stage']}" if saved["kind"] == "deepspeed" else "one process or DDP (no deepspeed: section)"
        raise TrainingError(
            f"checkpoint {path} was written with {how}; resume it with the same engine, or start a new output_dir "
            f"(its drafter weights are in {path / 'model.safetensors'})"
        )
    if now["kind"] != "deepspeed" or (saved["world_size"], saved["zero_stage"]) == (now["world_size"], now["zero_stage"]):
        return path
    universal = path / "universal"
    with accelerator.main_process_first():
        if accelerator.is_main_process and not (universal / STATE_FILE).is_file():
            log(f"converting {path} (ZeRO-{saved['zero_stage']}, {saved['world_size']} processes) for ZeRO-{now['zero_stage']} on {now['world_size']}")
            _to_universal(path, universal)
    accelerator.state.deepspeed_plugin.deepspeed_config.setdefault("checkpoint", {})["load_universal"] = True
    return universal


def _to_universal(path: Path, out: Path) -> None:
    import contextlib
    import io
    import types

    from deepspeed.checkpoint import ds_to_universal

    tmp = out.with_name(f".tmp-{out.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    args = types.SimpleNamespace(
        input_folder=str(path / "pytorch_model"),
        output_folder=str(tmp / "pytorch_model"),
        num_extract_workers=1,  # in this process: no worker pool to leak on a failure
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,
    )
    with contextlib.redirect_stdout(io.StringIO()):
        ds_to_universal.main(args)
    # accelerate's own states (scheduler, RNG) travel with it; the marker file goes last.
    for file in path.iterdir():
        if file.is_file() and file.suffix == ".pkl":
            shutil.copy2(file, tmp / file.name)
    shutil.copy2(path / STATE_FILE, tmp / STATE_FILE)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)


def load_checkpoint(accelerator, path: Path, load_from: Optional[Path] = None, strict: bool = True) -> dict:
    """Restore model, optimizer, scheduler and RNG states; return trainer_state.json of `path`.

    `load_from` is what prepare_resume returned (default: `path` itself). `strict=False` when the
    checkpoint holds only the trainable part of the wrapped module (a LoRA adapter).
    """
    source = load_from or path
    if uses_deepspeed(accelerator):
        # Frozen parameters (the target, a LoRA base) are never saved, so the engine must not
        # insist on finding them.
        accelerator.load_state(str(source), load_module_strict=False)
    else:
        accelerator.load_state(str(source), strict=strict)
    state = json.loads((path / STATE_FILE).read_text())
    # accelerate restores its micro-batch counter, which decides where accumulation windows end;
    # a run with another world size accumulates differently, so align it with the optimizer step.
    accelerator.step = int(state["step"]) * accelerator.gradient_accumulation_steps
    return state


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
        kept = []
        for line in self.path.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:  # a line cut short by the crash being resumed from
                continue
            if record.get("step", step + 1) <= step:
                kept.append(line)
        self.path.write_text("".join(line + "\n" for line in kept))

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


# ----------------------------------------------------------------------------- the step loop


def run_steps(trainer, desc: str, describe: Callable[[int, dict], str]) -> tuple[dict, float]:
    """Optimizer steps until train.max_steps, for a trainer with accelerator, recipe, step,
    metrics, last_checkpoint, train_step(), evaluate() and save().

    Logs train_step's values every train.log_every steps (and at step 1), evaluates every
    train.eval_every steps and at the end (printing `describe(step, result)`), saves every
    train.save_every steps, at the end and when a SIGINT/SIGTERM reached any rank (then stops,
    every rank at the same step). A NaN or infinite loss raises TrainingError naming the step and
    the last good checkpoint. Returns (the last evaluation or {}, seconds spent).
    """
    from tqdm.auto import tqdm

    acc, train = trainer.accelerator, trainer.recipe.train
    stop = StopFlag()
    restore = install_stop_handlers(stop)
    bar = tqdm(total=train.max_steps, initial=trainer.step, desc=desc, disable=not acc.is_main_process, dynamic_ncols=True)
    started, result = time.time(), {}
    try:
        while trainer.step < train.max_steps:
            values = trainer.train_step()
            trainer.step += 1
            step = trainer.step
            bar.update(1)
            if not math.isfinite(values["loss"]):
                where = f"; the last good checkpoint is {trainer.last_checkpoint}" if trainer.last_checkpoint else ""
                raise TrainingError(f"loss became {values['loss']} at step {step}{where}")
            bar.set_postfix(loss=f"{values['loss']:.4f}", lr=f"{values['lr']:.2e}")
            if step % train.log_every == 0 or step == 1:
                trainer.metrics.write(step, "train", values)
            if step % train.eval_every == 0 or step == train.max_steps:
                result = trainer.last_eval = trainer.evaluate()
                trainer.metrics.write(step, "eval", result)
                if acc.is_main_process:
                    bar.write(describe(step, result))
            stopping = any_rank(acc, stop.requested)
            if step % train.save_every == 0 or step == train.max_steps or stopping:
                trainer.save()
            if stopping:
                log(f"stopped at step {step}; resume with the same command. Checkpoint: {trainer.last_checkpoint}")
                break
    finally:
        bar.close()
        restore()
    return result, time.time() - started


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


def any_rank(accelerator, flag: bool) -> bool:
    """True on every rank when `flag` is true on any rank, so all ranks stop at the same step."""
    if accelerator.num_processes == 1:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=accelerator.device)
    return bool(accelerator.reduce(t, reduction="sum").item() > 0)


def gather_objects(accelerator, obj: Any) -> list[Any]:
    """Every rank's `obj` (picklable), in rank order, on every rank."""
    if accelerator.num_processes == 1:
        return [obj]
    out: list[Any] = [None] * accelerator.num_processes
    torch.distributed.all_gather_object(out, obj)
    return out


def teardown(accelerator) -> None:
    """Free the engine before the process group goes, so ranks exit cleanly.

    The caller drops its own references to the wrapped model and optimizer first. Without that and a
    garbage collection, a rank sometimes aborts at interpreter exit after a successful DDP run (see
    docs/ENVIRONMENT.md).
    """
    import gc

    from accelerate.state import AcceleratorState, GradientState

    accelerator.free_memory()
    gc.collect()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    # accelerate keeps its settings (mixed precision, DeepSpeed plugin, accumulation) in
    # process-wide singletons: forget them, so a later run in this process can choose its own.
    AcceleratorState._reset_state()
    GradientState._reset_state()


def peak_memory(accelerator) -> dict:
    """Peak memory of the busiest rank in MB: host RSS, and device memory on CUDA."""
    import resource

    rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kilobytes on Linux
    values = [rss_kb / 1024]
    if torch.cuda.is_available():
        values.append(torch.cuda.max_memory_allocated() / 2**20)
    t = torch.tensor(values, dtype=torch.float64, device=accelerator.device)
    if accelerator.num_processes > 1 and torch.distributed.is_initialized():
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    out = {"peak_rss_mb": round(float(t[0]), 1)}
    if len(values) > 1:
        out["peak_device_mb"] = round(float(t[1]), 1)
    return out


def command_line() -> list[str]:
    return [Path(sys.argv[0]).name, *sys.argv[1:]]
