"""Distilled draft LM -> a plain Hugging Face causal-LM folder.

The folder is what ``save_pretrained`` writes for the draft (LoRA adapters merged into the weights),
plus the tokenizer, a model card (README.md), the resolved recipe (recipe.yaml, which names the
target) and the last held-out metrics. Nothing in it is draftsmith-specific, so the runtime
(``draftsmith eval --drafter``), transformers' ``generate(assistant_model=...)`` and any other
speculative-decoding stack load it directly. It never holds target weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from safetensors.torch import load_file

from draftsmith import __version__
from draftsmith.export.hf import ExportError, _hub_id
from draftsmith.runs import WEIGHTS_NAME, RunFolderError, drafter_kind, read_state, resolve_checkpoint

DRAFT_PREFIX = "draft."


def is_lm_checkpoint(path: str | Path) -> bool:
    """True for a checkpoint (or run folder) of a trainer that trains a draft LM (distill, online)."""
    try:
        return drafter_kind(read_state(resolve_checkpoint(path))) == "standalone"
    except RunFolderError:
        return False


def load_lm_drafter(source: str | Path):
    """(draft model with LoRA merged, tokenizer, recipe, checkpoint folder, last metrics) from a
    distill/online run folder or checkpoint."""
    from draftsmith.recipe import load_recipe
    from draftsmith.target import load_draft

    try:
        ckpt = resolve_checkpoint(source)
        state = read_state(ckpt)
    except RunFolderError as err:
        raise ExportError(str(err)) from None
    if drafter_kind(state) != "standalone":
        raise ExportError(f"{ckpt} holds a {drafter_kind(state)} drafter, not a draft LM (trainers distill, online)")
    recipe = load_recipe(ckpt / "recipe.yaml")
    model, tokenizer = load_draft(recipe.draft)
    weights = load_file(str(ckpt / WEIGHTS_NAME))
    weights = {k[len(DRAFT_PREFIX) :]: v for k, v in weights.items() if k.startswith(DRAFT_PREFIX)}
    if not weights:
        raise ExportError(f"{ckpt / WEIGHTS_NAME} holds no draft weights")
    result = model.load_state_dict(weights, strict=False)
    if result.unexpected_keys:
        raise ExportError(f"{ckpt} does not match draft {recipe.draft.path}: unexpected weights {result.unexpected_keys[:3]}")
    if recipe.draft.lora.enabled:
        model = model.merge_and_unload()
    else:
        # Weights the checkpoint may leave out are the ones tied to another (embeddings / LM head).
        tied = {k for k in result.missing_keys if "lm_head" in k or "embed_tokens" in k}
        if set(result.missing_keys) - tied:
            raise ExportError(f"{ckpt} lacks draft weights {sorted(set(result.missing_keys) - tied)[:3]}")
    # A GGUF-loaded model refuses save_pretrained while it still carries its quantizer.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model.eval(), tokenizer, recipe, ckpt, state.get("last_eval")


def lm_model_card(recipe, model, metrics: Optional[dict], recipe_yaml: str, use: Optional[str] = None) -> str:
    """A Hub model card for a distilled draft LM (`use`: the Use section, default transformers'
    assisted generation and draftsmith eval)."""
    target, draft = recipe.target.path, recipe.draft.path
    hub_target, hub_draft = _hub_id(str(target)), _hub_id(str(draft))
    use = use or "\n".join([
        "```python",
        "from transformers import AutoModelForCausalLM",
        f'target = AutoModelForCausalLM.from_pretrained("{hub_target or target}")',
        'draft = AutoModelForCausalLM.from_pretrained("<this folder>")',
        "out = target.generate(input_ids, assistant_model=draft, max_new_tokens=128)",
        "```",
        "",
        "```bash",
        "draftsmith eval --drafter <this folder> --prompts mtbench --out eval/",
        "```",
    ])
    method = "online speculative decoding" if recipe.trainer == "online" else f"DistillSpec ({recipe.distill.divergence})"
    lines = [
        "---",
        "library_name: transformers",
        *([f"base_model: {hub_draft}"] if hub_draft else []),
        "tags:",
        "- speculative-decoding",
        "- draft-model",
        "- draftsmith",
        "---",
        "",
        f"# Draft model for `{target}`",
        "",
        f"`{draft}` distilled into the target `{target}`{f' ({hub_target})' if hub_target else ''} with {method}, "
        f"by draftsmith {__version__}. It is a plain causal LM ({model.config.model_type}, "
        f"{model.num_parameters():,} parameters{', LoRA merged' if recipe.draft.lora.enabled else ''}) sharing the "
        "target's tokenizer; speculative decoding with it produces exactly the target's output, faster when it agrees.",
        "",
        "## Use",
        "",
        use,
        "",
    ]
    if metrics:
        lines += [
            "## Held-out agreement with the target (teacher forced)",
            "",
            "| metric | value |",
            "| --- | --- |",
            *[f"| {k} | {v:.4f} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in metrics.items()],
            "",
        ]
    lines += ["## Recipe", "", "```yaml", recipe_yaml.rstrip(), "```", ""]
    return "\n".join(lines)


def write_lm_files(model, tokenizer, recipe, metrics: Optional[dict], recipe_yaml: str, folder: Path, card: Optional[str] = None) -> None:
    """A draft LM as a plain HF causal-LM folder: save_pretrained's files, the tokenizer, the model
    card (`card`, default the draftsmith one), the recipe and the last metrics."""
    from draftsmith.export.hf import write_provenance

    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    write_provenance(folder, recipe_yaml, metrics, card or lm_model_card(recipe, model, metrics, recipe_yaml))
