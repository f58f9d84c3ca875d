"""Checkpoints -> Hugging Face folders with a model card, and Hub upload."""

from draftsmith.export.hf import ExportError, HeadExport, export_heads, load_head, model_card, push_folder

__all__ = ["ExportError", "HeadExport", "export_heads", "load_head", "model_card", "push_folder"]
