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
   drafter is one entry in CHECKPOINT_LOADERS (and, for a new third-party folder layout, its
   name in ``layouts.detect_layout`` and one reader in ``layouts.READERS``);
2. ``draftsmith/layouts``: its engine layouts, one module writing and reading them, and
   ``draftsmith/export``: what each format refuses (``refusal``);
3. ``draftsmith/runtime/load.py``: how its artifact becomes a runtime Drafter.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from draftsmith.atomic import MANIFEST_NAME, manifest_problem
from draftsmith.heads import HEADS, DraftHead, TargetDims
from draftsmith.layouts import detect_layout, head_from_foreign, read_foreign
from draftsmith.layouts.common import CONFIG_NAME, ArtifactError, ForeignHead, read_json, read_weights
from draftsmith.runs import (
    STATE_FILE, WEIGHTS_NAME, checkpoint_problem, is_checkpoint, list_checkpoints, log, read_state,
)
from draftsmith.target import BUILTIN_MODELS

# How checkpoints name the drafter's weights inside model.safetensors, per drafter kind.
HEAD_PREFIX, DRAFT_PREFIX, MODEL_PREFIX = "head.", "draft.", "model."
# The config.json block of an early-exit export.
EARLY_EXIT_KEY = "layerskip"


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
    # (path, gguf_file) of the model's config, which ``config`` reads without the weights (None:
    # ``config`` loads the model).
    config_source: Optional[tuple[str, Optional[str]]] = None
    _loaded: Optional[tuple[Any, Any]] = field(default=None, repr=False)

    def _load(self) -> tuple[Any, Any]:
        if self._loaded is None:
            self._loaded = self.loader()
        return self._loaded

    @property
    def config(self):
        """The model's HF config: the loaded model's once it is loaded, else read from its files
        without the weights (a format deciding whether it can carry the model loads nothing)."""
        if self._loaded is not None or self.config_source is None:
            return self.model.config
        from draftsmith.target import TargetLoadError, load_config

        try:
            return load_config(*self.config_source)
        except TargetLoadError as err:
            raise ArtifactError(str(err)) from None

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
    # A draftsmith export carries the recipe that trained it (its card is written from it again on
    # a re-export); a plain model folder has none.
    recipe = _recipe_or_none(folder) if recipe_yaml else None
    if block or exit_layer is not None:
        chosen = exit_layer if exit_layer is not None else block.get("exit_layer")
        how = "--exit-layer" if exit_layer is not None else block.get("chosen_by", "the export's config")
        return EarlyExitArtifact(
            "early_exit", folder, layout, {"path": path}, recipe_yaml, metrics, recipe=recipe, loader=load, config_source=(path, None),
            exit_layer=chosen, exit_chosen_by=how, block=dict(block),
        )  # fmt: skip
    return DraftLMArtifact("standalone", folder, layout, recorded, recipe_yaml, metrics, recipe=recipe, loader=load, config_source=(path, None))


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


def _recipe_or_none(folder: Path):
    """The recipe of ``folder``, or None where it does not load (``_recipe_of`` says why)."""
    try:
        return _recipe_of(folder)
    except ArtifactError:
        return None


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
    return DraftLMArtifact(
        "standalone", ckpt, "checkpoint", target, _text(ckpt / "recipe.yaml"), state.get("last_eval"), recipe=recipe, loader=load,
        config_source=(str(recipe.draft.path), recipe.draft.gguf_file),
    )  # fmt: skip


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
        recipe=recipe, loader=load, config_source=(str(recipe.target.path), recipe.target.gguf_file), exit_layer=chosen, exit_chosen_by=how,
        state=state,
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


__all__ = [
    "Artifact",
    "ArtifactError",
    "CHECKPOINT_LOADERS",
    "DraftLMArtifact",
    "EARLY_EXIT_KEY",
    "EarlyExitArtifact",
    "HeadArtifact",
    "ModelArtifact",
    "head_from_record",
    "hub_id",
    "open_drafter",
    "recorded_target",
    "verified_checkpoint",
    "verified_folder",
]
