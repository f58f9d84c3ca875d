"""DeepSpeed and launcher settings come from the recipe: fragments load, the config is derived from
train:, conflicts fail at load time naming the key, and checkpoints of every format are verified."""

import json
import types
from pathlib import Path

import pytest

from draftsmith.runs import RunFolderError
import torch

from draftsmith import cli
from draftsmith.recipe import DEEPSPEED_OWNED_KEYS, TRAINER_RULES, RecipeError, TrainConfig, load_recipe
from draftsmith.runs import STATE_FILE, checkpoint_root, list_checkpoints
from draftsmith.trainers import checkpoint, engine

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "recipes" / "medusa" / "smollm2-135m.yaml"
FRAGMENTS = sorted((REPO / "recipes" / "deepspeed").glob("*.yaml"))


def test_there_are_zero_1_2_3_fragments():
    names = {p.stem for p in FRAGMENTS}
    assert {"zero1", "zero2", "zero3"} <= names


@pytest.mark.parametrize("fragment", FRAGMENTS, ids=lambda p: p.stem)
def test_each_fragment_merges_with_the_quickstart_and_loads(fragment):
    recipe = load_recipe(QUICKSTART, fragment)
    plain = load_recipe(QUICKSTART)
    assert recipe.deepspeed.zero_stage == int(fragment.stem[4])
    # A fragment changes the engine only: batch sizes, accumulation and precision stay the recipe's.
    assert recipe.train == plain.train and recipe.head == plain.head and recipe.data == plain.data
    config = engine.deepspeed_config(recipe.train, recipe.deepspeed, world=8)
    assert config["train_micro_batch_size_per_gpu"] == recipe.train.micro_batch_size
    assert config["train_batch_size"] == recipe.train.micro_batch_size * recipe.train.grad_accum_steps * 8
    assert config["zero_optimization"]["stage"] == recipe.deepspeed.zero_stage
    assert "optimizer" not in config and "bf16" not in config and "fp16" not in config


@pytest.mark.parametrize("key", sorted(DEEPSPEED_OWNED_KEYS))
def test_a_deepspeed_block_that_repeats_the_recipe_is_refused_naming_the_key(tmp_path, key):
    value: object = {"enabled": True} if key in ("bf16", "fp16", "bfloat16", "amp", "torch_autocast") else 4
    node: dict = {}
    cursor = node
    parts = key.split(".")
    for part in parts[:-1]:
        cursor = cursor.setdefault(part, {})
    cursor[parts[-1]] = value
    extra = tmp_path / "ds.yaml"
    extra.write_text(json.dumps({"deepspeed": {"zero_stage": 2, "config": node}}))
    with pytest.raises(RecipeError, match=f"recipe key 'deepspeed.config.{key}' repeats what"):
        load_recipe(QUICKSTART, extra)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["deepspeed.zero_stage=4"], "must be 0, 1, 2 or 3"),
        (["deepspeed.zero_stage=2", "deepspeed.shard_target=true"], "'deepspeed.shard_target' needs deepspeed.zero_stage=3"),
        (["deepspeed.zero_stage=2", "deepspeed.offload_param=cpu"], "'deepspeed.offload_param' needs deepspeed.zero_stage=3"),
        (["deepspeed.zero_stage=3", "deepspeed.offload_param=nvme"], "'deepspeed.nvme_path' is missing"),
        (["deepspeed.shard_target=true"], "sets options but not 'deepspeed.zero_stage'"),
        (["deepspeed.zero_stag=2"], "did you mean 'deepspeed.zero_stage'"),
        (["train.global_batch_size=10"], "is not a multiple of train.micro_batch_size=8"),
        (["data.features.mode=cachee"], "data.features.mode"),
        (["data.features.top_k_logits=-1"], "'data.features.top_k_logits' must be >= 0"),
    ],
)
def test_bad_scale_settings_fail_at_load_time(overrides, message):
    with pytest.raises(RecipeError, match=message):
        load_recipe(QUICKSTART, overrides=overrides)


