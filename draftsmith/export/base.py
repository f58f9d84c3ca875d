"""What every export format shares: its error, its options, and the files every folder carries
beside its weights (recipe.yaml, metrics.json, README.md, written before the manifest)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional


class ExportError(ValueError):
    """A drafter a format cannot carry, or a destination it must not write. The message names it."""


@dataclass
class ExportOptions:
    """Settings the engine layouts need beyond the drafter itself."""

    # Tokens drafted per step in the serve command (and speculators' proposal method).
    num_speculative_tokens: int = 3
    # speculators: the target the folder names as its verifier (default: the recorded target's
    # hub id, else its path).
    verifier: Optional[str] = None


def write_provenance(folder: Path, recipe_yaml: str, metrics: Optional[dict], card: str) -> None:
    """What every export carries beside its weights: the recipe, the last metrics, the model card."""
    (folder / "recipe.yaml").write_text(recipe_yaml)
    (folder / "metrics.json").write_text(json.dumps(metrics or {}, indent=2) + "\n")
    (folder / "README.md").write_text(card)


def source_record(artifact) -> dict:
    """The ``draftsmith_source`` block engine layouts keep in config.json: what was exported."""
    from draftsmith.export.card import head_config_values

    return {
        "kind": artifact.kind,
        "head": head_config_values(artifact.head),
        "target": {k: v for k, v in artifact.target.items() if k != "hf_config"},
    }


__all__ = ["ExportError", "ExportOptions", "source_record", "write_provenance"]
