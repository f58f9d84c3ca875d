"""--format sglang: the layouts SGLang loads with ``--speculative-algorithm EAGLE3``, ``EAGLE`` or
``DFLASH``.

SGLang loads by name and skips what it does not know without a word, so names must be exact:
EAGLE-3's layer is ``midlayer.*``; EAGLE-1's fc always has a bias (written as zeros for a head
trained without one, which computes the same). SGLang reads auxiliary layer ids only from
``eagle_config`` and, since 2026-05, takes them as they are unless the first id is 1 (then it adds
1 to all, the older "output of layer L" convention): ids are written there only when they differ
from the default, and ids starting at 1 are refused as ambiguous between SGLang versions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from draftsmith.export.base import ExportOptions, aux_state_refusal, depth_refusal, write_engine_folder, write_provenance
from draftsmith.export.card import head_config_values, model_card
from draftsmith.export.vllm import EARLY_EXIT_REFUSAL
from draftsmith.heads.eagle3 import default_aux_layer_ids

NAME = "sglang"
ALGORITHMS = {"eagle3": "EAGLE3", "eagle": "EAGLE", "dflash": "DFLASH"}


def refusal(drafter, out: Path, options: ExportOptions) -> Optional[str]:
    if drafter.kind == "early_exit":
        return EARLY_EXIT_REFUSAL.format(format=NAME)
    if drafter.kind not in ALGORITHMS:
        return f"SGLang runs EAGLE-3, EAGLE and DFlash drafters (as draft heads), not {drafter.kind}"
    family = aux_state_refusal(drafter)
    if family:
        return family
    if drafter.kind == "dflash":
        return dflash_refusal(drafter, options)
    if drafter.kind == "eagle3":
        on = [name for name in ("norm_before_fc", "fc_norm", "norm_output") if getattr(drafter.head.cfg, name)]
        if on:
            return f"draftsmith's SGLang layout does not carry the EAGLE-3.1 switch(es) {', '.join(on)} (SGLang's reading of them is unverified): use --format vllm or speculators"
        if drafter.head.cfg.norm_before_residual:
            return "SGLang's EAGLE-3 layer does not read norm_before_residual (it would run the head as if it were false): train with head.norm_before_residual=false to serve in SGLang"
        ids = list(drafter.head.cfg.aux_layer_ids)
        if drafter.head.dims.num_layers in ids:
            return (
                f"auxiliary layer id {drafter.head.dims.num_layers} (the last layer's output) is one SGLang would mis-read: "
                f"train with ids below {drafter.head.dims.num_layers} to serve in SGLang"
            )
        if ids != default_aux_layer_ids(drafter.head.dims.num_layers) and ids[0] == 1:
            return (
                f"auxiliary layer ids {ids} start at 1, which SGLang reads as {[i + 1 for i in ids]} since 2026-05 and as "
                f"{ids} before: train with ids >= 2 or the default (2, N//2, N-3) to serve in SGLang"
            )
    return None


def dflash_refusal(drafter, options: ExportOptions) -> Optional[str]:
    """SGLang's DFlash draft reads the same names and dflash_config as vLLM's, but always drafts
    through the target's embedding and LM head, ignores what it does not know without a word, and
    makes a layer causal only as a sliding-window layer."""
    cfg = drafter.head.cfg
    if cfg.draft_vocab_size:
        return "SGLang's DFlash draft has no LM head of its own (head.draft_vocab_size must be 0): --format vllm carries it"
    if cfg.mask_embedding:
        return "SGLang's DFlash draft has no learned mask vector (head.mask_embedding): --format vllm carries it"
    if cfg.causal:
        return "SGLang's DFlash attends bidirectionally inside the block unless a layer has a sliding window: train with head.causal=false"
    return depth_refusal(drafter, options)


def write(drafter, folder: Path, options: ExportOptions) -> None:
    head = drafter.head
    write_engine_folder(drafter, folder, NAME)
    k = options.speculative_tokens(drafter)
    if drafter.kind == "dflash":
        flags = f"--speculative-num-draft-tokens {k + 1}"
        note = f"SGLang drafts the block of {k + 1} in one forward through the target's embedding and LM head."
    else:
        flags = f"--speculative-num-steps {k} --speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}"
        note = "SGLang shares the target's embedding" + (" and LM head." if drafter.kind == "eagle" else ".")
    use = "\n".join([
        "```bash",
        f"python -m sglang.launch_server --model-path {drafter.target_name()} --speculative-algorithm {ALGORITHMS[drafter.kind]} "
        f"--speculative-draft-model-path <this folder> {flags}",
        "```",
        "",
        note,
    ])
    write_provenance(folder, drafter.recipe_yaml, drafter.metrics, model_card(drafter.kind, head_config_values(head), drafter.target, drafter.recipe_yaml, drafter.metrics, use, NAME))
