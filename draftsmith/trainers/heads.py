"""The head trainer: draft heads (Medusa, ...) learn from a frozen target's features.

Only the head's parameters reach the optimizer; the target runs under no_grad and never enters a
checkpoint. Heads hide their differences behind DraftHead.loss, so nothing here branches on kind.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor, nn

from draftsmith.heads import HEADS, DraftHead
from draftsmith.heads.base import depth_labels
from draftsmith.recipe import Recipe, save_resolved
from draftsmith.target import FrozenTarget, TargetFeatures
from draftsmith.trainers import loop


class HeadTrainStep(nn.Module):
    """The module the engine wraps: its forward is the head's loss, so DDP/DeepSpeed see one call."""

    def __init__(self, head: DraftHead) -> None:
        super().__init__()
        self.head = head

    def forward(self, features: TargetFeatures, loss_mask: Tensor, segment_ids: Optional[Tensor] = None):
        return self.head.loss(features, loss_mask, segment_ids)


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


class HeadTrainer:
    needs_head = True

    def __init__(self, recipe: Recipe, argv: Optional[list[str]] = None) -> None:
        self.recipe = recipe
        self.argv = argv if argv is not None else loop.command_line()
        self.output_dir = Path(recipe.output_dir)

    # ------------------------------------------------------------------ setup

    def setup(self) -> "HeadTrainer":
        from draftsmith.data import BatchStream, Collator, prepare_data

        r = self.recipe
        self.accelerator = acc = loop.make_accelerator(r.train)
        torch.manual_seed(r.train.seed)
        if acc.is_main_process:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            save_resolved(r, self.output_dir, self.argv)
            loop.clear_partial_checkpoints(self.output_dir)
        self.resume_from = loop.find_resume_checkpoint(self.output_dir, r.train.resume)

        self.target = FrozenTarget.from_config(r.target).to(acc.device)
        tokenizer = self.target.tokenizer
        cache_dir = Path(r.data.cache_dir) if r.data.cache_dir else self.output_dir / "data"
        # The main process prepares (and regenerates) the data; the others then read its cache.
        with acc.main_process_first():
            self.data = prepare_data(
                r.data, tokenizer, cache_dir, target_model=self.target.model, progress=acc.is_main_process
            )

        head_cls = HEADS[r.head.kind]
        self.head = head_cls(r.head, self.target.dims)
        self.head.init_from_target(self.target)
        self.step_module = HeadTrainStep(self.head)
        optimizer = loop.build_optimizer(self.head.parameters(), r.train)
        self.scheduler = loop.build_scheduler(optimizer, r.train)
        self.model, self.optimizer = acc.prepare(self.step_module, optimizer)
        acc.register_for_checkpointing(self.scheduler)

        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.collator = Collator(pad_token_id=pad, max_length=r.data.max_length, packing=r.data.packing)
        self.stream = BatchStream(
            self.data.train,
            batch_size=r.train.micro_batch_size,
            collator=self.collator,
            seed=r.data.seed,
            shuffle=True,
            rank=acc.process_index,
            world_size=acc.num_processes,
        )
        self.metrics = loop.MetricsLog(self.output_dir, enabled=acc.is_main_process)
        self.step = 0
        if self.resume_from is not None:
            state = loop.load_checkpoint(acc, self.resume_from)
            self.step = state["step"]
            self.stream.load_state_dict(state["data"])
            self.metrics.truncate_after(self.step)
            loop.log(f"resumed from {self.resume_from} at step {self.step}")
        n_params = sum(p.numel() for p in self.head.parameters() if p.requires_grad)
        loop.log(
            f"target {r.target.path}: {self.target.dims.num_layers} layers, hidden {self.target.dims.hidden_size}, "
            f"vocab {self.target.dims.vocab_size}; head {r.head.kind} with {n_params:,} trainable parameters; "
            f"{len(self.data.train)} train / {len(self.data.eval)} eval examples"
        )
        return self

    # ------------------------------------------------------------------ steps

    def _features(self, batch: dict) -> TargetFeatures:
        device = self.accelerator.device
        features = self.target.features(
            batch["input_ids"].to(device),
            attention_mask=batch["attention_mask"].to(device),
            position_ids=batch["position_ids"].to(device) if "position_ids" in batch else None,
            layers=self.head.required_layers(),
            need_logits=False,
        )
        # The head trains in fp32 (or under autocast) whatever precision the target runs in.
        head_dtype = next(self.head.parameters()).dtype
        features.final_hidden = features.final_hidden.to(head_dtype)
        features.hidden = {i: h.to(head_dtype) for i, h in features.hidden.items()}
        return features

    def train_step(self) -> dict:
        """One optimizer step over grad_accum_steps micro-batches. Returns logged values."""
        acc, r = self.accelerator, self.recipe
        losses = []
        for _ in range(r.train.grad_accum_steps):
            batch = self.stream.next_batch()
            features = self._features(batch)
            with acc.accumulate(self.model):
                loss, _stats = self.model(
                    features, batch["loss_mask"].to(acc.device), batch.get("segment_ids", None)
                )
                acc.backward(loss)
                if acc.sync_gradients:
                    grad_norm = acc.clip_grad_norm_(self.head.parameters(), r.train.max_grad_norm)
                    self.optimizer.step()
                    self.scheduler.step()
                    self.optimizer.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        mean = torch.stack(losses).mean()
        mean = acc.reduce(mean, reduction="mean") if acc.num_processes > 1 else mean
        return {
            "loss": float(mean),
            "lr": self.scheduler.get_last_lr()[0],
            "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
        }

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Per-depth top-1/top-5 accuracy on held-out conversations and the simulated chain length."""
        acc, r = self.accelerator, self.recipe
        self.head.eval()
        K = self.head.depth
        hits = torch.zeros(2, K, dtype=torch.float64, device=acc.device)
        counts = torch.zeros(K, dtype=torch.float64, device=acc.device)
        examples = self.data.eval[acc.process_index :: acc.num_processes]
        for start in range(0, len(examples), r.train.micro_batch_size):
            batch = self.collator(examples[start : start + r.train.micro_batch_size])
            features = self._features(batch)
            logits = self.head(features)  # [B,T,K,V]
            labels, valid = depth_labels(
                features.input_ids, batch["loss_mask"].to(acc.device), K, batch.get("segment_ids")
            )
            top5 = logits.topk(min(5, logits.shape[-1]), dim=-1).indices  # [B,T,K,5]
            hit1 = (top5[..., 0] == labels) & valid
            hit5 = (top5 == labels.unsqueeze(-1)).any(-1) & valid
            hits[0] += hit1.sum(dim=(0, 1)).double()
            hits[1] += hit5.sum(dim=(0, 1)).double()
            counts += valid.sum(dim=(0, 1)).double()
        if acc.num_processes > 1:
            hits = acc.reduce(hits, reduction="sum")
            counts = acc.reduce(counts, reduction="sum")
        self.head.train()
        top1 = (hits[0] / counts.clamp_min(1)).tolist()
        top5 = (hits[1] / counts.clamp_min(1)).tolist()
        return {
            "top1": top1,
            "top5": top5,
            "positions": int(counts[0].item()) if K else 0,
            "simulated_accept_length": simulated_accept_length(top1),
        }

    def save(self) -> Path:
        dims = self.target.dims
        state = {
            "data": self.stream.state_dict(),
            "head": asdict(self.recipe.head),
            "target": {
                "path": self.recipe.target.path,
                "hidden_size": dims.hidden_size,
                "vocab_size": dims.vocab_size,
                "num_layers": dims.num_layers,
                "model_type": dims.hf_config.get("model_type", ""),
            },
            "last_eval": getattr(self, "last_eval", None),
        }
        path = loop.save_checkpoint(
            self.accelerator, self.output_dir, self.step, state, self.recipe, self.recipe.train.keep_last
        )
        self.last_checkpoint = path
        return path

    # ------------------------------------------------------------------ the loop

    def train(self) -> dict:
        from tqdm.auto import tqdm

        acc, r = self.accelerator, self.recipe
        self.last_checkpoint = loop.list_checkpoints(self.output_dir)[-1] if self.resume_from else None
        stop = loop.StopFlag()
        restore = loop.install_stop_handlers(stop)
        self.head.train()
        bar = tqdm(total=r.train.max_steps, initial=self.step, desc="train", disable=not acc.is_main_process, dynamic_ncols=True)
        started, result = time.time(), {}
        try:
            while self.step < r.train.max_steps:
                values = self.train_step()
                self.step += 1
                bar.update(1)
                if not math.isfinite(values["loss"]):
                    where = f"; the last good checkpoint is {self.last_checkpoint}" if self.last_checkpoint else ""
                    raise loop.TrainingError(f"loss became {values['loss']} at step {self.step}{where}")
                bar.set_postfix(loss=f"{values['loss']:.4f}", lr=f"{values['lr']:.2e}")
                if self.step % r.train.log_every == 0 or self.step == 1:
                    self.metrics.write(self.step, "train", values)
                if self.step % r.train.eval_every == 0 or self.step == r.train.max_steps:
                    result = self.last_eval = self.evaluate()
                    self.metrics.write(self.step, "eval", result)
                    bar.write(format_eval(self.step, result)) if acc.is_main_process else None
                stopping = loop.any_rank(acc, stop.requested)
                if self.step % r.train.save_every == 0 or self.step == r.train.max_steps or stopping:
                    self.save()
                if stopping:
                    loop.log(f"stopped at step {self.step}; resume with the same command. Checkpoint: {self.last_checkpoint}")
                    break
        finally:
            bar.close()
            restore()
        elapsed = time.time() - started
        if self.step >= r.train.max_steps and not result:
            result = self.evaluate()
        summary = {"step": self.step, "seconds": round(elapsed, 1), **result, "checkpoint": str(self.last_checkpoint)}
        if acc.is_main_process:
            (self.output_dir / "final_metrics.json").write_text(json.dumps(summary, indent=2))
        return summary

    def close(self) -> None:
        """Release the engine and the process group so every rank exits cleanly."""
        acc = self.accelerator
        self.model = self.optimizer = self.step_module = None
        self.metrics.close()
        loop.teardown(acc)


def format_eval(step: int, result: dict) -> str:
    top1 = " ".join(f"{a:.3f}" for a in result["top1"])
    top5 = " ".join(f"{a:.3f}" for a in result["top5"])
    return (
        f"step {step}: per-head top-1 [{top1}]  top-5 [{top5}]  "
        f"simulated accepted length {result['simulated_accept_length']:.3f}  ({result['positions']} positions)"
    )
