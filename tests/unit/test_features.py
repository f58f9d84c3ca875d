"""The hidden-state cache: storage round trips, deterministic resumable builds, refusals, and head
training from the cache giving the losses of online training (fp32 cache)."""

import json
import random
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from draftsmith import cli
from draftsmith.data import Collator
from draftsmith.data import features as fc
from draftsmith.recipe import FeaturesConfig, load_recipe
from draftsmith.target import FrozenTarget
from draftsmith.testing import write_chats
from draftsmith.trainers import TRAINERS

def recipe_file(tmp_path: Path, model_dir: Path, name: str, features: str = "") -> Path:
    data = write_chats(tmp_path / "chats.jsonl", n=24)
    text = f"""
trainer: heads
output_dir: {tmp_path / name}
target: {{path: {model_dir}}}
data: {{path: {data}, eval_size: 4, max_length: 96, seed: 1, cache_dir: {tmp_path / 'data'}, features: {{{features}}}}}
head: {{kind: medusa, num_heads: 2, num_layers: 1, lm_head: own}}
train: {{micro_batch_size: 2, grad_accum_steps: 2, max_steps: 8, lr: 0.01, log_every: 1, eval_every: 8, save_every: 100}}
"""
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return path


def losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


def train(path: Path, *overrides: str, before_train=None):
    recipe = load_recipe(path, overrides=list(overrides))
    trainer = TRAINERS["heads"](recipe, argv=["test"]).setup()
    if before_train:
        before_train(trainer)
    try:
        summary = trainer.train()
    finally:
        trainer.close()
    return trainer, summary


# ----------------------------------------------------------------------------- storage


def test_int8_round_trip_error_is_bounded_by_half_a_step():
    torch.manual_seed(0)
    x = torch.randn(50, 64) * torch.logspace(-2, 2, 50).unsqueeze(1)
    x[3] = 0.0  # an all-zero row must not divide by zero
    x[7, 5] = 300.0  # an outlier sets its row's scale
    q, scale = fc.quantize_int8(x)
    assert q.dtype == torch.int8 and scale.shape == (50,)
    back = fc.dequantize_int8(q, scale)
    bound = x.abs().amax(dim=1, keepdim=True) / 254 * (1 + 1e-5)
    assert torch.all((back - x).abs() <= bound + 1e-12)
    assert torch.equal(back[3], torch.zeros(64))


def test_plan_shards_covers_every_example_once_in_order():
    lengths = [5, 7, 3, 9, 1, 1, 12, 4]
    plan = fc.plan_shards(lengths, shard_tokens=10)
    assert plan == [(0, 2), (2, 4), (4, 7), (7, 8)]
    assert fc.plan_shards(lengths, shard_tokens=1000) == [(0, 8)]
    assert fc.plan_shards([], 10) == []


def test_rows_of_batch_undoes_padding_and_packing():
    examples = [{"input_ids": list(range(n)), "loss_mask": [1] * n} for n in (3, 5, 2)]
    for packing in (False, True):
        batch = Collator(pad_token_id=0, max_length=16, packing=packing)(examples)
        values = batch["input_ids"].float().unsqueeze(-1).expand(-1, -1, 4)
        spec = fc.FeatureSpec(target={"hidden_size": 4}, layers=[], dtype="float32", compress="none", top_k=0, data={})
        rows = fc.rows_of_batch(spec, batch["segment_ids"] > 0, [3, 5, 2], {"final_hidden": values})
        assert [r["final_hidden"][:, 0].tolist() for r in rows] == [[0, 1, 2], [0, 1, 2, 3, 4], [0, 1]]


# ----------------------------------------------------------------------------- building


