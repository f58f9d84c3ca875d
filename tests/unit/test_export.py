"""Export: an HF folder with the head's weights only, a model card, and a push to a (local) Hub."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.artifacts import ArtifactError, open_drafter
from draftsmith.export import export
from draftsmith.heads import MedusaConfig, MedusaHead
from draftsmith.target import FrozenTarget
from draftsmith.testing import tiny_causal_lm

REPO = Path(__file__).resolve().parents[2]


def fake_checkpoint(tmp_path: Path, lm_head: str = "own"):
    """A checkpoint folder as the head trainer writes it (accelerate's model.safetensors + state)."""
    from safetensors.torch import save_file

    target = FrozenTarget(tiny_causal_lm("llama", vocab_size=40, hidden_size=32))
    head = MedusaHead(MedusaConfig(num_heads=2, lm_head=lm_head), target.dims)
    head.init_from_target(target)
    for p in head.parameters():
        p.data.add_(torch.randn_like(p) * 0.1)
    ckpt = tmp_path / "run" / "checkpoints" / "step-000010"
    ckpt.mkdir(parents=True)
    save_file({f"head.{k}": v.contiguous() for k, v in head.state_dict().items()}, str(ckpt / "model.safetensors"))
    state = {
        "step": 10,
        "trainer": "heads",
        "drafter": {"kind": "medusa"},
        "head": {"kind": "medusa", "num_heads": 2, "num_layers": 1, "lm_head": lm_head, "loss_decay": 0.8},
        "target": {"path": "org/tiny", "hidden_size": 32, "vocab_size": 40, "num_layers": 3, "model_type": "llama"},
        "last_eval": {"top1": [0.5, 0.25], "top5": [0.75, 0.5], "simulated_accept_length": 1.625},
    }
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    (ckpt / "recipe.yaml").write_text("trainer: heads\n")
    return target, head, tmp_path / "run"


def test_export_round_trip_and_model_card(tmp_path):
    target, head, run = fake_checkpoint(tmp_path)
    out = export(run, tmp_path / "export")
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "draftsmith-manifest.json", "metrics.json", "model.safetensors", "recipe.yaml"]
    config = json.loads((out / "config.json").read_text())["draftsmith"]
    assert config["drafter"] == "heads" and config["head"]["kind"] == "medusa" and config["target"]["path"] == "org/tiny"
    loaded = open_drafter(out)
    for key, value in head.state_dict().items():
        assert torch.equal(loaded.head.state_dict()[key], value), key
    card = (out / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: draftsmith\nbase_model: org/tiny\n")
    assert "| 2 | 0.250 | 0.500 |" in card and "1.625" in card
    # No tensor in the export equals a target tensor of the same shape except the LM heads the
    # recipe asked to train (they started from the target's and have moved away from it).
    weights = load_file(str(out / "model.safetensors"))
    for name, tensor in target.model.state_dict().items():
        for key, value in weights.items():
            assert not (value.shape == tensor.shape and torch.equal(value, tensor)), (key, name)


def test_loading_the_wrong_folder_fails_clearly(tmp_path):
    with pytest.raises(ArtifactError, match="drafter folder not found"):
        open_drafter(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ArtifactError, match="neither a draftsmith checkpoint nor a run folder"):
        open_drafter(tmp_path / "empty")


def test_push_to_local_hub(tmp_path, local_hub):
    _, _, run = fake_checkpoint(tmp_path)
    out = export(run, tmp_path / "export")
    exported = {p.name for p in out.iterdir()}
    (out / "notes.txt").write_text("mine, beside the export: not for the Hub\n")
    with local_hub() as hub:
        env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_TOKEN": "hf_test", "HF_HUB_OFFLINE": "0"}
        proc = subprocess.run(
            [sys.executable, "-m", "draftsmith.cli", "push", str(out), "--repo-id", "me/tiny-medusa"],
            env=env, capture_output=True, text=True, cwd=REPO,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        files = hub.state.repos["me/tiny-medusa"]
        assert set(files) == exported  # what was exported and verified, the user's file left behind, said
        assert "1 file(s)" in proc.stderr and "notes.txt" in proc.stderr and "stay behind" in proc.stderr
        assert files["model.safetensors"] == (out / "model.safetensors").read_bytes()
        assert files["README.md"].decode().startswith("---\nlibrary_name: draftsmith")


@pytest.mark.parametrize("recipe,said", [
    ("trainer: heads\ntrain:\n  max_steps: 200\n", "at step 10 of train.max_steps=200: its run stopped before the end"),
    ("trainer: heads\ntrain:\n  max_steps: 10\n", "(step 10)"),
    ("trainer: heads\n", "(step 10)"),
])  # fmt: skip
def test_export_names_its_checkpoint_and_a_run_that_stopped_early(tmp_path, capsys, recipe, said):
    """A run stopped by Ctrl-C exports as it is; the user is told it is not the run's end."""
    _, _, run = fake_checkpoint(tmp_path)
    (run / "checkpoints" / "step-000010" / "recipe.yaml").write_text(recipe)
    out = export(run, tmp_path / "export")
    printed = "".join(capsys.readouterr())
    assert "step-000010" in printed and said in printed, printed
    assert ("stopped before the end" in printed) == ("200" in recipe)
    # The card says it too, and keeps saying it when the export is exported again.
    card = (out / "README.md").read_text()
    assert "## Training\n\nExported from checkpoint `step-000010`" in card
    assert ("step 10 of the recipe's 200: its training stopped before the end" in card) == ("200" in recipe)
    assert card == (export(out, tmp_path / "again") / "README.md").read_text()


def test_an_earlier_checkpoint_of_a_run_that_went_on_is_not_called_stopped(tmp_path, capsys):
    import shutil

    _, _, run = fake_checkpoint(tmp_path)
    first = run / "checkpoints" / "step-000010"
    (first / "recipe.yaml").write_text("trainer: heads\ntrain:\n  max_steps: 200\n")
    later = run / "checkpoints" / "step-000020"
    shutil.copytree(first, later)
    state = json.loads((later / "trainer_state.json").read_text())
    (later / "trainer_state.json").write_text(json.dumps({**state, "step": 20}))
    out = export(first, tmp_path / "export")
    printed = "".join(capsys.readouterr())
    assert "its run has a later checkpoint, at step 20" in printed and "stopped before the end" not in printed
    assert "step 10 of the recipe's 200 (not its run's last)" in (out / "README.md").read_text()


def test_a_checkpoint_of_a_run_still_training_is_not_called_stopped(tmp_path, capsys):
    """The run's folder is held (a `train` at work there): the export says the run goes on,
    naming the process, and once it lets go the same export says the run stopped."""
    from draftsmith.runs import hold_folder, holder_of

    _, _, run = fake_checkpoint(tmp_path)
    (run / "checkpoints" / "step-000010" / "recipe.yaml").write_text("trainer: heads\ntrain:\n  max_steps: 200\n")
    assert holder_of(run) is None
    with hold_folder(run):
        assert holder_of(run)["pid"] == os.getpid()
        out = export(run, tmp_path / "export")
        printed = "".join(capsys.readouterr())
    assert f"its run is still training (pid {os.getpid()})" in printed and "stopped before the end" not in printed, printed
    assert "step 10 of the recipe's 200, while its training went on" in (out / "README.md").read_text()
    assert holder_of(run) is None
    export(run, tmp_path / "later")
    assert "its run stopped before the end" in "".join(capsys.readouterr())
