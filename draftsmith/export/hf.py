"""Checkpoint -> Hugging Face folder: config.json, model.safetensors, README.md, recipe.yaml, metrics.json.

An exported head folder holds the head's own weights only, never the target's: the target is named in
config.json and loaded separately by whoever runs the drafter.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Optional

from safetensors.torch import load_file, save_file

from draftsmith import __version__
from draftsmith.atomic import atomic_path
from draftsmith.heads import HEADS, DraftHead, TargetDims
from draftsmith.runs import WEIGHTS_NAME, RunFolderError, drafter_kind, read_state, resolve_checkpoint

CONFIG_NAME = "config.json"
HEAD_PREFIX = "head."


class ExportError(RuntimeError):
    """A folder that is not a checkpoint or export draftsmith can read. The message names it."""


@dataclass
class HeadExport:
    """A draft head loaded from an export or checkpoint, with what it was trained against."""

    head: DraftHead
    target: dict  # path, hidden_size, vocab_size, num_layers, model_type
    folder: Path
    metrics: Optional[dict] = None
    # The sparse tree the trainer built from held-out accuracies (runtime.tree.SparseTree.to_dict), if any.
    tree: Optional[dict] = None


def _head_config(kind: str, values: dict):
    if kind not in HEADS:
        raise ExportError(f"unknown head kind '{kind}' (known: {', '.join(HEADS)})")
    cls = HEADS[kind].config_class
    known = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in values.items() if k in known})


def _dims(target: dict) -> TargetDims:
    return TargetDims(
        hidden_size=target["hidden_size"], vocab_size=target["vocab_size"], num_layers=target["num_layers"],
        hf_config=target.get("hf_config") or {},
    )


def load_head(path: str | Path) -> HeadExport:
    """Load a head from an export folder, a checkpoint folder or a run folder."""
    path = Path(path)
    if not path.exists():
        raise ExportError(f"drafter folder not found: {path}")
    config_file = path / CONFIG_NAME
    if config_file.is_file():
        config = json.loads(config_file.read_text()).get("draftsmith")
        if not config or config.get("drafter") != "heads":
            raise ExportError(f"{config_file} is not a draftsmith head export")
        head = HEADS[config["head"]["kind"]](_head_config(config["head"]["kind"], config["head"]), _dims(config["target"]))
        head.load_state_dict(load_file(str(path / WEIGHTS_NAME)))
        metrics = json.loads((path / "metrics.json").read_text()) if (path / "metrics.json").is_file() else None
        return HeadExport(head.eval(), config["target"], path, metrics, config.get("tree"))
    try:
        ckpt = resolve_checkpoint(path)
        state = read_state(ckpt)
    except RunFolderError as err:
        raise ExportError(str(err)) from None
    if drafter_kind(state) not in HEADS:
        raise ExportError(f"{ckpt} holds a {drafter_kind(state)} drafter, not a draft head")
    head = HEADS[state["head"]["kind"]](_head_config(state["head"]["kind"], state["head"]), _dims(state["target"]))
    weights = load_file(str(ckpt / WEIGHTS_NAME))
    head.load_state_dict({k[len(HEAD_PREFIX) :]: v for k, v in weights.items() if k.startswith(HEAD_PREFIX)})
    return HeadExport(head.eval(), state["target"], ckpt, state.get("last_eval"), state.get("tree"))


def _hub_id(path: str) -> Optional[str]:
    """The Hub id of a target path, when it has one (built-in names map to their origin)."""
    from draftsmith.target import BUILTIN_MODELS

    if path in BUILTIN_MODELS:
        return BUILTIN_MODELS[path]["hub_id"]
    looks_like_hub_id = path.count("/") == 1 and not path.startswith((".", "/", "~")) and not path.endswith(".gguf")
    return path if looks_like_hub_id else None


DRAFTSMITH_USE = "\n".join([
    "```bash",
    "pip install draftsmith",
    'draftsmith generate --drafter <this folder> --prompt "Write a haiku about the sea."',
    "draftsmith eval --drafter <this folder> --prompts mtbench --out eval/",
    "```",
])


def model_card(
    kind: str, head_cfg: dict, target: dict, recipe_yaml: str, metrics: Optional[dict], use: str = DRAFTSMITH_USE, layout: str = "draftsmith"
) -> str:
    """A Hub model card: front matter for search, then what the drafter is and how to run it
    (`use`: the Use section's markdown, the serve command of the folder's `layout`)."""
    hub_id = _hub_id(str(target["path"]))
    lines = [
        "---",
        "library_name: draftsmith",
        *([f"base_model: {hub_id}"] if hub_id else []),
        "tags:",
        "- speculative-decoding",
        f"- {kind}",
        "- draftsmith",
        *([f"- {layout}"] if layout != "draftsmith" else []),
        "---",
        "",
        f"# {kind.capitalize()} draft head for `{target['path']}`" + (f" ({layout} layout)" if layout != "draftsmith" else ""),
        "",
        f"A {kind} draft head trained with draftsmith {__version__} against the frozen target `{target['path']}` "
        f"({target.get('model_type') or 'decoder'}, {target['num_layers']} layers, hidden size {target['hidden_size']}, "
        f"vocabulary {target['vocab_size']}). It holds only the head's own weights; speculative decoding with it "
        "produces exactly the target's output, faster when the head agrees with the target.",
        "",
        "## Use",
        "",
        use,
        "",
        "## Head",
        "",
        "| setting | value |",
        "| --- | --- |",
        *[f"| {k} | {v} |" for k, v in head_cfg.items()],
        "",
    ]
    if metrics:
        lines += ["## Held-out accuracy (teacher forced)", "", "| depth | top-1 | top-5 |", "| --- | --- | --- |"]
        for d, (a1, a5) in enumerate(zip(metrics.get("top1", []), metrics.get("top5", [])), start=1):
            lines.append(f"| {d} | {a1:.3f} | {a5:.3f} |")
        if "simulated_accept_length" in metrics:
            lines += ["", f"Simulated mean accepted length of a chain: {metrics['simulated_accept_length']:.3f}."]
        lines.append("")
    lines += ["## Recipe", "", "```yaml", recipe_yaml.rstrip(), "```", ""]
    return "\n".join(lines)


def head_config_values(head: DraftHead) -> dict:
    return {f.name: getattr(head.cfg, f.name) for f in fields(head.cfg)}


def write_head_files(
    head: DraftHead, target: dict, folder: Path, recipe_yaml: str = "", metrics: Optional[dict] = None, tree: Optional[dict] = None
) -> None:
    """draftsmith's own head layout into `folder`: config.json (the head config, the target it
    drafts for and, under "tree", the sparse tree eval and generate draft by default),
    model.safetensors (the head's own weights), README.md, recipe.yaml, metrics.json."""
    kind = head.cfg.kind
    head_cfg = head_config_values(head)
    config: dict[str, Any] = {
        "architectures": [f"Draftsmith{type(head).__name__}"],
        "model_type": f"draftsmith-{kind}",
        "draftsmith": {"version": __version__, "drafter": "heads", "head": head_cfg, "target": target},
    }
    if tree is not None:
        config["draftsmith"]["tree"] = tree
    save_file(head.runtime_state_dict(), str(folder / WEIGHTS_NAME), metadata={"format": "pt"})
    (folder / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    write_provenance(folder, recipe_yaml, metrics, model_card(kind, head_cfg, target, recipe_yaml, metrics))


def write_provenance(folder: Path, recipe_yaml: str, metrics: Optional[dict], card: str) -> None:
    """What every export carries beside its weights: the recipe, the last metrics, the model card."""
    (folder / "recipe.yaml").write_text(recipe_yaml)
    (folder / "metrics.json").write_text(json.dumps(metrics or {}, indent=2) + "\n")
    (folder / "README.md").write_text(card)


def write_head_folder(
    head: DraftHead, target: dict, out: str | Path, recipe_yaml: str = "", metrics: Optional[dict] = None, tree: Optional[dict] = None
) -> Path:
    """write_head_files into `out`, atomically."""
    out = Path(out)
    with atomic_path(out, folder=True) as tmp:
        write_head_files(head, target, tmp, recipe_yaml, metrics, tree)
    return out


def push_folder(folder: str | Path, repo_id: str, private: bool = False, token: Optional[str] = None) -> str:
    """Upload an export folder to the Hub (HF_ENDPOINT and HF_TOKEN are honoured). Returns the repo URL."""
    from huggingface_hub import HfApi

    folder = Path(folder)
    if not (folder / CONFIG_NAME).is_file():
        raise ExportError(f"{folder} has no {CONFIG_NAME}: export it first with `draftsmith export`")
    api = HfApi(token=token)
    url = api.create_repo(repo_id, private=private, exist_ok=True)
    api.upload_folder(folder_path=str(folder), repo_id=repo_id, commit_message="Upload draftsmith drafter")
    return str(url)
