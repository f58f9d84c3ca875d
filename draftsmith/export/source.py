"""What an export starts from: the drafter of a run folder, a checkpoint or a draftsmith export folder,
with the target it drafts for and how it was made."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from draftsmith.export.hf import ExportError, HeadExport, load_head
from draftsmith.runs import RunFolderError, drafter_kind, read_state, resolve_checkpoint


@dataclass
class ExportOptions:
    """Settings the engine layouts need beyond the drafter itself."""

    # Tokens drafted per step in the serve command (and speculators' proposal method).
    num_speculative_tokens: int = 3
    # speculators: the target the folder names as its verifier (default: the recorded target's
    # hub id, else its path).
    verifier: Optional[str] = None


@dataclass
class Drafter:
    """A trained drafter ready to be written in some layout.

    kind: a head kind ("medusa", "eagle3", ...), "standalone" (a draft LM) or "early_exit".
    head: the DraftHead for head kinds; model and tokenizer: the HF model (LoRA merged) otherwise.
    target: path, hidden_size, vocab_size, num_layers, model_type and hf_config where known.
    """

    kind: str
    folder: Path
    target: dict
    recipe_yaml: str = ""
    metrics: Optional[dict] = None
    head: Any = None
    model: Any = None
    tokenizer: Any = None
    recipe: Any = None
    # The sparse tree a head's trainer built from held-out accuracies (draftsmith's layout keeps it).
    tree: Optional[dict] = None

    @property
    def is_head(self) -> bool:
        return self.head is not None

    def target_source(self) -> tuple[str, Optional[str]]:
        """(path, gguf_file) of the target, from the recorded recipe where it has more than the path."""
        gguf = self.target.get("gguf_file")
        if gguf is None and self.recipe_yaml:
            from omegaconf import OmegaConf

            recorded = (OmegaConf.to_container(OmegaConf.create(self.recipe_yaml)) or {}).get("target") or {}
            gguf = recorded.get("gguf_file")
        return str(self.target["path"]), gguf

    def target_name(self) -> str:
        """How a serve command names the target: its Hub id where it has one, else its path."""
        from draftsmith.export.hf import _hub_id

        path = str(self.target["path"])
        return _hub_id(path) or path


def _from_head(loaded: HeadExport) -> Drafter:
    folder = loaded.folder
    recipe_yaml = (folder / "recipe.yaml").read_text() if (folder / "recipe.yaml").is_file() else ""
    return Drafter(loaded.head.cfg.kind, folder, loaded.target, recipe_yaml, loaded.metrics, head=loaded.head, tree=loaded.tree)


def load_source(path: str | Path) -> Drafter:
    """The drafter in a run folder, a checkpoint, or a draftsmith head export; ExportError (one line)
    for anything else."""
    path = Path(path)
    if not path.exists():
        raise ExportError(f"drafter folder not found: {path}")
    if (path / "config.json").is_file():
        return _from_head(load_head(path))  # refuses, in one line, a config.json that is not ours
    try:
        state = read_state(resolve_checkpoint(path))
    except RunFolderError as err:
        raise ExportError(f"{err} (and no config.json of a draftsmith export)") from None
    kind = drafter_kind(state)
    if kind == "standalone":
        from draftsmith.export.lm import load_lm_drafter

        model, tokenizer, recipe, ckpt, metrics = load_lm_drafter(path)
        target = {"path": str(recipe.target.path), "gguf_file": recipe.target.gguf_file}
        return Drafter(kind, ckpt, target, (ckpt / "recipe.yaml").read_text(), metrics, model=model, tokenizer=tokenizer, recipe=recipe)
    return _from_head(load_head(path))


__all__ = ["Drafter", "ExportOptions", "load_source"]
