"""Online speculative decoding on tiny random models: acceptance over the stream rises as the drafter
learns from what the target verified; the target stays frozen; an empty buffer warns, never crashes;
the simulation script plots the curve."""

import json
from pathlib import Path

import pytest
import torch

from draftsmith.recipe import load_recipe
from draftsmith.testing import load_script, save_tiny_model
from draftsmith.trainers import TRAINERS
from draftsmith.trainers.online import EmptyReplayWarning, serve_records


def write_prompts(path: Path, words: list[str], n: int) -> Path:
    with open(path, "w") as fh:
        for i in range(n):
            fh.write(json.dumps({"prompt": f"{words[i % len(words)]} {words[(3 * i + 1) % len(words)]}"}) + "\n")
    return path


@pytest.fixture(scope="module")
def setup_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("online")
    target = save_tiny_model(root / "target", "llama", seed=0)
    # The draft starts unrelated to the target: it mismatches every query distribution at first.
    draft = save_tiny_model(root / "draft", "llama", seed=5, hidden_size=32, num_layers=1)
    chat = write_prompts(root / "chat.jsonl", ["hello", "how", "are", "you", "today", "friend"], 12)
    code = write_prompts(root / "code.jsonl", ["def", "f(x):", "return", "x+1", "print", "import"], 12)
    return root, target, draft, chat, code


def online_recipe(setup_dir, name: str, *overrides: str):
    root, target, draft, chat, code = setup_dir
    text = f"""
trainer: online
output_dir: {root / name}
target: {{path: {target}}}
draft: {{path: {draft}}}
data: {{path: {chat}, max_length: 96}}
distill: {{divergence: fkl}}
online: {{shift_to: [{code}], requests_per_source: 12, update_every: 3, steps_per_update: 8, buffer_size: 12,
          max_new_tokens: 20, draft_length: 4, window: 3}}
train: {{micro_batch_size: 4, lr: 0.01, lr_schedule: constant, save_every: 100}}
"""
    (root / f"{name}.yaml").write_text(text)
    return load_recipe(root / f"{name}.yaml", overrides=list(overrides))


def test_acceptance_rises_over_the_stream(setup_dir):
    recipe = online_recipe(setup_dir, "run")
    trainer = TRAINERS["online"](recipe, argv=["test"]).setup()
    before = {k: v.clone() for k, v in trainer.target.model.state_dict().items()}
    try:
        summary = trainer.train()
    finally:
        trainer.close()
    records = serve_records(recipe.output_dir)
    assert len(records) == 24 and summary["served"] == 24
    rate = lambda rs: sum(r["accepted"] for r in rs) / max(1, sum(r["judged"] for r in rs))  # noqa: E731
    # Before any update the random draft is (almost) never accepted; a few updates later it is often.
    first, last = rate(records[:3]), rate(records[9:12])
    assert last > first + 0.2, [round(r["acceptance_rate"], 2) for r in records]
    assert rate(records[12:]) > first + 0.2
    after = trainer.target.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    updates = [json.loads(l) for l in (Path(recipe.output_dir) / "metrics.jsonl").read_text().splitlines() if '"update"' in l]
    assert len(updates) == 7  # after requests 3, 6, ..., 21

    # The online run exports like a distilled one and runs in the runtime.
    from draftsmith.export import export

    out = export(recipe.output_dir, Path(recipe.output_dir) / "export")
    assert (out / "config.json").is_file() and (out / "README.md").is_file()
    # An export exports again (its recipe.yaml is what the card is written from), card and all.
    again = export(out, Path(recipe.output_dir) / "again")
    assert (again / "README.md").read_text() == (out / "README.md").read_text()


def test_update_with_empty_buffer_warns_and_goes_on(setup_dir):
    recipe = online_recipe(setup_dir, "empty")
    trainer = TRAINERS["online"](recipe, argv=["test"]).setup()
    try:
        with pytest.warns(EmptyReplayWarning, match="no rejected positions"):
            assert trainer.update() is None
        # Verified tokens, but no rejection: nothing for OSD's update to train on.
        trainer.buffer.add({"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1], "rejected_mask": [0, 0, 0]})
        with pytest.warns(EmptyReplayWarning):
            assert trainer.update() is None
        assert trainer.step == 0
    finally:
        trainer.close()


def test_simulate_online_script_plots(setup_dir, tmp_path, monkeypatch):
    root, target, draft, chat, code = setup_dir
    simulate_online = load_script("scripts/simulate_online.py")
    out = tmp_path / "sim"
    rc = simulate_online.main([
        "--target", str(target), "--draft", str(draft), "--first", str(chat), "--then", str(code),
        "--requests-per-source", "3", "--update-every", "2", "--steps-per-update", "1", "--max-new-tokens", "6",
        "--out", str(out),
    ])
    assert rc == 0
    assert (out / "acceptance.png").stat().st_size > 1000
    assert len(serve_records(out)) == 6


@pytest.mark.parametrize("train_on, clear", [("rejected", True), ("verified", False)])
def test_update_trains_on_the_chosen_positions_and_clears_the_buffer(setup_dir, monkeypatch, train_on, clear):
    """The positions an update's loss averages over are exactly the records' rejected (OSD, the
    default) or verified positions, shifted onto the logits that predict them; OSD then empties
    the buffer, the FIFO variant keeps it."""
    from draftsmith.data.replay import verified_record
    from draftsmith.trainers import online as online_module
    from draftsmith.trainers.distill import predicted_mask

    overrides = [] if train_on == "rejected" else [f"online.train_on={train_on}", f"online.clear_buffer={clear}"]
    recipe = online_recipe(setup_dir, f"positions-{train_on}", "online.steps_per_update=2", *overrides)
    assert (recipe.online.train_on, recipe.online.clear_buffer) == (train_on, clear)
    trainer = TRAINERS["online"](recipe, argv=["test"]).setup()
    seen = []
    real = online_module.distill_objective

    def spy(recipe_, draft_logits, target_logits, mask):
        seen.append(mask.clone())
        return real(recipe_, draft_logits, target_logits, mask)

    monkeypatch.setattr(online_module, "distill_objective", spy)
    try:
        record = verified_record([5, 6, 7], [10, 11, 12, 20, 21, 22, 23], accept_lens=[2, 3], draft_depths=[3, 3])
        trainer.buffer.add(record)
        values = trainer.update()
        assert values is not None and values["buffer"] == 1 and len(seen) == 2
        wanted = predicted_mask(torch.tensor([record["rejected_mask" if train_on == "rejected" else "loss_mask"]]))
        for mask in seen:  # every micro-batch row is this one record
            assert mask.shape[1] == wanted.shape[1] and all(torch.equal(row, wanted[0]) for row in mask.cpu())
        assert len(trainer.buffer) == (0 if clear else 1)
    finally:
        trainer.close()


def test_clearing_buffer_must_hold_the_requests_between_updates(setup_dir):
    from draftsmith.recipe import RecipeError

    with pytest.raises(RecipeError, match="online.buffer_size'=2 must hold the online.update_every=3"):
        online_recipe(setup_dir, "small", "online.buffer_size=2")
    assert online_recipe(setup_dir, "small-fifo", "online.buffer_size=2", "online.clear_buffer=false").online.buffer_size == 2
