"""--format speculators: vllm-project/speculators' self-describing folders (types eagle3 and
dflash), which name their target (the verifier) and their proposal method, so ``vllm serve
<folder>`` runs them with no flags.

The folders themselves (tensor names, the layer config, DFlash's causal and bidirectional blocks)
are written in draftsmith.layouts (``eagle3.speculators_folder``, ``dflash.speculators_folder``);
this module adds the proposal method and the verifier and says what speculators cannot carry.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from draftsmith.export.base import ExportOptions, aux_state_refusal, depth_refusal, write_engine_folder, write_provenance
from draftsmith.export.card import head_config_values, model_card
from draftsmith.export.vllm import EARLY_EXIT_REFUSAL, METHODS as VLLM_METHODS

NAME = "speculators"
KINDS = ("eagle3", "dflash")


def refusal(drafter, out: Path, options: ExportOptions) -> Optional[str]:
    if drafter.kind == "early_exit":
        return EARLY_EXIT_REFUSAL.format(format=NAME)
    if drafter.kind not in KINDS:
        # Point at vLLM's own layout only for the kinds vLLM runs (not Hydra or Clover).
        hint = " (try --format vllm)" if drafter.kind in VLLM_METHODS else ""
        return f"draftsmith writes speculators' eagle3 and dflash types; a {drafter.kind} drafter has no speculators layout here{hint}"
    family = aux_state_refusal(drafter)
    if family:
        return family
    if drafter.kind == "eagle3" and drafter.head.cfg.norm_before_fc and drafter.head.cfg.fc_norm:
        # speculators 0.9.0's Eagle3SpeculatorConfig rejects the pair ("mutually exclusive").
        return "speculators refuses head.norm_before_fc together with head.fc_norm (one or the other); --format vllm carries both"
    if drafter.kind == "dflash" and drafter.head.cfg.mask_embedding:
        return "speculators' DFlash has no learned mask vector (head.mask_embedding): --format vllm carries it (mask_embedding.pt)"
    return depth_refusal(drafter, options)


def verifier(drafter, options: ExportOptions) -> dict:
    hf = drafter.target.get("hf_config") or {}
    return {"name_or_path": options.verifier or drafter.target_name(), "architectures": list(hf.get("architectures") or ["LlamaForCausalLM"])}


def proposal(drafter, options: ExportOptions) -> dict:
    k = options.speculative_tokens(drafter)
    return {
        "algorithm": drafter.kind,
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k, "verifier_accept_k": 1, "accept_tolerance": 0.0}],
        "default_proposal_method": "greedy",
        "verifier": verifier(drafter, options),
    }


def write(drafter, folder: Path, options: ExportOptions) -> None:
    head = drafter.head
    config = write_engine_folder(drafter, folder, NAME, {"speculators_config": proposal(drafter, options)})
    use = "\n".join([
        "```bash",
        "vllm serve <this folder>",
        "```",
        "",
        f"The folder names its target ({config['speculators_config']['verifier']['name_or_path']}) and drafts "
        f"{options.speculative_tokens(drafter)} tokens per step.",
    ])
    write_provenance(folder, drafter.recipe_yaml, drafter.metrics, model_card(drafter.kind, head_config_values(head), drafter.target, drafter.recipe_yaml, drafter.metrics, use, NAME))
