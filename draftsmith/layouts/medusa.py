"""Medusa heads in vLLM's layout (written only: no engine writes Medusa folders draftsmith reads).

``blocks.{h}.layers.{j}.{weight,bias}`` and ``lm_heads.{h}.weight``, or one shared
``lm_head.weight`` with ``original_lm_head: true``.
"""

from __future__ import annotations

import torch

from draftsmith.layouts.common import floats


def layout_config(head) -> dict:
    cfg, dims = head.cfg, head.dims
    return {
        "architectures": ["MedusaModel"],
        "model_type": "medusa",
        "hidden_size": dims.hidden_size,
        "vocab_size": dims.vocab_size,
        "truncated_vocab_size": dims.vocab_size,
        "num_heads": cfg.num_heads,
        "num_hidden_layers": cfg.num_layers,
        "medusa_fc_bias": True,
        "original_lm_head": cfg.lm_head == "target",
        "torch_dtype": "float32",
    }


def layout_tensors(head, target_source) -> dict[str, torch.Tensor]:
    """blocks.{h}.layers.{j}.* as ours are named, and per-head LM heads; heads that share the
    target's LM head get one copy of it (``original_lm_head``): vLLM's Medusa cannot point at the
    target's, so this layout carries it."""
    tensors = floats(head.runtime_state_dict())
    if head.cfg.lm_head == "target":
        from draftsmith.target import load_causal_lm

        path, gguf = target_source
        model, _ = load_causal_lm(path, "float32", gguf)
        tensors["lm_head.weight"] = model.get_output_embeddings().weight.detach().to(torch.float32).contiguous()
    return tensors


def vllm_folder(drafter, folder) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json, tensors) as vLLM's medusa method loads them."""
    head = drafter.head
    return layout_config(head), layout_tensors(head, drafter.target_source())
