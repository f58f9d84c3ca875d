"""The head trainer across processes on CPU (gloo), under torchrun, accelerate launch and the
deepspeed launcher: DDP and DeepSpeed ZeRO-1/2/3 give the loss curve of one process with the same
global batch, save, resume (also a 2-process checkpoint in one plain process), keep the frozen
target out of checkpoints, and exit cleanly every time.

Tolerance: losses agree within rel 1e-4 (measured: within 1e-7). The per-micro-batch loss weighting
makes 2 ranks x micro-batch 2 and 1 rank x micro-batch 2 x 2 accumulation the same computation up
to floating-point reduction order.

Runtime: each launch costs 15-30 s on 2 loaded cores, most of it importing torch, transformers and
DeepSpeed; the DeepSpeed CPU shm op is never compiled (draftsmith.trainers.loop._skip_cpu_shm_op).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.recipe import load_recipe
from draftsmith.trainers import TRAINERS, loop

pytestmark = pytest.mark.multiproc

REPO = Path(__file__).resolve().parents[2]
WORDS = ["red", "blue", "green", "cat", "dog", "sun", "moon", "tree"]
REL = 1e-4


def write_chats(path: Path, n: int = 40) -> Path:
    rng = random.Random(0)
    with open(path, "w") as fh:
        for _ in range(n):
            words = [rng.choice(WORDS) for _ in range(4)]
            turns = [{"role": "user", "content": "say " + " ".join(words)}, {"role": "assistant", "content": " ".join(words * 2)}]
            fh.write(json.dumps({"messages": turns}) + "\n")
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny target, chats, a base recipe (global batch 4 = 2 per rank on 2 ranks) and the curve of
    one plain process (micro-batch 2 x 2 accumulation) to compare every engine with."""
    from draftsmith.testing import save_tiny_model

    root = tmp_path_factory.mktemp("multiproc")
    model = save_tiny_model(root / "tiny", "llama")
    data = write_chats(root / "chats.jsonl")
    base = root / "base.yaml"
    base.write_text(
        f"""
trainer: heads
output_dir: {root / 'unused'}
target: {{path: {model}}}
data: {{path: {data}, eval_size: 8, max_length: 96, seed: 1, cache_dir: {root / 'data'}}}
head: {{kind: medusa, num_heads: 2, num_layers: 1, lm_head: own}}
train: {{micro_batch_size: 2, global_batch_size: 4, max_steps: 6, lr: 0.01, warmup_steps: 2, log_every: 1, eval_every: 6, save_every: 3, keep_last: 3}}
"""
    )
    recipe = load_recipe(base, overrides=[f"output_dir={root / 'one'}"])
    trainer = TRAINERS["heads"](recipe, argv=["test"]).setup()
    try:
        summary = trainer.train()
    finally:
        trainer.close()
    return {"root": root, "base": base, "reference": losses(root / "one"), "summary": summary}


def losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


