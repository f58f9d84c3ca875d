"""A LayerSkip run -> a plain Hugging Face causal-LM folder that drafts for itself.

The folder is the trained model (LoRA adapters merged) as ``save_pretrained`` writes it, plus the
tokenizer, a model card (README.md), the resolved recipe and the last held-out metrics. Its
config.json carries one extra block, ``"layerskip": {"exit_layer": E, ...}``: the exit the model
drafts with. Nothing else in it is draftsmith-specific, so transformers runs it as it is
(``generate(assistant_early_exit=E)``) and ``draftsmith eval --drafter <folder>`` decodes with the
runtime's early-exit drafter, which reuses the draft's KV cache for verification.

The exit layer is the recipe's ``layerskip.exit_layer`` when it sets one, else the exit with the
best modeled speedup on the run's last held-out evaluation; ``draftsmith eval --drafter <folder>
--exit-layer sweep`` measures every exit and records the fastest here instead.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional

from safetensors.torch import load_file

from draftsmith import __version__
from draftsmith.atomic import atomic_path, write_atomic
from draftsmith.distill.early_exit import best_exit
from draftsmith.export.hf import CONFIG_NAME, ExportError, _hub_id
from draftsmith.runs import WEIGHTS_NAME, RunFolderError, drafter_kind, read_state, resolve_checkpoint
from draftsmith.runtime.early_exit import DEFAULT_DRAFT_LENGTH

__all__ = [
    "EARLY_EXIT_KEY", "early_exit_config", "export_early_exit", "is_early_exit_run", "load_early_exit_model", "record_exit_layer",
]

# The config.json block of an early-exit export.
EARLY_EXIT_KEY = "layerskip"
# The step module the trainer checkpoints holds the model under this name.
MODEL_PREFIX = "model."
_CARD_EXIT_LINE = re.compile(r"^Exit layer: .*$", re.MULTILINE)


def is_early_exit_run(path: str | Path) -> bool:
    """True for a checkpoint (or run folder) of the layerskip trainer (drafter kind "early_exit")."""
    try:
        return drafter_kind(read_state(resolve_checkpoint(path))) == "early_exit"
    except RunFolderError:
        return False


def early_exit_config(folder: str | Path) -> Optional[dict]:
    """The "layerskip" block of an early-exit export's config.json, or None for any other folder."""
    config = Path(folder) / CONFIG_NAME
    if not config.is_file():
        return None
    try:
        block = json.loads(config.read_text()).get(EARLY_EXIT_KEY)
    except ValueError:
        return None
    return block if isinstance(block, dict) and "exit_layer" in block else None


def load_early_exit_model(source: str | Path):
    """(trained model with LoRA merged, tokenizer, recipe, checkpoint folder, trainer state) of a
    layerskip run folder or checkpoint; the model in float32, eval mode."""
    from draftsmith.recipe import load_recipe
    from draftsmith.target import load_causal_lm, with_lora

    try:
        ckpt = resolve_checkpoint(source)
        state = read_state(ckpt)
    except RunFolderError as err:
        raise ExportError(str(err)) from None
    if drafter_kind(state) != "early_exit":
        raise ExportError(f"{ckpt} holds a {drafter_kind(state)} drafter, not a model trained to exit early (trainer layerskip)")
    recipe = load_recipe(ckpt / "recipe.yaml")
    lora = recipe.layerskip.lora
    model, tokenizer = load_causal_lm(recipe.target.path, "float32", recipe.target.gguf_file, what="target")
    model = with_lora(model, lora)
    weights = load_file(str(ckpt / WEIGHTS_NAME))
    weights = {k[len(MODEL_PREFIX) :]: v for k, v in weights.items() if k.startswith(MODEL_PREFIX)}
    if not weights:
        raise ExportError(f"{ckpt / WEIGHTS_NAME} holds no model weights")
    result = model.load_state_dict(weights, strict=False)
    if result.unexpected_keys:
        raise ExportError(f"{ckpt} does not match target {recipe.target.path}: unexpected weights {result.unexpected_keys[:3]}")
    if lora.enabled:
        if not any("lora_" in k for k in weights):
            raise ExportError(f"{ckpt / WEIGHTS_NAME} holds no LoRA adapter weights")
        model = model.merge_and_unload()
    else:
        # A checkpoint stores a tied LM head once, under the embedding's name (or the other way round).
        tied = {k for k in result.missing_keys if "lm_head" in k or "embed_tokens" in k}
        if set(result.missing_keys) - tied:
            raise ExportError(f"{ckpt} lacks weights {sorted(set(result.missing_keys) - tied)[:3]}")
    # A GGUF-loaded model refuses save_pretrained while it still carries its quantizer.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model.eval(), tokenizer, recipe, ckpt, state


def chosen_exit_layer(recipe, state: dict, num_layers: int) -> tuple[int, str]:
    """(exit layer, how it was chosen) for a layerskip checkpoint: the recipe's, else the best
    modeled speedup on its last held-out evaluation."""
    if recipe.layerskip.exit_layer is not None:
        return recipe.layerskip.exit_layer, "layerskip.exit_layer in the recipe"
    evaluation = state.get("last_eval") or {}
    exits, acceptance = evaluation.get("eval_exits"), evaluation.get("exit_expected_acceptance")
    if not exits or not acceptance or len(exits) != len(acceptance):
        raise ExportError(
            f"checkpoint step {state.get('step')} records no held-out evaluation of its exits to choose an exit layer from: "
            "set layerskip.exit_layer in the recipe, or evaluate before saving"
        )
    chosen = best_exit(exits, acceptance, num_layers, DEFAULT_DRAFT_LENGTH)
    how = (
        f"best modeled speedup on held-out answers at step {state.get('step')} (expected acceptance "
        f"{acceptance[exits.index(chosen)]:.3f}, chain of {DEFAULT_DRAFT_LENGTH})"
    )
    return chosen, how


