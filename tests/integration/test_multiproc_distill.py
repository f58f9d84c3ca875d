"""The DistillSpec trainer across processes on CPU (gloo): torchrun DDP and DeepSpeed ZeRO-2 (with a
LoRA draft) and ZeRO-3 give the loss curve of one process with the same global batch, save the
draft's trainable weights in full beside the engine's shards, export, and resume (ZeRO-2: a
2-process checkpoint in one plain process). On-policy sampling runs under ZeRO-2.

Tolerance as in test_multiproc.py: rel 1e-4. Every micro-batch loss is a mean over its own answer
tokens, and 2 ranks x micro-batch 2 average the same two means that 1 rank x 2 accumulation does.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.recipe import load_recipe
from draftsmith.trainers import TRAINERS, loop

from test_multiproc import REPO, assert_same_curve, launch, losses, write_chats

pytestmark = pytest.mark.multiproc


def one_process_curve(base: Path, out: Path, *overrides: str) -> dict[int, float]:
    recipe = load_recipe(base, overrides=[f"output_dir={out}", *overrides])
    trainer = TRAINERS["distill"](recipe, argv=["test"]).setup()
    try:
        trainer.train()
    finally:
        trainer.close()
    return losses(out)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny target, a smaller draft sharing its tokenizer, and one-process reference curves of a
    fully trained draft and of a LoRA draft (micro-batch 2 x 2 accumulation = global batch 4)."""
    from draftsmith.testing import save_tiny_model

    root = tmp_path_factory.mktemp("multiproc-distill")
    target = save_tiny_model(root / "target", "llama", seed=0)
    draft = save_tiny_model(root / "draft", "llama", seed=1, hidden_size=32, num_layers=1)
    data = write_chats(root / "chats.jsonl")
    base = root / "base.yaml"
    base.write_text(
        f"""
trainer: distill
output_dir: {root / 'unused'}
target: {{path: {target}}}
draft: {{path: {draft}}}
data: {{path: {data}, eval_size: 6, max_length: 64, seed: 1, cache_dir: {root / 'data'}}}
distill: {{divergence: fkl}}
train: {{micro_batch_size: 2, global_batch_size: 4, max_steps: 6, lr: 0.01, warmup_steps: 2, log_every: 1, eval_every: 6, save_every: 3, keep_last: 3}}
"""
    )
    lora = ["draft.lora.enabled=true", "draft.lora.r=4", "draft.lora.target_modules=[q_proj,v_proj,down_proj]"]
    return {
        "root": root,
        "base": base,
        "lora": lora,
        "full": one_process_curve(base, root / "one-full"),
        "lora_curve": one_process_curve(base, root / "one-lora", *lora),
    }


def test_ddp_two_processes_give_the_one_process_curve(setup):
    out = setup["root"] / "ddp"
    done = launch(str(setup["base"]), f"output_dir={out}")
    assert "2 process(es) x micro-batch 2 x 1 accumulation; engine accelerate" in done.stdout
    assert_same_curve(out, setup["full"])
    one = load_file(str(setup["root"] / "one-full" / "checkpoints" / "step-000006" / "model.safetensors"))
    two = load_file(str(out / "checkpoints" / "step-000006" / "model.safetensors"))
    assert set(one) == set(two)
    for key in one:
        assert torch.allclose(one[key], two[key], atol=1e-5), key


def test_zero2_with_a_lora_draft_saves_the_adapter_exports_and_resumes_in_one_process(setup, tmp_path):
    from draftsmith.export import export_lm_drafter

    out = setup["root"] / "z2"
    args = [str(setup["base"]), str(REPO / "recipes/deepspeed/zero2.yaml"), *setup["lora"]]
    done = launch(*args, f"output_dir={out}")
    assert "engine deepspeed ZeRO-2" in done.stdout
    assert_same_curve(out, setup["lora_curve"])
    ckpt = out / "checkpoints" / "step-000006"
    state = json.loads((ckpt / loop.STATE_FILE).read_text())
    assert state["engine"] == {"kind": "deepspeed", "zero_stage": 2, "world_size": 2}
    # The adapter in full beside the shards, under the names the one-process run writes.
    one = load_file(str(setup["root"] / "one-lora" / "checkpoints" / "step-000006" / "model.safetensors"))
    two = load_file(str(ckpt / "model.safetensors"))
    assert set(two) == set(one) and all("lora_" in k for k in two)
    for key in one:
        assert torch.allclose(one[key], two[key], atol=1e-5), key
    exported = export_lm_drafter(ckpt, tmp_path / "export")
    assert (exported / "config.json").is_file() and (exported / "model.safetensors").is_file()

    resumed = setup["root"] / "z2-resumed"
    shutil.copytree(out, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-000006")
    done = launch(*args, f"output_dir={resumed}", nproc=1)
    assert "resumed from" in done.stdout and "step-000003" in done.stdout
    assert_same_curve(resumed, setup["lora_curve"], steps=range(4, 7))


def test_zero3_partitions_the_draft_and_gives_the_one_process_curve(setup):
    out = setup["root"] / "z3"
    launch(str(setup["base"]), str(REPO / "recipes/deepspeed/zero3.yaml"), f"output_dir={out}")
    assert_same_curve(out, setup["full"])
    ckpt = out / "checkpoints" / "step-000006"
    # The engine's shards hold the draft only (the target stays outside the engine) ...
    for shard in (ckpt / "pytorch_model").glob("*model_states.pt"):
        states = torch.load(shard, map_location="cpu", weights_only=False)
        names = [n for group in states["param_shapes"] for n in group]
        assert names and all(n.startswith("draft.") for n in names), names
    # ... and model.safetensors the whole draft, as one process writes it.
    weights = load_file(str(ckpt / "model.safetensors"))
    one = load_file(str(setup["root"] / "one-full" / "checkpoints" / "step-000006" / "model.safetensors"))
    assert set(weights) == set(one)
    for key in one:
        assert torch.allclose(one[key], weights[key], atol=1e-5), key


def test_onpolicy_answers_under_zero2(setup):
    out = setup["root"] / "z2-onpolicy"
    launch(
        str(setup["base"]), str(REPO / "recipes/deepspeed/zero2.yaml"), f"output_dir={out}",
        "distill.lambda_onpolicy=0.5", "distill.onpolicy_max_new_tokens=8", "train.max_steps=2", "train.save_every=2",
    )  # fmt: skip
    train = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    assert 0.0 < train[-1]["onpolicy_fraction"] < 1.0
    assert loop.list_checkpoints(out)[-1].name == "step-000002"