def test_raw_config_is_merged_last_and_offload_is_typed():
    recipe = load_recipe(QUICKSTART, REPO / "recipes" / "deepspeed" / "zero3-offload.yaml")
    config = engine.deepspeed_config(recipe.train, recipe.deepspeed, world=2)
    assert config["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}
    assert config["zero_optimization"]["offload_param"] == {"device": "cpu"}
    z2 = load_recipe(QUICKSTART, REPO / "recipes" / "deepspeed" / "zero2.yaml")
    config = engine.deepspeed_config(z2.train, z2.deepspeed, world=2)
    assert config["zero_optimization"] == {"stage": 2, "overlap_comm": True, "contiguous_gradients": True}


def test_global_batch_size_decides_accumulation_per_world_size(monkeypatch):
    train = TrainConfig(micro_batch_size=2, global_batch_size=8)
    assert engine.resolve_grad_accum(train, 1) == 4 and train.grad_accum_steps == 4
    assert engine.resolve_grad_accum(train, 4) == 1 and train.grad_accum_steps == 1
    with pytest.raises(RecipeError, match=r"global_batch_size'=8 is not divisible by train.micro_batch_size=2 x 3 processes"):
        engine.resolve_grad_accum(train, 3)
    # make_accelerator refuses before it creates anything, with one line (exit code 2 from the CLI).
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with pytest.raises(RecipeError, match="not divisible"):
        engine.make_accelerator(TrainConfig(micro_batch_size=2, global_batch_size=8))


def test_launcher_settings_that_contradict_the_recipe_are_refused(monkeypatch):
    ds = load_recipe(QUICKSTART, REPO / "recipes" / "deepspeed" / "zero2.yaml").deepspeed
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(RecipeError, match="the recipe has no deepspeed.zero_stage"):
        engine._check_launcher(None)
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    with pytest.raises(RecipeError, match="ZeRO stage 3 but the recipe has deepspeed.zero_stage=2"):
        engine._check_launcher(ds)
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")
    engine._check_launcher(ds)
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", "/tmp/ds.json")
    with pytest.raises(RecipeError, match="from the recipe's deepspeed: section only"):
        engine._check_launcher(ds)


def test_threads_are_split_between_local_ranks_when_the_launcher_did_not(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_SIZE", "2")  # the deepspeed launcher's name for it
    monkeypatch.setattr(engine.os, "cpu_count", lambda: 8)
    try:
        assert engine.configure_threads() == 4
        assert torch.get_num_threads() == 4
        assert engine.configure_threads() is None  # OMP_NUM_THREADS is set now: left alone
    finally:
        torch.set_num_threads(before)
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert engine.configure_threads() is None


@pytest.mark.parametrize(
    "argv",
    [
        ["--local_rank=1", "validate", str(QUICKSTART)],
        ["--local_rank", "1", "validate", str(QUICKSTART)],
        ["validate", str(QUICKSTART), "--local-rank", "0"],
    ],
)
def test_cli_drops_the_local_rank_argument_in_both_forms(argv, capsys):
    assert cli.main(argv) == 0
    assert "ok" in capsys.readouterr().out


def _fake_checkpoint(root: Path, step: int, files: dict[str, bytes], engine: dict) -> Path:
    path = checkpoint_root(root) / f"step-{step:06d}"
    for rel, data in files.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_bytes(data)
    manifest = {rel: len(data) for rel, data in files.items()}
    (path / STATE_FILE).write_text(json.dumps({"step": step, "drafter": {"kind": "medusa"}, "engine": engine, "files": manifest}))
    return path


def test_a_truncated_or_partial_deepspeed_checkpoint_is_skipped_for_the_previous_one(tmp_path, capsys):
    ds = {"kind": "deepspeed", "zero_stage": 2, "world_size": 2}
    files = {
        "model.safetensors": b"w" * 64,
        "latest": b"pytorch_model",
        "pytorch_model/mp_rank_00_model_states.pt": b"m" * 100,
        "pytorch_model/zero_pp_rank_0_mp_rank_00_optim_states.pt": b"o" * 300,
        "pytorch_model/zero_pp_rank_1_mp_rank_00_optim_states.pt": b"o" * 300,
    }
    _fake_checkpoint(tmp_path, 10, files, ds)
    truncated = _fake_checkpoint(tmp_path, 20, files, ds)
    (truncated / "pytorch_model/zero_pp_rank_1_mp_rank_00_optim_states.pt").write_bytes(b"o" * 12)
    missing = _fake_checkpoint(tmp_path, 30, files, ds)
    (missing / "pytorch_model/zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000010"]
    assert checkpoint.find_resume_checkpoint(tmp_path, "auto").name == "step-000010"
    out = capsys.readouterr().out
    assert "step-000020 (pytorch_model/zero_pp_rank_1_mp_rank_00_optim_states.pt has 12 bytes, 300 were written)" in out
    assert "step-000030 (pytorch_model/zero_pp_rank_0_mp_rank_00_optim_states.pt is missing)" in out
    with pytest.raises(RunFolderError, match="not a complete checkpoint .*is missing"):
        checkpoint.find_resume_checkpoint(tmp_path, str(missing))


def test_a_checkpoint_of_another_engine_is_refused_with_the_way_out(tmp_path):
    from accelerate.utils import DistributedType

    ckpt = _fake_checkpoint(tmp_path, 5, {"model.safetensors": b"x"}, {"kind": "deepspeed", "zero_stage": 3, "world_size": 2})
    ddp = types.SimpleNamespace(distributed_type=DistributedType.MULTI_CPU, num_processes=2)
    with pytest.raises(engine.TrainingError, match="written with DeepSpeed ZeRO-3; resume it with the same engine"):
        checkpoint.prepare_resume(ddp, ckpt)
    plain = _fake_checkpoint(tmp_path / "b", 5, {"model.safetensors": b"x"}, {"kind": "accelerate", "zero_stage": None, "world_size": 2})
    one = types.SimpleNamespace(distributed_type=DistributedType.NO, num_processes=1)
    assert checkpoint.prepare_resume(one, plain) == plain  # DDP checkpoints load at any world size


def test_a_trainer_without_deepspeed_support_refuses_the_section_instead_of_ignoring_it(monkeypatch):
    import dataclasses

    monkeypatch.setitem(TRAINER_RULES, "distill", dataclasses.replace(TRAINER_RULES["distill"], deepspeed=False))
    recipe = REPO / "recipes" / "distill" / "qwen2.5-coder-1.5b-fkl.yaml"
    with pytest.raises(RecipeError, match="trainer 'distill' does not run under DeepSpeed \\(trainers heads, online, layerskip do\\)"):
        load_recipe(recipe, REPO / "recipes" / "deepspeed" / "zero2.yaml")


def test_online_under_deepspeed_takes_zero_1_and_2_only():
    online = REPO / "recipes" / "online" / "qwen2.5-coder-1.5b.yaml"
    zero = REPO / "recipes" / "deepspeed"
    assert load_recipe(online, zero / "zero2.yaml").deepspeed.zero_stage == 2
    with pytest.raises(RecipeError, match="online trainer serves a different request on every rank"):
        load_recipe(online, zero / "zero3.yaml")


def test_distill_under_deepspeed_refuses_what_it_cannot_do():
    distill = REPO / "recipes" / "distill" / "qwen2.5-coder-1.5b-fkl.yaml"
    zero = REPO / "recipes" / "deepspeed"
    assert load_recipe(distill, zero / "zero2.yaml", overrides=["distill.lambda_onpolicy=0.5"]).deepspeed.zero_stage == 2
    assert load_recipe(distill, zero / "zero3.yaml", overrides=["distill.lambda_onpolicy=0"]).deepspeed.zero_stage == 3
    with pytest.raises(RecipeError, match="'distill.lambda_onpolicy' must be 0 under deepspeed.zero_stage=3"):
        load_recipe(distill, zero / "zero3.yaml", overrides=["distill.lambda_onpolicy=0.5"])
    with pytest.raises(RecipeError, match="'deepspeed.shard_target': the distill trainer keeps a full copy"):
        load_recipe(distill, zero / "zero3.yaml", overrides=["distill.lambda_onpolicy=0", "deepspeed.shard_target=true"])