@pytest.fixture
def built(tmp_path, tiny_llama_dir):
    """A target, its data and a cache of layer 1 + final_hidden + top-3 logits in float32."""
    target = FrozenTarget.load(str(tiny_llama_dir))
    tok = target.tokenizer
    rng = random.Random(0)
    make = lambda n: [{"input_ids": [rng.randrange(4, 100) for _ in range(rng.randrange(5, 30))], "loss_mask": [1] * 0} for _ in range(n)]
    train, evaluation = make(12), make(3)
    for e in train + evaluation:
        e["loss_mask"] = [1] * len(e["input_ids"])
    cfg = FeaturesConfig(mode="cache", dtype="float32", top_k_logits=3, shard_tokens=60, batch_size=3)
    spec = fc.make_spec(target, [1], cfg, train, evaluation, max_length=20)
    folder = tmp_path / "features"
    collator = Collator(pad_token_id=tok.pad_token_id, max_length=20)
    splits = {"train": train, "eval": evaluation}
    said = []
    fc.build_cache(target, spec, splits, collator, folder, cfg.shard_tokens, cfg.batch_size, 0.0, say=said.append, progress=False)
    Built = namedtuple("Built", "target spec folder splits collator said")
    return Built(target, spec, folder, splits, collator, said)


def test_cache_holds_exactly_what_the_target_computes(built):
    target, spec = built.target, built.spec
    cache = fc.FeatureCache(built.folder, spec)
    assert cache.count("train") == 12 and cache.count("eval") == 3
    example = built.splits["train"][5]
    ids = torch.tensor([example["input_ids"][:20]])
    online = target.features(ids, layers=[1], need_logits=True)
    rows = cache.example("train", 5)
    n = ids.shape[1]
    assert torch.allclose(rows["final_hidden"], online.final_hidden[0], atol=1e-5)
    assert torch.allclose(rows["layer_1"], online.hidden[1][0], atol=1e-5)
    top = online.logits[0].topk(3, dim=-1)
    assert torch.equal(rows["topk_indices"], top.indices) and torch.allclose(rows["topk_values"], top.values, atol=1e-5)
    assert rows["final_hidden"].shape == (n, 64)
    # The reported bytes per token are the stored tensors' bytes per token.
    tokens, stored = 0, 0
    for path in built.folder.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as fh:
            for name in fh.keys():
                t = fh.get_tensor(name)
                if name == "example_ids":
                    continue
                if name == "offsets":
                    tokens += int(t[-1])
                    continue
                stored += t.numel() * t.element_size()
    assert stored == spec.bytes_per_token() * tokens
    assert any("bytes/token" in line and "projected" in line for line in built.said)


def test_build_is_deterministic_and_resumes_missing_shards(built):
    files = sorted(built.folder.glob("*.safetensors"))
    assert len(files) > 3  # several shards, so resuming has something to skip
    before = {p.name: p.read_bytes() for p in files}
    victim = files[1]
    victim.unlink()
    (built.folder / f".{files[2].name}.tmp999").write_bytes(b"partial")  # an interrupted write
    kept_mtime = files[0].stat().st_mtime_ns
    fc.build_cache(built.target, built.spec, built.splits, built.collator, built.folder, 60, 3, 0.0, say=lambda _: None, progress=False)
    assert victim.read_bytes() == before[victim.name]  # rebuilt bit for bit
    assert files[0].stat().st_mtime_ns == kept_mtime  # complete shards are not recomputed


def test_int8_cache_is_half_of_bf16_and_close(built, tmp_path):
    cfg16 = FeaturesConfig(dtype="bfloat16")
    cfg8 = FeaturesConfig(dtype="bfloat16", compress="int8")
    train, evaluation = built.splits["train"], built.splits["eval"]
    spec16 = fc.make_spec(built.target, [1], cfg16, train, evaluation, 20)
    spec8 = fc.make_spec(built.target, [1], cfg8, train, evaluation, 20)
    assert spec16.bytes_per_token() == 2 * 64 * 2
    assert spec8.bytes_per_token() == 2 * (64 + 4)
    fc.build_cache(built.target, spec8, built.splits, built.collator, tmp_path / "int8", 60, 3, 0.0, say=lambda _: None, progress=False)
    exact = fc.FeatureCache(built.folder, built.spec).example("train", 2)["final_hidden"]
    approx = fc.FeatureCache(tmp_path / "int8", spec8).example("train", 2)["final_hidden"]
    bound = exact.abs().amax(dim=1, keepdim=True) / 254 + 1e-6
    assert torch.all((approx - exact).abs() <= bound)


