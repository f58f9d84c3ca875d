"""The head trainer across processes on CPU (gloo), under torchrun, accelerate launch and the
deepspeed launcher: DDP and DeepSpeed ZeRO-1/2/3 give the loss curve of one process with the same
global batch, save, resume (also a 2-process checkpoint in one plain process), keep the frozen
target out of checkpoints, and exit cleanly every time.

Tolerance: losses agree within rel 1e-4 (measured: within 1e-7). The per-micro-batch loss weighting
makes 2 ranks x micro-batch 2 and 1 rank x micro-batch 2 x 2 accumulation the same computation up
to floating-point reduction order.

Runtime: each launch costs 15-30 s on 2 loaded cores, most of it importing torch, transformers and
DeepSpeed; the DeepSpeed CPU shm op is never compiled (draftsmith.trainers.engine._skip_cpu_shm_op).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.recipe import load_recipe
from draftsmith.runs import read_state
from draftsmith.testing import REPO, assert_same_curve, launch, logged, run_trainer, write_chats

pytestmark = pytest.mark.multiproc

REL = 1e-4


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
    _, summary, _ = run_trainer(load_recipe(base, overrides=[f"output_dir={root / 'one'}"]))
    return {"root": root, "base": base, "reference": logged(root / "one"), "summary": summary}


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
    from draftsmith.artifacts import open_drafter

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
    state = read_state(ckpt)
    assert state["engine"] == {"kind": "deepspeed", "zero_stage": 2, "world_size": 2}
    assert sorted(p.name for p in (ckpt / "pytorch_model").iterdir()) == [
        "mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    ]
    # The drafter's full weights sit beside the shards, and exports read them like any checkpoint.
    weights = load_file(str(ckpt / "model.safetensors"))
    assert weights and all(k.startswith("head.") for k in weights)
    head = open_drafter(ckpt).head
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
    assert read_state(out / "checkpoints" / "step-000006")["engine"]["zero_stage"] == 1


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
