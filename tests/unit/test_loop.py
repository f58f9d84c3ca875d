"""Training-loop machinery: the learning-rate schedule and checkpoint discovery."""

import json
import math

import pytest

from draftsmith.recipe import TrainConfig
from draftsmith.trainers import loop


def test_lr_schedule_warmup_then_cosine_to_floor():
    cfg = TrainConfig(max_steps=110, warmup_steps=10, lr_schedule="cosine", min_lr_ratio=0.1)
    assert loop.lr_factor(0, cfg) == pytest.approx(0.1)
    assert loop.lr_factor(9, cfg) == pytest.approx(1.0)
    assert loop.lr_factor(10, cfg) == pytest.approx(1.0)
    assert loop.lr_factor(60, cfg) == pytest.approx(0.1 + 0.9 * 0.5)
    assert loop.lr_factor(110, cfg) == pytest.approx(0.1)
    lin = TrainConfig(max_steps=10, warmup_steps=0, lr_schedule="linear", min_lr_ratio=0.0)
    assert loop.lr_factor(5, lin) == pytest.approx(0.5)
    assert loop.lr_factor(3, TrainConfig(lr_schedule="constant")) == 1.0


def test_checkpoint_discovery_skips_partial_and_corrupt(tmp_path, capsys):
    root = loop.checkpoint_root(tmp_path)
    for step in (5, 10):
        (root / f"step-{step:06d}").mkdir(parents=True)
        (root / f"step-{step:06d}" / loop.STATE_FILE).write_text(json.dumps({"step": step}))
    (root / "step-000015").mkdir()  # crashed before trainer_state.json: incomplete
    (root / "step-000020").mkdir()
    (root / "step-000020" / loop.STATE_FILE).write_text("{truncated")  # corrupt
    (root / ".tmp-step-000025").mkdir()
    assert [p.name for p in loop.list_checkpoints(tmp_path)] == ["step-000005", "step-000010"]
    assert loop.find_resume_checkpoint(tmp_path, "auto").name == "step-000010"
    assert "skipping incomplete or corrupt checkpoint" in capsys.readouterr().out
    loop.clear_partial_checkpoints(tmp_path)
    assert not (root / ".tmp-step-000025").exists()
    with pytest.raises(loop.TrainingError, match="already holds checkpoints"):
        loop.find_resume_checkpoint(tmp_path, "never")
    with pytest.raises(loop.TrainingError, match="not a complete checkpoint"):
        loop.find_resume_checkpoint(tmp_path, str(root / "step-000015"))
    assert loop.find_resume_checkpoint(tmp_path / "elsewhere", "auto") is None


def test_simulated_accept_length():
    from draftsmith.trainers.heads import simulated_accept_length

    assert simulated_accept_length([]) == 1.0
    assert simulated_accept_length([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)
    assert simulated_accept_length([1.0, 1.0, 1.0]) == 4.0
    assert math.isclose(simulated_accept_length([0.0, 0.9]), 1.0)


def test_contents_check_catches_damage_that_keeps_the_size(tmp_path):
    ckpt = loop.checkpoint_root(tmp_path) / "step-000003"
    ckpt.mkdir(parents=True)
    (ckpt / "model.safetensors").write_bytes(b"0123456789")
    state = {"step": 3, "files": {"model.safetensors": 10}, "sha256": {"model.safetensors": loop.sha256_file(ckpt / "model.safetensors")}}
    (ckpt / loop.STATE_FILE).write_text(json.dumps(state))
    assert loop.checkpoint_problem(ckpt, verify_contents=True) is None
    (ckpt / "model.safetensors").write_bytes(b"0123456780")
    assert loop.checkpoint_problem(ckpt) is None  # the cheap check sees only sizes
    assert "sha256" in loop.checkpoint_problem(ckpt, verify_contents=True)
    assert loop.find_resume_checkpoint(tmp_path, "auto") is None
    with pytest.raises(loop.TrainingError, match="sha256"):
        loop.find_resume_checkpoint(tmp_path, str(ckpt))


def test_metrics_truncation_survives_a_line_cut_short(tmp_path):
    log = loop.MetricsLog(tmp_path)
    for step in (1, 2, 3):
        log.write(step, "train", {"loss": float(step)})
    with open(log.path, "a") as fh:
        fh.write('{"step": 4, "kind": "tr')  # the crash hit mid-write
    log.truncate_after(2)
    assert [json.loads(line)["step"] for line in log.path.read_text().splitlines()] == [1, 2]
    log.close()