def test_cache_for_another_target_or_layer_set_is_refused(built, tmp_path):
    from draftsmith.testing import save_tiny_model

    other = FrozenTarget.load(str(save_tiny_model(tmp_path / "other", "llama", seed=1)))
    train, evaluation = built.splits["train"], built.splits["eval"]
    cfg = FeaturesConfig(dtype="float32", top_k_logits=3)
    foreign = fc.make_spec(other, [1], cfg, train, evaluation, 20)
    with pytest.raises(fc.FeatureCacheError, match="built for another target"):
        fc.open_cache(built.folder, foreign, create=True)
    more_layers = fc.make_spec(built.target, [0, 1], cfg, train, evaluation, 20)
    with pytest.raises(fc.FeatureCacheError, match=r"needs layers \[0\]"):
        fc.open_cache(built.folder, more_layers, create=True)
    other_data = fc.make_spec(built.target, [1], cfg, train[:-1], evaluation, 20)
    with pytest.raises(fc.FeatureCacheError, match="other data"):
        fc.open_cache(built.folder, other_data, create=True)
    fewer_layers = fc.make_spec(built.target, [], FeaturesConfig(dtype="float32", top_k_logits=2), train, evaluation, 20)
    fc.open_cache(built.folder, fewer_layers, create=True)  # a superset serves


def test_build_refuses_when_the_disk_is_too_small(built, tmp_path, monkeypatch):
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(fc.shutil, "disk_usage", lambda _: Usage(10**9, 10**9, 1000))
    folder = tmp_path / "small"
    with pytest.raises(fc.FeatureCacheError, match="needs .* more but the disk has"):
        fc.build_cache(built.target, built.spec, built.splits, built.collator, folder, 60, 3, 0.0, say=lambda _: None, progress=False)
    assert not folder.exists()  # refused before writing anything


# ----------------------------------------------------------------------------- training


def test_training_from_the_cache_gives_online_losses_without_decoder_layers(tmp_path, tiny_llama_dir):
    online_path = recipe_file(tmp_path, tiny_llama_dir, "online")
    _, online_summary = train(online_path)
    cached_path = recipe_file(tmp_path, tiny_llama_dir, "cached", "mode: cache, dtype: float32")
    assert cli.main(["prepare", str(cached_path)]) == 0
    (built,) = (tmp_path / "data").glob("features-*/index.json")  # features-<key>: no layers besides the final state
    assert built.parent.name == f"features-{fc.read_spec(built.parent).key()}"
    trainer, cached_summary = train(cached_path)
    # The decoder layers are gone: any call would raise. Only embed/lm_head callables remain.
    assert all(type(layer).__name__ == "_DroppedDecoderLayer" for layer in trainer.target.layers)
    a, b = losses(tmp_path / "online"), losses(tmp_path / "cached")
    assert sorted(a) == sorted(b) == list(range(1, 9))
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-5), step
    assert cached_summary["top1"] == pytest.approx(online_summary["top1"])


def test_hybrid_runs_the_target_only_in_the_first_epoch(tmp_path, tiny_llama_dir):
    # 20 train examples, 4 per optimizer step: epoch 0 ends at step 5; step 8 is in epoch 1.
    path = recipe_file(tmp_path, tiny_llama_dir, "hybrid", "mode: hybrid, dtype: float32, shard_tokens: 200")
    calls = []

    def count_target_calls(trainer):
        original = trainer.target.features

        def features(*args, **kwargs):
            calls.append((trainer.step, trainer.stream.epoch))
            return original(*args, **kwargs)

        trainer.target.features = features

    train(path, before_train=count_target_calls)
    # trainer.step is the number of finished steps: epoch 0 is steps 0..4, two micro-batches each;
    # the final evaluation (step 8) computes the held-out examples once.
    assert [c for c in calls if c[0] < 8] == [(s, 0) for s in range(5) for _ in range(2)], calls
    assert len([c for c in calls if c[0] == 8]) == 2
    online = recipe_file(tmp_path, tiny_llama_dir, "online2")
    train(online)
    a, b = losses(tmp_path / "online2"), losses(tmp_path / "hybrid")
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-5), step
    # A second hybrid run finds the cache complete: the target's decoder layers are freed at once
    # (any call would raise), and it trains as the first did.
    again, _ = train(path, f"output_dir={tmp_path / 'hybrid-again'}")
    assert all(type(layer).__name__ == "_DroppedDecoderLayer" for layer in again.target.layers)
    c = losses(tmp_path / "hybrid-again")
    assert sorted(c) == sorted(b) and all(c[step] == pytest.approx(b[step], rel=1e-5) for step in b)


