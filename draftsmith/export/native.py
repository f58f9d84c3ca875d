"""--format draftsmith: the layout draftsmith itself loads (``draftsmith eval``, ``generate``), for
every drafter kind.

- Heads: config.json naming the head's config, its target and (under "tree") the sparse tree eval
  and generate draft by default; model.safetensors with the head's own weights only, never the
  target's (the target is named and loaded separately by whoever runs the drafter).
- Draft LMs: a plain Hugging Face causal-LM folder (LoRA merged), which transformers' assisted
  generation and vLLM's draft_model method load as it is.
- Early-exit (LayerSkip) models: the trained model as a plain HF causal-LM folder whose config.json
  carries one extra block, ``"layerskip": {"exit_layer": E, ...}``: the exit it drafts with.
  transformers runs it as it is (``generate(assistant_early_exit=E)``). The exit is the recipe's
  ``layerskip.exit_layer``, else the best modeled speedup of the run's last held-out evaluation;
  ``draftsmith eval --exit-layer sweep`` measures every exit and records the fastest here
  (``record_exit_layer``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Optional

from safetensors.torch import save_file

from draftsmith import __version__
from draftsmith.artifacts import CONFIG_NAME, EARLY_EXIT_KEY, ArtifactError, DraftLMArtifact, EarlyExitArtifact, HeadArtifact
from draftsmith.atomic import manifest_problem, write_atomic, write_manifest
from draftsmith.export.base import ExportOptions, depth_refusal, write_provenance
from draftsmith.export.card import early_exit_card, exit_layer_line, head_config_values, lm_model_card, model_card
from draftsmith.runs import WEIGHTS_NAME
from draftsmith.runtime.early_exit import DEFAULT_DRAFT_LENGTH

NAME = "draftsmith"
_CARD_EXIT_LINE = re.compile(r"^Exit layer: .*$", re.MULTILINE)


def refusal(artifact, out: Path, options: ExportOptions) -> Optional[str]:
    if isinstance(artifact, HeadArtifact) and artifact.head is None:
        return "a third-party head folder is already in an engine's layout; draftsmith exports what it trained"
    # The layout does not record tokens per step, but a number the drafter cannot draft is refused
    # here as in every format rather than ignored.
    return depth_refusal(artifact, options) if isinstance(artifact, HeadArtifact) else None


def write(artifact, folder: Path, options: ExportOptions) -> None:
    if isinstance(artifact, HeadArtifact):
        write_head_files(artifact.head, artifact.target, folder, artifact.recipe_yaml, artifact.metrics, artifact.tree)
    elif isinstance(artifact, EarlyExitArtifact):
        write_early_exit_files(artifact, folder)
    else:
        write_lm_files(artifact, folder)


def write_head_files(
    head, target: dict, folder: Path, recipe_yaml: str = "", metrics: Optional[dict] = None, tree: Optional[dict] = None
) -> None:
    """draftsmith's own head layout into `folder`: config.json, model.safetensors (the head's own
    weights), README.md, recipe.yaml, metrics.json."""
    kind = head.cfg.kind
    head_cfg = head_config_values(head)
    config: dict[str, Any] = {
        "architectures": [f"Draftsmith{type(head).__name__}"],
        "model_type": f"draftsmith-{kind}",
        "draftsmith": {"version": __version__, "drafter": "heads", "head": head_cfg, "target": target},
    }
    if tree is not None:
        config["draftsmith"]["tree"] = tree
    save_file(head.runtime_state_dict(), str(folder / WEIGHTS_NAME), metadata={"format": "pt"})
    (folder / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    write_provenance(folder, recipe_yaml, metrics, model_card(kind, head_cfg, target, recipe_yaml, metrics))


def write_head_folder(
    head, target: dict, out: str | Path, recipe_yaml: str = "", metrics: Optional[dict] = None, tree: Optional[dict] = None
) -> Path:
    """A head (no run behind it: tests, conversions) in draftsmith's layout at `out`, atomically,
    with its manifest."""
    from draftsmith.atomic import atomic_path

    out = Path(out)
    with atomic_path(out, folder=True) as tmp:
        write_head_files(head, target, tmp, recipe_yaml, metrics, tree)
        write_manifest(tmp)
    return out


def write_lm_files(artifact: DraftLMArtifact, folder: Path, card: Optional[str] = None) -> None:
    """A draft LM as a plain HF causal-LM folder: save_pretrained's files, the tokenizer, the model
    card (`card`, default the draftsmith one), the recipe and the last metrics."""
    artifact.model.save_pretrained(folder)
    artifact.tokenizer.save_pretrained(folder)
    write_provenance(folder, artifact.recipe_yaml, artifact.metrics, card or lm_model_card(artifact))


def write_early_exit_files(artifact: EarlyExitArtifact, folder: Path) -> None:
    model = artifact.model.float()
    L = int(model.config.num_hidden_layers)
    block = {
        "exit_layer": artifact.exit_layer, "num_layers": L, "draft_length": DEFAULT_DRAFT_LENGTH, "chosen_by": artifact.exit_chosen_by,
        "draftsmith": __version__,
    }  # fmt: skip
    setattr(model.config, EARLY_EXIT_KEY, block)
    model.save_pretrained(folder)
    artifact.tokenizer.save_pretrained(folder)
    write_provenance(folder, artifact.recipe_yaml, artifact.metrics, early_exit_card(artifact, block))


def record_exit_layer(folder: str | Path, exit_layer: int, draft_length: int, how: str) -> dict:
    """Write a newly chosen exit layer into an early-exit export: config.json's block, the model
    card's "Exit layer:" line, its prose and its transformers snippet, and the manifest, each
    atomically. Returns the new block."""
    folder = Path(folder)
    problem = manifest_problem(folder)
    if problem:
        raise ArtifactError(f"{problem}: not recording an exit layer into a damaged export")
    config = json.loads((folder / CONFIG_NAME).read_text())
    block = dict(config.get(EARLY_EXIT_KEY) or {})
    if not block:
        raise ArtifactError(f"{folder / CONFIG_NAME} has no {EARLY_EXIT_KEY!r} block: not an early-exit export")
    block.update(exit_layer=exit_layer, draft_length=draft_length, chosen_by=how)
    config[EARLY_EXIT_KEY] = block
    write_atomic(folder / CONFIG_NAME, json.dumps(config, indent=2) + "\n")
    card = folder / "README.md"
    if card.is_file():
        line = exit_layer_line(exit_layer, block.get("num_layers", "?"), how)
        text = _CARD_EXIT_LINE.sub(lambda _: line, card.read_text(), count=1)
        # The prose and the transformers snippet name the exit too.
        text = re.sub(r"drafts with its first\s+\d+ layers", f"drafts with its first {exit_layer} layers", text)
        text = re.sub(r"assistant_early_exit=\d+", f"assistant_early_exit={exit_layer}", text)
        write_atomic(card, text)
    write_manifest(folder)
    return block


__all__ = ["record_exit_layer", "write_head_files", "write_head_folder", "write_lm_files"]
