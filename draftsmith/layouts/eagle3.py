"""EAGLE-3 heads in the engines' layouts, written and read back here.

Facts these follow (vLLM 0.32, SGLang as of 2026-05, speculators 0.9; docs/export.md has the sources):
tensors ``fc.weight`` [H, 3H], ``midlayer.*`` (vLLM also takes ``layers.0.*``, which speculators
writes), ``norm.weight``, ``lm_head.weight`` [Vd, H], ``d2t`` [Vd] (vLLM refuses it when Vd equals
the target's vocabulary), ``t2d`` [V] (speculators writes it; both engines skip it). No embedding
of its own: the engines share the target's when the checkpoint has none (a folder that carries a
copy is read with it). No bias anywhere. EAGLE-3.1's switches (``norm_before_fc``, ``fc_norm``,
``norm_output``, ``norm_before_residual``) travel in the config and must agree with the tensors.

vLLM and SGLang read the same folder (``vllm_folder``; SGLang takes the auxiliary ids from an
``eagle_config`` block, ``sglang_folder``); speculators' is self-describing
(``speculators_folder``). ``read`` takes any of them back.
"""

from __future__ import annotations

from torch import Tensor

from draftsmith.heads.eagle3 import default_aux_layer_ids
from draftsmith.layouts.common import ArtifactError, ForeignHead, floats, llama_layer_config, read_draft_vocabulary, shape_keys, take


def layout_tensors(head, layer_prefix: str = "midlayer.", with_t2d: bool = False) -> dict[str, Tensor]:
    """An EAGLE-3 head's tensors in the engines' names: the midlayer under `layer_prefix`,
    ``d2t`` only when the draft vocabulary is smaller than the target's, ``t2d`` only where the
    layout keeps it (speculators; vLLM and SGLang never read it, d2t says the same)."""
    out = floats({(layer_prefix + n[len("layers.0.") :] if n.startswith("layers.0.") else n): v for n, v in head.runtime_state_dict().items()})
    if head.cfg.draft_vocab_size == head.dims.vocab_size:
        del out["d2t"]
    if not with_t2d:
        del out["t2d"]
    return out


def switches(cfg) -> dict:
    """EAGLE-3's norm switches, every one written: the engines' defaults differ between layouts
    (vLLM reads a missing norm_before_residual as true from a speculators folder, false otherwise)."""
    return {
        "norm_before_residual": cfg.norm_before_residual,
        "norm_before_fc": cfg.norm_before_fc,
        "fc_norm": cfg.fc_norm,
        "norm_output": cfg.norm_output,
    }


def layout_config(head, architecture: str = "LlamaForCausalLMEagle3") -> dict:
    """The draft's config.json as vLLM and SGLang read it (vLLM's aux-layer convention, top level)."""
    cfg, dims = head.cfg, head.dims
    return {
        "architectures": [architecture],
        **llama_layer_config(cfg, dims.hidden_size, dims.vocab_size, 1),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": dims.hidden_size,
        **switches(cfg),
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        "torch_dtype": "float32",
    }


def vllm_folder(drafter, folder) -> tuple[dict, dict[str, Tensor]]:
    """(config.json, tensors) as vLLM's eagle3 method loads them."""
    head = drafter.head
    return layout_config(head), layout_tensors(head, "midlayer.")


def sglang_folder(drafter, folder) -> tuple[dict, dict[str, Tensor]]:
    """(config.json, tensors) as SGLang's EAGLE3 loads them: vLLM's folder, with the auxiliary ids
    in ``eagle_config`` when they are not the default (the only place SGLang reads them)."""
    head = drafter.head
    out = layout_config(head)
    if list(head.cfg.aux_layer_ids) != default_aux_layer_ids(head.dims.num_layers):
        out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(head.cfg.aux_layer_ids)}
    return out, layout_tensors(head, "midlayer.")


def speculators_folder(drafter, folder) -> tuple[dict, dict[str, Tensor]]:
    """speculators' self-describing eagle3 folder, without its ``speculators_config`` (the
    export adds it): ``layers.0.*`` as speculators writes them (vLLM reads them like
    ``midlayer.*``), ``t2d`` kept, every switch written."""
    head = drafter.head
    cfg, dims = head.cfg, head.dims
    config = {
        "speculators_model_type": "eagle3",
        "architectures": ["Eagle3Speculator"],
        "transformer_layer_config": {"architectures": ["LlamaForCausalLM"], **llama_layer_config(cfg, dims.hidden_size, dims.vocab_size, 1)},
        "draft_vocab_size": cfg.draft_vocab_size,
        **switches(cfg),
        "target_hidden_size": dims.hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
    }
    return config, layout_tensors(head, "layers.0.", with_t2d=True)


