"""Run a drafter on prompts and measure it: the engine behind `draftsmith generate` and `draftsmith eval`.

A drafter folder is any of: a head export (config.json with a "draftsmith" block), a head-trainer
checkpoint or run folder, a distill/online run folder or checkpoint, or a plain HF causal-LM folder
(a standalone or distilled drafter); a built-in model name (e.g. qwen2.5-coder-0.5b) drafts as it
ships. The target comes from what the drafter recorded (its config or recipe.yaml) unless overridden.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from torch import Tensor

from draftsmith.eval.acceptance import AcceptanceStats
from draftsmith.export.layouts import detect_layout
from draftsmith.runs import recorded_target
from draftsmith.runtime.drafters import DrafterError, HeadDrafter, StandaloneDrafter
from draftsmith.runtime.generate import autoregressive_generate, speculative_generate
from draftsmith.runtime.tree import SparseTree, TreeError, TreeSpec, default_tree, parse_tree
from draftsmith.runtime.verify import POSTERIOR_ALPHA, POSTERIOR_THRESHOLD, check_typical
from draftsmith.target import BUILTIN_MODELS, FrozenTarget, load_causal_lm, resolve_dtype


@dataclass
class LoadedDrafter:
    """A drafter ready to run, the target it drafts for, and where both came from."""

    kind: str  # "medusa", ..., "standalone" or "early_exit"
    drafter: Any
    target: FrozenTarget
    folder: Path
    target_path: str
    draft_model: Any = None  # the HF model of a standalone drafter (for assisted generation)
    meta: dict = field(default_factory=dict)
    # transformers generate() arguments of the assisted generation to compare with, when it is not
    # assistant_model=draft_model (early exit: assistant_early_exit=E).
    assist: dict = field(default_factory=dict)


def _check_vocab(draft_tokenizer, target_tokenizer, folder: Path, target_path: str) -> None:
    if draft_tokenizer is None or target_tokenizer is None:
        return
    if draft_tokenizer.get_vocab() != target_tokenizer.get_vocab():
        raise DrafterError(
            f"drafter {folder} uses a different tokenizer than target {target_path} "
            f"({len(draft_tokenizer)} vs {len(target_tokenizer)} tokens); speculative decoding needs the same vocabulary"
        )


def _standalone(model, tokenizer, folder: Path, recorded: dict, target: Optional[str], target_dtype: str, spec) -> LoadedDrafter:
    """A standalone draft LM with its target (the recorded one unless `target` overrides it)."""
    target_path = target or recorded.get("path")
    if not target_path:
        raise DrafterError(f"{folder} does not record its target (no recipe.yaml): pass --target")
    tgt = FrozenTarget.load(target_path, target_dtype, recorded.get("gguf_file") if not target else None)
    _check_vocab(tokenizer, tgt.tokenizer, folder, target_path)
    if model.get_output_embeddings().weight.shape[0] != tgt.dims.vocab_size:
        raise DrafterError(
            f"drafter {folder} has a vocabulary of {model.get_output_embeddings().weight.shape[0]}, "
            f"target {target_path} of {tgt.dims.vocab_size}"
        )
    model = model.to(tgt.device).eval()
    drafter = StandaloneDrafter(model, spec or TreeSpec.chain(4))
    chosen = "given" if spec is not None else "chain of 4"
    return LoadedDrafter("standalone", drafter, tgt, folder, target_path, draft_model=model, meta={"tree": chosen})


def load_drafter(
    folder: str | Path,
    target: Optional[str] = None,
    tree: Optional[str] = None,
    dtype: Optional[str] = None,
    exit_layer: Optional[int] = None,
) -> LoadedDrafter:
    """Load a drafter folder and its target. `tree` is a spec for parse_tree; without one a head
    drafts the sparse tree its checkpoint or export stores (built from held-out accuracies at the
    end of training), else the default tree of its depth, and a standalone LM a chain of 4
    (``meta["tree"]`` says which). With `exit_layer`, or for a LayerSkip run or export, the model
    drafts for itself with its first layers (eval/early_exit.py)."""
    from draftsmith.eval.early_exit import is_early_exit, load_early_exit
    from draftsmith.export import ExportError, is_lm_checkpoint, load_head, load_lm_drafter

    if exit_layer is not None or is_early_exit(folder):
        return load_early_exit(folder, exit_layer, tree, dtype, target)
    spec = parse_tree(tree) if tree else None
    if str(folder) in BUILTIN_MODELS and not Path(folder).exists():
        # A built-in model as it ships (e.g. qwen2.5-coder-0.5b): the untrained baseline drafter.
        target_dtype = dtype or "float32"
        model, tokenizer = load_causal_lm(str(folder), target_dtype)
        return _standalone(model, tokenizer, Path(str(folder)), {}, target, target_dtype, spec)
    folder = Path(folder)
    if not folder.exists():
        raise DrafterError(f"drafter folder not found: {folder}")
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}

    if config and detect_layout(config) is not None:
        return _foreign(folder, config, target, dtype, spec)
    if config.get("model_type") == "medusa":
        raise DrafterError(f"{folder} holds Medusa heads in vLLM's layout; draftsmith reads Medusa heads in its own (draftsmith export --format draftsmith)")
    if config and "draftsmith" not in config and "model_type" in config:
        # A plain HF causal-LM folder: an exported distilled drafter or any small sibling model.
        recorded = recorded_target(folder) or {}
        target_dtype = dtype or recorded.get("dtype", "float32")
        model, tokenizer = load_causal_lm(str(folder), target_dtype)
        return _standalone(model, tokenizer, folder, recorded, target, target_dtype, spec)
    if is_lm_checkpoint(folder):
        # A distill / online run folder or checkpoint: its draft with the trained weights (LoRA merged).
        model, tokenizer, recipe, _, _ = load_lm_drafter(folder)
        recorded = {"path": str(recipe.target.path), "dtype": recipe.target.dtype, "gguf_file": recipe.target.gguf_file}
        target_dtype = resolve_dtype(dtype or recipe.target.dtype, "target")
        return _standalone(model.to(getattr(torch, target_dtype)), tokenizer, folder, recorded, target, target_dtype, spec)

    try:
        loaded = load_head(folder)
    except ExportError as err:
        raise DrafterError(str(err)) from None
    recorded = recorded_target(loaded.folder) or {}
    target_path = target or loaded.target.get("path") or recorded.get("path")
    target_dtype = dtype or recorded.get("dtype", "float32")
    tgt = FrozenTarget.load(target_path, target_dtype, recorded.get("gguf_file") if not target else None)
    want, have = loaded.target, tgt.dims
    if (want["hidden_size"], want["vocab_size"]) != (have.hidden_size, have.vocab_size):
        raise DrafterError(
            f"drafter {folder} was trained for a target with hidden size {want['hidden_size']} and vocabulary "
            f"{want['vocab_size']}; {target_path} has hidden size {have.hidden_size} and vocabulary {have.vocab_size}"
        )
    head = loaded.head.to(tgt.device)
    if spec is not None:
        chosen = f"given: {tree}"
    elif loaded.tree is not None:
        try:
            stored = SparseTree.from_dict(loaded.tree)
        except TreeError as err:
            raise DrafterError(f"{loaded.folder}: the stored tree is unreadable ({err})") from None
        spec = stored.spec
        chosen = f"stored sparse tree, {len(spec.choices)} nodes (expected accepted length {stored.expected_accept_length:.3f} from held-out accuracies)"
    else:
        spec = default_tree(depth=head.depth)
        chosen = f"default tree of depth {head.depth}, {len(spec.choices)} nodes"
    # The drafter refuses, in one line, a tree deeper than the head drafts.
    drafter = HeadDrafter(head, tgt, spec)
    return LoadedDrafter(head.cfg.kind, drafter, tgt, folder, target_path, meta={"head": loaded.metrics, "tree": chosen})


def _foreign(folder: Path, config: dict, target: Optional[str], dtype: Optional[str], spec) -> LoadedDrafter:
    """An EAGLE / EAGLE-3 folder in vLLM's, SGLang's or speculators' layout, written by anyone."""
    from draftsmith.export import ExportError, read_foreign
    from draftsmith.export.layouts import head_from_foreign

    try:
        foreign = read_foreign(folder)
    except ExportError as err:
        raise DrafterError(str(err)) from None
    ours = (config.get("draftsmith_source") or {}).get("target") or {}
    target_path = target or foreign.target_path or ours.get("path")
    if not target_path:
        raise DrafterError(f"{folder} ({foreign.layout} layout) does not name its target: pass --target")
    tgt = FrozenTarget.load(target_path, dtype or "float32")
    try:
        head = head_from_foreign(foreign, tgt.dims).to(tgt.device)
    except ExportError as err:
        raise DrafterError(f"{folder}: {err}") from None
    if foreign.embedding is not None:
        own = tgt.model.get_input_embeddings().weight
        if foreign.embedding.shape != own.shape or not torch.allclose(foreign.embedding.to(own.dtype), own, atol=1e-3, rtol=1e-3):
            raise DrafterError(f"{folder} carries an embedding that is not the target's ({target_path}); draftsmith drafts with the target's embedding")
    drafter = HeadDrafter(head, tgt, spec or default_tree(depth=min(head.depth, 4)))
    return LoadedDrafter(head.cfg.kind, drafter, tgt, folder, target_path, meta={"layout": foreign.layout})


