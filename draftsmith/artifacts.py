"""Drafter folders read back: the one place that turns a path into a typed drafter artifact.

A path is one of (decided once, from what the folder records):

    run folder / checkpoint      trainer_state.json says the drafter kind: a head kind, "standalone"
                                 (a distilled draft LM) or "early_exit" (a LayerSkip model)
    draftsmith head export       config.json with a "draftsmith" block (``export --format draftsmith``)
    early-exit export            a plain HF causal-LM folder whose config.json has a "layerskip" block
    third-party EAGLE / EAGLE-3  config.json in vLLM's, SGLang's or speculators' layout (SpecForge,
    or DFlash                    speculators, z-lab, our own engine exports)
    plain HF causal-LM folder    a draft LM (exported by draftsmith or not); with ``exit_layer`` the
                                 model drafts for itself instead
    built-in model name          e.g. qwen2.5-coder-0.5b, as it ships

Every file read is verified first: a checkpoint against the sha256 manifest in its
trainer_state.json, an export against the manifest written beside it at export time
(atomic.MANIFEST_NAME). A folder without a manifest (written by another tool or an older draftsmith)
is read as it is, said once. Anything unreadable, damaged or inconsistent is an ArtifactError whose
one line names the file.

Where a new drafter kind plugs in (and nothing more is needed):
1. here: a head kind needs nothing (HEADS builds it from what the folder records); another kind of
   drafter is one entry in CHECKPOINT_LOADERS (and, for a new folder layout, one reader in
   ``_read_config_folder``);
2. ``draftsmith/export``: its layouts, in each format's ``refusal``/``write``;
3. ``draftsmith/runtime/load.py``: how its artifact becomes a runtime Drafter.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from draftsmith.atomic import MANIFEST_NAME, manifest_problem
from draftsmith.heads import HEADS, DraftHead, TargetDims
from draftsmith.runs import (
    STATE_FILE, WEIGHTS_NAME, checkpoint_problem, is_checkpoint, list_checkpoints, log, read_state,
)
from draftsmith.target import BUILTIN_MODELS

CONFIG_NAME = "config.json"
# Where vLLM reads a DFlash draft's learned mask vector: {"mask_token_id": int, "embedding": [H]} (or the bare tensor).
MASK_EMBEDDING_FILE = "mask_embedding.pt"
# How checkpoints name the drafter's weights inside model.safetensors, per drafter kind.
HEAD_PREFIX, DRAFT_PREFIX, MODEL_PREFIX = "head.", "draft.", "model."
# The config.json block of an early-exit export.
EARLY_EXIT_KEY = "layerskip"


class ArtifactError(ValueError):
    """A path that is not a drafter draftsmith can read, or one whose files are damaged. The message names it."""


# ----------------------------------------------------------------------------- artifacts


@dataclass
class Artifact:
    """What a drafter folder holds, read and verified.

    kind: what drafts: a head kind ("medusa", "eagle3", ...), "standalone" or "early_exit".
    folder: the folder read (a run folder resolves to its newest sound checkpoint).
    layout: "checkpoint", "draftsmith" (our head export), "hf" (a plain causal-LM folder),
        "builtin", or a third-party head layout ("eagle3", "eagle", "speculators").
    target: what the folder records of its target: path, gguf_file, dtype and, for heads,
        hidden_size, vocab_size, num_layers, model_type, hf_config. Empty where nothing is recorded.
    """

    kind: str
    folder: Path
    layout: str
    target: dict = field(default_factory=dict)
    recipe_yaml: str = ""
    metrics: Optional[dict] = None

    def target_source(self) -> tuple[Optional[str], Optional[str]]:
        """(path, gguf_file) of the recorded target; (None, None) when the folder names none."""
        return self.target.get("path"), self.target.get("gguf_file")

    def target_name(self) -> str:
        """How a serve command names the target: its Hub id where it has one, else its path."""
        path = str(self.target.get("path") or "<target>")
        return hub_id(path) or path


@dataclass
class HeadArtifact(Artifact):
    """A draft head. ``head`` is built from the recorded target dimensions; a third-party folder
    (``foreign``) records no dimensions, so its head is built against the target it runs with
    (``head_for``). ``tree``: the sparse tree the trainer built from held-out accuracies, if any."""

    head: Optional[DraftHead] = None
    tree: Optional[dict] = None
    foreign: Optional["ForeignHead"] = None

    def head_for(self, dims: TargetDims, target_path: str = "the target") -> DraftHead:
        """The head, checked against (or, for a third-party folder, built for) a target of `dims`."""
        if self.foreign is not None:
            return head_from_foreign(self.foreign, dims)
        want = (self.target["hidden_size"], self.target["vocab_size"])
        if want != (dims.hidden_size, dims.vocab_size):
            raise ArtifactError(
                f"drafter {self.folder} was trained for a target with hidden size {want[0]} and vocabulary {want[1]}; "
                f"{target_path} has hidden size {dims.hidden_size} and vocabulary {dims.vocab_size}"
            )
        return self.head


@dataclass
class ModelArtifact(Artifact):
    """A drafter that is a whole causal LM. Its weights load on first use of ``model`` or
    ``tokenizer`` (a format that refuses the kind never waits for them); ``recipe`` is the run's
    when it came from one."""

    recipe: Any = None
    loader: Optional[Callable[[], tuple[Any, Any]]] = field(default=None, repr=False)
    _loaded: Optional[tuple[Any, Any]] = field(default=None, repr=False)

    def _load(self) -> tuple[Any, Any]:
        if self._loaded is None:
            self._loaded = self.loader()
        return self._loaded

    @property
    def model(self):
        return self._load()[0]

    @property
    def tokenizer(self):
        return self._load()[1]


@dataclass
class DraftLMArtifact(ModelArtifact):
    """A standalone draft LM (LoRA merged), with its tokenizer."""


@dataclass
class EarlyExitArtifact(ModelArtifact):
    """A model that drafts with its own first ``exit_layer`` layers (None: the folder records none).
    ``block``: an export's config.json block; ``state``: a checkpoint's trainer state."""

    exit_layer: Optional[int] = None
    exit_chosen_by: str = ""
    block: dict = field(default_factory=dict)
    state: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------- verification

_UNVERIFIED_SAID: set[str] = set()


def verified_folder(folder: Path) -> Path:
    """`folder` after checking its files against the manifest written at export time; a folder
    without one (another tool's, or an older draftsmith's) is read as it is, said once per folder."""
    problem = manifest_problem(folder)
    if problem:
        raise ArtifactError(f"{problem}: export it again (or restore the folder)")
    if not (folder / MANIFEST_NAME).is_file() and str(folder) not in _UNVERIFIED_SAID:
        _UNVERIFIED_SAID.add(str(folder))
        log(f"note: {folder} has no {MANIFEST_NAME} (written by another tool or an older draftsmith): its files are read unverified", sys.stderr)
    return folder


def _checkpoint_problem(path: Path) -> Optional[str]:
    """checkpoint_problem with the contents of what an artifact reads (weights, recipe) hashed."""
    problem = checkpoint_problem(path)
    if problem:
        return problem
    digests = read_state(path).sha256
    from draftsmith.atomic import sha256_file

    for rel in (WEIGHTS_NAME, "recipe.yaml"):
        if rel in digests and sha256_file(path / rel) != digests[rel]:
            return f"{rel} does not match the sha256 recorded when it was written (damaged or edited)"
    return None


def verified_checkpoint(path: Path) -> Path:
    """A checkpoint folder whose files match its manifest, or a run folder's newest such
    checkpoint (damaged newer ones are skipped with a warning). ArtifactError otherwise."""
    if is_checkpoint(path):
        problem = _checkpoint_problem(path)
        if problem:
            raise ArtifactError(f"checkpoint {path} is damaged: {problem}")
        return path
    found = list_checkpoints(path)
    if not found:
        raise ArtifactError(f"{path} is neither a draftsmith checkpoint nor a run folder with checkpoints")
    newest = None
    for candidate in reversed(found):
        problem = _checkpoint_problem(candidate)
        if problem is None:
            return candidate
        newest = newest or f"{candidate.name}: {problem}"
        log(f"warning: skipping damaged checkpoint {candidate} ({problem}); trying the one before it", sys.stderr)
    raise ArtifactError(f"every checkpoint of {path} is damaged (the newest, {newest})")


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


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8") if path.is_file() else ""


# ----------------------------------------------------------------------------- opening


def open_drafter(path: str | Path, dtype: str = "float32", exit_layer: Optional[int] = None) -> Artifact:
    """The drafter at `path` (a run folder, a checkpoint, an export, a third-party EAGLE folder, an
    HF causal-LM folder or a built-in model name), verified and loaded. Models (draft LMs,
    early-exit models) load in `dtype`; heads in float32. With `exit_layer`, a causal LM drafts for
    itself from that exit (the untrained baseline LayerSkip trains against). ArtifactError (one
    line) for anything else."""
    text = str(path)
    if text in BUILTIN_MODELS and not Path(text).exists():
        return _causal_lm_folder(text, {}, dtype, exit_layer, layout="builtin")
    path = Path(path)
    if not path.exists():
        raise ArtifactError(f"drafter folder not found: {path}")
    if not path.is_dir():
        raise ArtifactError(f"{path} is a file; a drafter is a folder (a run, a checkpoint or an export)")
    if (path / CONFIG_NAME).is_file():
        return _read_config_folder(verified_folder(path), dtype, exit_layer)
    if not is_checkpoint(path) and not (path / "checkpoints").is_dir():
        raise ArtifactError(f"{path} is neither a draftsmith checkpoint nor a run folder with checkpoints (and has no {CONFIG_NAME} of an export)")
    ckpt = verified_checkpoint(path)
    state = read_state(ckpt)
    kind = state.drafter_kind
    if kind is None:
        raise ArtifactError(f"{ckpt / STATE_FILE} records no drafter kind (drafter.kind): it cannot say what it holds; export a checkpoint draftsmith wrote")
    if exit_layer is not None and kind != "early_exit":
        raise ArtifactError(f"{ckpt} holds a {kind} drafter; --exit-layer applies to a model that drafts for itself (a layerskip run or a causal LM)")
    loader = CHECKPOINT_LOADERS.get(kind, _head_from_checkpoint if kind in HEADS else None)
    if loader is None:
        raise ArtifactError(f"{ckpt / STATE_FILE} records drafter kind {kind!r}, which this draftsmith does not know (heads: {', '.join(HEADS)})")
    return loader(ckpt, state, dtype, exit_layer)


def _read_config_folder(folder: Path, dtype: str, exit_layer: Optional[int]) -> Artifact:
    config = read_json(folder / CONFIG_NAME)
    ours = config.get("draftsmith")
    if isinstance(ours, dict) and ours.get("drafter") == "heads":
        if exit_layer is not None:
            raise ArtifactError(f"{folder} holds a draft head; --exit-layer applies to a model that drafts for itself")
        return _head_from_export(folder, ours)
    if ours is not None:
        raise ArtifactError(f"{folder / CONFIG_NAME} has a draftsmith block of an unknown drafter {ours.get('drafter') if isinstance(ours, dict) else ours!r}")
    layout = detect_layout(config)
    if layout is not None:
        if exit_layer is not None:
            raise ArtifactError(f"{folder} holds a draft head ({layout} layout); --exit-layer applies to a model that drafts for itself")
        foreign = read_foreign(folder, config)
        source = config.get("draftsmith_source") or {}
        target = dict(source.get("target") or {})
        # A folder that names its target (speculators' verifier) by the Hub id of the target
        # draftsmith recorded (a built-in, read offline) keeps the recorded one, as the layouts
        # that do not name it do; another name wins.
        if foreign.target_path and foreign.target_path not in (target.get("path"), hub_id(str(target.get("path") or ""))):
            target["path"] = foreign.target_path
        # A draftsmith export in an engine's layout carries the tree its head was evaluated with.
        return HeadArtifact(foreign.kind, folder, foreign.layout, target, _text(folder / "recipe.yaml"), foreign=foreign, tree=source.get("tree"))
    if config.get("model_type") == "medusa":
        raise ArtifactError(f"{folder} holds Medusa heads in vLLM's layout; draftsmith reads Medusa heads in its own (draftsmith export --format draftsmith)")
    if "model_type" not in config:
        raise ArtifactError(f"{folder / CONFIG_NAME} is neither a draftsmith export nor a causal-LM config (no model_type)")
    return _causal_lm_folder(str(folder), config, dtype, exit_layer, layout="hf")


def _causal_lm_folder(path: str, config: dict, dtype: str, exit_layer: Optional[int], layout: str) -> Artifact:
    """A plain causal LM (a folder or a built-in name): an early-exit export, a model asked to
    draft for itself from `exit_layer`, or a standalone draft LM."""
    from draftsmith.target import TargetLoadError, load_causal_lm

    block = config.get(EARLY_EXIT_KEY) if isinstance(config.get(EARLY_EXIT_KEY), dict) else {}
    folder = Path(path)

    def load():
        try:
            return load_causal_lm(path, dtype)
        except (OSError, ValueError, TargetLoadError) as err:
            raise ArtifactError(f"{path} does not load as a causal LM ({type(err).__name__}: {str(err).splitlines()[0][:160]})") from None

    recorded = recorded_target(folder) if layout != "builtin" else {}
    recipe_yaml = _text(folder / "recipe.yaml") if layout != "builtin" else ""
    metrics = _json_or_none(folder / "metrics.json") if layout != "builtin" else None
    if block or exit_layer is not None:
        chosen = exit_layer if exit_layer is not None else block.get("exit_layer")
        how = "--exit-layer" if exit_layer is not None else block.get("chosen_by", "the export's config")
        return EarlyExitArtifact(
            "early_exit", folder, layout, {"path": path}, recipe_yaml, metrics, loader=load, exit_layer=chosen, exit_chosen_by=how, block=dict(block),
        )  # fmt: skip
    return DraftLMArtifact("standalone", folder, layout, recorded, recipe_yaml, metrics, loader=load)


def _json_or_none(path: Path) -> Optional[dict]:
    return read_json(path) if path.is_file() else None


def recorded_target(folder: Path) -> dict:
    """The target section a run, checkpoint or export recorded in recipe.yaml (its own, or its run's)."""
    from omegaconf import OmegaConf

    for candidate in (folder / "recipe.yaml", folder.parent / "recipe.yaml", folder.parent.parent / "recipe.yaml"):
        if candidate.is_file():
            try:
                data = OmegaConf.to_container(OmegaConf.load(candidate)) or {}
            except Exception as err:  # omegaconf's parse errors have no common base beyond this
                raise ArtifactError(f"{candidate} is unreadable ({type(err).__name__})") from None
            if isinstance(data, dict) and isinstance(data.get("target"), dict):
                return dict(data["target"])
    return {}


# ----------------------------------------------------------------------------- heads


def head_from_record(kind: str, values: dict, target: dict, where: Path) -> DraftHead:
    """Our head of `kind` from recorded config values and target dimensions; ArtifactError (one
    line) for a kind this draftsmith does not know or values its config refuses."""
    if kind not in HEADS:
        raise ArtifactError(f"{where} names head kind {kind!r}, which this draftsmith does not know (known: {', '.join(HEADS)})")
    cls = HEADS[kind]
    known = {f.name for f in fields(cls.config_class)}
    try:
        dims = TargetDims(
            hidden_size=target["hidden_size"], vocab_size=target["vocab_size"], num_layers=target["num_layers"], hf_config=target.get("hf_config") or {},
        )  # fmt: skip
        return cls(cls.config_class(**{k: v for k, v in values.items() if k in known}), dims)
    except (KeyError, TypeError, ValueError) as err:
        raise ArtifactError(f"{where}: the recorded {kind} head or its target cannot be rebuilt ({type(err).__name__}: {err})") from None


def _load_head_weights(head: DraftHead, weights: dict[str, Tensor], where: Path) -> DraftHead:
    mine = head.state_dict()
    missing, extra = sorted(set(mine) - set(weights)), sorted(set(weights) - set(mine))
    if missing or extra:
        raise ArtifactError(f"{where}: the weights {'lack' if missing else 'hold an unexpected'} tensor {(missing or extra)[0]} for a {head.cfg.kind} head as configured")
    for name, value in weights.items():
        if value.shape != mine[name].shape:
            raise ArtifactError(f"{where}: tensor {name} has shape {tuple(value.shape)}, the configured head needs {tuple(mine[name].shape)}")
    head.load_state_dict(weights)
    return head.eval()


def _head_from_export(folder: Path, config: dict) -> HeadArtifact:
    head_cfg, target = config.get("head") or {}, config.get("target") or {}
    head = head_from_record(head_cfg.get("kind"), head_cfg, target, folder / CONFIG_NAME)
    _load_head_weights(head, read_weights(folder / WEIGHTS_NAME), folder / WEIGHTS_NAME)
    recorded = recorded_target(folder)
    target = {**{k: recorded[k] for k in ("gguf_file", "dtype") if k in recorded}, **target}
    return HeadArtifact(
        head.cfg.kind, folder, "draftsmith", target, _text(folder / "recipe.yaml"), _json_or_none(folder / "metrics.json"),
        head=head, tree=config.get("tree"),
    )  # fmt: skip


def _head_from_checkpoint(ckpt: Path, state: dict, dtype: str, exit_layer: Optional[int]) -> HeadArtifact:
    head = head_from_record(state["head"].get("kind"), state["head"], state.get("target") or {}, ckpt / STATE_FILE)
    weights = read_weights(ckpt / WEIGHTS_NAME)
    _load_head_weights(head, {k[len(HEAD_PREFIX) :]: v for k, v in weights.items() if k.startswith(HEAD_PREFIX)}, ckpt / WEIGHTS_NAME)
    recorded = recorded_target(ckpt)
    target = {**{k: recorded[k] for k in ("gguf_file", "dtype") if k in recorded}, **state["target"]}
    return HeadArtifact(head.cfg.kind, ckpt, "checkpoint", target, _text(ckpt / "recipe.yaml"), state.get("last_eval"), head=head, tree=state.get("tree"))


# ----------------------------------------------------------------------------- draft LMs and early-exit models


def _trained_model(ckpt: Path, model, prefix: str, lora: bool, what: str):
    """`model` with a checkpoint's weights under `prefix` (LoRA merged); a GGUF-loaded model
    forgets its quantizer so that save_pretrained works."""
    weights = read_weights(ckpt / WEIGHTS_NAME)
    weights = {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}
    if not weights:
        raise ArtifactError(f"{ckpt / WEIGHTS_NAME} holds no {what} weights")
    result = model.load_state_dict(weights, strict=False)
    if result.unexpected_keys:
        raise ArtifactError(f"{ckpt} does not match its {what}: unexpected weights {result.unexpected_keys[:3]}")
    if lora:
        if not any("lora_" in k for k in weights):
            raise ArtifactError(f"{ckpt / WEIGHTS_NAME} holds no LoRA adapter weights")
        model = model.merge_and_unload()
    else:
        # A checkpoint stores a tied LM head once, under the embedding's name (or the other way round).
        tied = {k for k in result.missing_keys if "lm_head" in k or "embed_tokens" in k}
        if set(result.missing_keys) - tied:
            raise ArtifactError(f"{ckpt} lacks {what} weights {sorted(set(result.missing_keys) - tied)[:3]}")
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model.eval()


def _recipe_of(ckpt: Path):
    from draftsmith.recipe import RecipeError, load_recipe

    try:
        return load_recipe(ckpt / "recipe.yaml")
    except RecipeError as err:
        raise ArtifactError(f"{ckpt / 'recipe.yaml'}: {err}") from None


def _draft_lm_from_checkpoint(ckpt: Path, state: dict, dtype: str, exit_layer: Optional[int]) -> DraftLMArtifact:
    from draftsmith.target import load_draft

    recipe = _recipe_of(ckpt)

    def load():
        model, tokenizer = load_draft(recipe.draft)
        model = _trained_model(ckpt, model, DRAFT_PREFIX, recipe.draft.lora.enabled, f"draft ({recipe.draft.path})")
        return model.to(getattr(torch, dtype)), tokenizer

    target = {"path": str(recipe.target.path), "gguf_file": recipe.target.gguf_file, "dtype": recipe.target.dtype}
    return DraftLMArtifact("standalone", ckpt, "checkpoint", target, _text(ckpt / "recipe.yaml"), state.get("last_eval"), recipe=recipe, loader=load)


def _early_exit_from_checkpoint(ckpt: Path, state: dict, dtype: str, exit_layer: Optional[int]) -> EarlyExitArtifact:
    from draftsmith.target import load_causal_lm, with_lora

    recipe = _recipe_of(ckpt)
    lora = recipe.layerskip.lora

    def load():
        model, tokenizer = load_causal_lm(recipe.target.path, "float32", recipe.target.gguf_file, what="target")
        model = _trained_model(ckpt, with_lora(model, lora), MODEL_PREFIX, lora.enabled, f"model ({recipe.target.path})")
        return model.to(getattr(torch, dtype)), tokenizer

    if exit_layer is not None:
        chosen, how = exit_layer, "--exit-layer"
    elif recipe.layerskip.exit_layer is not None:
        chosen, how = recipe.layerskip.exit_layer, "layerskip.exit_layer in the recipe"
    else:
        evaluation = state.get("last_eval") or {}
        if "best_exit" not in evaluation:
            raise ArtifactError(
                f"checkpoint step {state.get('step')} records no held-out evaluation of its exits to choose an exit layer from: "
                "set layerskip.exit_layer in the recipe, or evaluate before saving"
            )
        chosen = int(evaluation["best_exit"])
        how = (
            f"best modeled speedup on held-out answers at step {state.get('step')} (expected acceptance "
            f"{evaluation.get('best_exit_expected_acceptance', float('nan')):.3f})"
        )
    target = {"path": str(recipe.target.path), "gguf_file": recipe.target.gguf_file}
    return EarlyExitArtifact(
        "early_exit", ckpt, "checkpoint", target, _text(ckpt / "recipe.yaml"), state.get("last_eval"),
        recipe=recipe, loader=load, exit_layer=chosen, exit_chosen_by=how, state=state,
    )  # fmt: skip


# Checkpoint readers by the drafter kind trainer_state.json records; every head kind reads as a head.
CHECKPOINT_LOADERS: dict[str, Callable[[Path, dict, str, Optional[int]], Artifact]] = {
    "standalone": _draft_lm_from_checkpoint,
    "early_exit": _early_exit_from_checkpoint,
}


def hub_id(path: str) -> Optional[str]:
    """The Hub id of a target path, when it has one (built-in names map to their origin)."""
    if path in BUILTIN_MODELS:
        return BUILTIN_MODELS[path]["hub_id"]
    looks_like_hub_id = path.count("/") == 1 and not path.startswith((".", "/", "~")) and not path.endswith(".gguf")
    return path if looks_like_hub_id else None


# ----------------------------------------------------------------------------- third-party EAGLE / EAGLE-3 folders
#
# Facts these follow (vLLM 0.32, SGLang as of 2026-05, speculators 0.9; docs/export.md has the sources):
# - EAGLE-3: ``fc.weight`` [H, 3H], ``midlayer.*`` (or ``layers.0.*``, which speculators writes),
#   ``norm.weight``, ``lm_head.weight`` [Vd, H], ``d2t`` [Vd] (absent with the full vocabulary),
#   ``t2d`` [V] (speculators writes it; the engines skip it); an embedding only as a copy of the target's.
# - EAGLE-1: ``fc.weight`` (+ ``fc.bias`` in SGLang), ``layers.{i}.*`` with no
#   ``layers.0.input_layernorm``, no final norm, no LM head.


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


def _load_tensors(folder: Path) -> dict[str, Tensor]:
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


def read_foreign(folder: str | Path, config: Optional[dict] = None) -> ForeignHead:
    """Read an EAGLE-3 or EAGLE folder in vLLM's, SGLang's or speculators' layout (ArtifactError,
    one line, for a folder whose config and tensors disagree or that holds something else)."""
    folder = Path(folder)
    config = config if config is not None else read_json(folder / CONFIG_NAME)
    layout = detect_layout(config)
    if layout is None:
        raise ArtifactError(f"{folder} is not an EAGLE, EAGLE-3 or DFlash drafter in vLLM's, SGLang's or speculators' layout (config.json architectures {config.get('architectures')})")
    tensors = _load_tensors(folder)
    where = f"{folder} ({layout} layout)"
    if layout == "speculators":
        kind = config["speculators_model_type"]
        if kind not in ("eagle3", "dflash"):
            raise ArtifactError(f"{where}: speculators model type {kind!r}; draftsmith reads eagle3 and dflash")
        layer = dict(config.get("transformer_layer_config") or {})
        verifier = (config.get("speculators_config") or {}).get("verifier") or {}
        if kind == "dflash":
            head = _read_dflash(where, folder, layer, config, tensors, speculators=True)
        else:
            head = _read_eagle3(where, {**layer, **config}, tensors)
            # speculators' own default is True when the key is missing, as vLLM reads it on this path.
            head.config["norm_before_residual"] = bool(config.get("norm_before_residual", True))
        head.target_path = verifier.get("name_or_path")
        head.layout = "speculators"
        return head
    if layout == "dflash":
        return _read_dflash(where, folder, config, config, tensors, speculators=False)
    if layout == "eagle3":
        return _read_eagle3(where, config, tensors)
    return _read_eagle(where, config.get("model") if config.get("model_type") == "eagle" else config, tensors)


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


def _take(tensors: dict[str, Tensor], name: str, where: str) -> Tensor:
    if name not in tensors:
        raise ArtifactError(f"{where}: the config describes a tensor {name} that the weights do not hold")
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
    ours["d2t"], ours["t2d"] = _read_draft_vocabulary(where, tensors, Vd, vocab)
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
        **_shape_keys(config),
        "aux_layer_ids": aux,
        "draft_vocab_size": Vd,
        "norm_before_residual": bool(config.get("norm_before_residual", False)),
        **switches,
    }
    return ForeignHead("eagle3", "eagle3", values, ours, embedding=embedding)


