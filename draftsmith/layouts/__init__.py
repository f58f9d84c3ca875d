"""The engines' folder layouts for draft heads, each in one module that writes it and reads it back.

One module per head kind holds every engine's layout of that kind, writers and readers side by
side (``eagle3``, ``dflash``, ``eagle``, ``medusa``); ``common`` holds what they share. Two tables
choose among them:

- ``WRITERS[(format, kind)]``: ``(drafter, folder) -> (config.json, tensors)`` of an export format
  (``draftsmith export --format``) for a head kind; the format's module (draftsmith.export) adds
  its own policy around it (what it refuses, the serve command, the card). Adding a kind to a
  format is one entry here and a writer in the kind's module.
- ``READERS[layout]`` / ``SPECULATORS_READERS[kind]``: a third-party folder, as ``detect_layout``
  names it from its config.json, back to our head (``read_foreign``, then ``head_from_foreign``
  against the target it runs with). draftsmith.artifacts calls these for folders written by other
  tools (SpecForge, speculators, z-lab) or by our own engine exports.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Callable, Optional

from draftsmith.heads import HEADS, DraftHead, TargetDims
from draftsmith.layouts import dflash, eagle, eagle3, medusa
from draftsmith.layouts.common import CONFIG_NAME, ArtifactError, ForeignHead, load_tensors, read_json

WRITERS: dict[tuple[str, str], Callable] = {
    ("vllm", "eagle3"): eagle3.vllm_folder,
    ("vllm", "eagle"): eagle.vllm_folder,
    ("vllm", "medusa"): medusa.vllm_folder,
    ("vllm", "dflash"): dflash.vllm_folder,
    ("sglang", "eagle3"): eagle3.sglang_folder,
    ("sglang", "eagle"): eagle.sglang_folder,
    ("sglang", "dflash"): dflash.sglang_folder,
    ("speculators", "eagle3"): eagle3.speculators_folder,
    ("speculators", "dflash"): dflash.speculators_folder,
}

# Layouts by what detect_layout names: (where, folder, config, tensors) -> ForeignHead (one signature:
# only DFlash reads a file beside the weights, its mask vector, from folder).
READERS: dict[str, Callable[..., ForeignHead]] = {"eagle3": eagle3.read, "dflash": dflash.read, "eagle": eagle.read}
# speculators' self-describing folders by their speculators_model_type.
SPECULATORS_READERS: dict[str, Callable[..., ForeignHead]] = {"eagle3": eagle3.read_speculators, "dflash": dflash.read_speculators}


def detect_layout(config: dict) -> Optional[str]:
    """'speculators', 'dflash', 'eagle3' or 'eagle' for a third-party drafter config.json, else None
    (our own head folders, plain causal LMs, anything else)."""
    if "draftsmith" in config:
        return None
    if "speculators_model_type" in config:
        return "speculators"
    archs = " ".join(config.get("architectures") or [])
    if "DFlash" in archs or isinstance(config.get("dflash_config"), dict):
        return "dflash"
    if "Eagle3" in archs:
        return "eagle3"
    if "Eagle" in archs or config.get("model_type") == "eagle":
        return "eagle"
    return None


def read_foreign(folder: str | Path, config: Optional[dict] = None) -> ForeignHead:
    """Read an EAGLE-3 or EAGLE folder in vLLM's, SGLang's or speculators' layout (ArtifactError,
    one line, for a folder whose config and tensors disagree or that holds something else)."""
    folder = Path(folder)
    config = config if config is not None else read_json(folder / CONFIG_NAME)
    layout = detect_layout(config)
    if layout is None:
        raise ArtifactError(f"{folder} is not an EAGLE, EAGLE-3 or DFlash drafter in vLLM's, SGLang's or speculators' layout (config.json architectures {config.get('architectures')})")
    tensors = load_tensors(folder)
    where = f"{folder} ({layout} layout)"
    if layout == "speculators":
        kind = config["speculators_model_type"]
        if not isinstance(kind, str) or kind not in SPECULATORS_READERS:
            raise ArtifactError(f"{where}: speculators model type {kind!r}; draftsmith reads {' and '.join(SPECULATORS_READERS)}")
        head = SPECULATORS_READERS[kind](where, folder, config, tensors)
        head.target_path = ((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
        head.layout = "speculators"
        return head
    return READERS[layout](where, folder, config, tensors)


def head_from_foreign(foreign: ForeignHead, dims: TargetDims) -> DraftHead:
    """Our head for a third-party folder, drafting for a target of `dims`; ArtifactError (one line)
    when the folder's config and tensors disagree with each other or with the target."""
    cls = HEADS[foreign.kind]
    known = {f.name for f in fields(cls.config_class)}
    try:
        head = cls(cls.config_class(**{k: v for k, v in foreign.config.items() if k in known}), dims)
    except ValueError as err:
        raise ArtifactError(f"{foreign.layout} folder: {err}") from None
    mine = head.state_dict()
    missing = sorted(set(mine) - set(foreign.tensors))
    extra = sorted(set(foreign.tensors) - set(mine))
    if missing or extra:
        name = (missing or extra)[0]
        raise ArtifactError(f"{foreign.layout} folder: its config describes a {foreign.kind} head {'with' if missing else 'without'} tensor {name}, its weights {'lack' if missing else 'hold'} it")
    for name, value in foreign.tensors.items():
        if value.shape != mine[name].shape:
            raise ArtifactError(f"{foreign.layout} folder: tensor {name} has shape {tuple(value.shape)}, its config implies {tuple(mine[name].shape)}")
    head.load_state_dict({k: v.to(mine[k].dtype) for k, v in foreign.tensors.items()})
    return head.eval()


__all__ = ["READERS", "SPECULATORS_READERS", "WRITERS", "ArtifactError", "ForeignHead", "detect_layout", "head_from_foreign", "read_foreign"]
