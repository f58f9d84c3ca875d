"""The DistillSpec trainer on tiny random models: the draft moves towards the target (loss down,
agreement up), the target stays frozen, checkpoints hold no target weights, an interrupted run
resumes to the uninterrupted run's losses, and bad input fails with one clear line."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.recipe import RecipeError
from draftsmith.runs import list_checkpoints
from draftsmith.testing import run_trainer, save_tiny_model, write_chats, write_recipe
from draftsmith.trainers import TRAINERS


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny target and a smaller, differently initialised draft sharing its tokenizer."""
    root = tmp_path_factory.mktemp("distill-models")
    target = save_tiny_model(root / "target", "llama", seed=0)
    draft = save_tiny_model(root / "draft", "llama", seed=1, hidden_size=32, num_layers=1)
    return target, draft


def make_recipe(tmp_path: Path, models, name: str, *overrides: str):
    target, draft = models
    data = write_chats(tmp_path / "chats.jsonl", words=3)
    text = f"""
trainer: distill
output_dir: {tmp_path / name}
target: {{path: {target}}}
draft: {{path: {draft}}}
data: {{path: {data}, eval_size: 8, max_length: 64, seed: 1}}
distill: {{divergence: fkl}}
train: {{micro_batch_size: 4, max_steps: 24, lr: 0.01, warmup_steps: 2, log_every: 1, eval_every: 24, save_every: 8}}
"""
    return write_recipe(tmp_path / f"{name}.yaml", text, *overrides)


def records(run_dir: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


def target_weights(trainer) -> dict:
    return {k: v.clone() for k, v in trainer.target.model.state_dict().items()}


@pytest.mark.parametrize("divergence", ["fkl", "tvdpp"])
def test_distill_moves_draft_towards_target(tmp_path, models, divergence):
    overrides = [f"distill.divergence={divergence}"]
    if divergence == "tvdpp":
        # A policy-gradient estimate: more, gentler steps than the closed-form divergences need.
        overrides += ["train.max_steps=40", "train.eval_every=40", "train.lr=0.003"]
    recipe = make_recipe(tmp_path, models, divergence, *overrides)
    trainer = TRAINERS["distill"](recipe, argv=["test"]).setup()
    before = target_weights(trainer)
    try:
        summary = trainer.train()
    finally:
        trainer.close()
    evals = records(tmp_path / divergence, "eval")
    first, last = evals[0], evals[-1]
    assert first["step"] == 0 and last["step"] == recipe.train.max_steps
    # The draft agrees with the target more often and would be accepted more often.
    assert last["top1_agreement"] > first["top1_agreement"] + 0.05, (first, last)
    assert last["expected_acceptance"] > first["expected_acceptance"] + 0.02, (first, last)
    assert last["tvd"] < first["tvd"]
    if divergence == "fkl":
        losses = [r["loss"] for r in records(tmp_path / divergence, "train")]
        assert sum(losses[-4:]) / 4 < 0.7 * sum(losses[:4]) / 4, losses
        assert last["divergence_value"] < first["divergence_value"]
    # The target did not move.
    after = trainer.target.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert summary["step"] == recipe.train.max_steps


def test_checkpoint_holds_draft_only_and_resume_reproduces(tmp_path, models):
    recipe = make_recipe(tmp_path, models, "full", "train.max_steps=12", "train.save_every=4", "train.eval_every=12", "distill.lambda_onpolicy=0.5", "distill.onpolicy_max_new_tokens=8")
    trainer, _, _ = run_trainer(recipe)
    full = {r["step"]: r["loss"] for r in records(tmp_path / "full", "train")}
    ckpt = list_checkpoints(tmp_path / "full")[-1]
    weights = load_file(str(ckpt / "model.safetensors"))
    draft_keys = {f"draft.{k}" for k in trainer.draft.state_dict()}
    assert set(weights) == draft_keys
    target_values = [v for v in trainer.target.model.state_dict().values()]
    assert not any(v.shape == t.shape and torch.equal(v, t.cpu()) for v in weights.values() for t in target_values)

    recipe2 = make_recipe(tmp_path, models, "resumed", "train.max_steps=12", "train.save_every=4", "train.eval_every=12", "distill.lambda_onpolicy=0.5", "distill.onpolicy_max_new_tokens=8")
    run_trainer(recipe2, interrupt_at=6)
    assert list_checkpoints(tmp_path / "resumed")[-1].name == "step-000006"
    run_trainer(recipe2)
    resumed = {r["step"]: r["loss"] for r in records(tmp_path / "resumed", "train")}
    assert sorted(resumed) == sorted(full)
    for step in full:
        assert resumed[step] == pytest.approx(full[step], rel=1e-5, abs=1e-6), step


def test_onpolicy_fraction_is_honoured(tmp_path, models):
    from draftsmith.data.onpolicy import choose_onpolicy

    chosen = [c for step in range(200) for c in choose_onpolicy(4, 0.3, 0, step)]
    assert abs(sum(chosen) / len(chosen) - 0.3) < 0.05
    assert not any(choose_onpolicy(8, 0.0, 0, 1)) and all(choose_onpolicy(8, 1.0, 0, 1))

    recipe = make_recipe(tmp_path, models, "onpolicy", "distill.lambda_onpolicy=1.0", "distill.onpolicy_max_new_tokens=6", "train.max_steps=2")
    trainer = TRAINERS["distill"](recipe, argv=["test"]).setup()
    try:
        examples = trainer.next_examples()
        # Every answer was written by the draft: at most 6 trained tokens, continuing the prompt.
        originals = [trainer.stream.examples[i] for i in range(len(trainer.stream.examples))]
        for example in examples:
            assert 0 < sum(example["loss_mask"]) <= 6
            n = example["loss_mask"].index(1)
            assert any(o["input_ids"][:n] == example["input_ids"][:n] for o in originals)
        assert trainer.onpolicy_counts == [4, 4]
    finally:
        trainer.close()


def test_lora_checkpoint_holds_adapter_only(tmp_path, models):
    recipe = make_recipe(
        tmp_path, models, "lora", "draft.lora.enabled=true", "draft.lora.r=4", "train.max_steps=4", "train.save_every=4", "train.eval_every=4"
    )
    trainer, summary, _ = run_trainer(recipe)
    weights = load_file(str(list_checkpoints(tmp_path / "lora")[-1] / "model.safetensors"))
    assert weights and all("lora_" in k for k in weights)


def test_tokenizer_mismatch_is_one_clear_error(tmp_path, models):
    from draftsmith.trainers.distill import TokenizerMismatchError

    target, _ = models
    other = tmp_path / "other-draft"
    save_tiny_model(other, "llama", seed=2, hidden_size=32, num_layers=1)
    # Same size, different tokens: two ids swapped.
    vocab_file = json.loads((other / "tokenizer.json").read_text())
    vocab = vocab_file["model"]["vocab"]
    a, b = "a", "b"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(vocab_file))
    recipe = make_recipe(tmp_path, models, "mismatch", f"draft.path={other}")
    with pytest.raises(TokenizerMismatchError, match="different tokenizers"):
        TRAINERS["distill"](recipe, argv=["test"]).setup()


