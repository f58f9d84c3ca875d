"""Faults of the head trainer: a real SIGTERM to one torchrun rank stops every rank at the same step
with a checkpoint and exit code 143 (then a single process resumes it); a NaN loss stops the run naming
the step and the last good checkpoint."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from draftsmith import cli
from draftsmith.heads.medusa import MedusaHead
from draftsmith.recipe import load_recipe
from draftsmith.runs import list_checkpoints, read_state
from draftsmith.testing import REPO, launch_env, write_chats
from draftsmith.trainers import TRAINERS, loop


def recipe_file(tmp_path: Path, model_dir: Path, **train) -> Path:
    data = write_chats(tmp_path / "chats.jsonl", n=24, words=3)
    settings = {"micro_batch_size": 2, "global_batch_size": 4, "max_steps": 6, "lr": 0.01, "log_every": 1, "eval_every": 1000, "save_every": 4, **train}
    path = tmp_path / "recipe.yaml"
    path.write_text(
        f"""
trainer: heads
output_dir: {tmp_path / 'run'}
target: {{path: {model_dir}}}
data: {{path: {data}, eval_size: 4, max_length: 64, seed: 1}}
head: {{kind: medusa, num_heads: 2, num_layers: 1}}
train: {json.dumps(settings)}
"""
    )
    return path


def logged_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    steps = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # a line being written
            continue
        if record["kind"] == "train":
            steps.append(record["step"])
    return steps


def children_by_rank(parent: int) -> dict[int, int]:
    """Worker pids of a torchrun agent, by the RANK in their environment (Linux /proc)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid != parent:
                continue
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        for item in environ:
            if item.startswith(b"RANK="):
                found[int(item[5:])] = int(entry.name)
    return found


@pytest.mark.multiproc
def test_sigterm_to_one_rank_checkpoints_every_rank_and_exits_143(tmp_path, tiny_llama_dir):
    path = recipe_file(tmp_path, tiny_llama_dir, max_steps=100000, save_every=100000, lr_schedule="constant")
    env = launch_env()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "draftsmith.cli", "train", str(path)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run = tmp_path / "run"
    try:
        deadline = time.time() + 240
        while len(logged_steps(run)) < 3:
            assert proc.poll() is None, proc.communicate()
            assert time.time() < deadline, "training did not start"
            time.sleep(0.2)
        ranks = children_by_rank(proc.pid)
        assert sorted(ranks) == [0, 1], ranks
        os.kill(ranks[1], signal.SIGTERM)  # one rank only, as a scheduler preempting one node would
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    # A stopped run is not a finished one: every rank exits 143 after saving, which torchrun reports
    # as a failure (so `train && export` does not export a half-trained drafter).
    assert proc.returncode != 0 and "exitcode: 143" in err, out[-2000:] + err[-4000:]
    assert "SIGTERM received" in out and "stopped at step" in out
    assert "terminate called" not in err
    (ckpt,) = list_checkpoints(run)
    stopped = read_state(ckpt)["step"]
    assert stopped == max(logged_steps(run)) >= 3
    assert stopped < 100000

    # One plain process resumes the 2-process checkpoint and carries on from the next step.
    recipe = load_recipe(path, overrides=[f"train.max_steps={stopped + 2}"])
    trainer = TRAINERS["heads"](recipe, argv=["test"]).setup()
    try:
        assert trainer.step == stopped
        summary = trainer.train()
    finally:
        trainer.close()
    assert summary["step"] == stopped + 2
    assert logged_steps(run)[-2:] == [stopped + 1, stopped + 2]


def test_a_nan_loss_stops_the_run_naming_the_step_and_the_last_good_checkpoint(tmp_path, tiny_llama_dir, monkeypatch, capsys):
    path = recipe_file(tmp_path, tiny_llama_dir, global_batch_size=2, max_steps=8, save_every=4)
    calls = {"n": 0}
    original = MedusaHead.loss

    def loss_that_breaks_at_step_6(self, *args, **kwargs):
        calls["n"] += 1
        loss, stats = original(self, *args, **kwargs)
        return (loss * math.nan if calls["n"] == 6 else loss), stats

    monkeypatch.setattr(MedusaHead, "loss", loss_that_breaks_at_step_6)
    assert cli.main(["train", str(path)]) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    good = tmp_path / "run" / "checkpoints" / "step-000004"
    assert errors == [f"error: loss became nan at step 6; the last good checkpoint is {good}"]
    # Nothing is lost: the good checkpoint is intact and nothing was written for the broken step.
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == ["step-000004"]
    assert max(logged_steps(tmp_path / "run")) == 5


def test_a_launchers_forwarded_ctrl_c_is_not_a_second_keypress(monkeypatch, capsys):
    """torchrun forwards the terminal's SIGINT to workers that already got it; only a Ctrl-C that
    comes later aborts without a checkpoint."""
    monkeypatch.setattr(loop, "SECOND_CTRL_C_AFTER_S", 0.2)
    flag = loop.StopFlag()
    restore = loop.install_stop_handlers(flag)
    try:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)  # the launcher's copy, moments later
        assert flag.requested and flag.signal_name == "SIGINT"
        time.sleep(0.3)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)  # the handler runs between bytecodes
    finally:
        restore()
    assert capsys.readouterr().out.count("SIGINT received") == 1