def read(where: str, folder, config: dict, tensors: dict[str, Tensor]) -> ForeignHead:
    """An EAGLE-3 folder in vLLM's or SGLang's layout (SpecForge writes it too) as our head."""
    tensors = dict(tensors)
    ours: dict[str, Tensor] = {}
    for name in list(tensors):
        for prefix in ("midlayer.", "layers.0.", "model.midlayer.", "model.layers.0."):
            if name.startswith(prefix):
                ours["layers.0." + name[len(prefix) :]] = tensors.pop(name)
                break
    for name in ("fc.weight", "norm.weight", "lm_head.weight"):
        ours[name] = take(tensors, name if name in tensors else f"model.{name}" if f"model.{name}" in tensors else name, where)
    # EAGLE-3.1's switches (speculators' trainer turns norm_before_fc and norm_output on by default).
    # A switch and its tensors must agree: an engine drops a tensor whose switch is off without a word.
    eagle_config = config.get("eagle_config") or {}
    switches = {
        "norm_before_fc": bool(eagle_config.get("norm_before_fc", config.get("norm_before_fc", False))),
        "fc_norm": bool(config.get("fc_norm", False)),
        "norm_output": bool(config.get("norm_output", False)),
    }
    for switch, prefix in (("norm_before_fc", "input_norm."), ("fc_norm", "fc_norm.")):
        held = [n for n in list(tensors) if n.startswith((prefix, "model." + prefix))]
        if held and not switches[switch]:
            raise ArtifactError(f"{where}: tensor {held[0]} is there but {switch} is off in config.json, so an engine would drop it: set {switch} to true or remove the tensor")
        for name in held:
            ours[name[len("model.") :] if name.startswith("model.") else name] = tensors.pop(name)
        if switches[switch] and not held:
            raise ArtifactError(f"{where}: config.json turns {switch} on but the weights hold no {prefix}* tensor")
    H = ours["fc.weight"].shape[0]
    if ours["fc.weight"].shape[1] != 3 * int(config.get("target_hidden_size") or H):
        raise ArtifactError(
            f"{where}: fc.weight has shape {tuple(ours['fc.weight'].shape)} but the config says three auxiliary states of "
            f"{config.get('target_hidden_size') or H} (fc must be [{H}, {3 * int(config.get('target_hidden_size') or H)}])"
        )
    Vd = ours["lm_head.weight"].shape[0]
    declared = int(config.get("draft_vocab_size") or config.get("vocab_size") or Vd)
    if declared != Vd:
        raise ArtifactError(f"{where}: lm_head.weight has {Vd} rows but the config says draft_vocab_size {declared}")
    vocab = int(config.get("vocab_size") or Vd)
    ours["d2t"], ours["t2d"] = read_draft_vocabulary(where, tensors, Vd, vocab)
    embedding = tensors.pop("embed_tokens.weight", tensors.pop("model.embed_tokens.weight", None))
    extra = [n for n in tensors if not n.endswith(("rotary_emb.inv_freq",))]
    if extra:
        raise ArtifactError(f"{where}: tensor {extra[0]} is not part of an EAGLE-3 draft with one midlayer ({len(extra)} such tensor(s))")
    if config.get("eagle_aux_hidden_state_layer_ids"):
        aux = list(config["eagle_aux_hidden_state_layer_ids"])  # vLLM's key and convention
    elif eagle_config.get("eagle_aux_hidden_state_layer_ids"):
        aux = list(eagle_config["eagle_aux_hidden_state_layer_ids"])
        if aux and aux[0] == 1:
            aux = [i + 1 for i in aux]  # SGLang / SpecForge's older "output of layer L" ids, as SGLang reads them
    else:
        aux = []  # the engines' default, resolved against the target
    values = {
        **shape_keys(config),
        "aux_layer_ids": aux,
        "draft_vocab_size": Vd,
        "norm_before_residual": bool(config.get("norm_before_residual", False)),
        **switches,
    }
    return ForeignHead("eagle3", "eagle3", values, ours, embedding=embedding)


def read_speculators(where: str, folder, config: dict, tensors: dict[str, Tensor]) -> ForeignHead:
    """speculators' eagle3 folder: its layer config nested, ``norm_before_residual`` true when the
    key is missing (speculators' own default, and how vLLM reads it on this path)."""
    layer = dict(config.get("transformer_layer_config") or {})
    head = read(where, folder, {**layer, **config}, tensors)
    head.config["norm_before_residual"] = bool(config.get("norm_before_residual", True))
    return head
