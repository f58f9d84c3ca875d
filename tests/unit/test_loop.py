"""Training-loop machinery: the learning-rate schedule, checkpoint discovery, the loop's cadence."""

import json
import math
from pathlib import Path

import pytest

from draftsmith.atomic import sha256_file
from draftsmith.recipe import TrainConfig
from draftsmith.runs import RunFolderError, STATE_FILE, checkpoint_problem, checkpoint_root, list_checkpoints
from draftsmith.trainers import loop
from draftsmith.trainers.checkpoint import clear_partial_checkpoints, find_resume_checkpoint
from draftsmith.trainers.engine import TrainingError, apply_optimizer_settings, build_optimizer, build_scheduler, lr_factor, stepping_optimizer


def test_lr_schedule_warmup_then_cosine_to_floor():
    cfg = TrainConfig(max_steps=110, warmup_steps=10, lr_schedule="cosine", min_lr_ratio=0.1)
    assert lr_factor(0, cfg) == pytest.approx(0.1)
    assert lr_factor(9, cfg) == pytest.approx(1.0)
    assert lr_factor(10, cfg) == pytest.approx(1.0)
    assert lr_factor(60, cfg) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_factor(110, cfg) == pytest.approx(0.1)
    lin = TrainConfig(max_steps=10, warmup_steps=0, lr_schedule="linear", min_lr_ratio=0.0)
    assert lr_factor(5, lin) == pytest.approx(0.5)
    assert lr_factor(3, TrainConfig(lr_schedule="constant")) == 1.0


def test_checkpoint_discovery_skips_partial_and_corrupt(tmp_path, capsys):
    root = checkpoint_root(tmp_path)
    for step in (5, 10):
        (root / f"step-{step:06d}").mkdir(parents=True)
        (root / f"step-{step:06d}" / STATE_FILE).write_text(json.dumps({"step": step}))
    (root / "step-000015").mkdir()  # crashed before trainer_state.json: incomplete
    (root / "step-000020").mkdir()
    (root / "step-000020" / STATE_FILE).write_text("{truncated")  # corrupt
    (root / ".tmp-step-000025").mkdir()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000005", "step-000010"]
    assert find_resume_checkpoint(tmp_path, "auto").name == "step-000010"
    assert "skipping incomplete or corrupt checkpoint" in capsys.readouterr().out
    clear_partial_checkpoints(tmp_path)
    assert not (root / ".tmp-step-000025").exists()
    with pytest.raises(RunFolderError, match="already holds checkpoints"):
        find_resume_checkpoint(tmp_path, "never")
    with pytest.raises(RunFolderError, match="not a complete checkpoint"):
        find_resume_checkpoint(tmp_path, str(root / "step-000015"))
    assert find_resume_checkpoint(tmp_path / "elsewhere", "auto") is None


