"""A drafter artifact (draftsmith.artifacts) made ready to decode: the target it drafts for, loaded,
and the runtime Drafter around it. ``draftsmith generate`` and ``eval`` start here.

One rule picks where and in what precision decoding runs, as training does: the ``--device``
given, else ``auto`` (CUDA when a device is visible, else the CPU), then the ``--dtype`` given,
else ``auto`` for that device (bf16 only where it computes bf16 natively, fp32 elsewhere); both
are printed once with why. The target, the drafter and every tensor of the decoding loop live on
that device, and on CUDA verification runs in the fused kernel. Greedy output is token-identical
to the target's own only in fp32 (bf16 rounds one-token and many-token forwards differently), so
measurements of losslessness pass ``--dtype float32``.

One builder per artifact type; a new kind of drafter adds one here (a head kind needs none).
The drafters that need no training are names, not folders: ``lookup`` (prompt lookup) and
``suffix`` (suffix matching). Nothing records their target, so it is ``--target``, else the
built-in ``smollm2-135m`` (said once on stderr). ``hybrid`` merges one of them with a trained
head's tree (``HybridDrafter``).
"""

from __future__ import annotations

import difflib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from draftsmith.artifacts import Artifact, ArtifactError, DraftLMArtifact, EarlyExitArtifact, HeadArtifact, open_drafter
from draftsmith.runtime.drafters import DrafterError, HeadDrafter, StandaloneDrafter, check_tree_depth
from draftsmith.runtime.static import check_cache
from draftsmith.runtime.early_exit import DEFAULT_DRAFT_LENGTH, EarlyExitDrafter, check_exit_layer, is_chain
from draftsmith.runtime.lookup import DEFAULT_LOOKUP_TREE, LOOKUP_KINDS, HybridDrafter, LookupDrafter, make_matcher
from draftsmith.runtime.tree import SparseTree, TreeError, TreeSpec, default_tree, parse_tree, tree_shape
from draftsmith.target import BUILTIN_MODELS, FrozenTarget, TargetNotFoundError, choose_device, resolve_dtype


@dataclass
class LoadedDrafter:
    """A drafter ready to run, the target it drafts for, and where both came from."""

    kind: str  # "medusa", ..., "standalone", "early_exit", "lookup", "suffix", or a head's kind + "+lookup" / "+suffix" (hybrid)
    drafter: Any
    target: FrozenTarget
    folder: Path
    target_path: str
    draft_model: Any = None  # the HF model of a standalone drafter (for assisted generation)
    meta: dict = field(default_factory=dict)
    # transformers generate() arguments of the assisted generation to compare with, when it is not
    # assistant_model=draft_model (early exit: assistant_early_exit=E).
    assist: dict = field(default_factory=dict)
    # The KV caches decoding keeps: "auto", "dynamic" or "static" (runtime.generate.open_session).
    cache: str = "auto"


def decoding_placement(device: Optional[str] = None, dtype: Optional[str] = None) -> tuple[torch.device, str]:
    """(device, dtype) of decoding: `device` (--device), else auto, then `dtype` (--dtype), else
    what that device computes natively; each printed once when auto chooses."""
    chosen = choose_device(device or "auto", "decoding")
    return chosen, resolve_dtype(dtype or "auto", "target", chosen)


# The target of a lookup drafter when --target is not given: the fast real model every machine here has.
DEFAULT_LOOKUP_TARGET = "smollm2-135m"


@dataclass(frozen=True)
class LookupOptions:
    """How a lookup drafter matches (``--prompt-lookup-min/max``, ``--suffix-cache``)."""

    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3
    global_cache: bool = False

    def matcher(self, kind: str):
        return make_matcher(kind, self.prompt_lookup_min, self.prompt_lookup_max, self.global_cache)