def test_lambda_outside_unit_interval_is_a_recipe_error(tmp_path, models):
    with pytest.raises(RecipeError, match=r"distill.lambda_onpolicy.*\[0, 1\]"):
        make_recipe(tmp_path, models, "bad", "distill.lambda_onpolicy=1.5")
    with pytest.raises(RecipeError, match="distill.divergence"):
        make_recipe(tmp_path, models, "bad", "distill.divergence=kl")
    with pytest.raises(RecipeError, match="draft.path"):
        make_recipe(tmp_path, models, "bad", "draft.path=null")


def test_cli_exits_nonzero_with_one_line(tmp_path, models, capsys):
    from draftsmith.cli import main

    recipe_path = tmp_path / "r.yaml"
    make_recipe(tmp_path, models, "cli")
    (tmp_path / "r.yaml").write_text((tmp_path / "cli.yaml").read_text())
    assert main(["train", str(recipe_path), "distill.lambda_onpolicy=-0.1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "lambda_onpolicy" in err[0]


def test_expected_acceptance_is_measured_at_the_distillation_temperature(tmp_path, models):
    """1 - TVD in the evaluation is that of the two distributions softened by distill.temperature
    (the temperature a distilled draft is sampled at), computed here by hand on the same batch."""
    recipe = make_recipe(tmp_path, models, "hot", "distill.temperature=2.5")
    trainer = TRAINERS["distill"](recipe, argv=["test"]).setup()
    try:
        result = trainer.evaluate()
        batch = trainer.collator(trainer.data.eval)
        draft_logits, target_logits, mask = trainer._logits(batch, trainer.step_module)
        def one_minus_tvd(temperature):
            p, q = torch.softmax(target_logits / temperature, -1), torch.softmax(draft_logits / temperature, -1)
            return 1.0 - float((0.5 * (p - q).abs().sum(-1))[mask].mean())

        assert result["temperature"] == 2.5
        assert abs(result["expected_acceptance"] - one_minus_tvd(2.5)) < 1e-4
        assert abs(one_minus_tvd(2.5) - one_minus_tvd(1.0)) > 1e-3  # the temperature matters here
    finally:
        trainer.close()