def test_simulated_accept_length():
    from draftsmith.trainers.heads import simulated_accept_length

    assert simulated_accept_length([]) == 1.0
    assert simulated_accept_length([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)
    assert simulated_accept_length([1.0, 1.0, 1.0]) == 4.0
    assert math.isclose(simulated_accept_length([0.0, 0.9]), 1.0)


def test_contents_check_catches_damage_that_keeps_the_size(tmp_path):
    ckpt = checkpoint_root(tmp_path) / "step-000003"
    ckpt.mkdir(parents=True)
    (ckpt / "model.safetensors").write_bytes(b"0123456789")
    state = {"step": 3, "files": {"model.safetensors": 10}, "sha256": {"model.safetensors": sha256_file(ckpt / "model.safetensors")}}
    (ckpt / STATE_FILE).write_text(json.dumps(state))
    assert checkpoint_problem(ckpt, verify_contents=True) is None
    (ckpt / "model.safetensors").write_bytes(b"0123456780")
    assert checkpoint_problem(ckpt) is None  # the cheap check sees only sizes
    assert "sha256" in checkpoint_problem(ckpt, verify_contents=True)
    assert find_resume_checkpoint(tmp_path, "auto") is None
    with pytest.raises(RunFolderError, match="sha256"):
        find_resume_checkpoint(tmp_path, str(ckpt))


def test_metrics_truncation_survives_a_line_cut_short(tmp_path):
    log = loop.MetricsLog(tmp_path)
    for step in (1, 2, 3):
        log.write(step, "train", {"loss": float(step)})
    with open(log.path, "a") as fh:
        fh.write('{"step": 4, "kind": "tr')  # the crash hit mid-write
    log.truncate_after(2)
    assert [json.loads(line)["step"] for line in log.path.read_text().splitlines()] == [1, 2]
    log.close()


def test_cadence_counts_crossings_of_multiples():
    """A trainer that advances several units at once (one request per rank) keeps every cadence."""
    assert loop.crossed(3, 4, 4) and loop.crossed(3, 5, 4) and loop.crossed(7, 9, 2)
    assert not loop.crossed(4, 5, 4) and not loop.crossed(0, 3, 4)
    assert [s for s in range(1, 13) if loop.crossed(s - 1, s, 5)] == [5, 10]


class _Counter:
    """A trainer stand-in for run_loop: advances two units a call, loss 1/position."""

    def __init__(self, nan_at=None):
        import types

        self.accelerator = types.SimpleNamespace(num_processes=1, is_main_process=True)
        self.metrics = loop.MetricsLog("unused", enabled=False)
        self.position, self.saves, self.evals, self.last_checkpoint, self.nan_at = 0, [], [], None, nan_at
        self.logged = []
        self.metrics.write = lambda step, kind, values: self.logged.append((step, kind))

    def advance(self):
        self.position += 2
        return self.position, {"loss": float("nan") if self.position == self.nan_at else 1.0 / self.position}

    def evaluate(self):
        self.evals.append(self.position)
        return {"at": self.position}

    def describe(self, position, result):
        return f"eval at {position}"

    def save(self):
        self.saves.append(self.position)
        self.last_checkpoint = f"ckpt-{self.position}"


def test_run_loop_logs_evaluates_and_saves_on_schedule():
    trainer = _Counter()
    result, _ = loop.run_loop(trainer, loop.Schedule(10, "step", log_every=4, save_every=6, eval_every=5), 0, "test")
    assert trainer.logged[0] == (2, "train")  # the first advance is always logged
    assert [s for s, kind in trainer.logged if kind == "train"] == [2, 4, 8]
    assert trainer.evals == [6, 10] and result == {"at": 10}
    assert trainer.saves == [6, 10]


def test_run_loop_stops_on_a_nan_loss_naming_the_position_and_the_last_checkpoint():
    trainer = _Counter(nan_at=8)
    with pytest.raises(TrainingError, match="loss became nan at step 8; the last good checkpoint is ckpt-6"):
        loop.run_loop(trainer, loop.Schedule(10, "step", log_every=1, save_every=3), 0, "test")


def test_tensorboard_opens_at_the_first_record(tmp_path, monkeypatch):
    """A run that stops before logging anything (bad input found on resume) leaves no events file."""
    import sys
    import types

    opened = []

    class Writer:
        def __init__(self, folder):
            opened.append(folder)
            Path(folder).mkdir(parents=True)
            (Path(folder) / "events").write_text("")

        def add_scalar(self, *args):
            pass

        def close(self):
            pass

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=Writer))
    log = loop.MetricsLog(tmp_path / "run")
    log.close()
    assert opened == [] and not (tmp_path / "run" / "tensorboard").exists()
    log = loop.MetricsLog(tmp_path / "run")
    log.write(1, "train", {"loss": 1.0})
    log.write(2, "train", {"loss": 0.5})
    assert opened == [str(tmp_path / "run" / "tensorboard")] and (tmp_path / "run" / "tensorboard" / "events").is_file()


def test_a_resumed_schedule_drives_the_optimizer_that_steps():
    """DeepSpeed's optimizer offload, in torch alone: accelerate builds the optimizer that steps
    (DeepSpeedCPUAdam) from ours, and a checkpoint load gives it new parameter groups. Found
    through the wrappers (accelerate's, then ZeRO's), it takes the schedule and the recipe's new
    learning rate; left on ours, it would keep the checkpoint's (the mutant below)."""
    from types import SimpleNamespace

    import torch

    train = TrainConfig(lr=0.1, warmup_steps=0, lr_schedule="linear", max_steps=10, min_lr_ratio=0.0)
    ours = build_optimizer([torch.nn.Parameter(torch.zeros(2))], train)
    scheduler = build_scheduler(ours, train)
    stepping = torch.optim.Adam(ours.param_groups)
    stepping.load_state_dict(stepping.state_dict())  # the checkpoint's groups: new dicts
    assert stepping.param_groups[0] is not ours.param_groups[0]
    zero = SimpleNamespace(optimizer=stepping, param_groups=stepping.param_groups)
    wrapped = SimpleNamespace(optimizer=zero, param_groups=stepping.param_groups)
    assert stepping_optimizer(wrapped) is stepping and stepping_optimizer(ours) is ours
    scheduler.optimizer = stepping_optimizer(wrapped)
    changed = apply_optimizer_settings(scheduler, TrainConfig(lr=0.5, warmup_steps=0, lr_schedule="linear", max_steps=10, min_lr_ratio=0.0))
    assert changed == ["train.lr 0.1 -> 0.5"] and stepping.param_groups[0]["lr"] == pytest.approx(0.5)
    scheduler.step()
    assert stepping.param_groups[0]["lr"] == pytest.approx(0.5 * 0.9)
    # Left on ours, the one that steps never hears of either.
    stale = torch.optim.Adam(ours.param_groups)
    stale.load_state_dict(stale.state_dict())
    build_scheduler(ours, train).step()
    assert stale.param_groups[0]["lr"] == pytest.approx(0.1)