def _read_draft_vocabulary(where: str, tensors: dict[str, Tensor], Vd: int, vocab: int) -> tuple[Tensor, Tensor]:
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


def _read_dflash(where: str, folder: Path, layer: dict, config: dict, tensors: dict[str, Tensor], speculators: bool) -> ForeignHead:
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
        _take(dict(tensors), name, where)
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
        tensors["d2t"], tensors["t2d"] = _read_draft_vocabulary(where, tensors, Vd, vocab)
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
        **_shape_keys(layer),
        "num_layers": declared,
        "block_size": int(block),
        "aux_layer_ids": aux,
        "mask_token_id": int(mask),
        "mask_embedding": mask_file.is_file(),
        "causal": causal,
        "draft_vocab_size": Vd,
    }
    return ForeignHead("dflash", "dflash", values, tensors, embedding=embedding)


def _read_eagle(where: str, config: dict, tensors: dict[str, Tensor]) -> ForeignHead:
    tensors = {n[len("model.") :] if n.startswith("model.") else n: t for n, t in tensors.items()}
    for refused in ("lm_head.weight", "norm.weight", "layers.0.input_layernorm.weight"):
        if refused in tensors:
            raise ArtifactError(f"{where}: an EAGLE-1 draft has no {refused} (the target's LM head and final norm serve, layer 0 reads fc's output unnormed)")
    embedding = tensors.pop("embed_tokens.weight", None)
    layers = sorted({int(n.split(".")[1]) for n in tensors if n.startswith("layers.")})
    declared = int(config.get("num_hidden_layers") or len(layers))
    if layers != list(range(declared)):
        raise ArtifactError(f"{where}: the config has {declared} decoder layer(s), the weights hold layers {layers}")
    _take(dict(tensors), "fc.weight", where)
    values = {**_shape_keys(config), "num_layers": declared, "fc_bias": "fc.bias" in tensors}
    return ForeignHead("eagle", "eagle", values, tensors, embedding=embedding)


__all__ = [
    "Artifact",
    "ArtifactError",
    "CHECKPOINT_LOADERS",
    "DraftLMArtifact",
    "EARLY_EXIT_KEY",
    "EarlyExitArtifact",
    "ForeignHead",
    "HeadArtifact",
    "MASK_EMBEDDING_FILE",
    "ModelArtifact",
    "head_from_record",
    "detect_layout",
    "head_from_foreign",
    "hub_id",
    "open_drafter",
    "read_foreign",
    "recorded_target",
    "verified_checkpoint",
    "verified_folder",
]