def env() -> dict:
    out = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    out.update(DS_ACCELERATOR="cpu", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    return out


LAUNCHERS = {
    "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node={n}", "-m"],
    # accelerate 1.15 on CPU: --cpu would silently run one process; --multi_gpu with
    # ACCELERATE_USE_CPU=true runs N (docs/ENVIRONMENT.md).
    "accelerate": [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes={n}", "-m"],
    # The deepspeed launcher injects --local_rank=N into the command line and sets no OMP_NUM_THREADS.
    "deepspeed": [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus={n}", "--module"],
}


def launch(*args: str, nproc: int = 2, timeout: int = 300, launcher: str = "torchrun") -> subprocess.CompletedProcess:
    """`LAUNCHER ... -m draftsmith.cli train ARGS` with N processes (torchrun by default), or one plain process."""
    if nproc > 1:
        cmd = [part.format(n=nproc) for part in LAUNCHERS[launcher]] + ["draftsmith.cli", "train", *args]
    else:
        cmd = [sys.executable, "-m", "draftsmith.cli", "train", *args]
    environment = env()
    if launcher == "accelerate":
        environment["ACCELERATE_USE_CPU"] = "true"
    if launcher == "deepspeed":
        environment.pop("OMP_NUM_THREADS", None)  # as on a machine where nobody set it
    done = subprocess.run(cmd, cwd=REPO, env=environment, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert "terminate called" not in done.stderr  # the teardown trap (docs/ENVIRONMENT.md)
    return done


def assert_same_curve(run_dir: Path, reference: dict[int, float], steps=range(1, 7)) -> None:
    got = losses(run_dir)
    for step in steps:
        assert got[step] == pytest.approx(reference[step], rel=REL), (step, got, reference)


def test_ddp_two_processes_give_the_one_process_curve(setup):
    out = setup["root"] / "ddp"
    done = launch(str(setup["base"]), f"output_dir={out}")
    assert "2 process(es) x micro-batch 2 x 1 accumulation" in done.stdout
    assert_same_curve(out, setup["reference"])
    final = json.loads((out / "final_metrics.json").read_text())
    assert final["top1"] == pytest.approx(setup["summary"]["top1"], rel=REL)
    one = load_file(str(setup["root"] / "one" / "checkpoints" / "step-000006" / "model.safetensors"))
    two = load_file(str(out / "checkpoints" / "step-000006" / "model.safetensors"))
    assert set(one) == set(two)
    for key in one:
        assert torch.allclose(one[key], two[key], atol=1e-5), key


def test_zero2_from_a_feature_cache_trains_saves_and_a_two_process_checkpoint_resumes_in_one_process(setup):
    """ZeRO-2 training from a float32 feature cache that the two ranks build together."""
    from draftsmith.export.hf import load_head

    out = setup["root"] / "z2"
    features = setup["root"] / "z2-features"
    args = [
        str(setup["base"]), str(REPO / "recipes/deepspeed/zero2.yaml"),
        "data.features.mode=cache", "data.features.dtype=float32", "data.features.shard_tokens=300", f"data.features.dir={features}",
    ]
    launch(*args, f"output_dir={out}")
    assert len(list(features.glob("train-*.safetensors"))) > 4  # split between the ranks
    assert_same_curve(out, setup["reference"])
    ckpt = out / "checkpoints" / "step-000006"
    state = json.loads((ckpt / loop.STATE_FILE).read_text())
    assert state["engine"] == {"kind": "deepspeed", "zero_stage": 2, "world_size": 2}
    assert sorted(p.name for p in (ckpt / "pytorch_model").iterdir()) == [
        "mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    ]
    # The drafter's full weights sit beside the shards, and exports read them like any checkpoint.
    weights = load_file(str(ckpt / "model.safetensors"))
    assert weights and all(k.startswith("head.") for k in weights)
    head = load_head(ckpt).head
    assert torch.equal(head.state_dict()["lm_heads.0.weight"], weights["head.lm_heads.0.weight"])

    # Resume the 2-process checkpoint of step 3 in one plain process (micro-batch 2 x 2 accumulation).
    resumed = setup["root"] / "z2-resumed"
    shutil.copytree(out, resumed)
    for late in ("step-000006",):
        shutil.rmtree(resumed / "checkpoints" / late)
    done = launch(*args, f"output_dir={resumed}", nproc=1)
    assert "resumed from" in done.stdout and "step-000003" in done.stdout
    assert_same_curve(resumed, setup["reference"], steps=range(4, 7))


def test_zero3_with_a_sharded_target_trains_saves_and_resumes(setup):
    out = setup["root"] / "z3"
    args = [str(setup["base"]), str(REPO / "recipes/deepspeed/zero3.yaml"), "deepspeed.shard_target=true"]
    launch(*args, f"output_dir={out}")
    assert_same_curve(out, setup["reference"])
    ckpt = out / "checkpoints" / "step-000006"
    # The frozen target is partitioned into the engine but never saved: only head tensors.
    for shard in (ckpt / "pytorch_model").glob("*model_states.pt"):
        states = torch.load(shard, map_location="cpu", weights_only=False)
        names = [n for group in states["param_shapes"] for n in group] + list(states["module"])
        assert names and all(n.startswith("head.") for n in names), names
    assert all(k.startswith("head.") for k in load_file(str(ckpt / "model.safetensors")))

    resumed = setup["root"] / "z3-resumed"
    shutil.copytree(out, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-000006")
    done = launch(*args, f"output_dir={resumed}")
    assert "resumed from" in done.stdout
    assert_same_curve(resumed, setup["reference"], steps=range(4, 7))


def test_accelerate_launch_gives_the_one_process_curve(setup):
    out = setup["root"] / "accelerate"
    done = launch(str(setup["base"]), f"output_dir={out}", launcher="accelerate")
    assert "2 process(es) x micro-batch 2 x 1 accumulation; engine accelerate" in done.stdout
    assert_same_curve(out, setup["reference"])


def test_deepspeed_launcher_with_zero1_gives_the_one_process_curve(setup):
    out = setup["root"] / "ds-launcher"
    done = launch(str(setup["base"]), str(REPO / "recipes/deepspeed/zero1.yaml"), f"output_dir={out}", launcher="deepspeed")
    assert "engine deepspeed ZeRO-1" in done.stdout
    # The launcher sets no thread count; draftsmith splits the cores between the ranks itself.
    assert "OMP_NUM_THREADS was not set by the launcher" in done.stdout
    assert_same_curve(out, setup["reference"])
    assert json.loads((out / "checkpoints" / "step-000006" / loop.STATE_FILE).read_text())["engine"]["zero_stage"] == 1


def test_zero3_with_a_replicated_target_resumes_a_two_process_checkpoint_in_one_process(setup):
    out = setup["root"] / "z3-replicated"
    args = [str(setup["base"]), str(REPO / "recipes/deepspeed/zero3.yaml")]
    launch(*args, f"output_dir={out}")
    assert_same_curve(out, setup["reference"])
    resumed = setup["root"] / "z3-replicated-resumed"
    shutil.copytree(out, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-000006")
    done = launch(*args, f"output_dir={resumed}", nproc=1)
    assert "converting" in done.stdout and "resumed from" in done.stdout and "step-000003" in done.stdout
    assert_same_curve(resumed, setup["reference"], steps=range(4, 7))
