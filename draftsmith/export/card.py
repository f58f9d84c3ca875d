"""Model cards (README.md with Hub front matter) for every kind of exported drafter."""

from __future__ import annotations

from dataclasses import fields
from typing import Optional

from draftsmith import __version__
from draftsmith.artifacts import hub_id

DRAFTSMITH_USE = "\n".join([
    "```bash",
    "pip install draftsmith",
    'draftsmith generate --drafter <this folder> --prompt "Write a haiku about the sea."',
    "draftsmith eval --drafter <this folder> --prompts mtbench --out eval/",
    "```",
])


def head_config_values(head) -> dict:
    return {f.name: getattr(head.cfg, f.name) for f in fields(head.cfg)}


def model_card(
    kind: str, head_cfg: dict, target: dict, recipe_yaml: str, metrics: Optional[dict], use: str = DRAFTSMITH_USE, layout: str = "draftsmith",
    holds_target_lm_head: bool = False,
) -> str:
    """A draft head's card: front matter for search, then what the drafter is and how to run it
    (`use`: the Use section's markdown, the serve command of the folder's `layout`)."""
    hub = hub_id(str(target["path"]))
    lines = [
        "---",
        "library_name: draftsmith",
        *([f"base_model: {hub}"] if hub else []),
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
        f"vocabulary {target['vocab_size']}). "
        + ("It holds the head's own weights and one copy of the target's LM head, which this layout cannot point at"
           if holds_target_lm_head else "It holds only the head's own weights")
        + "; speculative decoding with it "
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


def lm_model_card(artifact, use: Optional[str] = None) -> str:
    """A distilled draft LM's card (`use`: the Use section, default transformers' assisted
    generation and draftsmith eval)."""
    recipe, model, metrics = artifact.recipe, artifact.model, artifact.metrics
    target, draft = recipe.target.path, recipe.draft.path
    hub_target, hub_draft = hub_id(str(target)), hub_id(str(draft))
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
    lines += ["## Recipe", "", "```yaml", artifact.recipe_yaml.rstrip(), "```", ""]
    return "\n".join(lines)


def exit_layer_line(exit_layer: int, num_layers, how: str) -> str:
    """The card's line that names the exit layer (rewritten when a sweep picks another)."""
    return f"Exit layer: {exit_layer} of {num_layers} ({how})."


def early_exit_card(artifact, block: dict) -> str:
    """A LayerSkip-trained model's card."""
    recipe, model, metrics = artifact.recipe, artifact.model, artifact.metrics
    target = str(recipe.target.path)
    hub_target = hub_id(target)
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
        exit_layer_line(E, L, block["chosen_by"]),
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
    lines += ["## Recipe", "", "```yaml", artifact.recipe_yaml.rstrip(), "```", ""]
    return "\n".join(lines)


__all__ = ["DRAFTSMITH_USE", "early_exit_card", "exit_layer_line", "head_config_values", "lm_model_card", "model_card"]
