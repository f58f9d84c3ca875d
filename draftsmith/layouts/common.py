"""What every engine layout module shares: the error a folder's problem raises, file readers,
the third-party head in our terms (``ForeignHead``), and the Llama-style config keys the engines'
draft configs hold.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

CONFIG_NAME = "config.json"
# Target families whose models in vLLM expose the auxiliary hidden states EAGLE-3 and DFlash read.
EAGLE3_TARGETS = {"llama", "mistral", "qwen2", "qwen3", "qwen3_moe"}


class ArtifactError(ValueError):
    """A path that is not a drafter draftsmith can read, or one whose files are damaged. The message names it."""


def read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ArtifactError(f"{path} is unreadable ({type(err).__name__}: {str(err).splitlines()[0][:120]})") from None
    if not isinstance(value, dict):
        raise ArtifactError(f"{path} holds a {type(value).__name__}, not a JSON object")
    return value


def read_weights(path: Path) -> dict[str, Tensor]:
    """A safetensors file, one line naming it when it is truncated or not safetensors."""
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except FileNotFoundError:
        raise ArtifactError(f"{path} is missing") from None
    except Exception as err:  # safetensors raises its own SafetensorError, and OSError/ValueError
        raise ArtifactError(f"{path} is not a readable safetensors file ({type(err).__name__}: {str(err).splitlines()[0][:120]})") from None


def load_tensors(folder: Path) -> dict[str, Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    tensors: dict[str, Tensor] = {}
    if files:
        for path in files:
            tensors.update(read_weights(path))
        return tensors
    bins = sorted(folder.glob("*.bin"))
    if not bins:
        raise ArtifactError(f"{folder} has no *.safetensors or *.bin weights")
    for path in bins:
        try:
            tensors.update(torch.load(path, map_location="cpu", weights_only=True))
        except Exception as err:  # pickle and zip errors alike
            raise ArtifactError(f"{path} is unreadable ({type(err).__name__})") from None
    return tensors


@dataclass
class ForeignHead:
    """A third-party draft head folder in our terms: the head kind, its config values (our config
    class's keys; the target fills the rest), its tensors in our names, the target it names
    (speculators records one) and the target embedding copy it carries, if any."""

    kind: str
    layout: str
    config: dict
    tensors: dict[str, Tensor]
    target_path: Optional[str] = None
    embedding: Optional[Tensor] = None


def shape_keys(layer_config: dict) -> dict:
    """Our LayerShape keys from an HF-style layer config (0 / None where it is silent)."""
    rope = layer_config.get("rope_parameters") if isinstance(layer_config.get("rope_parameters"), dict) else {}
    scaling = layer_config.get("rope_scaling") if isinstance(layer_config.get("rope_scaling"), dict) else None
    if scaling is None and rope.get("rope_type", "default") not in (None, "default"):
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    return {
        "num_attention_heads": int(layer_config.get("num_attention_heads") or 0),
        "num_key_value_heads": int(layer_config.get("num_key_value_heads") or 0),
        "head_dim": int(layer_config.get("head_dim") or 0),
        "intermediate_size": int(layer_config.get("intermediate_size") or 0),
        "rms_norm_eps": float(layer_config.get("rms_norm_eps") or 0.0),
        "rope_theta": float(layer_config.get("rope_theta") or rope.get("rope_theta") or 0.0),
        "rope_scaling": scaling,
        "max_position_embeddings": int(layer_config.get("max_position_embeddings") or 0),
    }


def take(tensors: dict[str, Tensor], name: str, where: str) -> Tensor:
    if name not in tensors:
        raise ArtifactError(f"{where}: the config describes a tensor {name} that the weights do not hold")
    return tensors.pop(name)


def read_draft_vocabulary(where: str, tensors: dict[str, Tensor], Vd: int, vocab: int) -> tuple[Tensor, Tensor]:
    """(d2t, t2d) of a draft LM head with Vd rows over a target vocabulary of `vocab`, popped from
    `tensors` (d2t absent: the first Vd ids; t2d, where a layout keeps it, must agree)."""
    d2t = tensors.pop("d2t", None)
    if d2t is None:
        d2t = torch.zeros(Vd, dtype=torch.int64)
    elif d2t.shape != (Vd,):
        raise ArtifactError(f"{where}: d2t has shape {tuple(d2t.shape)}, the draft vocabulary {Vd} tokens")
    d2t = d2t.to(torch.int64)
    ids = torch.arange(Vd) + d2t
    if int(ids.max()) >= vocab or int(ids.min()) < 0:
        raise ArtifactError(f"{where}: d2t maps draft ids to target ids outside the vocabulary of {vocab}")
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    given = tensors.pop("t2d", None)
    if given is not None and not torch.equal(given.to(torch.bool), t2d):
        raise ArtifactError(f"{where}: t2d and d2t describe different draft vocabularies")
    return d2t, t2d


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


def floats(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """Tensors as a layout file holds them: floating ones contiguous in fp32, integer ones (d2t, t2d) as they are."""
    return {n: v.detach().to(torch.float32).contiguous() if v.is_floating_point() else v.contiguous() for n, v in tensors.items()}
