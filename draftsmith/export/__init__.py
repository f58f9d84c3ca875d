"""Checkpoints -> Hugging Face folders with a model card, and Hub upload."""

from draftsmith.export.hf import ExportError, HeadExport, export_heads, load_head, model_card, push_folder
from draftsmith.export.lm import export_lm_drafter, is_lm_checkpoint, load_lm_drafter

__all__ = [
    "ExportError",
    "HeadExport",
    "export_heads",
    "export_lm_drafter",
    "is_lm_checkpoint",
    "load_head",
    "load_lm_drafter",
    "model_card",
    "push_folder",
]
