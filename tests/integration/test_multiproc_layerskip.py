"""The LayerSkip trainer across processes on CPU (gloo): torchrun DDP and DeepSpeed ZeRO-1 and ZeRO-3
(the model fully fine-tuned) and ZeRO-2 (LoRA) give the loss curve of one process with the same
global batch (layer dropout draws by the sample's place in the global batch, so it drops the same
layers wherever a sample runs), save the model's trainable weights in full beside the engine's
shards, export, and resume (ZeRO-2: a 2-process checkpoint in one plain process).

Tolerance rel 1e-4, as in test_multiproc.py: each micro-batch loss is a mean over its own answer
tokens, and 2 ranks x micro-batch 2 average the same two means that 1 rank x 2 accumulation does.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.runs import read_state
from draftsmith.testing import REPO, assert_same_curve, launch, one_process_curve, save_tiny_model, write_chats

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("multiproc-layerskip")
    target = save_tiny_model(root / "target", "llama", num_layers=4)
    data = write_chats(root / "chats.jsonl")
    base = root / "base.yaml"
    base.write_text(
        f"""
trainer: layerskip
output_dir: {root / 'unused'}
target: {{path: {target}}}
data: {{path: {data}, eval_size: 6, max_length: 64, seed: 1, cache_dir: {root / 'data'}}}
layerskip: {{layer_dropout: {{max_rate: 0.5}}, early_exit: {{curriculum: rotational, rotation: 2}}}}
train: {{micro_batch_size: 2, global_batch_size: 4, max_steps: 6, lr: 0.003, warmup_steps: 2, log_every: 1, eval_every: 6, save_every: 3, keep_last: 3}}
"""
    )
    lora = ["layerskip.lora.enabled=true", "layerskip.lora.r=4", "layerskip.lora.target_modules=[q_proj,v_proj,down_proj]"]
    return {
        "root": root,
        "base": base,
        "lora": lora,
        "full": one_process_curve(base, root / "one-full"),
        "lora_curve": one_process_curve(base, root / "one-lora", *lora),
    }


def same_weights(a: Path, b: Path) -> None:
    one, two = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert set(one) == set(two)
    for key in one:
        assert torch.allclose(one[key], two[key], atol=1e-5), key


def test_ddp_two_processes_give_the_one_process_curve(setup):
    out = setup["root"] / "ddp"
    done = launch(str(setup["base"]), f"output_dir={out}")
    assert "2 process(es) x micro-batch 2 x 1 accumulation; engine accelerate" in done.stdout
    assert_same_curve(out, setup["full"])
    same_weights(setup["root"] / "one-full" / "checkpoints" / "step-000006", out / "checkpoints" / "step-000006")


@pytest.mark.parametrize("stage", [1, 3])
def test_zero_fully_fine_tunes_to_the_one_process_curve_and_exports(setup, stage, tmp_path):
    from transformers import AutoModelForCausalLM

    from draftsmith.export import export

    out = setup["root"] / f"z{stage}"
    done = launch(str(setup["base"]), str(REPO / f"recipes/deepspeed/zero{stage}.yaml"), f"output_dir={out}")
    assert f"engine deepspeed ZeRO-{stage}" in done.stdout
    assert_same_curve(out, setup["full"])
    ckpt = out / "checkpoints" / "step-000006"
    assert read_state(ckpt)["engine"] == {"kind": "deepspeed", "zero_stage": stage, "world_size": 2}
    # model.safetensors: the whole model, as one process writes it (gathered from the partitions).
    weights = load_file(str(ckpt / "model.safetensors"))
    one = load_file(str(setup["root"] / "one-full" / "checkpoints" / "step-000006" / "model.safetensors"))
    assert set(weights) == set(one)
    for key in one:
        assert torch.allclose(one[key], weights[key], atol=1e-5), key
    exported = export(ckpt, tmp_path / "export")
    model = AutoModelForCausalLM.from_pretrained(exported)
    torch.testing.assert_close(model.state_dict()["model.norm.weight"], one["model.model.norm.weight"], atol=1e-5, rtol=1e-5)
    final = json.loads((out / "final_metrics.json").read_text())
    reference = json.loads((setup["root"] / "one-full" / "final_metrics.json").read_text())
    assert final["exit_expected_acceptance"] == pytest.approx(reference["exit_expected_acceptance"], rel=1e-3)


def test_zero2_with_lora_saves_the_adapter_and_resumes_in_one_process(setup):
    out = setup["root"] / "z2"
    args = [str(setup["base"]), str(REPO / "recipes/deepspeed/zero2.yaml"), *setup["lora"]]
    done = launch(*args, f"output_dir={out}")
    assert "engine deepspeed ZeRO-2" in done.stdout
    assert_same_curve(out, setup["lora_curve"])
    ckpt = out / "checkpoints" / "step-000006"
    two = load_file(str(ckpt / "model.safetensors"))
    assert two and all("lora_" in k for k in two)
    same_weights(setup["root"] / "one-lora" / "checkpoints" / "step-000006", ckpt)

    resumed = setup["root"] / "z2-resumed"
    shutil.copytree(out, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-000006")
    done = launch(*args, f"output_dir={resumed}", nproc=1)
    assert "resumed from" in done.stdout and "step-000003" in done.stdout
    assert_same_curve(resumed, setup["lora_curve"], steps=range(4, 7))
