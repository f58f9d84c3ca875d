"""Checkpoints: written atomically with a sha256 manifest, found again on resume, converted when the
world size or ZeRO stage changes. The folder layout is in draftsmith/runs.py.

A checkpoint is written into a hidden temporary folder and renamed into place, so a folder named
step-N is always complete; a crash mid-write leaves only a temporary folder, removed on the next
start. A folder whose files no longer match its manifest (truncated, deleted; when resuming, also
a sha256 that differs) is skipped with a warning, and the previous complete one is used.
trainer_state.json records the trainer and the drafter kind, so export and eval never guess.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor, nn

from draftsmith.atomic import TMP_PREFIX, atomic_path, commit, full_disk_names, sha256_file, write_atomic
from draftsmith.recipe import Recipe, save_resolved
from draftsmith.runs import (
    CHECKPOINT_PREFIX, LOCK_NAME, STATE_FILE, WEIGHTS_NAME, FolderLock, RunFolderError, checkpoint_problem, checkpoint_root, hold_folder,
    is_data_cache, is_run_folder, list_checkpoints, log, read_state,
)
from draftsmith.trainers.engine import TrainingError, engine_info, full_state_dict, uses_deepspeed


def _quiet_tied_weights(record: logging.LogRecord) -> bool:
    """accelerate warns at every save of a model with tied weights (an LM head tied to the
    embedding) that it stored one copy and asks the user to check the reload: draftsmith's loader
    reties them (artifacts._trained_model), and resuming is tested exact, so the line is dropped."""
    return "Removed shared tensor" not in str(record.msg)  # after "[RANK n] "


logging.getLogger("accelerate.utils.other").addFilter(_quiet_tied_weights)


def find_resume_checkpoint(output_dir: str | Path, resume: str) -> Optional[Path]:
    """The checkpoint to continue from, per train.resume ("auto", "never" or a folder)."""
    if resume == "never":
        if list_checkpoints(output_dir):
            raise RunFolderError(
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
        raise RunFolderError(f"train.resume: {path} is not a complete checkpoint (no {STATE_FILE})")
    problem = checkpoint_problem(path, verify_contents=True)
    if problem:
        raise RunFolderError(f"train.resume: {path} is not a complete checkpoint ({problem})")
    return path


# Whose weights a checkpoint holds: a resumed run must not change these (a changed shape shows up
# when the weights load; see load_checkpoint).
MODEL_KEYS = ("trainer", "target.path", "target.gguf_file", "head.kind", "draft.path", "draft.gguf_file", "draft.lora.enabled", "layerskip.lora.enabled")


def _flatten(value, prefix: str = "") -> dict:
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            out.update(_flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: value}


def check_resumable(recipe: Recipe, checkpoint: Path) -> None:
    """RunFolderError naming the first recipe key whose value differs from the one `checkpoint`
    was trained with, among the keys that decide what its weights are (MODEL_KEYS): resuming would
    load weights into a different model."""
    from omegaconf import OmegaConf

    from draftsmith.recipe import as_dict

    saved_file = checkpoint / "recipe.yaml"
    if not saved_file.is_file():
        return
    saved = _flatten(OmegaConf.to_container(OmegaConf.load(saved_file)) or {})
    now = _flatten(as_dict(recipe))
    for key in MODEL_KEYS:
        if saved.get(key) != now.get(key):
            raise RunFolderError(
                f"recipe key '{key}' is {now.get(key)!r} but {checkpoint} was trained with {saved.get(key)!r}: "
                f"resuming would load its weights into another model; use another output_dir (or delete that run's checkpoints to start it over)"
            )


def check_output_dir(output_dir: Path) -> None:
    """RunFolderError unless `output_dir` is absent, empty, or a draftsmith run (its recipe.yaml,
    command.txt and metrics would otherwise overwrite what the user keeps there)."""
    if not output_dir.exists():
        return
    if not output_dir.is_dir():
        raise RunFolderError(f"output_dir {output_dir} exists and is not a folder")
    # A first run stopped in its data step (Ctrl-C while the target regenerates answers) leaves
    # only its default data cache, <output_dir>/data: the same command goes on.
    entries = sorted(p.name for p in output_dir.iterdir() if p.name != LOCK_NAME and not (p.name == "data" and is_data_cache(p)))
    if not entries or is_run_folder(output_dir):
        return
    if is_data_cache(output_dir):
        raise RunFolderError(
            f"output_dir {output_dir} is a draftsmith data cache, whose recipe.yaml and command.txt a run would replace: "
            "choose an empty or new folder (the data cache stays data.cache_dir)"
        )
    raise RunFolderError(
        f"output_dir {output_dir} holds files that are not a draftsmith run ({len(entries)} entries, e.g. {entries[0]!r}): "
        "choose an empty or new folder"
    )


def open_run(accelerator, output_dir: Path, resume: str) -> tuple[Optional[Path], Optional[FolderLock]]:
    """Start or continue a run in `output_dir`: the main process takes the folder for this run (the
    ranks of one run write through it; another run there is refused, runs.hold_folder), drops
    half-written checkpoints; returns the checkpoint to resume from (per train.resume) and the lock
    (None on the other ranks) that Trainer.close releases. Writes nothing else: what an earlier
    run left there stays as it was until `record_run`, so a run that fails while setting up loses
    nothing."""
    check_output_dir(output_dir)
    lock = hold_folder(output_dir) if accelerator.is_main_process else None
    try:
        if accelerator.is_main_process:
            clear_partial_checkpoints(output_dir)
        accelerator.wait_for_everyone()
        return find_resume_checkpoint(output_dir, resume), lock
    except BaseException:
        if lock is not None:
            lock.release()
        raise


def record_run(accelerator, recipe: Recipe, output_dir: Path, argv: list[str]) -> None:
    """Save the resolved recipe and the command line beside the run, once setup has succeeded."""
    if accelerator.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        save_resolved(recipe, output_dir, argv)


def clear_partial_checkpoints(output_dir: str | Path) -> None:
    root = checkpoint_root(output_dir)
    if root.is_dir():
        for path in root.glob(f"{TMP_PREFIX}*"):
            shutil.rmtree(path, ignore_errors=True)


def save_checkpoint(
    accelerator,
    output_dir: str | Path,
    step: int,
    state: dict,
    recipe: Recipe,
    drafter_kind: str,
    weights: Optional[dict[str, torch.Tensor]] = None,
    argv: Optional[list[str]] = None,
) -> Path:
    """Write checkpoint step-N atomically (every rank calls this) and prune old ones. Returns its path.

    trainer_state.json records `state` (the trainer's own: data position, metrics), the trainer and
    `drafter_kind` (a head kind, "standalone" or "early_exit"). Under DeepSpeed the engine's shards
    never hold frozen parameters (the target), and `weights` (the drafter's full weights, from
    full_state_dict) become model.safetensors, so exports read every checkpoint the same way.
    """
    from safetensors.torch import save_file

    root = checkpoint_root(output_dir)
    final = root / f"{CHECKPOINT_PREFIX}{step:06d}"
    # One name every rank agrees on: DeepSpeed ranks write their shards into it.
    tmp = root / f"{TMP_PREFIX}{final.name}"
    deepspeed = uses_deepspeed(accelerator)
    try:
        # A full disk is one line naming the checkpoint; what was written of it goes (a full disk
        # has no room for a leftover), and the checkpoints written before it stay as they were.
        with full_disk_names(final):
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
                    save_file(weights, str(tmp / WEIGHTS_NAME))
                save_resolved(recipe, tmp, argv)
                files = [p for p in sorted(tmp.rglob("*")) if p.is_file()]
                record = {
                    "step": step,
                    "trainer": recipe.trainer,
                    "drafter": {"kind": drafter_kind},
                    "engine": engine_info(accelerator),
                    **state,
                    "files": {str(p.relative_to(tmp)): p.stat().st_size for p in files},
                    "sha256": {str(p.relative_to(tmp)): sha256_file(p) for p in files},
                }
                # trainer_state.json goes last: its presence marks the folder complete.
                write_atomic(tmp / STATE_FILE, json.dumps(record, indent=2))
                commit(tmp, final)
    except BaseException:
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if accelerator.is_main_process:
        for old in list_checkpoints(output_dir)[: -recipe.train.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def trainable_only(weights: dict) -> dict:
    """A LoRA draft's checkpoint keeps the adapter: the frozen base weights are the draft's files."""
    return {k: v for k, v in weights.items() if "lora_" in k}


def keep_adapter_weights(_models: list, weights: list[dict], _output_dir: str) -> None:
    """accelerate save_state pre-hook: each model's state dict shrinks to its LoRA adapter."""
    for state in weights:
        adapter = trainable_only(state)
        state.clear()
        state.update(adapter)


def draft_checkpoint_weights(accelerator, step_module: nn.Module, lora: bool) -> Optional[dict[str, Tensor]]:
    """What model.safetensors of a checkpoint gets under DeepSpeed (whose own shards are per rank):
    the draft's trainable weights in full (with LoRA, the adapter), named as the other engines
    write them. None elsewhere: accelerate writes the file itself. A collective: all ranks call it."""
    if not uses_deepspeed(accelerator):
        return None
    return full_state_dict(accelerator, step_module, trainable_only=lora)


def prepare_resume(accelerator, path: Path) -> Path:
    """Check that checkpoint `path` fits this run's engine; return the folder load_checkpoint reads.

    Call before accelerator.prepare(). A DeepSpeed checkpoint written by another world size or ZeRO
    stage is converted once into DeepSpeed's universal format (in <path>/universal) and the engine
    is configured to load it, so a 2-process run resumes in 1 process and vice versa. A DDP or
    single-process checkpoint loads at any world size as it is.
    """
    state = read_state(path)
    saved = state.engine
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
    with atomic_path(out, folder=True) as tmp:
        _write_universal(path, tmp)


def _write_universal(path: Path, tmp: Path) -> None:
    import contextlib
    import io
    import types

    from deepspeed.checkpoint import ds_to_universal

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


def load_checkpoint(accelerator, path: Path, load_from: Optional[Path] = None, strict: bool = True) -> dict:
    """Restore model, optimizer, scheduler and RNG states; return trainer_state.json of `path`.

    `load_from` is what prepare_resume returned (default: `path` itself). `strict=False` when the
    checkpoint holds only the trainable part of the wrapped module (a LoRA adapter).
    """
    source = load_from or path
    try:
        if uses_deepspeed(accelerator):
            # Frozen parameters (the target, a LoRA base) are never saved, so the engine must not
            # insist on finding them.
            accelerator.load_state(str(source), load_module_strict=False)
        else:
            accelerator.load_state(str(source), strict=strict)
    except (RuntimeError, KeyError, ValueError) as err:
        first = next((line.strip() for line in str(err).splitlines() if "size mismatch" in line or "Missing key" in line), str(err).splitlines()[0] if str(err) else "")
        raise RunFolderError(
            f"checkpoint {path} does not fit the model this recipe builds ({first[:200]}): a head or draft setting changed since it "
            "was written; use another output_dir, or the recipe it was trained with"
        ) from None
    state = read_state(path)
    # accelerate restores its micro-batch counter, which decides where accumulation windows end;
    # a run with another world size accumulates differently, so align it with the optimizer step.
    accelerator.step = state.step * accelerator.gradient_accumulation_steps
    return state
