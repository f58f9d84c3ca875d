"""The head trainer: draft heads (Medusa, ...) learn from a frozen target's features.

Only the head's parameters reach the optimizer; the target runs under no_grad and never enters a
checkpoint. Heads hide their differences behind DraftHead.loss, so nothing here branches on kind.

Where features come from (data.features.mode): the target on every batch (online), a cache built
once by `draftsmith prepare` (cache: the target's decoder layers are dropped, only its embedding
and LM head stay, as callables), or the target during the first epoch and the cache after (hybrid).

At scale: the target is a full frozen copy per rank, outside the engine (DDP never broadcasts it,
DeepSpeed never partitions or saves it), or with deepspeed.shard_target a ZeRO-3 partitioned module
inside the engine, excluded from checkpoints as a frozen parameter. Each micro-batch's loss is
weighted by its share of the trained positions of the whole optimizer step, so DDP, DeepSpeed and
gradient accumulation all give the loss (and gradient) of one big batch.
"""

from __future__ import annotations

import contextlib
import itertools
import json
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Optional, Union

import torch
from torch import Tensor, nn

from draftsmith.atomic import write_atomic
from draftsmith.data.collate import Batch
from draftsmith.heads import HEADS, DraftHead
from draftsmith.heads.base import depth_labels
from draftsmith.recipe import Recipe, RecipeError
from draftsmith.runs import log
from draftsmith.runtime.tree import sparse_tree
from draftsmith.target import FrozenTarget, TargetFeatures, gathered_parameters, load_causal_lm, resolve_dtype
from draftsmith.trainers import engine, loop
from draftsmith.trainers.base import Trainer, trainable_parameters
from draftsmith.trainers.data import pad_token_id, prepare_shared_data
from draftsmith.trainers.features import FeatureSource, build_feature_cache


# Candidate ranks whose held-out accuracy evaluation measures (top-1, top-5 and the sparse tree's input).
EVAL_RANKS = 10


class HeadTrainStep(nn.Module):
    """The module the engine wraps: its forward is the head's loss (or, without a loss mask, its
    EVAL_RANKS best tokens per position and depth [B,T,K,R], for evaluation), so DDP and DeepSpeed
    see one call.

    `features` may be a zero-argument callable: the target then runs inside the engine's forward,
    where ZeRO-3 gathers a partitioned target's weights. `target_model` (deepspeed.shard_target
    only) registers the target here so ZeRO-3 partitions it; otherwise it stays outside the engine.
    """

    def __init__(self, head: DraftHead, target_model: Optional[nn.Module] = None) -> None:
        super().__init__()
        self.head = head
        if target_model is not None:
            self.target = target_model

    def forward(
        self,
        features: Union[TargetFeatures, Callable[[], TargetFeatures]],
        loss_mask: Optional[Tensor] = None,
        segment_ids: Optional[Tensor] = None,
        token_weights: Optional[Tensor] = None,
    ):
        if callable(features):
            features = features()
        if loss_mask is None:
            return self.head.top_tokens(features, EVAL_RANKS)
        if token_weights is not None:  # only heads that take it (EAGLE-3's lookup weighting)
            return self.head.loss(features, loss_mask, segment_ids, token_weights=token_weights)
        return self.head.loss(features, loss_mask, segment_ids)


def lookup_token_weights(input_ids: Tensor, segment_ids: Tensor, matcher: str, hit_weight: float) -> Tensor:
    """weights [B,T] float (host): ``hit_weight`` where the lookup drafter ``matcher`` ("suffix",
    "lookup"), reading each packed example from its start, would have proposed the token from the
    text before it (runtime.lookup.lookup_hits), 1 elsewhere. Every row of every example is read."""
    from draftsmith.runtime.lookup import lookup_hits, make_matcher

    weights = torch.ones(input_ids.shape, dtype=torch.float32)
    for b, (row, segments) in enumerate(zip(input_ids.tolist(), segment_ids.tolist())):
        start = 0
        for segment, run in itertools.groupby(segments):  # an example's tokens, or padding (0)
            end = start + len(list(run))
            if segment > 0:
                hits = lookup_hits(row[start:end], make_matcher(matcher))
                weights[b, start:end] = torch.tensor([hit_weight if hit else 1.0 for hit in hits])
            start = end
    return weights


