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

    # Tokens drafted per step in the serve command (and speculators' proposal method); None: a
    # block drafter's whole block (DFlash: block_size - 1), else DEFAULT_SPECULATIVE_TOKENS.
    num_speculative_tokens: Optional[int] = None
    # speculators: the target the folder names as its verifier (default: the recorded target's
    # hub id, else its path).
    verifier: Optional[str] = None

    def speculative_tokens(self, drafter) -> int:
        """Tokens per step for `drafter`: as given, else its block (DFlash drafts block_size - 1
        per forward, and the engines' block is num_speculative_tokens + 1), else 3 (at most one
        per head of a Medusa or Hydra drafter)."""
        if self.num_speculative_tokens is not None:
            return self.num_speculative_tokens
        if drafter.kind == "dflash":
            return drafter.head.cfg.block_size - 1
        if drafter.kind in ONE_HEAD_PER_TOKEN:
            return min(DEFAULT_SPECULATIVE_TOKENS, drafter.head.depth)
        return DEFAULT_SPECULATIVE_TOKENS


# Tokens per step in a serve command when neither the user nor the drafter says otherwise.
DEFAULT_SPECULATIVE_TOKENS = 3


# Kinds with one module per drafted position: they cannot draft past their last head.
ONE_HEAD_PER_TOKEN = ("medusa", "hydra")


def depth_refusal(drafter, options: ExportOptions) -> Optional[str]:
    """Tokens per step that `drafter` cannot draft: past the last head of a Medusa or Hydra drafter
    (the engines draft one token per head), or another block than a DFlash head was trained for
    (the engines run a block of num_speculative_tokens + 1 slots, all attending to each other, so a
    shorter or longer block computes something the head never learned)."""
    k = options.speculative_tokens(drafter)
    if drafter.kind in ONE_HEAD_PER_TOKEN and k > drafter.head.depth:
        heads = drafter.head.depth
        return f"the drafter has {heads} heads, one per drafted token, so it cannot draft {k} tokens per step: use --num-speculative-tokens {heads} or fewer"
    if drafter.kind != "dflash" or options.num_speculative_tokens is None:
        return None
    B = drafter.head.cfg.block_size
    if options.num_speculative_tokens != B - 1:
        return (
            f"the head was trained on blocks of {B} (the anchor and {B - 1} drafted slots), and the engine's block is "
            f"num_speculative_tokens + 1: use --num-speculative-tokens {B - 1} or leave it out"
        )
    return None


def aux_state_refusal(drafter, engine: str = "") -> Optional[str]:
    """EAGLE-3 and DFlash read the target's auxiliary hidden states, which the engines expose only
    for some model families (layouts.common.EAGLE3_TARGETS); None for other kinds, or a target that
    records no family. `engine` prefixes the drafter's name ("vLLM's ")."""
    from draftsmith.layouts.common import EAGLE3_TARGETS

    model_type = drafter.target.get("model_type") or ""
    if drafter.kind not in ("eagle3", "dflash") or not model_type or model_type in EAGLE3_TARGETS:
        return None
    name = "EAGLE-3" if drafter.kind == "eagle3" else "DFlash"
    return f"{engine}{name} reads auxiliary hidden states from {', '.join(sorted(EAGLE3_TARGETS))} targets; this target is {model_type}"


def write_provenance(folder: Path, recipe_yaml: str, metrics: Optional[dict], card: str) -> None:
    """What every export carries beside its weights: the recipe, the last metrics, the model card."""
    (folder / "recipe.yaml").write_text(recipe_yaml)
    (folder / "metrics.json").write_text(json.dumps(metrics or {}, indent=2) + "\n")
    (folder / "README.md").write_text(card)


def write_engine_folder(drafter, folder: Path, format: str, extra: Optional[dict] = None) -> dict:
    """The head's folder in `format`'s layout for its kind (draftsmith.layouts.WRITERS): weights,
    then config.json with `extra` and the ``draftsmith_source`` block. Returns the config written."""
    from safetensors.torch import save_file

    from draftsmith.layouts import WRITERS
    from draftsmith.runs import WEIGHTS_NAME

    config, tensors = WRITERS[(format, drafter.kind)](drafter, folder)
    config.update(extra or {})
    config["draftsmith_source"] = source_record(drafter)
    save_file(tensors, str(folder / WEIGHTS_NAME), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return config


def source_record(artifact) -> dict:
    """The ``draftsmith_source`` block engine layouts keep in config.json: what was exported, and
    the sparse tree the head was evaluated with (``draftsmith eval`` on the folder drafts it, so a
    run and its export measure the same; the engines ignore the block)."""
    from draftsmith.export.card import head_config_values

    record = {
        "kind": artifact.kind,
        "head": head_config_values(artifact.head),
        "target": {k: v for k, v in artifact.target.items() if k != "hf_config"},
    }
    if getattr(artifact, "tree", None) is not None:
        record["tree"] = artifact.tree
    return record


__all__ = ["DEFAULT_SPECULATIVE_TOKENS", "ExportError", "ExportOptions", "ONE_HEAD_PER_TOKEN", "aux_state_refusal", "depth_refusal", "source_record", "write_engine_folder", "write_provenance"]