def load_drafter(
    folder: str | Path,
    target: Optional[str] = None,
    tree: Optional[str] = None,
    dtype: Optional[str] = None,
    exit_layer: Optional[int] = None,
    device: Optional[str] = None,
    hybrid: Optional[str] = None,
    lookup: LookupOptions = LookupOptions(),
    cache: str = "auto",
) -> LoadedDrafter:
    """Open a drafter folder (draftsmith.artifacts) and load its target. `tree` is a spec for
    parse_tree; without one a head drafts the sparse tree its checkpoint or export stores (built
    from held-out accuracies at the end of training), else the default tree of its depth, a draft
    LM a chain of 4, an early-exit model its recorded chain (``meta["tree"]`` says which). With
    `exit_layer`, or for a LayerSkip run or export, the model drafts for itself with its first layers.

    `folder` "lookup" or "suffix" is a drafter without training (on `target`, else the built-in
    smollm2-135m). `hybrid` ("lookup" or "suffix") merges that matcher with a head's tree under
    the tree's node budget. Everything lands on `device` (see decoding_placement). `cache`: the
    KV caches decoding keeps ("auto", "dynamic", "static": runtime.generate.open_session), the
    target's and a draft model's alike; ``LoadedDrafter.cache`` carries it to the decoding calls."""
    spec = parse_tree(tree) if tree else None
    by_name = str(folder) in LOOKUP_KINDS
    if by_name and hybrid:
        raise DrafterError(f"--hybrid merges lookup with a trained drafter: give its folder as --drafter, not {folder!r}")
    if lookup.global_cache and "suffix" not in (str(folder), hybrid):
        raise DrafterError("--suffix-cache belongs to suffix matching: use --drafter suffix or --hybrid suffix")
    if (lookup.prompt_lookup_min, lookup.prompt_lookup_max) != (LookupOptions.prompt_lookup_min, LookupOptions.prompt_lookup_max) and "lookup" not in (str(folder), hybrid):
        raise DrafterError("--prompt-lookup-min/--prompt-lookup-max belong to prompt lookup: use --drafter lookup or --hybrid lookup")
    if by_name and exit_layer is not None:
        raise DrafterError(f"--exit-layer belongs to a model drafting for itself; --drafter {folder} drafts from lookup, without a model")
    try:
        check_cache(cache)
    except ValueError as err:
        raise DrafterError(f"--cache: {err}") from None
    where, chosen = decoding_placement(device, dtype)
    if by_name:
        loaded = _lookup(str(folder), target, chosen, tree, spec, lookup, where)
    else:
        if not Path(folder).exists() and str(folder) not in BUILTIN_MODELS:
            # Not a folder: perhaps a built-in name mistyped (``sufix``).
            close = difflib.get_close_matches(str(folder), [*LOOKUP_KINDS, *BUILTIN_MODELS], n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise DrafterError(f"drafter folder not found: {folder} ({hint}--drafter takes a run, checkpoint or export folder, or a built-in name: "
                               f"{', '.join([*LOOKUP_KINDS, *BUILTIN_MODELS])})")  # fmt: skip
        artifact = open_drafter(folder, chosen, exit_layer)
        if spec is not None and isinstance(artifact, HeadArtifact) and artifact.head is not None:
            check_tree_depth(spec, artifact.head)  # before the target loads (HeadDrafter checks it again)
        if isinstance(artifact, EarlyExitArtifact):
            loaded = _early_exit(artifact, target, tree, spec, where)
        elif isinstance(artifact, DraftLMArtifact):
            loaded = _draft_lm(artifact, target, chosen, spec, where, cache)
        else:
            loaded = _head(artifact, target, chosen, tree, spec, where, cache)
        if hybrid:
            loaded = _hybrid(loaded, hybrid, spec, lookup)
    loaded.cache = cache
    return loaded


def _lookup(kind: str, target: Optional[str], dtype: str, tree: Optional[str], spec, options: LookupOptions, device: torch.device) -> LoadedDrafter:
    matcher = options.matcher(kind)  # refuses bad options before the target loads
    drafter = LookupDrafter(matcher, spec or DEFAULT_LOOKUP_TREE)
    if target is None:
        print(f"--drafter {kind}: no --target given, drafting for the built-in {DEFAULT_LOOKUP_TARGET}", file=sys.stderr)
    target_path = target or DEFAULT_LOOKUP_TARGET
    tgt = FrozenTarget.load(target_path, dtype, device=device)
    shape = drafter.shape
    meta = {"tree": f"given: {tree}" if spec is not None else f"default lookup tree: depth {shape.depth}, {shape.budget} nodes", "matcher": matcher.describe()}
    # transformers' own prompt lookup, drafting a chain as deep as ours, is the peer in eval.
    assist = {"prompt_lookup_num_tokens": shape.depth, "max_matching_ngram_size": options.prompt_lookup_max} if kind == "lookup" else {}
    return LoadedDrafter(kind, drafter, tgt, Path(kind), target_path, meta=meta, assist=assist)


def _hybrid(loaded: LoadedDrafter, kind: str, spec, options: LookupOptions) -> LoadedDrafter:
    if kind not in LOOKUP_KINDS:
        raise DrafterError(f"--hybrid {kind}: choose one of {', '.join(LOOKUP_KINDS)}")
    if not isinstance(loaded.drafter, HeadDrafter):
        raise DrafterError(f"--hybrid merges lookup with a trained head's tree; a {loaded.kind} drafter keeps its own state along its own tree and cannot join one")
    drafter = HybridDrafter(loaded.drafter, options.matcher(kind), spec)
    shape = tree_shape(drafter.tree)
    meta = {
        **loaded.meta,
        "hybrid": drafter.matcher.describe(),
        "tree": f"{loaded.meta.get('tree')}; merged with {kind} under one budget: depth {shape.depth}, {shape.topk} children a node, {shape.budget} nodes"
        + (f", cost {shape.cost}" if shape.cost else ""),
    }
    return LoadedDrafter(f"{loaded.kind}+{kind}", drafter, loaded.target, loaded.folder, loaded.target_path, meta=meta)


def _target_for(artifact: Artifact, override: Optional[str], dtype: str, device: torch.device) -> tuple[FrozenTarget, str]:
    path, gguf = artifact.target_source()
    path = override or path
    if not path:
        raise DrafterError(f"{artifact.folder} does not record its target (no recipe.yaml): pass --target")
    try:
        return FrozenTarget.load(path, dtype, None if override else gguf, device), path
    except TargetNotFoundError as err:
        if override or Path(path).is_absolute():
            raise
        # A relative folder recorded at training time is read from where the command runs.
        raise TargetNotFoundError(
            f"{artifact.folder} records its target as {path!r}, not found from {Path.cwd()}: a relative folder is read from where the "
            f"command runs, so run it from the folder the drafter was trained in, or pass --target ({err})"
        ) from None


def _head(artifact: HeadArtifact, target: Optional[str], dtype: str, tree: Optional[str], spec, device: torch.device, cache: str) -> LoadedDrafter:
    tgt, target_path = _target_for(artifact, target, dtype, device)
    head = artifact.head_for(tgt.dims, target_path).to(tgt.device)
    if artifact.foreign is not None and artifact.foreign.embedding is not None:
        own, theirs = tgt.model.get_input_embeddings().weight, artifact.foreign.embedding
        # Compared at the folder's own precision, on the host: speculators 0.9.0 saves every tensor
        # in bf16, the target's embedding among them, whatever precision it trained in.
        own = own.detach().to("cpu", theirs.dtype)
        if theirs.shape != own.shape or not torch.allclose(theirs.float(), own.float(), atol=1e-3, rtol=1e-3):
            raise ArtifactError(f"{artifact.folder} carries an embedding that is not the target's ({target_path}); draftsmith drafts with the target's embedding")
    meta: dict = {"head": artifact.metrics} if artifact.foreign is None else {"layout": artifact.layout}
    if spec is not None:
        meta["tree"] = f"given: {tree}"
    elif artifact.tree is not None:
        try:
            stored = SparseTree.from_dict(artifact.tree)
        except TreeError as err:
            raise ArtifactError(f"{artifact.folder}: the stored tree is unreadable ({err})") from None
        spec = stored.spec
        meta["tree"] = f"stored sparse tree, {len(spec.choices)} nodes (expected accepted length {stored.expected_accept_length:.3f} from held-out accuracies)"
    else:
        # A third-party folder drafts at most 4 deep by default, as the engines serve such heads.
        depth = head.depth if artifact.foreign is None else min(head.depth, 4)
        spec = default_tree(depth=depth)
        meta["tree"] = f"default tree of depth {depth}, {len(spec.choices)} nodes"
    # The drafter refuses, in one line, a tree deeper than the head drafts.
    return LoadedDrafter(head.cfg.kind, HeadDrafter(head, tgt, spec, cache=cache), tgt, artifact.folder, target_path, meta=meta)


def _draft_lm(artifact: DraftLMArtifact, target: Optional[str], dtype: str, spec, device: torch.device, cache: str) -> LoadedDrafter:
    tgt, target_path = _target_for(artifact, target, dtype, device)
    model, tokenizer = artifact.model, artifact.tokenizer
    if tokenizer is not None and tgt.tokenizer is not None and tokenizer.get_vocab() != tgt.tokenizer.get_vocab():
        raise DrafterError(
            f"drafter {artifact.folder} uses a different tokenizer than target {target_path} "
            f"({len(tokenizer)} vs {len(tgt.tokenizer)} tokens); speculative decoding needs the same vocabulary"
        )
    rows = model.get_output_embeddings().weight.shape[0]
    if rows != tgt.dims.vocab_size:
        raise DrafterError(f"drafter {artifact.folder} has a vocabulary of {rows}, target {target_path} of {tgt.dims.vocab_size}")
    model = model.to(device=tgt.device, dtype=getattr(torch, dtype)).eval()
    drafter = StandaloneDrafter(model, spec or TreeSpec.chain(4), cache=cache)
    meta = {"tree": "given" if spec is not None else "chain of 4"}
    return LoadedDrafter("standalone", drafter, tgt, artifact.folder, target_path, draft_model=model, meta=meta)


def early_exit_chain(tree: Optional[str], block: dict) -> TreeSpec:
    """The chain an early-exit model drafts: `tree` (which must be a chain), else its recorded length."""
    spec = parse_tree(tree) if tree else TreeSpec.chain(int(block.get("draft_length") or DEFAULT_DRAFT_LENGTH))
    if not is_chain(spec):
        raise DrafterError(f"early-exit drafting drafts a chain: --tree {tree} has branches (e.g. --tree 1,1,1,1 drafts 4 tokens)")
    return spec


def early_exit_loaded(target: FrozenTarget, folder, exit_layer: int, spec: TreeSpec, how: str, cache: str = "auto") -> LoadedDrafter:
    """The model `target` drafting for itself from `exit_layer`, beside transformers' own early-exit
    assisted generation drafting the same chain (``assist``); `cache` as load_drafter's."""
    drafter = EarlyExitDrafter(target, exit_layer, spec)
    k = spec.max_depth
    # transformers' own early-exit assisted generation drafts as the assistant's generation config
    # says (here the model's own: by default up to 20 tokens, stopping below 0.4 confidence); the
    # comparison drafts the same chain as ours every step.
    config = target.model.generation_config
    config.num_assistant_tokens, config.num_assistant_tokens_schedule, config.assistant_confidence_threshold = k, "constant", 0.0
    meta = {"exit_layer": exit_layer, "exit_layer_chosen_by": how, "draft_length": k, "tree": f"chain of {k}"}
    return LoadedDrafter("early_exit", drafter, target, Path(str(folder)), str(folder), meta=meta, assist={"assistant_early_exit": exit_layer}, cache=cache)


def early_exit_target(artifact: EarlyExitArtifact, device: torch.device) -> FrozenTarget:
    """The early-exit model, on `device`, as the target it is (it drafts for itself, so no --target)."""
    return FrozenTarget(artifact.model.to(device), artifact.tokenizer, source=str(artifact.folder))


def _early_exit(artifact: EarlyExitArtifact, target: Optional[str], tree: Optional[str], spec, device: torch.device) -> LoadedDrafter:
    if target:
        raise DrafterError("an early-exit drafter is its own target: drop --target")
    if artifact.exit_layer is None:
        raise DrafterError(f"{artifact.folder} records no exit layer: pass --exit-layer E (or sweep)")
    config = Path(artifact.config_source[0]) / "config.json"
    layers = json.loads(config.read_text()).get("num_hidden_layers") if config.is_file() else None
    if isinstance(layers, int):
        check_exit_layer(artifact.exit_layer, layers)  # before the model loads (early_exit_target checks it again)
    return early_exit_loaded(early_exit_target(artifact, device), artifact.folder, artifact.exit_layer, early_exit_chain(tree, artifact.block), artifact.exit_chosen_by)


__all__ = ["DEFAULT_LOOKUP_TARGET", "LoadedDrafter", "LookupOptions", "decoding_placement", "early_exit_chain", "early_exit_loaded", "early_exit_target", "load_drafter"]
