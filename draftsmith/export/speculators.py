"""--format speculators: vllm-project/speculators' self-describing folders (types eagle3 and
dflash), which name their target (the verifier) and their proposal method, so ``vllm serve
<folder>`` runs them with no flags.

EAGLE-3: tensors as speculators writes them (``layers.0.*``, which vLLM reads like ``midlayer.*``);
``norm_before_residual`` is always written, since vLLM's default on this path (true) differs from
its default for a plain config (false).

DFlash: speculators' ``aux_hidden_state_layer_ids`` are vLLM's capture ids (ours); its layers are
bidirectional inside the block when full attention, and vLLM 0.32 makes every layer causal unless
``sliding_window_non_causal`` is true, so a bidirectional head writes full-attention layers and
``sliding_window_non_causal: true`` (both tools then run it as trained); a causal head writes
sliding-window layers whose window spans every position and ``sliding_window_non_causal: false``.
speculators has no learned mask vector: such a head is refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from safetensors.torch import save_file

from draftsmith.export.base import ExportOptions, depth_refusal, source_record, write_provenance
from draftsmith.export.card import head_config_values, model_card
from draftsmith.export.layouts import EAGLE3_TARGETS, dflash_tensors, eagle3_switches, eagle3_tensors, llama_layer_config, qwen3_layer_config
from draftsmith.export.vllm import EARLY_EXIT_REFUSAL, METHODS as VLLM_METHODS
from draftsmith.runs import WEIGHTS_NAME

NAME = "speculators"
KINDS = ("eagle3", "dflash")


def refusal(drafter, out: Path, options: ExportOptions) -> Optional[str]:
    if drafter.kind == "early_exit":
        return EARLY_EXIT_REFUSAL.format(format=NAME)
    if drafter.kind not in KINDS:
        # Point at vLLM's own layout only for the kinds vLLM runs (not Hydra or Clover).
        hint = " (try --format vllm)" if drafter.kind in VLLM_METHODS else ""
        return f"draftsmith writes speculators' eagle3 and dflash types; a {drafter.kind} drafter has no speculators layout here{hint}"
    model_type = drafter.target.get("model_type") or ""
    if model_type and model_type not in EAGLE3_TARGETS:
        return f"{'EAGLE-3' if drafter.kind == 'eagle3' else 'DFlash'} reads auxiliary hidden states from {', '.join(sorted(EAGLE3_TARGETS))} targets; this target is {model_type}"
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


def eagle3_folder(head) -> tuple[dict, dict]:
    cfg, dims = head.cfg, head.dims
    config = {
        "speculators_model_type": "eagle3",
        "architectures": ["Eagle3Speculator"],
        "transformer_layer_config": {"architectures": ["LlamaForCausalLM"], **llama_layer_config(cfg, dims.hidden_size, dims.vocab_size, 1)},
        "draft_vocab_size": cfg.draft_vocab_size,
        **eagle3_switches(cfg),
        "target_hidden_size": dims.hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
    }
    return config, eagle3_tensors(head, "layers.0.", with_t2d=True)


def dflash_folder(head) -> tuple[dict, dict]:
    cfg, dims = head.cfg, head.dims
    layer = {"architectures": ["Qwen3ForCausalLM"], **qwen3_layer_config(head)}
    if cfg.causal:
        layer.update(layer_types=["sliding_attention"] * cfg.num_layers, use_sliding_window=True, sliding_window=cfg.max_position_embeddings)
    config = {
        "speculators_model_type": "dflash",
        "architectures": ["DFlashDraftModel"],
        "transformer_layer_config": layer,
        # speculators' default is 32000: always written, the target's vocabulary without a draft vocabulary.
        "draft_vocab_size": cfg.draft_vocab_size or dims.vocab_size,
        "block_size": cfg.block_size,
        "target_hidden_size": dims.hidden_size,
        "aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        "mask_token_id": cfg.mask_token_id,
        "sample_from_anchor": False,
        "sliding_window_non_causal": not cfg.causal,
    }
    return config, dflash_tensors(head, with_t2d=True)


def write(drafter, folder: Path, options: ExportOptions) -> None:
    head = drafter.head
    config, tensors = (eagle3_folder if drafter.kind == "eagle3" else dflash_folder)(head)
    config["speculators_config"] = proposal(drafter, options)
    config["draftsmith_source"] = source_record(drafter)
    save_file(tensors, str(folder / WEIGHTS_NAME), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    use = "\n".join([
        "```bash",
        "vllm serve <this folder>",
        "```",
        "",
        f"The folder names its target ({config['speculators_config']['verifier']['name_or_path']}) and drafts "
        f"{options.speculative_tokens(drafter)} tokens per step.",
    ])
    write_provenance(folder, drafter.recipe_yaml, drafter.metrics, model_card(drafter.kind, head_config_values(head), drafter.target, drafter.recipe_yaml, drafter.metrics, use, NAME))
