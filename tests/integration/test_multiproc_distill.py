"""The draft-LM trainers across processes on CPU (gloo). DistillSpec: torchrun DDP and DeepSpeed
ZeRO-2 (with a LoRA draft) and ZeRO-3 give the loss curve of one process with the same global batch,
save the draft's trainable weights in full beside the engine's shards, export, and resume (ZeRO-2:
a 2-process checkpoint in one plain process); on-policy sampling runs under ZeRO-2. Online: two
ranks serving alternate requests give the one-process stream.

Tolerance as in test_multiproc.py: rel 1e-4. Every micro-batch loss is a mean over its own answer
tokens, and 2 ranks x micro-batch 2 average the same two means that 1 rank x 2 accumulation does.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.runs import list_checkpoints, read_state
from draftsmith.testing import REPO, assert_same_curve, launch, one_process_curve, write_chats

REL = 1e-4

pytestmark = pytest.mark.multiproc


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
    from draftsmith.export import export

    out = setup["root"] / "z2"
    args = [str(setup["base"]), str(REPO / "recipes/deepspeed/zero2.yaml"), *setup["lora"]]
    done = launch(*args, f"output_dir={out}")
    assert "engine deepspeed ZeRO-2" in done.stdout
    assert_same_curve(out, setup["lora_curve"])
    ckpt = out / "checkpoints" / "step-000006"
    state = read_state(ckpt)
    assert state["engine"] == {"kind": "deepspeed", "zero_stage": 2, "world_size": 2}
    # The adapter in full beside the shards, under the names the one-process run writes.
    one = load_file(str(setup["root"] / "one-lora" / "checkpoints" / "step-000006" / "model.safetensors"))
    two = load_file(str(ckpt / "model.safetensors"))
    assert set(two) == set(one) and all("lora_" in k for k in two)
    for key in one:
        assert torch.allclose(one[key], two[key], atol=1e-5), key
    exported = export(ckpt, tmp_path / "export")
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
    assert list_checkpoints(out)[-1].name == "step-000002"


def test_online_serving_on_two_ranks_gives_the_one_process_stream(setup):
    """Two ranks serve alternate requests and update the drafter together: every request's
    acceptance and every update's loss are those of one process (update_every is even, and the
    global batch is drawn the same way)."""
    from draftsmith.trainers.online import serve_records

    root = setup["root"]
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"say {w} {v}"}) + "\n" for w, v in zip("abcdefgh", "hgfedcba")))
    base = root / "online.yaml"
    base.write_text(
        f"""
trainer: online
output_dir: {root / 'unused'}
target: {{path: {root / 'target'}}}
draft: {{path: {root / 'draft'}}}
data: {{path: {prompts}, max_length: 64}}
distill: {{divergence: fkl}}
online: {{requests_per_source: 8, update_every: 2, steps_per_update: 3, buffer_size: 8, max_new_tokens: 12, draft_length: 3, window: 2}}
train: {{micro_batch_size: 2, global_batch_size: 4, lr: 0.01, lr_schedule: constant, save_every: 4}}
"""
    )
    one, two = root / "online-one", root / "online-two"
    launch(str(base), f"output_dir={one}", nproc=1)
    done = launch(str(base), f"output_dir={two}")
    assert "2 process(es) x micro-batch 2 x 1 accumulation" in done.stdout
    a, b = serve_records(one), serve_records(two)
    assert [r["step"] for r in b] == list(range(1, 9))
    assert [(r["accepted"], r["judged"]) for r in a] == [(r["accepted"], r["judged"]) for r in b]
    assert sum(r["accepted"] for r in a) > 0  # the comparison is not one of empty streams
    updates = lambda run: [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "update"]  # noqa: E731
    assert len(updates(one)) == len(updates(two)) == 3  # after requests 2, 4, 6
    for x, y in zip(updates(one), updates(two)):
        assert y["loss"] == pytest.approx(x["loss"], rel=REL)
    assert [c.name for c in list_checkpoints(two)] == ["step-000004", "step-000008"]
    assert json.loads((two / "final_metrics.json").read_text())["served"] == 8

    # The same under DeepSpeed ZeRO-2, which keeps the drafter whole on every rank for serving.
    z2 = root / "online-z2"
    done = launch(str(base), str(REPO / "recipes/deepspeed/zero2.yaml"), f"output_dir={z2}")
    assert "engine deepspeed ZeRO-2" in done.stdout
    assert [(r["accepted"], r["judged"]) for r in serve_records(z2)] == [(r["accepted"], r["judged"]) for r in a]
    for x, y in zip(updates(one), updates(z2)):
        assert y["loss"] == pytest.approx(x["loss"], rel=REL)