def load_prompts(spec: str, limit: Optional[int] = None) -> list[list[dict]]:
    """Prompts as chat messages ending with a user turn: a JSONL/JSON file (`prompt` field or chat
    `messages`) or a built-in set ("mtbench", "humaneval", "sharegpt"). Only the first user turn
    (with any system message before it) of each conversation is kept."""
    from draftsmith.data import DataError, load_conversations

    conversations = load_conversations(spec, format="auto", limit=None)
    prompts = []
    for conv in conversations:
        head = []
        for message in conv:
            head.append({"role": message["role"], "content": message["content"]})
            if message["role"] == "user":
                break
        if head and head[-1]["role"] == "user" and head[-1]["content"].strip():
            prompts.append(head)
        if limit is not None and len(prompts) >= limit:
            break
    if not prompts:
        raise DataError(f"no usable prompts in {spec}: each record needs a `prompt` field or chat `messages` with a user turn")
    return prompts


def encode_prompt(tokenizer, messages: list[dict], device) -> Tensor:
    """Chat messages -> input_ids [1,T] with the generation prompt, via the tokenizer's template."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    else:
        text = "\n".join(m["content"] for m in messages)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    return ids.to(device)


def _eos(tokenizer, model) -> list[int]:
    ids = set()
    for value in (getattr(tokenizer, "eos_token_id", None), getattr(model.generation_config, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(value)
    return sorted(ids)


@dataclass(frozen=True)
class Verification:
    """How drafted tokens are judged: "exact" (greedy or lossless sampling, per the temperature) or
    "typical" (Medusa's typical acceptance with posterior_threshold / posterior_alpha: NOT lossless)."""

    kind: str = "exact"
    posterior_threshold: float = POSTERIOR_THRESHOLD
    posterior_alpha: float = POSTERIOR_ALPHA

    def check(self, temperature: float, top_k: int, top_p: float) -> None:
        """DrafterError, one line, for sampling settings the mode does not support."""
        if self.kind not in ("exact", "typical"):
            raise DrafterError(f"verification must be 'exact' or 'typical', got {self.kind!r}")
        if self.kind == "typical":
            try:
                check_typical(temperature, top_k, top_p, self.posterior_threshold, self.posterior_alpha)
            except ValueError as err:
                raise DrafterError(f"--verify typical: {err}") from None

    def describe(self) -> str:
        if self.kind == "typical":
            return (
                f"typical acceptance (NOT lossless): posterior_threshold={self.posterior_threshold}, "
                f"posterior_alpha={self.posterior_alpha}"
            )
        return "exact (greedy, or lossless rejection sampling)"


EXACT = Verification()


def _sampling(temperature: float, top_k: int, top_p: float, verification: Verification = EXACT) -> dict:
    if verification.kind == "typical":
        return {
            "mode": "typical", "temperature": temperature,
            "posterior_threshold": verification.posterior_threshold, "posterior_alpha": verification.posterior_alpha,
        }  # fmt: skip
    if temperature <= 0:
        return {"mode": "greedy"}
    return {"mode": "sample", "temperature": temperature, "top_k": top_k, "top_p": top_p}


def generate_one(
    loaded: LoadedDrafter, messages: list[dict], max_new_tokens: int, temperature: float = 0.0,
    top_k: int = 0, top_p: float = 1.0, seed: int = 0, verification: Verification = EXACT,
):
    """Speculative generation for one prompt. Returns (completion text, new token ids, GenerationStats)."""
    verification.check(temperature, top_k, top_p)
    tok = loaded.target.tokenizer
    ids = encode_prompt(tok, messages, loaded.target.device)
    gen = torch.Generator(device=loaded.target.device).manual_seed(seed)
    out, stats = speculative_generate(
        loaded.target, loaded.drafter, ids, max_new_tokens, eos_token_id=_eos(tok, loaded.target.model),
        generator=gen, **_sampling(temperature, top_k, top_p, verification),
    )
    new = out[0, ids.shape[1]:]
    return tok.decode(new, skip_special_tokens=True), new, stats


def _count_forwards(model):
    """Count a model's forward calls at its full depth (assisted generation's target passes; an
    early-exit assistant runs the same model with fewer layers, and those passes do not count)."""
    counter = {"n": 0}
    depth = getattr(model.config, "num_hidden_layers", None)

    def hook(module, *_):
        if getattr(module.config, "num_hidden_layers", None) == depth:
            counter["n"] += 1

    return counter, model.register_forward_pre_hook(hook)


def evaluate(
    loaded: LoadedDrafter,
    prompts: list[list[dict]],
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    baseline: bool = True,
    assisted: bool = False,
    progress: bool = True,
    verification: Verification = EXACT,
) -> tuple[AcceptanceStats, dict]:
    """Speculative decoding over `prompts`, plus plain decoding of the same target in the same
    process, plus transformers' assisted generation when asked (standalone drafters). Returns the
    stats and extra figures (greedy outputs identical to the baseline, draft time). With typical
    verification the baseline samples the target at the same temperature."""
    from tqdm.auto import tqdm

    verification.check(temperature, top_k, top_p)
    target, tok = loaded.target, loaded.target.tokenizer
    eos = _eos(tok, target.model)
    sampling = _sampling(temperature, top_k, top_p, verification)
    plain = _sampling(temperature, top_k, top_p)
    stats = AcceptanceStats()
    identical, draft_time = 0, 0.0
    for i, messages in enumerate(tqdm(prompts, desc="eval", disable=not progress, dynamic_ncols=True)):
        ids = encode_prompt(tok, messages, target.device)
        gen = torch.Generator(device=target.device).manual_seed(seed + i)
        out, g = speculative_generate(target, loaded.drafter, ids, max_new_tokens, eos_token_id=eos, generator=gen, **sampling)
        for accepted, attempted, depth in zip(g.accept_lens, g.attempted_depths, g.draft_depths):
            stats.add_step(accepted, max(depth, 1), attempted=min(attempted, max(depth, 1)))
        stats.add_generation(g.new_tokens, g.wall_time, g.target_forwards)
        draft_time += g.draft_time
        if baseline:
            gen = torch.Generator(device=target.device).manual_seed(seed + i)
            base, b = autoregressive_generate(target, ids, max_new_tokens, eos_token_id=eos, generator=gen, **plain)
            stats.add_baseline(b.new_tokens, b.wall_time)
            identical += int(torch.equal(base, out))
        assist = loaded.assist or ({"assistant_model": loaded.draft_model} if loaded.draft_model is not None else {})
        if assisted and assist:
            counter, handle = _count_forwards(target.model)
            kwargs = {"do_sample": False} if plain["mode"] == "greedy" else {
                "do_sample": True, "temperature": temperature, "top_k": top_k or None, "top_p": top_p}
            started = time.perf_counter()
            try:
                res = target.model.generate(
                    ids, attention_mask=torch.ones_like(ids), **assist,
                    max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=tok.pad_token_id or eos[0], **kwargs,
                )
            finally:
                handle.remove()
            stats.add_assisted(res.shape[1] - ids.shape[1], time.perf_counter() - started, counter["n"])
    extra = {"draft_seconds": round(draft_time, 3)}
    if baseline and sampling["mode"] == "greedy":
        extra["greedy_identical_to_baseline"] = f"{identical}/{len(prompts)}"
    return stats, extra
