"""--format speculators: vllm-project/speculators' self-describing EAGLE-3 folder, which names its
target (the verifier) and its proposal method, so ``vllm serve <folder>`` runs it with no flags.

Tensors as speculators writes them (``layers.0.*``, which vLLM reads like ``midlayer.*``);
``norm_before_residual`` is always written, since vLLM's default on this path (true) differs from
its default for a plain config (false).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from safetensors.torch import save_file

from draftsmith.export.base import ExportOptions, source_record, write_provenance
from draftsmith.export.card import head_config_values, model_card
from draftsmith.export.layouts import EAGLE3_TARGETS, eagle3_switches, eagle3_tensors, llama_layer_config
from draftsmith.export.vllm import EARLY_EXIT_REFUSAL, METHODS as VLLM_METHODS
from draftsmith.runs import WEIGHTS_NAME

NAME = "speculators"


def refusal(drafter, out: Path, options: ExportOptions) -> Optional[str]:
    if drafter.kind == "early_exit":
        return EARLY_EXIT_REFUSAL.format(format=NAME)
    if drafter.kind != "eagle3":
        # Point at vLLM's own layout only for the kinds vLLM runs (not Hydra or Clover).
        hint = " (try --format vllm)" if drafter.kind in VLLM_METHODS else ""
        return f"draftsmith writes speculators' eagle3 type; a {drafter.kind} drafter has no speculators layout here{hint}"
    model_type = drafter.target.get("model_type") or ""
    if model_type and model_type not in EAGLE3_TARGETS:
        return f"EAGLE-3 reads auxiliary hidden states from {', '.join(sorted(EAGLE3_TARGETS))} targets; this target is {model_type}"
    return None


def verifier(drafter, options: ExportOptions) -> dict:
    hf = drafter.target.get("hf_config") or {}
    return {"name_or_path": options.verifier or drafter.target_name(), "architectures": list(hf.get("architectures") or ["LlamaForCausalLM"])}


def write(drafter, folder: Path, options: ExportOptions) -> None:
    head = drafter.head
    cfg, dims = head.cfg, head.dims
    k = options.num_speculative_tokens
    config = {
        "speculators_model_type": "eagle3",
        "architectures": ["Eagle3Speculator"],
        "transformer_layer_config": {"architectures": ["LlamaForCausalLM"], **llama_layer_config(cfg, dims.hidden_size, dims.vocab_size, 1)},
        "draft_vocab_size": cfg.draft_vocab_size,
        **eagle3_switches(cfg),
        "target_hidden_size": dims.hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k, "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": verifier(drafter, options),
        },
        "draftsmith_source": source_record(drafter),
    }
    save_file(eagle3_tensors(head, "layers.0.", with_t2d=True), str(folder / WEIGHTS_NAME), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    use = "\n".join([
        "```bash",
        "vllm serve <this folder>",
        "```",
        "",
        f"The folder names its target ({config['speculators_config']['verifier']['name_or_path']}) and drafts {k} tokens per step.",
    ])
    write_provenance(folder, drafter.recipe_yaml, drafter.metrics, model_card("eagle3", head_config_values(head), drafter.target, drafter.recipe_yaml, drafter.metrics, use, NAME))
