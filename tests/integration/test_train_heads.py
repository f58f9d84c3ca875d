"""The head trainer on a tiny random model: loss goes down, the target stays frozen, checkpoints are
atomic and hold only head weights, and an interrupted run resumes to the uninterrupted run's losses."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.runs import STATE_FILE, RunFolderError, checkpoint_root, list_checkpoints, read_state
from draftsmith.testing import heads_recipe, logged, run_trainer
from draftsmith.trainers import TRAINERS


def test_loss_decreases_target_frozen_checkpoint_clean(tmp_path, tiny_llama_dir):
    recipe = heads_recipe(tmp_path, tiny_llama_dir, "golden")
    trainer, summary, target_before = run_trainer(recipe)
    curve = logged(Path(recipe.output_dir))
    first, last = sum(curve[s] for s in (1, 2, 3)) / 3, sum(curve[s] for s in (28, 29, 30)) / 3
    assert last < 0.8 * first, curve

    # The frozen target did not move, and only the head's parameters were ever in the optimizer.
    for key, value in trainer.target.model.state_dict().items():
        assert torch.equal(value, target_before[key]), key
    assert {id(p) for p in trainer.optimized} == {id(p) for p in trainer.head.parameters()}

    # Checkpoints: only complete step-N folders, the newest keep_last of them, no target tensors.
    ckpts = list_checkpoints(recipe.output_dir)
    assert [c.name for c in ckpts] == ["step-000020", "step-000030"]
    assert not list(checkpoint_root(recipe.output_dir).glob(".tmp-*"))
    weights = load_file(str(ckpts[-1] / "model.safetensors"))
    assert weights and all(k.startswith("head.") for k in weights)
    head_params = {f"head.{k}" for k in trainer.head.state_dict()}
    assert set(weights) == head_params
    target_names = set(trainer.target.model.state_dict())
    assert not any(k.removeprefix("head.") in target_names for k in weights)
    state = read_state(ckpts[-1])
    assert state["step"] == 30 and "data" in state
    assert state["trainer"] == "heads" and state["drafter"] == {"kind": "medusa"}
    assert (ckpts[-1] / "recipe.yaml").is_file() and (ckpts[-1] / "command.txt").is_file()
    assert (Path(recipe.output_dir) / "recipe.yaml").is_file()

    # Evaluation reports per-head accuracy and the simulated chain length from it.
    assert len(summary["top1"]) == 2 and len(summary["top5"]) == 2
    expected = 1 + summary["top1"][0] + summary["top1"][0] * summary["top1"][1]
    assert summary["simulated_accept_length"] == pytest.approx(expected)
    assert all(t5 >= t1 for t1, t5 in zip(summary["top1"], summary["top5"]))


def test_sigterm_then_resume_reproduces_uninterrupted_losses(tmp_path, tiny_llama_dir):
    full = heads_recipe(tmp_path, tiny_llama_dir, "full", "train.max_steps=12", "train.save_every=100")
    run_trainer(full)
    reference = logged(Path(full.output_dir))

    broken = heads_recipe(tmp_path, tiny_llama_dir, "broken", "train.max_steps=12", "train.save_every=100")
    trainer, summary, _ = run_trainer(broken, interrupt_at=5)
    assert summary["step"] == 5
    assert [c.name for c in list_checkpoints(broken.output_dir)] == ["step-000005"]
    # The checkpoint records the seconds trained so far; the resumed run counts on from them (made
    # large here, so that the resumed run's own seconds cannot pass for the sum).
    state_file = list_checkpoints(broken.output_dir)[0] / STATE_FILE
    state = json.loads(state_file.read_text())
    assert 0 < state["train_seconds"] <= summary["seconds"] + 0.1
    state_file.write_text(json.dumps({**state, "train_seconds": 1000.0}))

    # A crash while writing the next checkpoint leaves a temporary folder; it must not be picked up.
    (checkpoint_root(broken.output_dir) / ".tmp-step-000008").mkdir()
    (checkpoint_root(broken.output_dir) / "step-000009").mkdir()  # no trainer_state.json: corrupt
    _, summary, _ = run_trainer(broken)
    assert 1000 < summary["seconds"] < 1000 + 600
    assert json.loads((list_checkpoints(broken.output_dir)[-1] / STATE_FILE).read_text())["train_seconds"] > 1000
    assert json.loads((Path(broken.output_dir) / "final_metrics.json").read_text())["seconds"] == summary["seconds"]
    resumed = logged(Path(broken.output_dir))
    assert sorted(resumed) == sorted(reference) == list(range(1, 13))
    for step in reference:
        assert resumed[step] == pytest.approx(reference[step], rel=1e-5, abs=1e-6), step


def test_a_signal_at_the_last_step_leaves_a_finished_run(tmp_path, tiny_llama_dir, capsys):
    """SIGTERM as the last step ends (its evaluation and save still run): the run is complete, not
    stopped, so the command line exits 0 and `train && export` exports it."""
    recipe = heads_recipe(tmp_path, tiny_llama_dir, "last", "train.max_steps=4", "train.save_every=100", "train.eval_every=100")
    trainer, summary, _ = run_trainer(recipe, interrupt_at=4)
    assert summary["step"] == 4 and getattr(trainer, "stopped_by", None) is None
    assert [c.name for c in list_checkpoints(recipe.output_dir)] == ["step-000004"]
    assert "SIGTERM arrived as the last step ended: the run is complete" in capsys.readouterr().out


def test_a_resume_follows_a_changed_learning_rate_and_says_so(tmp_path, tiny_llama_dir, capsys):
    """The checkpoint brings back its optimizer's settings; train.lr and weight_decay changed in the
    recipe since hold from the resumed step on (the schedule's factor kept), and the run says so."""
    first = heads_recipe(tmp_path, tiny_llama_dir, "lr", "train.max_steps=4", "train.lr_schedule=linear", "train.min_lr_ratio=0.5")
    run_trainer(first)
    before = logged(Path(first.output_dir), key="lr")
    capsys.readouterr()
    again = heads_recipe(tmp_path, tiny_llama_dir, "lr", "train.max_steps=6", "train.lr_schedule=linear", "train.min_lr_ratio=0.5", "train.lr=0.5",
                         "train.weight_decay=0.3")  # fmt: skip
    trainer, _, _ = run_trainer(again)
    lrs = logged(Path(again.output_dir), key="lr")
    assert all(lrs[step] == before[step] for step in range(1, 5))
    # Linear from 1 to 0.5 over the 4 steps after 2 of warm-up: factors 0.625 and 0.5 after steps 5 and 6.
    assert lrs[5] == pytest.approx(0.5 * 0.625) and lrs[6] == pytest.approx(0.5 * 0.5)
    assert trainer.scheduler.optimizer.param_groups[0]["weight_decay"] == 0.3
    out = capsys.readouterr().out
    assert "train.lr 0.01 -> 0.5" in out and "train.weight_decay 0.0 -> 0.3" in out, out


def test_prepare_then_train_with_the_default_data_cache(tmp_path, tiny_llama_dir):
    """`prepare` writes <output_dir>/data (data.cache_dir unset): the run folder then holds only
    that data cache, as after a first run stopped in its data step, and `train` goes on there
    instead of calling the folder someone else's."""
    from draftsmith.cli import main

    recipe = heads_recipe(tmp_path, tiny_llama_dir, "fresh")
    assert main(["prepare", str(tmp_path / "fresh.yaml")]) == 0
    assert sorted(p.name for p in Path(recipe.output_dir).iterdir()) == ["data"]
    assert main(["train", str(tmp_path / "fresh.yaml"), "train.max_steps=2"]) == 0
    assert [c.name for c in list_checkpoints(recipe.output_dir)] == ["step-000002"]


def test_resume_never_refuses_to_overwrite(tmp_path, tiny_llama_dir):
    recipe = heads_recipe(tmp_path, tiny_llama_dir, "once", "train.max_steps=2", "train.save_every=1")
    run_trainer(recipe)
    again = heads_recipe(tmp_path, tiny_llama_dir, "once", "train.max_steps=2", "train.resume=never")
    with pytest.raises(RunFolderError, match="already holds checkpoints"):
        TRAINERS["heads"](again).setup()


def test_damaged_checkpoint_is_skipped_and_explicit_resume_works(tmp_path, tiny_llama_dir, capsys):
    first = heads_recipe(tmp_path, tiny_llama_dir, "first", "train.max_steps=4", "train.save_every=2")
    run_trainer(first)
    reference = logged(Path(first.output_dir))
    step2, step4 = list_checkpoints(first.output_dir)

    # Continue from an explicit checkpoint of another run, into a fresh output_dir.
    fork = heads_recipe(tmp_path, tiny_llama_dir, "fork", "train.max_steps=4", f"train.resume={step2}")
    _, summary, _ = run_trainer(fork)
    forked = logged(Path(fork.output_dir))
    assert sorted(forked) == [3, 4] and summary["step"] == 4
    for step in (3, 4):
        assert forked[step] == pytest.approx(reference[step], rel=1e-5, abs=1e-6)

    # Damage the newest checkpoint in place (same size): resuming warns and takes the one before it.
    weights = step4 / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    capsys.readouterr()
    again = heads_recipe(tmp_path, tiny_llama_dir, "first", "train.max_steps=4", "train.save_every=2")
    trainer = TRAINERS["heads"](again, argv=["test"]).setup()
    try:
        assert trainer.resume_from == step2 and trainer.step == 2
    finally:
        trainer.close()
    out = capsys.readouterr().out
    assert f"skipping corrupt checkpoint {step4}" in out and "sha256" in out


@pytest.mark.parametrize("figure", ["damaged", "absent"])
def test_a_damaged_or_absent_seconds_figure_does_not_stop_a_resume(tmp_path, tiny_llama_dir, capsys, figure):
    """train_seconds is a report figure: a checkpoint whose figure is not a number of seconds, or
    that has none (written before checkpoints kept it), resumes all the same, says so in one line
    naming the file, and counts from the checkpoint."""
    recipe = heads_recipe(tmp_path, tiny_llama_dir, "run", "train.max_steps=4", "train.save_every=2")
    run_trainer(recipe)
    step2, step4 = list_checkpoints(recipe.output_dir)
    state = json.loads((step2 / STATE_FILE).read_text())
    if figure == "damaged":
        state["train_seconds"] = None
    else:
        del state["train_seconds"]
    (step2 / STATE_FILE).write_text(json.dumps(state))
    shutil.rmtree(step4)
    capsys.readouterr()
    _, summary, _ = run_trainer(heads_recipe(tmp_path, tiny_llama_dir, "run", "train.max_steps=4", "train.save_every=2"))
    out = capsys.readouterr().out
    assert summary["step"] == 4 and 0 <= summary["seconds"] < 600
    if figure == "damaged":
        assert f"{step2 / STATE_FILE} has train_seconds None, not a number of seconds" in out
    else:
        assert f"{step2 / STATE_FILE} records no train_seconds (written before checkpoints kept them)" in out


def test_a_run_that_fails_to_set_up_keeps_what_was_there(tmp_path, tiny_llama_dir):
    from draftsmith.data import DataError

    recipe = heads_recipe(tmp_path, tiny_llama_dir, "keep", "train.max_steps=1")
    run_trainer(recipe)
    out = Path(recipe.output_dir)
    before = {name: (out / name).read_bytes() for name in ("recipe.yaml", "command.txt", "metrics.jsonl")}
    broken = heads_recipe(tmp_path, tiny_llama_dir, "keep", "train.max_steps=2", f"data.path={tmp_path / 'missing.jsonl'}")
    trainer = TRAINERS["heads"](broken, argv=["other", "command"])
    with pytest.raises(DataError, match="missing.jsonl"):
        try:
            trainer.setup()
        finally:
            trainer.close()
    assert {name: (out / name).read_bytes() for name in before} == before


def test_quickstart_settings_bf16_target_and_its_frozen_lm_head(tmp_path, tiny_llama_dir):
    """The quickstart's choices on a tiny model: a bf16 target whose frozen LM head the heads share,
    bf16 autocast for the heads, features from the hybrid cache after the first epoch."""
    recipe = heads_recipe(
        tmp_path, tiny_llama_dir, "bf16", "target.dtype=bfloat16", "head.lm_head=target", "train.mixed_precision=bf16",
        "data.features.mode=hybrid", "train.lr=0.03",
    )
    trainer, summary, target_before = run_trainer(recipe)
    assert trainer.target.dtype == torch.bfloat16
    curve = logged(Path(recipe.output_dir))
    first, last = sum(curve[s] for s in (1, 2, 3)) / 3, sum(curve[s] for s in (28, 29, 30)) / 3
    assert last < 0.8 * first, curve
    for key, value in trainer.target.model.state_dict().items():
        assert torch.equal(value, target_before[key]), key
    weights = load_file(str(list_checkpoints(recipe.output_dir)[-1] / "model.safetensors"))
    assert not any("lm_head" in k for k in weights)  # the shared LM head stays the target's
    assert summary["top1"][0] > 0.2


@pytest.mark.parametrize(
    "head",
    [
        "{kind: dflash, block_size: 4, num_layers: 1, aux_layer_ids: [1, 2, 3], draft_vocab_size: 64}",
        # The references' choices: the middle target layer, the target's LM head, whole blocks, the
        # target's argmax as labels (read from the cached final hidden state).
        "{kind: dflash, block_size: 4, num_layers: 1, aux_layer_rule: per_draft_layer, anchors: full_block, labels: target_argmax}",
    ],
    ids=["ours", "references"],
)
def test_dflash_golden_run_from_the_feature_cache_on_packed_rows(tmp_path, tiny_llama_dir, head):
    """A DFlash head trains from the feature cache on packed rows: loss goes down, the mask token is
    chosen from the data and recorded, the slots' held-out accuracy is reported per depth, and the
    checkpoint decodes exactly the target's greedy output (the data's answers are not the random
    target's, so acceptance is the interop test's business: tests/interop/test_vllm_dflash.py)."""
    from draftsmith.runtime.generate import speculative_generate
    from draftsmith.runtime.load import load_drafter

    recipe = heads_recipe(tmp_path, tiny_llama_dir, "dflash", "data.packing=true", "data.features.mode=cache", head=head)
    trainer, summary, _ = run_trainer(recipe)
    curve = logged(Path(recipe.output_dir))
    first, last = sum(curve[s] for s in (1, 2, 3)) / 3, sum(curve[s] for s in (28, 29, 30)) / 3
    # With the target's frozen LM head only one layer and fc learn: the loss falls less in 30 steps.
    assert last < (0.95 if "per_draft_layer" in head else 0.8) * first, curve
    state = read_state(list_checkpoints(recipe.output_dir)[-1])
    mask = state["head"]["mask_token_id"]
    assert mask >= 0 and state["drafter"] == {"kind": "dflash"}
    if "per_draft_layer" in head:
        assert state["head"]["aux_layer_ids"] == [trainer.head.dims.num_layers // 2 + 1]  # the middle layer's output
    assert not any(mask in e["input_ids"] for e in trainer.data.train + trainer.data.eval)
    assert len(summary["top1"]) == 3
    # Held-out top-1 scores against the data's tokens, which are not this random target's argmax.
    assert summary["top1"][0] > 0 or "target_argmax" in head
    loaded = load_drafter(recipe.output_dir, tree="1,1,1", dtype="float32", device="cpu")
    tok = loaded.target.tokenizer
    for question in ("say red cat sun moon", "say dog tree blue green"):
        text = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False)
        ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
        want = loaded.target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24, pad_token_id=0, eos_token_id=None)
        out, _ = speculative_generate(loaded.target, loaded.drafter, ids, 24)
        assert out.tolist() == want.tolist()


def test_lookup_hit_weighting_reaches_the_eagle3_loss(tmp_path, tiny_llama_dir):
    """head.lookup_hit_weight: the trainer weights the tokens a suffix matcher would have drafted,
    so the first step's loss (same weights, same batch) differs from the unweighted run's."""
    head = "{kind: eagle3, depth: 2, train_depth: 2, draft_vocab_size: 64, aux_layer_ids: [1, 2, 3]}"
    losses = {}
    for name, weight in (("plain", 1.0), ("weighted", 0.2)):
        recipe = heads_recipe(tmp_path, tiny_llama_dir, name, "train.max_steps=2", "train.save_every=100", f"head.lookup_hit_weight={weight}", head=head)
        _, summary, _ = run_trainer(recipe)
        assert summary["step"] == 2
        losses[name] = logged(tmp_path / name)[1]
    assert losses["plain"] != losses["weighted"]
