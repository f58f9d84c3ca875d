"""Trained drafters -> folders that draftsmith, vLLM, SGLang and speculators load, with a model card
(and the exact serve command), the recipe, the metrics and a sha256 manifest; Hub upload.

FORMATS maps ``draftsmith export --format`` names to converter modules: each says in one line why it
cannot carry a drafter (``refusal``, from what the folder records: no weights load to refuse),
or writes it (``write``) into a folder that appears atomically. The engines' tensor and config
layouts themselves live in draftsmith.layouts (``WRITERS[(format, kind)]``), beside the code that
reads them back; what a source folder holds is draftsmith.artifacts' question, never this package's.
"""

from pathlib import Path
from typing import Optional

from draftsmith.artifacts import HeadArtifact, _recipe_of, open_drafter
from draftsmith.atomic import atomic_path, check_destination, previous_output, previous_report, write_manifest
from draftsmith.export import native, sglang, speculators, vllm
from draftsmith.export.base import ExportError, ExportOptions
from draftsmith.export.hub import push_folder
from draftsmith.export.native import write_head_folder
from draftsmith.runs import work_in

FORMATS = {
    "draftsmith": native,
    "vllm": vllm,
    "sglang": sglang,
    "speculators": speculators,
}


def export_folder(folder: str | Path) -> bool:
    """Whether `folder` holds only what an export wrote (its manifest lists every file), which a
    later export may replace whole; an eval report, which has a manifest too, is not one."""
    return previous_output(folder) and not previous_report(folder)


def export(
    source: str | Path, out: str | Path, format: str = "draftsmith", options: ExportOptions = ExportOptions(), overwrite: bool = False
) -> Path:
    """Write the drafter of `source` (run folder, checkpoint or draftsmith export) into `out` in
    `format`. Raises ExportError (or DestinationError), writing nothing, when the format cannot carry
    the drafter or `out` holds something draftsmith did not write there (unless `overwrite`)."""
    if format not in FORMATS:
        raise ExportError(f"unknown export format '{format}'; one of: {', '.join(FORMATS)}")
    artifact = open_drafter(source)  # reads what the folder records; weights of a whole model load later
    # An export may go inside a run folder (run/export), never around it or inside what is read,
    # nor over the drafter's own target where that is a local folder; a training run or a data
    # cache is never replaced, not even with overwrite.
    target = artifact.target_source()[0]
    inputs = [artifact.folder, *([Path(target)] if target and Path(target).is_dir() else [])]
    check_destination(out, inputs=inputs, around=[source], overwrite=overwrite, owned=export_folder, keep=work_in)
    if isinstance(artifact, HeadArtifact) and artifact.head is None:
        raise ExportError(f"{source} is a {artifact.layout} folder written by another tool: export reads what draftsmith trained (a run, a checkpoint or a draftsmith export)")
    if not isinstance(artifact, HeadArtifact) and artifact.recipe is None:
        if (artifact.folder / "recipe.yaml").is_file():
            _recipe_of(artifact.folder)  # raises what is wrong with it
        raise ExportError(
            f"{source} is a model folder without the recipe.yaml draftsmith trains with: export reads what draftsmith trained (a run, a checkpoint "
            "or a draftsmith export); a plain model is already a drafter as it is (draftsmith eval --drafter FOLDER)"
        )
    converter = FORMATS[format]
    reason = converter.refusal(artifact, Path(out), options)
    if reason:
        raise ExportError(f"--format {format} cannot carry this {artifact.kind} drafter: {reason}")
    progress = _progress(artifact)
    with atomic_path(out, folder=True) as tmp:
        converter.write(artifact, tmp, options)
        if progress and (tmp / "README.md").is_file():  # the card says it too, for whoever downloads it
            card = (tmp / "README.md").read_text()
            (tmp / "README.md").write_text(card.rstrip("\n") + f"\n\n## Training\n\n{progress}\n")
        write_manifest(tmp)
    return Path(out)


def _progress(artifact) -> Optional[str]:
    """Which checkpoint an export reads and whether its run stopped before train.max_steps (a run
    stopped by Ctrl-C or a crash exports as it is; the user should know it is not the end): said
    now, and returned as a sentence for the card (None for an export read again)."""
    if artifact.layout != "checkpoint":  # an export read again keeps what its card said
        card = artifact.folder / "README.md"
        said = card.read_text().split("\n## Training\n\n", 1) if card.is_file() else []
        return said[1].split("\n", 1)[0] if len(said) == 2 else None
    from omegaconf import OmegaConf

    from draftsmith.runs import holder_of, list_checkpoints, log, read_state

    step = read_state(artifact.folder).step
    try:
        recipe = OmegaConf.create(artifact.recipe_yaml) if artifact.recipe_yaml else None
        total = int(recipe.train.max_steps) if recipe is not None and recipe.get("trainer") != "online" else None
    except Exception:  # a recipe without the key: the step alone is said
        total = None
    name = artifact.folder.name
    newest = max((read_state(c).step for c in list_checkpoints(artifact.folder.parent.parent, warn=lambda _: None)), default=step)
    if total is not None and step < total and newest > step:
        # An earlier checkpoint of a run that went on (asked for by name, or the newest was damaged).
        log(f"note: exporting {artifact.folder} at step {step} of train.max_steps={total}; its run has a later checkpoint, at step {newest}")
        return f"Exported from checkpoint `{name}`, step {step} of the recipe's {total} (not its run's last)."
    running = holder_of(artifact.folder.parent.parent) if total is not None and step < total else None
    if running:
        log(f"note: exporting {artifact.folder} at step {step} of train.max_steps={total}: its run is still training (pid {running.get('pid', '?')})")
        return f"Exported from checkpoint `{name}`, step {step} of the recipe's {total}, while its training went on."
    if total is not None and step < total:
        log(f"note: exporting {artifact.folder} at step {step} of train.max_steps={total}: its run stopped before the end (train again to finish it)")
        return f"Exported from checkpoint `{name}`, step {step} of the recipe's {total}: its training stopped before the end."
    log(f"exporting {artifact.folder} (step {step})")
    return f"Exported from checkpoint `{name}`" + (f", the end of the recipe's {total} steps." if total is not None else ".")


__all__ = ["FORMATS", "ExportError", "ExportOptions", "export", "push_folder", "write_head_folder"]