def trained_positions(batch: dict) -> int:
    """Positions of a collated batch that carry a depth-1 label (the unit the loss averages over)."""
    _, valid = depth_labels(batch["input_ids"], batch["loss_mask"], 1, batch.get("segment_ids"))
    return int(valid.sum())


def simulated_accept_length(top1: list[float]) -> float:
    """Mean accepted length of a chain drafted by heads with these top-1 accuracies.

    tau = 1 + sum_k prod_{j<=k} acc_j: the target's own token plus each draft token, accepted only
    if every earlier one was (accuracies treated as independent).
    """
    total, run = 1.0, 1.0
    for acc in top1:
        run *= acc
        total += run
    return total


class HeadTrainer(Trainer):
    def __init__(self, recipe: Recipe, argv: Optional[list[str]] = None) -> None:
        super().__init__(recipe, argv)
        self.source: Optional[FeatureSource] = None

    # ------------------------------------------------------------------ setup

    @staticmethod
    def prepare(recipe: Recipe) -> dict:
        """``draftsmith prepare``: the tokenized data (answers regenerated by the target), and with
        data.features.mode=cache the feature cache of the layers the head reads. Under a launcher
        the ranks share the work. Returns summary counts."""
        acc = engine.make_accelerator(recipe.train)
        try:
            target = FrozenTarget.from_config(recipe.target, acc.device)
            data = prepare_shared_data(recipe, acc, target.tokenizer, target.model)
            stats = {**data.stats, "data_dir": str(recipe.data_dir().resolve())}
            if recipe.data.features.mode == "cache":
                head = build_head(recipe, target.dims)
                stats.update(build_feature_cache(recipe, target, data, head.required_layers(), acc))
            return stats
        finally:
            engine.teardown(acc)

    def setup(self) -> "HeadTrainer":
        from draftsmith.data import Collator

        r = self.recipe
        self.start_run()
        acc = self.accelerator
        self.shard_target = bool(r.deepspeed.shard_target and engine.uses_deepspeed(acc))
        if self.shard_target and r.data.regenerate.enabled:
            raise engine.TrainingError(
                "deepspeed.shard_target cannot regenerate answers (a partitioned target cannot generate before training "
                "starts): regenerate in a run without shard_target, then train on that data with data.regenerate.enabled=false"
            )
        self.target = load_target(r, acc, self.shard_target)
        tokenizer = self.target.tokenizer
        self.data = prepare_shared_data(r, acc, tokenizer, None if self.shard_target else self.target.model)

        self.head = build_head(r, self.target.dims)
        try:
            chose = self.head.init_from_data(self.data.train)
        except ValueError as err:  # a head setting the data contradicts: bad input, named by the head
            raise RecipeError(str(err)) from None
        if chose:
            log(f"head {r.head.kind}: {chose}")
        with self._target_io_weights():
            chose = self.head.init_from_target(self.target)
        if chose:
            log(f"head {r.head.kind}: {chose}")
        pad = pad_token_id(tokenizer)
        self.collator = Collator(pad_token_id=pad, max_length=r.data.max_length, packing=r.data.packing)
        self.source = FeatureSource(
            r, self.target, self.head.required_layers(), self.data, acc, self.shard_target,
            Collator(pad_token_id=pad, max_length=r.data.max_length), next(self.head.parameters()).dtype,
        )  # fmt: skip

        self.prepare_engine(HeadTrainStep(self.head, self.target.model if self.shard_target else None), self.head.parameters())
        self.stream = self.batch_stream(self.data.train, self.collator)
        # The last evaluation comes back too: the tree of the next checkpoint comes from it until the next evaluation.
        self.resume()
        self.record(
            f"target {r.target.path}: {self.target.dims.num_layers} layers, hidden {self.target.dims.hidden_size}, "
            f"vocab {self.target.dims.vocab_size}; head {r.head.kind} with {trainable_parameters(self.head):,} trainable "
            f"parameters; {len(self.data.train)} train / {len(self.data.eval)} eval examples; features {r.data.features.mode}",
        )
        return self

    def _target_io_weights(self):
        """The target's embedding, LM head and final norm weights in full inside the block (ZeRO-3 shard_target)."""
        if not self.shard_target:
            return contextlib.nullcontext()
        model = self.target.model
        norm = getattr(model.base_model, "norm", None)  # heads with their own final norm start from it
        extra = [norm.weight] if getattr(norm, "weight", None) is not None else []
        return gathered_parameters([model.get_input_embeddings().weight, model.get_output_embeddings().weight, *extra])

    # ------------------------------------------------------------------ steps

    def advance(self) -> tuple[int, dict]:
        """One optimizer step over grad_accum_steps micro-batches. Returns (step, logged values).

        Every micro-batch's loss is a mean over its own trained positions; it is weighted by its
        share of the step's trained positions over all ranks, so the step's gradient and logged loss
        are those of one batch holding all of them, whatever the world size and accumulation.
        """
        acc, r = self.accelerator, self.recipe
        micro = []
        for _ in range(r.train.grad_accum_steps):
            ids = self.stream.next_indices()
            batch = self.collator([self.data.train[i] for i in ids])
            hit_weight = getattr(self.head.cfg, "lookup_hit_weight", 1.0)
            if hit_weight != 1.0:
                batch["token_weights"] = lookup_token_weights(batch["input_ids"], batch["segment_ids"], self.head.cfg.lookup_matcher, hit_weight)
            # Counted on the host batch (no device sync); the model gets the batch moved once.
            micro.append((ids, batch.to(acc.device), trained_positions(batch), int((batch["segment_ids"] > 0).sum())))
        self.source.after_epoch(self.stream.epoch)
        tokens = sum(m[3] for m in micro)
        local = torch.tensor([float(sum(m[2] for m in micro)), float(tokens)], device=acc.device, dtype=torch.float64)
        counts = acc.reduce(local, reduction="sum") if acc.num_processes > 1 else local
        total, tokens = float(counts[0]), int(counts[1])
        # DDP/DeepSpeed average gradients over ranks and accelerate divides by the accumulation.
        unit = acc.num_processes * r.train.grad_accum_steps / max(total, 1.0)
        weighted = torch.zeros((), dtype=torch.float64, device=acc.device)

        def micro_loss(ids: list[int], batch: Batch, count: int) -> Callable[[], Tensor]:
            def compute() -> Tensor:
                nonlocal weighted
                loss, _stats = self.model(
                    lambda: self.source.features("train", ids, batch), batch["loss_mask"], batch["segment_ids"], batch.get("token_weights")
                )
                weighted += loss.detach().double() * count
                return loss * (count * unit)

            return compute

        grad_norm = loop.optimizer_step(self, [micro_loss(*m[:3]) for m in micro], self.head.parameters())
        if acc.num_processes > 1:
            weighted = acc.reduce(weighted.reshape(1), reduction="sum")[0]
        self.step += 1
        return self.step, {
            "loss": float(weighted) / max(total, 1.0),
            "lr": self.scheduler.get_last_lr()[0],
            "grad_norm": grad_norm,
            "tokens": tokens,  # real (non-padding) tokens of the step over all ranks
        }

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Per-depth top-1/top-5 accuracy on held-out conversations, the accuracy of each candidate
        rank per depth (the sparse tree's input) and the simulated chain length."""
        acc = self.accelerator
        self.head.eval()
        K = self.head.depth
        hits = torch.zeros(K, EVAL_RANKS, dtype=torch.float64, device=acc.device)
        counts = torch.zeros(K, dtype=torch.float64, device=acc.device)
        for ids, counted in self.eval_rounds(list(range(len(self.data.eval)))):
            batch = self.collator([self.data.eval[i] for i in ids]).to(acc.device)
            top = self.model(lambda ids=ids, batch=batch: self.source.features("eval", ids, batch))  # [B,T,K,R]
            if not counted:
                continue
            labels, valid = depth_labels(batch["input_ids"], batch["loss_mask"], K, batch["segment_ids"])
            hit = (top == labels.unsqueeze(-1)) & valid.unsqueeze(-1)  # [B,T,K,R]; a vocabulary under R ranks gives fewer
            hits[:, : hit.shape[-1]] += hit.sum(dim=(0, 1)).double()
            counts += valid.sum(dim=(0, 1)).double()
        if acc.num_processes > 1:
            hits = acc.reduce(hits, reduction="sum")
            counts = acc.reduce(counts, reduction="sum")
        self.head.train()
        rank_accuracy = hits / counts.clamp_min(1).unsqueeze(-1)  # [K,R]; the ranks' events are disjoint
        top1 = rank_accuracy[:, 0].tolist()
        return {
            "top1": top1,
            "top5": rank_accuracy[:, :5].sum(-1).tolist(),
            "rank_accuracy": rank_accuracy.tolist(),
            "positions": int(counts[0].item()) if K else 0,
            "simulated_accept_length": simulated_accept_length(top1),
        }

    def tree(self) -> Optional[dict]:
        """The sparse tree of train.tree_nodes nodes from the last evaluation's rank accuracies, or None."""
        last = self.last_eval
        nodes = self.recipe.train.tree_nodes
        if not nodes or not last or not last.get("positions"):
            return None
        return sparse_tree(last["rank_accuracy"], nodes).to_dict()

    def describe(self, step: int, result: dict) -> str:
        return format_eval(step, result, self.recipe.train.tree_nodes)

    def drafter_kind(self) -> str:
        return self.recipe.head.kind

    def checkpoint_state(self) -> dict:
        dims = self.target.dims
        return {
            "head": asdict(self.head.cfg),
            "target": {
                "path": self.recipe.target.path,
                "hidden_size": dims.hidden_size,
                "vocab_size": dims.vocab_size,
                "num_layers": dims.num_layers,
                "model_type": dims.hf_config.get("model_type", ""),
                "hf_config": dims.hf_config,
            },
            "tree": self.tree(),
        }

    def checkpoint_weights(self) -> Optional[dict[str, Tensor]]:
        acc = self.accelerator
        return engine.full_state_dict(acc, self.head, "head.") if engine.uses_deepspeed(acc) else None

    def save(self) -> Path:
        self.source.flush()  # features computed so far survive an interruption
        return super().save()

    # ------------------------------------------------------------------ the loop

    def train(self) -> dict:
        acc, r = self.accelerator, self.recipe
        self.head.train()
        result, elapsed = loop.run_loop(self, loop.Schedule.steps(r.train), self.step, "train")
        if self.step >= r.train.max_steps and not result:
            result = self.last_eval = self.evaluate()  # resumed after the last step: report the final figures anyway
        summary = {"step": self.step, "seconds": round(self.train_seconds(elapsed), 1), **result, **engine.peak_memory(acc), "checkpoint": str(self.last_checkpoint)}
        tree = self.tree()
        if tree is not None:
            summary["tree"] = {k: tree[k] for k in ("choices", "expected_accept_length")}
        if acc.is_main_process and not self.nothing_to_train:
            write_atomic(self.output_dir / "final_metrics.json", json.dumps(summary, indent=2))
        return summary

    def release(self) -> None:
        if self.source is not None:
            self.source.close()


def build_head(recipe: Recipe, dims) -> DraftHead:
    """The recipe's head for a target of `dims`; a setting this target cannot take (a layer it
    lacks, a vocabulary larger than its own) is a RecipeError naming the key."""
    try:
        return HEADS[recipe.head.kind](recipe.head, dims)
    except ValueError as err:
        raise RecipeError(str(err)) from None


def load_target(recipe: Recipe, accelerator, shard: bool) -> FrozenTarget:
    """The frozen target: a full copy on this rank's device, or (shard) loaded straight into ZeRO-3
    partitions with zero.Init, so no rank ever holds all of it."""
    cfg = recipe.target
    if not shard:
        return FrozenTarget.from_config(cfg, accelerator.device)
    dtype = resolve_dtype(cfg.dtype, "target", accelerator.device)
    model, tokenizer = load_causal_lm(cfg.path, dtype, cfg.gguf_file, what="target", device=None)
    # FrozenTarget reads the vocabulary size off the LM head's weight, which is partitioned.
    with gathered_parameters([model.get_output_embeddings().weight]):
        return FrozenTarget(model, tokenizer, source=cfg.path)


def format_eval(step: int, result: dict, tree_nodes: int = 0) -> str:
    top1 = " ".join(f"{a:.3f}" for a in result["top1"])
    top5 = " ".join(f"{a:.3f}" for a in result["top5"])
    line = (
        f"step {step}: per-head top-1 [{top1}]  top-5 [{top5}]  "
        f"simulated accepted length {result['simulated_accept_length']:.3f}  ({result['positions']} positions)"
    )
    if tree_nodes and result.get("positions"):
        tree = sparse_tree(result["rank_accuracy"], tree_nodes)
        line += f"; sparse tree of {tree_nodes} nodes: expected accepted length {tree.expected_accept_length:.3f}"
    return line
