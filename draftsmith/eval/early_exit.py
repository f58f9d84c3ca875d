"""Early-exit self-drafting in `draftsmith eval` and `generate`: a model that drafts with its own
first E layers (runtime/early_exit.py), and the sweep that picks E.

`--drafter` with early exit is one of:
- a LayerSkip export (config.json with a "layerskip" block): its exit layer unless `--exit-layer`
  says otherwise;
- a layerskip run folder or checkpoint: the trained weights (LoRA merged), the exit layer from the
  recipe or the last held-out evaluation unless `--exit-layer` says otherwise;
- with `--exit-layer`, any HF causal-LM folder or built-in model, untrained: the baseline LayerSkip
  training is measured against.

The model is its own target (no `--target`). The sweep decodes the prompts once per exit layer
(plain decoding once, for the speedups), picks the exit with the best measured speedup, decodes
again at that exit beside plain decoding and transformers' `generate(assistant_early_exit=E)` for
the report, and for an export records the choice in its config.json and model card.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from draftsmith.eval.run import LoadedDrafter, evaluate
from draftsmith.export.early_exit import (
    chosen_exit_layer, early_exit_config, is_early_exit_run, load_early_exit_model, record_exit_layer,
)
from draftsmith.runtime.drafters import DrafterError
from draftsmith.runtime.early_exit import DEFAULT_DRAFT_LENGTH, EarlyExitDrafter, check_exit_layer, is_chain
from draftsmith.runtime.tree import TreeSpec, parse_tree
from draftsmith.target import FrozenTarget, load_causal_lm, resolve_dtype

__all__ = ["is_early_exit", "load_early_exit", "sweep_exit_layers"]


def is_early_exit(folder: str | Path) -> bool:
    """True for a LayerSkip export or a layerskip run folder or checkpoint."""
    return early_exit_config(folder) is not None or is_early_exit_run(folder)


def _load_model(folder: str | Path, dtype: Optional[str]) -> tuple[FrozenTarget, Optional[int], str, dict]:
    """(the model as a target in `dtype` (default float32), its recorded exit layer or None, how that
    was chosen, the export's config block or {})."""
    import torch

    chosen = resolve_dtype(dtype or "float32", "target")
    block = early_exit_config(folder) or {}
    if block:
        model, tokenizer = load_causal_lm(str(folder), chosen)
        return FrozenTarget(model, tokenizer, source=str(folder)), block["exit_layer"], block.get("chosen_by", "the export's config"), block
    if is_early_exit_run(folder):
        model, tokenizer, recipe, _, state = load_early_exit_model(folder)
        exit_layer, how = chosen_exit_layer(recipe, state, int(model.config.num_hidden_layers))
        return FrozenTarget(model.to(getattr(torch, chosen)), tokenizer, source=str(folder)), exit_layer, how, {}
    model, tokenizer = load_causal_lm(str(folder), chosen)
    return FrozenTarget(model, tokenizer, source=str(folder)), None, "", {}


def _chain(tree: Optional[str], block: dict) -> TreeSpec:
    spec = parse_tree(tree) if tree else TreeSpec.chain(int(block.get("draft_length") or DEFAULT_DRAFT_LENGTH))
    if not is_chain(spec):
        raise DrafterError(f"early-exit drafting drafts a chain: --tree {tree} has branches (e.g. --tree 1,1,1,1 drafts 4 tokens)")
    return spec


def _loaded(target: FrozenTarget, folder, exit_layer: int, spec: TreeSpec, how: str) -> LoadedDrafter:
    drafter = EarlyExitDrafter(target, exit_layer, spec)
    k = spec.max_depth
    # transformers' own early-exit assisted generation drafts as the assistant's generation config
    # says (here the model's own: by default up to 20 tokens, stopping below 0.4 confidence); the
    # comparison drafts the same chain as ours every step.
    config = target.model.generation_config
    config.num_assistant_tokens, config.num_assistant_tokens_schedule, config.assistant_confidence_threshold = k, "constant", 0.0
    assist = {"assistant_early_exit": exit_layer}
    meta = {"exit_layer": exit_layer, "exit_layer_chosen_by": how, "draft_length": k}
    return LoadedDrafter("early_exit", drafter, target, Path(str(folder)), str(folder), meta=meta, assist=assist)


def load_early_exit(
    folder: str | Path, exit_layer: Optional[int] = None, tree: Optional[str] = None, dtype: Optional[str] = None, target: Optional[str] = None
) -> LoadedDrafter:
    """A model drafting for itself with its first `exit_layer` layers (default: the one it recorded)."""
    if target:
        raise DrafterError("an early-exit drafter is its own target: drop --target")
    model, recorded, how, block = _load_model(folder, dtype)
    if exit_layer is None:
        if recorded is None:
            raise DrafterError(f"{folder} records no exit layer: pass --exit-layer E (or sweep)")
        exit_layer = recorded
    else:
        how = "--exit-layer"
    return _loaded(model, folder, exit_layer, _chain(tree, block), how)


def sweep_exit_layers(
    folder: str | Path,
    exits: Optional[Sequence[int]],
    prompts: list,
    tree: Optional[str] = None,
    dtype: Optional[str] = None,
    target: Optional[str] = None,
    assisted: bool = True,
    progress: bool = True,
    **decoding,
) -> tuple[LoadedDrafter, object, dict, list[dict]]:
    """Decode `prompts` at each exit layer (`exits`, default 1..L-1), choose the one with the best
    measured speedup, and decode again there beside plain decoding (and transformers' assisted
    generation with `assisted`). `decoding`: max_new_tokens, temperature, top_k, top_p, seed as
    in evaluate(). Returns (loaded drafter at the chosen exit, its AcceptanceStats, extra figures
    with the choice, one row per exit). An export records the choice in config.json and its card.
    """
    if target:
        raise DrafterError("an early-exit drafter is its own target: drop --target")
    model, _, _, block = _load_model(folder, dtype)
    L = len(model.layers)
    exits = list(exits) if exits else list(range(1, L))
    for e in exits:
        check_exit_layer(e, L)
    spec = _chain(tree, block)
    rows, baseline = [], None
    for e in exits:
        stats, _ = evaluate(_loaded(model, folder, e, spec, "sweep"), prompts, baseline=baseline is None, assisted=False, progress=progress, **decoding)
        if baseline is None:
            baseline = (stats.baseline_tokens, stats.baseline_seconds)
        else:  # plain decoding does not depend on the exit: timed once, in the first pass
            stats.baseline_tokens, stats.baseline_seconds = baseline
        rows.append({
            "exit_layer": e, "mean_accepted_length": stats.mean_accepted_length, "acceptance_rate": stats.acceptance_rate,
            "tokens_per_second": stats.tokens_per_second, "speedup": stats.speedup,
        })
    best = max(rows, key=lambda row: row["speedup"] or 0.0)["exit_layer"]
    how = f"eval --exit-layer sweep: best measured speedup over plain decoding among exits {exits[0]}..{exits[-1]} ({len(prompts)} prompts)"
    loaded = _loaded(model, folder, best, spec, how)
    stats, extra = evaluate(loaded, prompts, baseline=True, assisted=assisted, progress=progress, **decoding)
    if block:
        record_exit_layer(folder, best, spec.max_depth, how)
        extra["recorded_in"] = str(Path(folder) / "config.json")
    return loaded, stats, extra, rows