def early_exit_card(recipe, model, block: dict, metrics: Optional[dict], recipe_yaml: str) -> str:
    """A Hub model card for a LayerSkip-trained model."""
    target = str(recipe.target.path)
    hub_target = _hub_id(target)
    E, L = block["exit_layer"], block["num_layers"]
    lines = [
        "---",
        "library_name: transformers",
        *([f"base_model: {hub_target}"] if hub_target else []),
        "tags:",
        "- speculative-decoding",
        "- layerskip",
        "- early-exit",
        "- draftsmith",
        "---",
        "",
        f"# `{target}` trained to draft for itself (LayerSkip)",
        "",
        f"`{target}`{f' ({hub_target})' if hub_target else ''} fine-tuned by draftsmith {__version__} with LayerSkip "
        f"(layer dropout and an early-exit loss{', LoRA merged' if recipe.layerskip.lora.enabled else ''}): its first "
        f"layers, followed by its own final norm and LM head, predict the next token, so the model drafts with its first "
        f"{E} layers and verifies with all {L}. It is a plain {model.config.model_type} causal LM "
        f"({model.num_parameters():,} parameters); decoded greedily it produces its own greedy output.",
        "",
        f"Exit layer: {E} of {L} ({block['chosen_by']}).",
        "",
        "## Use",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM",
        'model = AutoModelForCausalLM.from_pretrained("<this folder>")',
        f"out = model.generate(input_ids, assistant_early_exit={E}, max_new_tokens=128)  # self-speculative",
        "```",
        "",
        "```bash",
        "draftsmith eval --drafter <this folder> --prompts mtbench --out eval/   # drafts with the exit in config.json",
        "draftsmith eval --drafter <this folder> --exit-layer sweep --prompts mtbench --limit 20 --out eval/",
        "```",
        "",
    ]
    if metrics and metrics.get("exit_expected_acceptance"):
        lines += [
            "## Held-out agreement of each exit with the full model (teacher forced)",
            "",
            f"Full-model cross-entropy on held-out answers: {metrics['full_loss']:.4f}.",
            "",
            "| exit layer | top-1 agreement | expected acceptance (1 - TVD) | cross-entropy |",
            "| --- | --- | --- | --- |",
        ]
        rows = zip(metrics["eval_exits"], metrics["exit_top1_agreement"], metrics["exit_expected_acceptance"], metrics["exit_loss"])
        for e, agree, accept, loss in rows:
            lines.append(f"| {e} | {agree:.3f} | {accept:.3f} | {loss:.3f} |")
        lines.append("")
    lines += ["## Recipe", "", "```yaml", recipe_yaml.rstrip(), "```", ""]
    return "\n".join(lines)


def export_early_exit(source: str | Path, out: str | Path) -> Path:
    """Write the trained model of a layerskip run (folder or checkpoint) as an HF folder, atomically."""
    model, tokenizer, recipe, ckpt, state = load_early_exit_model(source)
    L = int(model.config.num_hidden_layers)
    exit_layer, how = chosen_exit_layer(recipe, state, L)
    block = {"exit_layer": exit_layer, "num_layers": L, "draft_length": DEFAULT_DRAFT_LENGTH, "chosen_by": how, "draftsmith": __version__}
    setattr(model.config, EARLY_EXIT_KEY, block)
    metrics = state.get("last_eval")
    recipe_yaml = (ckpt / "recipe.yaml").read_text()
    out = Path(out)
    with atomic_path(out, folder=True) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "recipe.yaml").write_text(recipe_yaml)
        (tmp / "metrics.json").write_text(json.dumps(metrics or {}, indent=2) + "\n")
        (tmp / "README.md").write_text(early_exit_card(recipe, model, block, metrics, recipe_yaml))
    return out


def record_exit_layer(folder: str | Path, exit_layer: int, draft_length: int, how: str) -> dict:
    """Write a newly chosen exit layer into an early-exit export: config.json's block and the
    model card's "Exit layer:" line, each atomically. Returns the new block."""
    folder = Path(folder)
    config = json.loads((folder / CONFIG_NAME).read_text())
    block = dict(config.get(EARLY_EXIT_KEY) or {})
    if not block:
        raise ExportError(f"{folder / CONFIG_NAME} has no {EARLY_EXIT_KEY!r} block: not an early-exit export")
    block.update(exit_layer=exit_layer, draft_length=draft_length, chosen_by=how)
    config[EARLY_EXIT_KEY] = block
    write_atomic(folder / CONFIG_NAME, json.dumps(config, indent=2) + "\n")
    card = folder / "README.md"
    if card.is_file():
        line = f"Exit layer: {exit_layer} of {block.get('num_layers', '?')} ({how})."
        write_atomic(card, _CARD_EXIT_LINE.sub(lambda _: line, card.read_text(), count=1))
    return block
