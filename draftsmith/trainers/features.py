"""Where the head trainer gets the target's features, per data.features.mode:

- online: the target runs on every batch;
- cache: a cache built once (``draftsmith prepare``, or the first ``train``) is read; the target's
  decoder layers are dropped, only its embedding and LM head stay, as callables;
- hybrid: the target runs during the first epoch, and what it computes is cached for later epochs.

Under several processes the ranks split the cache build; with a ZeRO-3 partitioned target
(deepspeed.shard_target) the target runs as a collective, so every rank takes the same branch.
The storage format itself is data/features.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from torch import nn

from draftsmith.data import features as fc
from draftsmith.data.collate import Batch
from draftsmith.recipe import Recipe
from draftsmith.runs import log
from draftsmith.target import FrozenTarget, TargetFeatures
from draftsmith.trainers.engine import TrainingError, any_rank


def features_dir(cfg, data_dir: Path, layers, spec: Optional[fc.FeatureSpec] = None, say=None) -> Path:
    """data.features.dir, or by default a folder of the data cache named after the decoder layers
    the head reads (``features`` for the final hidden state alone, ``features-l1-14-26`` for
    EAGLE-3's), so recipes that share one data cache (Medusa, EAGLE-3, Clover on the same answers)
    each keep their own feature cache instead of refusing each other's; and, given the ``spec``
    the run wants, after what they were computed from (``features-l1-14-26-<spec.key()>``), so a
    trial run on fewer examples, another target or another precision keeps its own beside the
    others, as the data cache keeps each variant's answers. A cache of those layers that already
    serves the spec is read wherever it is (the key-less folder of an older draftsmith, one with
    more top-k logits); where one was found that does not, ``say`` is told why, before a new one
    is built (prepare on another device than train gives another precision, so other features)."""
    if cfg.dir:
        return Path(cfg.dir)
    layers = sorted(set(layers))
    base = data_dir / ("features" + ("-l" + "-".join(str(i) for i in layers) if layers else ""))
    if spec is None:
        return base
    keyed = base.with_name(f"{base.name}-{spec.key()}")
    found = [base] + sorted(p for p in data_dir.glob(f"{base.name}-*") if p.name[len(base.name) + 1 :].isalnum())
    refusals = []
    for folder in [keyed] + [f for f in found if f != keyed]:
        try:
            stored = fc.read_spec(folder)
            if stored is not None:
                stored.check_serves(spec, folder)
                return folder
        except fc.FeatureCacheError as err:  # an unreadable index, or a cache of something else
            refusals.append(str(err).split(": set data.features.dir")[0].split(": delete")[0].split("; delete")[0])
    if refusals and say is not None:
        say(f"note: {refusals[0]}" + (f" (and {len(refusals) - 1} more)" if len(refusals) > 1 else "") + f"; this run's features go to {keyed}")
    return keyed


class _DroppedDecoderLayer(nn.Module):
    """Stands in for a target decoder layer when training from the feature cache (frees its memory)."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"target decoder layer {self.index} was dropped: this run trains from the feature cache")


def drop_decoder_layers(target: FrozenTarget) -> None:
    """Free the target's decoder layers for a run that reads its features from a cache: only its
    embedding, final norm and LM head stay (what a head's loss still calls). A forward through a
    dropped layer raises, naming it."""
    blocks = target.layers
    for i in range(len(blocks)):
        blocks[i] = _DroppedDecoderLayer(i)


class FeatureSource:
    """The target's features of a collated batch of examples, from the target or the cache.

    ``features(split, ids, batch)``: TargetFeatures of examples `ids` of `split` ("train" or "eval"),
    with final_hidden and the head's layers in `dtype` (the head's parameter dtype).
    """

    def __init__(
        self,
        recipe: Recipe,
        target: FrozenTarget,
        layers: list[int],
        data,
        accelerator,
        shard_target: bool,
        padding_collator,
        dtype: torch.dtype,
    ) -> None:
        self.recipe, self.target, self.data, self.accelerator = recipe, target, data, accelerator
        self.layers, self.shard_target, self.dtype = list(layers), shard_target, dtype
        self.cache: Optional[fc.FeatureCache] = None
        self.spec: Optional[fc.FeatureSpec] = None
        self._first_epoch_written = False
        if recipe.data.features.mode != "online":
            self._open(padding_collator)

    # ------------------------------------------------------------------ set-up

    def _open(self, padding_collator) -> None:
        """Open (and in cache mode build or complete) the cache."""
        r, acc, data = self.recipe, self.accelerator, self.data
        cfg = r.data.features
        spec = fc.make_spec(self.target, self.layers, cfg, data.train, data.eval, r.data.max_length)
        folder = features_dir(cfg, r.data_dir(), self.layers, spec, say=log)
        splits = {"train": data.train, "eval": data.eval}
        if cfg.mode == "cache":
            if self.shard_target:
                fc.open_cache(folder, spec, create=False)  # a cache of another target or layer set: one line
                probe = fc.FeatureCache(folder, spec) if fc.read_spec(folder) is not None else None
                if probe is None or any(probe.count(s) < len(splits[s]) for s in splits):
                    raise TrainingError(
                        f"the feature cache {folder} is missing or incomplete and a partitioned target (deepspeed.shard_target) "
                        "cannot build it: build it first with `draftsmith prepare` on this recipe (it loads the whole target on each rank)"
                    )
            else:
                fc.build_cache(
                    self.target, spec, splits, padding_collator, folder, cfg.shard_tokens, cfg.batch_size, cfg.reserve_gb,
                    rank=acc.process_index, world_size=acc.num_processes, barrier=acc.wait_for_everyone, say=log,
                    progress=acc.is_main_process,
                )
        else:
            # Every rank checks an existing index, so a cache of another target or layer set stops
            # them all with the same line (none is left waiting at the barrier below).
            fc.open_cache(folder, spec, create=False)
            if acc.is_main_process:
                tokens = sum(min(len(e["input_ids"]), r.data.max_length) for e in data.train + data.eval)
                fc.check_disk(folder, spec, tokens, sum(p.stat().st_size for p in folder.glob("*.safetensors")), cfg.reserve_gb, log)
                fc.open_cache(folder, spec, create=True)
            acc.wait_for_everyone()
            fc.open_cache(folder, spec, create=False)
        cache = fc.FeatureCache(folder, spec, rank=acc.process_index, shard_tokens=cfg.shard_tokens)
        complete = all(cache.count(split) >= len(examples) for split, examples in splits.items())
        if cfg.mode == "cache":
            for split, examples in splits.items():
                if cache.count(split) < len(examples):
                    raise fc.FeatureCacheError(f"feature cache {folder} holds {cache.count(split)} of {len(examples)} {split} examples after building")
            if not self.shard_target:
                drop_decoder_layers(self.target)
        elif complete and not self.shard_target:
            # Hybrid mode on a cache an earlier run completed: the target's decoder layers would
            # never run, so they go as in cache mode (at 8B, 14 GB the run does not hold).
            drop_decoder_layers(self.target)
            log(f"feature cache {folder} holds every example: the target's decoder layers are freed, its features are read from there")
        self.cache, self.spec = cache, spec

    # ------------------------------------------------------------------ reading

    def _lengths(self, split: str, ids: list[int]) -> list[int]:
        examples = self.data.train if split == "train" else self.data.eval
        return [min(len(examples[i]["input_ids"]), self.recipe.data.max_length) for i in ids]

    def features(self, split: str, ids: list[int], batch: Batch) -> TargetFeatures:
        """The target's features of a batch already on the device: from the cache when it holds
        every example of the batch, else from the target (and, in hybrid mode, added to the cache)."""
        cached = self.cache is not None and self.cache.has(split, ids)
        if self.cache is not None and self.shard_target:
            # The partitioned target runs as a collective: every rank takes the same branch.
            cached = not any_rank(self.accelerator, not cached)
        if cached:
            rows = self.cache.batch(split, ids, batch["segment_ids"], self._lengths(split, ids), self.dtype)
            return TargetFeatures(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                logits=None,
                hidden={i: rows[f"layer_{i}"] for i in self.spec.layers},
                final_hidden=rows["final_hidden"],
                embed=self.target.embed,
                lm_head=self.target.lm_head,
            )
        features = self.target.features(
            batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
            layers=self.spec.layers if self.spec is not None else self.layers,
            need_logits=False,
        )
        if self.cache is not None:
            self.cache.add(split, ids, fc.rows_from_features(self.target, self.spec, features, batch["segment_ids"], self._lengths(split, ids)))
        # The head trains in its own precision (fp32, or under autocast) whatever the target's.
        features.final_hidden = features.final_hidden.to(self.dtype)
        features.hidden = {i: h.to(self.dtype) for i, h in features.hidden.items()}
        return features

    def after_epoch(self, epoch: int) -> None:
        """Hybrid mode: once the first epoch is over, write out what it computed on every rank (all
        cross the epoch boundary at the same step), so later epochs read it instead of the target."""
        if self.cache is not None and epoch >= 1 and not self._first_epoch_written:
            self.cache.flush()
            self.accelerator.wait_for_everyone()
            self._first_epoch_written = True

    def flush(self) -> None:
        """Write buffered features, so what was computed survives an interruption."""
        if self.cache is not None:
            self.cache.flush()

    def close(self) -> None:
        if self.cache is not None:
            self.cache.flush()
            self.cache.close()


def build_feature_cache(recipe: Recipe, target: FrozenTarget, data, layers, accelerator) -> dict:
    """Build (or complete) the feature cache of `layers` for the prepared `data`; under a launcher
    the ranks split the shards. Returns its folder and size."""
    from draftsmith.data import Collator
    from draftsmith.trainers.data import pad_token_id

    cfg = recipe.data.features
    spec = fc.make_spec(target, layers, cfg, data.train, data.eval, recipe.data.max_length)
    folder = features_dir(cfg, recipe.data_dir(), layers, spec, say=log)
    fc.build_cache(
        target, spec, {"train": data.train, "eval": data.eval}, Collator(pad_token_id=pad_token_id(target.tokenizer), max_length=recipe.data.max_length),
        folder, cfg.shard_tokens, cfg.batch_size, cfg.reserve_gb, rank=accelerator.process_index, world_size=accelerator.num_processes,
        barrier=accelerator.wait_for_everyone, say=log, progress=accelerator.is_main_process,
    )  # fmt: skip
    size = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    return {"features_dir": str(folder), "feature_bytes": size, "bytes_per_token": spec.bytes_per_token()}
