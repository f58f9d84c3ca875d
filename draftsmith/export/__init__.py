"""Trained drafters -> folders that draftsmith, vLLM, SGLang and speculators load, with a model card
(and the exact serve command), the recipe and the metrics; Hub upload; readers for third-party
EAGLE / EAGLE-3 folders.

FORMATS maps ``draftsmith export --format`` names to converter modules: each says in one line why it
cannot carry a drafter (``refusal``), or writes it (``write``) into a folder that appears atomically.
"""

from pathlib import Path

from draftsmith.atomic import atomic_path
from draftsmith.export import native, sglang, speculators, vllm
from draftsmith.export.early_exit import export_early_exit, is_early_exit_run
from draftsmith.export.hf import ExportError, HeadExport, load_head, model_card, push_folder, write_head_folder
from draftsmith.export.layouts import ForeignHead, detect_layout, read_foreign
from draftsmith.export.lm import is_lm_checkpoint, load_lm_drafter
from draftsmith.export.source import Drafter, ExportOptions, load_source

FORMATS = {
    "draftsmith": native,
    "vllm": vllm,
    "sglang": sglang,
    "speculators": speculators,
}


def export(source: str | Path, out: str | Path, format: str = "draftsmith", options: ExportOptions = ExportOptions()) -> Path:
    """Write the drafter of `source` (run folder, checkpoint or draftsmith export) into `out` in
    `format`. Raises ExportError, writing nothing, when the source is not a drafter or the format
    cannot carry it."""
    if format not in FORMATS:
        raise ExportError(f"unknown export format '{format}'; one of: {', '.join(FORMATS)}")
    if is_early_exit_run(source):  # LayerSkip: the trained model itself, a plain HF causal LM with its exit layer
        if format != "draftsmith":
            raise ExportError(
                f"--format {format} cannot carry this early_exit drafter: {format} has no self-speculative (early-exit) "
                "method; --format draftsmith writes a plain HF causal LM that transformers (assistant_early_exit) and draftsmith decode with"
            )
        return export_early_exit(source, out)
    drafter = load_source(source)
    converter = FORMATS[format]
    reason = converter.refusal(drafter, Path(out), options)
    if reason:
        raise ExportError(f"--format {format} cannot carry this {drafter.kind} drafter: {reason}")
    with atomic_path(out, folder=True) as tmp:
        converter.write(drafter, tmp, options)
    return Path(out)


__all__ = [
    "FORMATS",
    "Drafter",
    "ExportError",
    "ExportOptions",
    "ForeignHead",
    "HeadExport",
    "detect_layout",
    "export",
    "is_lm_checkpoint",
    "load_head",
    "load_lm_drafter",
    "load_source",
    "model_card",
    "push_folder",
    "read_foreign",
    "write_head_folder",
]