def test_cli_refuses_a_cache_of_another_target_in_one_line(tmp_path, tiny_llama_dir, capsys):
    """At the folder data.features.dir names; by default another target's features go to a folder
    of their own (test_variants_of_the_data_keep_a_feature_cache_each)."""
    from draftsmith.testing import save_tiny_model

    path = recipe_file(tmp_path, tiny_llama_dir, "first", f"mode: cache, dtype: float32, dir: {tmp_path / 'mine'}")
    assert cli.main(["prepare", str(path)]) == 0
    other = save_tiny_model(tmp_path / "other-target", "llama", seed=3)
    capsys.readouterr()
    code = cli.main(["train", str(path), f"target.path={other}", f"output_dir={tmp_path / 'second'}"])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert code == 2
    assert len(errors) == 1 and "built for another target" in errors[0], errors
    assert not (tmp_path / "second" / "checkpoints").exists()


def test_variants_of_the_data_keep_a_feature_cache_each(tmp_path, tiny_llama_dir, capsys):
    """A trial on fewer conversations, then the full run, in one data cache (the walk-through's
    trap: the second was refused once its answers were made). Each gets its own features-<key>;
    running either again reads its own, and a folder made before keys (no key in its name) that
    serves the run is read as it is."""
    path = recipe_file(tmp_path, tiny_llama_dir, "v", "mode: cache, dtype: float32")
    assert cli.main(["prepare", str(path), "data.limit=12"]) == 0
    (trial,) = (tmp_path / "data").glob("features-*")
    assert cli.main(["prepare", str(path)]) == 0
    (full,) = set((tmp_path / "data").glob("features-*")) - {trial}
    assert fc.read_spec(trial).data != fc.read_spec(full).data
    assert full.name == f"features-{fc.read_spec(full).key()}" and trial.name == f"features-{fc.read_spec(trial).key()}"
    assert cli.main(["prepare", str(path)]) == 0 and set((tmp_path / "data").glob("features-*")) == {trial, full}
    # A cache that does not serve the run is named, with why, before another is built.
    printed = capsys.readouterr().out
    assert f"note: feature cache {trial} was built for other data" in printed and f"this run's features go to {full}" in printed, printed
    # The full run's cache under the key-less name an older draftsmith gave it: read there.
    full.rename(tmp_path / "data" / "features")
    trainer, _ = train(path)
    assert trainer.source.cache.folder == tmp_path / "data" / "features"
    assert set((tmp_path / "data").glob("features-*")) == {trial}


def test_the_default_cache_folder_is_named_after_the_layers_so_heads_sharing_data_do_not_collide(tmp_path):
    from draftsmith.recipe import FeaturesConfig
    from draftsmith.trainers.features import features_dir

    assert features_dir(FeaturesConfig(), tmp_path, []) == tmp_path / "features"
    assert features_dir(FeaturesConfig(), tmp_path, [26, 1, 14]) == tmp_path / "features-l1-14-26"
    assert features_dir(FeaturesConfig(), tmp_path, [29]) != features_dir(FeaturesConfig(), tmp_path, [1, 14, 26])
    assert features_dir(FeaturesConfig(dir=str(tmp_path / "mine")), tmp_path, [3]) == tmp_path / "mine"
