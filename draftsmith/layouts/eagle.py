"""EAGLE-1 heads in the engines' layouts, written and read back here.

``fc.weight`` (+ ``fc.bias`` in SGLang; vLLM has no fc bias and drops one silently),
``layers.{i}.*`` with no ``layers.0.input_layernorm``, no final norm, no LM head: the target's LM
head and final norm serve, and its embedding.
"""

from __future__ import annotations

import torch
from torch import Tensor

from draftsmith.layouts.common import ArtifactError, ForeignHead, floats, llama_layer_config, shape_keys, take


def layout_tensors(head, with_fc_bias: bool) -> dict[str, Tensor]:
    """An EAGLE-1 head's tensors in the engines' names (ours already are); `with_fc_bias` writes
    ``fc.bias`` (zeros when the head has none: SGLang's fc always has one)."""
    out = floats(head.runtime_state_dict())
    if with_fc_bias and "fc.bias" not in out:
        out["fc.bias"] = torch.zeros(head.dims.hidden_size)
    if not with_fc_bias:
        out.pop("fc.bias", None)
    return out


def layout_config(head, architecture: str) -> dict:
    cfg, dims = head.cfg, head.dims
    return {"architectures": [architecture], **llama_layer_config(cfg, dims.hidden_size, dims.vocab_size, cfg.num_layers), "torch_dtype": "float32"}


def vllm_folder(drafter, folder) -> tuple[dict, dict[str, Tensor]]:
    """(config.json, tensors) as vLLM's eagle method loads them (no fc bias: its refusal checks)."""
    head = drafter.head
    return layout_config(head, "EagleLlamaForCausalLM"), layout_tensors(head, with_fc_bias=False)


def sglang_folder(drafter, folder) -> tuple[dict, dict[str, Tensor]]:
    """(config.json, tensors) as SGLang's EAGLE loads them: its fc always has a bias."""
    head = drafter.head
    return layout_config(head, "LlamaForCausalLMEagle"), layout_tensors(head, with_fc_bias=True)


def read(where: str, folder, config: dict, tensors: dict[str, Tensor]) -> ForeignHead:
    """An EAGLE-1 folder in vLLM's or SGLang's layout as our head (vLLM's older configs nest the
    layer config under "model")."""
    config = config.get("model") if config.get("model_type") == "eagle" else config
    tensors = {n[len("model.") :] if n.startswith("model.") else n: t for n, t in tensors.items()}
    for refused in ("lm_head.weight", "norm.weight", "layers.0.input_layernorm.weight"):
        if refused in tensors:
            raise ArtifactError(f"{where}: an EAGLE-1 draft has no {refused} (the target's LM head and final norm serve, layer 0 reads fc's output unnormed)")
    embedding = tensors.pop("embed_tokens.weight", None)
    layers = sorted({int(n.split(".")[1]) for n in tensors if n.startswith("layers.")})
    declared = int(config.get("num_hidden_layers") or len(layers))
    if layers != list(range(declared)):
        raise ArtifactError(f"{where}: the config has {declared} decoder layer(s), the weights hold layers {layers}")
    take(dict(tensors), "fc.weight", where)
    values = {**shape_keys(config), "num_layers": declared, "fc_bias": "fc.bias" in tensors}
    return ForeignHead("eagle", "eagle", values, tensors, embedding=embedding)
