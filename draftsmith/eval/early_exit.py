"""The exit-layer sweep of `draftsmith eval --exit-layer sweep`: decode the prompts once per exit
layer of a model that drafts for itself (plain decoding once, for the speedups), pick the exit with
the best measured speedup, decode again there beside plain decoding and transformers'
`generate(assistant_early_exit=E)` for the report, and for an export record the choice in its
config.json and model card.

`--drafter` is anything draftsmith.artifacts opens as an early-exit model: a LayerSkip export or
run, or (with --exit-layer) any causal LM, untrained: the baseline LayerSkip training is measured
against. The model is its own target (no `--target`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from draftsmith.artifacts import open_drafter
from draftsmith.eval.run import evaluate, fitting_prompts
from draftsmith.export.native import record_exit_layer
from draftsmith.runtime.drafters import DrafterError
from draftsmith.runtime.early_exit import check_exit_layer
from draftsmith.runtime.load import LoadedDrafter, decoding_placement, early_exit_chain, early_exit_loaded, early_exit_target
from draftsmith.runtime.static import check_cache

__all__ = ["sweep_exit_layers"]


def sweep_exit_layers(
    folder: str | Path,
    exits: Optional[Sequence[int]],
    prompts: list,
    tree: Optional[str] = None,
    dtype: Optional[str] = None,
    target: Optional[str] = None,
    assisted: bool = True,
    progress: bool = True,
    device: Optional[str] = None,
    cache: str = "auto",
    **decoding,
) -> tuple[LoadedDrafter, object, dict, list[dict]]:
    """Decode `prompts` at each exit layer (`exits`, default 1..L-1), choose the one with the best
    measured speedup, and decode again there beside plain decoding (and transformers' assisted
    generation with `assisted`) on `device` (decoding_placement), on the KV cache `cache` (as
    load_drafter's). `decoding`: max_new_tokens, sampling, seed as in evaluate().
    Returns (loaded drafter at the chosen exit, its AcceptanceStats, extra figures with the choice,
    one row per exit). An export records the choice in config.json and its card.
    """
    if target:
        raise DrafterError("an early-exit drafter is its own target: drop --target")
    try:
        check_cache(cache)
    except ValueError as err:
        raise DrafterError(f"--cache: {err}") from None
    # Any exit layer opens a causal LM as a model drafting for itself; the sweep then tries its own.
    where, chosen = decoding_placement(device, dtype)
    artifact = open_drafter(folder, chosen, exit_layer=exits[0] if exits else 1)
    model = early_exit_target(artifact, where)
    L = len(model.layers)
    asked = ",".join(map(str, exits)) if exits else "sweep"
    exits = list(exits) if exits else list(range(1, L))
    for e in exits:
        check_exit_layer(e, L)
    spec = early_exit_chain(tree, artifact.block)
    prompts = fitting_prompts(early_exit_loaded(model, folder, exits[0], spec, "sweep", cache), prompts, decoding["max_new_tokens"])
    rows, baseline = [], None
    for e in exits:
        stats, _ = evaluate(early_exit_loaded(model, folder, e, spec, "sweep", cache), prompts, baseline=baseline is None, assisted=False, progress=progress, **decoding)
        if baseline is None:
            baseline = (stats.baseline_tokens, stats.baseline_seconds)
        else:  # plain decoding does not depend on the exit: timed once, in the first pass
            stats.baseline_tokens, stats.baseline_seconds = baseline
        rows.append({
            "exit_layer": e, "mean_accepted_length": stats.mean_accepted_length, "acceptance_rate": stats.acceptance_rate,
            "tokens_per_second": stats.tokens_per_second, "speedup": stats.speedup,
        })
    best = max(rows, key=lambda row: row["speedup"] or 0.0)["exit_layer"]
    among = f"{exits[0]}..{exits[-1]}" if exits == list(range(exits[0], exits[-1] + 1)) and len(exits) > 2 else ", ".join(map(str, exits))
    how = f"eval --exit-layer {asked}: best measured speedup over plain decoding among exits {among} ({len(prompts)} prompts)"
    loaded = early_exit_loaded(model, folder, best, spec, how, cache)
    stats, extra = evaluate(loaded, prompts, baseline=True, assisted=assisted, progress=progress, **decoding)
    extra["num_prompts"] = len(prompts)
    if artifact.block:
        record_exit_layer(folder, best, spec.max_depth, how)
        extra["recorded_in"] = str(Path(folder) / "config.json")
    return loaded, stats, extra, rows
