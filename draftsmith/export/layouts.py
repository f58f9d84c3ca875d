"""The engines' checkpoint layouts for draft heads, both ways: our heads' tensors and configs as
vLLM, SGLang and speculators name them, and third-party EAGLE / EAGLE-3 folders (SpecForge,
speculators, anyone) read back into our heads.

Facts these follow (vLLM 0.32, SGLang as of 2026-05, speculators; docs/export.md has the sources):
- EAGLE-3: tensors ``fc.weight`` [H, 3H], ``midlayer.*`` (vLLM also takes ``layers.0.*``, which
  speculators writes), ``norm.weight``, ``lm_head.weight`` [Vd, H], ``d2t`` [Vd] (vLLM refuses it
  when Vd equals the target's vocabulary), ``t2d`` [V] (speculators writes it; both engines skip
  it). No embedding: the engines share the target's when the checkpoint has none. No bias anywhere.
- EAGLE-1: ``fc.weight`` (+ ``fc.bias`` in SGLang; vLLM has no fc bias and drops one silently),
  ``layers.{i}.*`` with no ``layers.0.input_layernorm``, no final norm, no LM head.
- Medusa: ``blocks.{h}.layers.{j}.{weight,bias}`` and ``lm_heads.{h}.weight``, or one shared
  ``lm_head.weight`` with ``original_lm_head: true``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

from draftsmith.export.hf import ExportError

# Target families whose models in vLLM expose the auxiliary hidden states EAGLE-3 reads.
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


def default_aux_ids(num_layers: int) -> list[int]:
    """vLLM's and SGLang's default auxiliary layers of an N-layer target: (2, N//2, N-3)."""
    return [2, num_layers // 2, num_layers - 3]


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
        "norm_before_residual": cfg.norm_before_residual,
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        "torch_dtype": "float32",
    }


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


# ----------------------------------------------------------------------------- reading third-party folders


@dataclass
class ForeignHead:
    """A third-party draft head folder read into our terms: the head kind, its config values (our
    config class's keys; the target fills the rest), its tensors in our names, the target it names
    (speculators records one) and the target embedding copy it carries, if any."""

    kind: str
    layout: str
    config: dict
    tensors: dict[str, Tensor]
    target_path: Optional[str] = None
    embedding: Optional[Tensor] = None
    notes: list[str] = field(default_factory=list)


def _load_tensors(folder: Path) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        bins = sorted(folder.glob("*.bin"))
        if not bins:
            raise ExportError(f"{folder} has no *.safetensors or *.bin weights")
        tensors = {}
        for path in bins:
            tensors.update(torch.load(path, map_location="cpu", weights_only=True))
        return tensors
    tensors = {}
    for path in files:
        tensors.update(load_file(str(path)))
    return tensors


def detect_layout(config: dict) -> Optional[str]:
    """'speculators', 'eagle3' or 'eagle' for a third-party drafter config.json, else None (our own
    head folders, plain causal LMs, anything else)."""
    if "draftsmith" in config:
        return None
    if "speculators_model_type" in config:
        return "speculators"
    archs = " ".join(config.get("architectures") or [])
    if "Eagle3" in archs:
        return "eagle3"
    if "Eagle" in archs or config.get("model_type") == "eagle":
        return "eagle"
    return None


def _shape_keys(layer_config: dict) -> dict:
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


def read_foreign(folder: str | Path) -> ForeignHead:
    """Read an EAGLE-3 or EAGLE folder in vLLM's, SGLang's or speculators' layout (ExportError, one
    line, for a folder whose config and tensors disagree or that holds something else)."""
    folder = Path(folder)
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise ExportError(f"{folder / 'config.json'} is unreadable ({type(err).__name__})") from None
    layout = detect_layout(config)
    if layout is None:
        raise ExportError(f"{folder} is not an EAGLE or EAGLE-3 drafter in vLLM's, SGLang's or speculators' layout (config.json architectures {config.get('architectures')})")
    tensors = _load_tensors(folder)
    where = f"{folder} ({layout} layout)"
    if layout == "speculators":
        if config["speculators_model_type"] != "eagle3":
            raise ExportError(f"{where}: speculators model type {config['speculators_model_type']!r}; draftsmith reads eagle3")
        layer = dict(config.get("transformer_layer_config") or {})
        verifier = (config.get("speculators_config") or {}).get("verifier") or {}
        head = _read_eagle3(where, {**layer, **config}, tensors)
        head.target_path = verifier.get("name_or_path")
        # speculators' own default is True when the key is missing, as vLLM reads it on this path.
        head.config["norm_before_residual"] = bool(config.get("norm_before_residual", True))
        head.layout = "speculators"
        return head
    if layout == "eagle3":
        return _read_eagle3(where, config, tensors)
    return _read_eagle(where, config.get("model") if config.get("model_type") == "eagle" else config, tensors)


def head_from_foreign(foreign: ForeignHead, dims):
    """Our head for a third-party folder, drafting for a target of `dims`; ExportError (one line)
    when the folder's config and tensors disagree with each other or with the target."""
    from dataclasses import fields as config_fields

    from draftsmith.heads import HEADS

    cls = HEADS[foreign.kind]
    known = {f.name for f in config_fields(cls.config_class)}
    try:
        head = cls(cls.config_class(**{k: v for k, v in foreign.config.items() if k in known}), dims)
    except ValueError as err:
        raise ExportError(f"{foreign.layout} folder: {err}") from None
    mine = head.state_dict()
    missing = sorted(set(mine) - set(foreign.tensors))
    extra = sorted(set(foreign.tensors) - set(mine))
    if missing or extra:
        name = (missing or extra)[0]
        raise ExportError(f"{foreign.layout} folder: its config describes a {foreign.kind} head {'with' if missing else 'without'} tensor {name}, its weights {'lack' if missing else 'hold'} it")
    for name, value in foreign.tensors.items():
        if value.shape != mine[name].shape:
            raise ExportError(f"{foreign.layout} folder: tensor {name} has shape {tuple(value.shape)}, its config implies {tuple(mine[name].shape)}")
    head.load_state_dict({k: v.to(mine[k].dtype) for k, v in foreign.tensors.items()})
    return head.eval()


def _take(tensors: dict[str, Tensor], name: str, where: str) -> Tensor:
    if name not in tensors:
        raise ExportError(f"{where}: the config describes a tensor {name} that the weights do not hold")
    return tensors.pop(name)


def _read_eagle3(where: str, config: dict, tensors: dict[str, Tensor]) -> ForeignHead:
    tensors = dict(tensors)
    ours: dict[str, Tensor] = {}
    for name in list(tensors):
        for prefix in ("midlayer.", "layers.0.", "model.midlayer.", "model.layers.0."):
            if name.startswith(prefix):
                ours["layers.0." + name[len(prefix) :]] = tensors.pop(name)
                break
    for name in ("fc.weight", "norm.weight", "lm_head.weight"):
        ours[name] = _take(tensors, name if name in tensors else f"model.{name}" if f"model.{name}" in tensors else name, where)
    H = ours["fc.weight"].shape[0]
    if ours["fc.weight"].shape[1] != 3 * int(config.get("target_hidden_size") or H):
        raise ExportError(
            f"{where}: fc.weight has shape {tuple(ours['fc.weight'].shape)} but the config says three auxiliary states of "
            f"{config.get('target_hidden_size') or H} (fc must be [{H}, {3 * int(config.get('target_hidden_size') or H)}])"
        )
    Vd = ours["lm_head.weight"].shape[0]
    declared = int(config.get("draft_vocab_size") or config.get("vocab_size") or Vd)
    if declared != Vd:
        raise ExportError(f"{where}: lm_head.weight has {Vd} rows but the config says draft_vocab_size {declared}")
    vocab = int(config.get("vocab_size") or Vd)
    d2t = tensors.pop("d2t", None)
    if d2t is None:
        d2t = torch.zeros(Vd, dtype=torch.int64)
    elif d2t.shape != (Vd,):
        raise ExportError(f"{where}: d2t has shape {tuple(d2t.shape)}, the draft vocabulary {Vd} tokens")
    ours["d2t"] = d2t.to(torch.int64)
    ids = torch.arange(Vd) + ours["d2t"]
    if int(ids.max()) >= vocab or int(ids.min()) < 0:
        raise ExportError(f"{where}: d2t maps draft ids to target ids outside the vocabulary of {vocab}")
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    given = tensors.pop("t2d", None)
    if given is not None and not torch.equal(given.to(torch.bool), t2d):
        raise ExportError(f"{where}: t2d and d2t describe different draft vocabularies")
    ours["t2d"] = t2d
    embedding = tensors.pop("embed_tokens.weight", tensors.pop("model.embed_tokens.weight", None))
    extra = [n for n in tensors if not n.endswith(("rotary_emb.inv_freq",))]
    if extra:
        raise ExportError(f"{where}: tensor {extra[0]} is not part of an EAGLE-3 draft with one midlayer ({len(extra)} such tensor(s))")
    eagle_config = config.get("eagle_config") or {}
    if config.get("eagle_aux_hidden_state_layer_ids"):
        aux = list(config["eagle_aux_hidden_state_layer_ids"])  # vLLM's key and convention
    elif eagle_config.get("eagle_aux_hidden_state_layer_ids"):
        aux = list(eagle_config["eagle_aux_hidden_state_layer_ids"])
        if aux and aux[0] == 1:
            aux = [i + 1 for i in aux]  # SGLang / SpecForge's older "output of layer L" ids, as SGLang reads them
    else:
        aux = []  # the engines' default, resolved against the target
    values = {
        **_shape_keys(config),
        "aux_layer_ids": aux,
        "draft_vocab_size": Vd,
        "norm_before_residual": bool(config.get("norm_before_residual", False)),
    }
    return ForeignHead("eagle3", "eagle3", values, ours, embedding=embedding)


def _read_eagle(where: str, config: dict, tensors: dict[str, Tensor]) -> ForeignHead:
    tensors = {n[len("model.") :] if n.startswith("model.") else n: t for n, t in tensors.items()}
    for refused in ("lm_head.weight", "norm.weight", "layers.0.input_layernorm.weight"):
        if refused in tensors:
            raise ExportError(f"{where}: an EAGLE-1 draft has no {refused} (the target's LM head and final norm serve, layer 0 reads fc's output unnormed)")
    embedding = tensors.pop("embed_tokens.weight", None)
    layers = sorted({int(n.split(".")[1]) for n in tensors if n.startswith("layers.")})
    declared = int(config.get("num_hidden_layers") or len(layers))
    if layers != list(range(declared)):
        raise ExportError(f"{where}: the config has {declared} decoder layer(s), the weights hold layers {layers}")
    _take(dict(tensors), "fc.weight", where)
    values = {**_shape_keys(config), "num_layers": declared, "fc_bias": "fc.bias" in tensors}
    return ForeignHead("eagle", "eagle", values, tensors, embedding=embedding)


__all__ = [
    "EAGLE3_TARGETS",
    "ForeignHead",
    "default_aux_ids",
    "detect_layout",
    "eagle3_config",
    "eagle3_tensors",
    "eagle_config",
    "eagle_tensors",
    "head_from_foreign",
    "llama_layer_config",
    "read_foreign",
    "rope_config",
]
