"""--format draftsmith: the layout draftsmith itself loads (``draftsmith eval``, ``generate``).

Heads: config.json naming the head's config and its target, model.safetensors with the head's own
weights only. Draft LMs: a plain Hugging Face causal-LM folder (LoRA merged), which transformers'
assisted generation and vLLM's draft_model method load as it is.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from draftsmith.export.hf import write_head_files
from draftsmith.export.lm import write_lm_files
from draftsmith.export.source import Drafter, ExportOptions

NAME = "draftsmith"


def refusal(drafter: Drafter, out: Path, options: ExportOptions) -> Optional[str]:
    return None


def write(drafter: Drafter, folder: Path, options: ExportOptions) -> None:
    if drafter.is_head:
        write_head_files(drafter.head, drafter.target, folder, drafter.recipe_yaml, drafter.metrics, drafter.tree)
    else:
        write_lm_files(drafter.model, drafter.tokenizer, drafter.recipe, drafter.metrics, drafter.recipe_yaml, folder)
