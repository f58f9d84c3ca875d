"""The LayerSkip trainer: the target's own weights learn to predict from early exits, so that its
first layers can draft for the whole model (Elhoushi et al., 2024; the objective is in
distill/early_exit.py).

Per micro-batch: every sample skips layers at random (layer dropout: rates rising with depth, a
skipped layer's output is its input, the draw a function of seed, step and the sample's place in
the global batch); the model runs once; the outputs of the exits the curriculum enables at this step
go through the model's final norm and LM head at the answer positions, and their cross-entropies,
weighted by depth, are the loss. The last exit is the model's own output, so the ordinary LM loss is
always part of it. A skipped row still runs through its layer (its output is then discarded): the
forward and the gradients equal the skip, and every rank and engine sees the same computation.

What trains: every weight (a float32 master copy whatever target.dtype says; train.mixed_precision
sets the compute precision), or with layerskip.lora only peft adapters, which are then all a
checkpoint holds. Checkpoints record the drafter kind "early_exit": export writes the trained model
as a plain HF causal LM with its exit layer, eval decodes with it (runtime/early_exit.py).

Held-out evaluation (no dropout, the whole model): per exit layer E = 1..L-1 (the first E layers,
then the final norm and LM head), the top-1 agreement with the full model, the expected acceptance
1 - TVD of a token drafted from the exit, and its cross-entropy; and the full model's cross-entropy
on the held-out answers, which says what the training cost the model itself.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor, nn

from draftsmith.data.collate import Batch
from draftsmith.distill.early_exit import (
    best_exit, dropout_curriculum, early_exit_loss, exit_agreement, exit_cross_entropy, exit_curriculum, exit_loss_scales,
    layer_drop_mask, layer_dropout_rates,
)
from draftsmith.recipe import RecipeError
from draftsmith.runtime.early_exit import DEFAULT_DRAFT_LENGTH
from draftsmith.target import TargetLoadError, capture_layers, decoder_stack, load_causal_lm, resolve_dtype, with_lora
from draftsmith.trainers import loop
from draftsmith.trainers.base import Trainer, trainable_parameters
from draftsmith.trainers.data import pad_token_id, prepare_shared_data, prepare_with_target
from draftsmith.trainers.distill import predicted_mask

class LayerSkipStep(nn.Module):
    """The module the engine wraps: the model under training, with layer dropout hooks on its
    decoder layers. forward returns, at the selected positions, each requested exit's logits (or
    its post-norm hidden state), so DDP and DeepSpeed see one call that touches every weight used."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.stack = decoder_stack(model)
        self.num_layers = self.stack.num_layers
        self._drop: Optional[Tensor] = None
        for index, layer in enumerate(self.stack.layers):
            layer.register_forward_hook(self._dropout_hook(index), with_kwargs=True)

    def _dropout_hook(self, index: int):
        def hook(_module, args, kwargs, output):
            drop = self._drop
            if drop is None or not bool(drop[:, index].any()):
                return None
            given = args[0] if args else kwargs["hidden_states"]
            out = output[0] if isinstance(output, tuple) else output
            # A skipped row's output is its input: x_{l+1} = x_l, no rescaling.
            mixed = torch.where(drop[:, index].view(-1, 1, 1).to(out.device), given, out)
            return (mixed, *output[1:]) if isinstance(output, tuple) else mixed

        return hook

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        position_ids: Optional[Tensor],
        select: Tensor,
        exits: Sequence[int],
        drop: Optional[Tensor] = None,
        unembed: bool = True,
    ) -> tuple[Tensor, ...]:
        """input_ids [B,T]; select [B,T] bool, the positions whose predictions are wanted (N of them);
        exits: layer indices l (exit after layer l; L-1 is the model's output); drop [B,L] bool, the
        layers each row skips (training only). Returns one tensor per exit, in order: logits [N,V],
        or without `unembed` the final-norm output [N,D]. (A tuple: DeepSpeed's hooks walk outputs.)"""
        self._drop = drop if self.training else None
        last = self.num_layers - 1
        try:
            with capture_layers(self.stack.model, [l for l in exits if l != last]) as captured:
                out = self.stack.model.base_model(
                    input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
                )
        finally:
            self._drop = None
        result = []
        for l in exits:
            hidden = out.last_hidden_state[select] if l == last else self.stack.norm(captured[l][select])
            result.append(self.stack.lm_head(hidden) if unembed else hidden)
        return tuple(result)


def batch_inputs(batch: Batch, device) -> tuple[Tensor, Tensor, Optional[Tensor], Tensor, Tensor]:
    """(input_ids, attention_mask, position_ids, select [B,T], labels [N]) of a collated batch,
    moved to `device`: position t is trained when token t+1 is an answer token of the same example."""
    batch = batch.to(device)
    ids = batch["input_ids"]
    keep = predicted_mask(batch["loss_mask"], batch["segment_ids"])
    select = torch.zeros_like(ids, dtype=torch.bool)
    select[:, :-1] = keep
    return ids, batch["attention_mask"], batch["position_ids"], select, ids[:, 1:][keep]


class LayerSkipTrainer(Trainer):

    # ------------------------------------------------------------------ setup

    def setup(self) -> "LayerSkipTrainer":
        from draftsmith.data import Collator

        r, ls = self.recipe, self.recipe.layerskip
        self.start_run()
        acc = self.accelerator

        # The weights that train are float32 whatever target.dtype says; mixed precision is train:'s.
        model, tokenizer = load_causal_lm(r.target.path, "float32", r.target.gguf_file, what="target", device=acc.device)
        try:
            self.num_layers = decoder_stack(model).num_layers
        except TargetLoadError as err:
            raise RecipeError(f"recipe key 'target.path' ({r.target.path}): {err}") from None
        L = self.num_layers
        for name, values in (("exit_layer", [ls.exit_layer] if ls.exit_layer is not None else []), ("eval_exits", ls.eval_exits)):
            for value in values:
                if not 1 <= value <= L - 1:
                    raise RecipeError(f"recipe key 'layerskip.{name}' must be in 1..{L - 1} ({r.target.path} has {L} decoder layers), got {value}")
        self.eval_exits = sorted(set(ls.eval_exits)) or list(range(1, L))
        self.tokenizer = tokenizer
        # Answers the recipe asks the target to rewrite are written by the model before training, in
        # target.dtype as `draftsmith prepare` and the other trainers write them (they share caches).
        writer = model
        if r.data.regenerate.enabled and resolve_dtype(r.target.dtype, "target", acc.device) != "float32":
            writer, _ = load_causal_lm(r.target.path, r.target.dtype, r.target.gguf_file, what="target", device=acc.device)
        self.data = prepare_shared_data(r, acc, tokenizer, writer)
        del writer

        self.lm = with_lora(model, ls.lora)
        step_module = LayerSkipStep(self.lm)
        self.prepare_engine(step_module, step_module.parameters(), adapter_only=ls.lora.enabled)
        self.collator = Collator(pad_token_id=pad_token_id(tokenizer), max_length=r.data.max_length, packing=r.data.packing)
        self.stream = self.batch_stream(self.data.train, self.collator)
        self.drop_rates = layer_dropout_rates(L, ls.layer_dropout.max_rate, ls.layer_dropout.scale)
        # strict=False: a LoRA checkpoint holds the adapter only (the base is the target's own files).
        self.resume(strict=False)
        ee, ld = ls.early_exit, ls.layer_dropout
        self.record(
            f"target {r.target.path} ({L} decoder layers; {trainable_parameters(step_module):,} trainable parameters"
            f"{', LoRA' if ls.lora.enabled else ''}); layer dropout up to {ld.max_rate} ({ld.scale}, {ld.curriculum}); early-exit loss "
            f"scale {ee.scale}, {ee.curriculum}{f' every {ee.rotation} layers' if ee.curriculum == 'rotational' else ''}; "
            f"{len(self.data.train)} train / {len(self.data.eval)} eval examples",
        )
        return self

    prepare = staticmethod(prepare_with_target)

    @property
    def watched(self) -> nn.Module:
        """The model being trained (the target itself); it stays after close() for tests to inspect."""
        return self.lm

    # ------------------------------------------------------------------ steps

    def exits_now(self) -> tuple[list[int], Tensor]:
        """The exits trained at this step (layer indices whose loss weight is positive) and their weights."""
        ee, L = self.recipe.layerskip.early_exit, self.num_layers
        enabled = exit_curriculum(ee.curriculum, L, self.step, self.recipe.train.max_steps, ee.rotation)
        scales = exit_loss_scales(L, ee.scale, enabled)
        exits = [l for l in range(L) if scales[l] > 0]
        return exits, scales[exits]

    def drop_mask(self, micro: int, rows: int) -> Tensor:
        """Layer dropout of this micro-batch's rows [B,L]: sample ids are places in the global batch
        (micro-batch, then rank), the order in which the data stream hands out examples."""
        acc, r = self.accelerator, self.recipe
        ld = r.layerskip.layer_dropout
        rates = self.drop_rates * dropout_curriculum(self.step, r.train.max_steps, ld.curriculum)
        first = (micro * acc.num_processes + acc.process_index) * r.train.micro_batch_size
        return layer_drop_mask(rates, range(first, first + rows), self.step, r.train.seed).to(acc.device)

    def advance(self) -> tuple[int, dict]:
        """One optimizer step over grad_accum_steps micro-batches. Returns (step, logged values)."""
        acc, r = self.accelerator, self.recipe
        exits, scales = self.exits_now()
        losses, last_losses = [], []

        def micro_loss(micro: int) -> Tensor:
            batch = self.stream.next_batch()
            ids, attention, positions, select, labels = batch_inputs(batch, acc.device)
            logits = self.model(ids, attention, positions, select, exits, drop=self.drop_mask(micro, ids.shape[0]))
            loss, per_exit = early_exit_loss(logits, labels, scales)
            losses.append(loss.detach())
            last_losses.append(per_exit[-1])
            return loss

        grad_norm = loop.optimizer_step(self, [lambda m=m: micro_loss(m) for m in range(r.train.grad_accum_steps)], self.step_module.parameters())
        means = torch.stack([torch.stack(losses).mean(), torch.stack(last_losses).mean()]).float()
        means = acc.reduce(means, reduction="mean") if acc.num_processes > 1 else means
        self.step += 1
        return self.step, {
            "loss": float(means[0]),
            "last_layer_loss": float(means[1]),
            "exits": [l + 1 for l in exits],
            "lr": self.scheduler.get_last_lr()[0],
            "grad_norm": grad_norm,
        }

    @torch.no_grad()
    def evaluate(self) -> dict:
        """On held-out answers, no dropout: per exit layer E (layerskip.eval_exits, default 1..L-1)
        the top-1 agreement with the full model, the expected acceptance 1 - TVD and the
        cross-entropy; the full model's cross-entropy; the exit with the best modeled speedup."""
        acc, L = self.accelerator, self.num_layers
        module = self.step_module
        module.eval()
        layers = [e - 1 for e in self.eval_exits] + [L - 1]
        # Rows: agreement, acceptance, cross-entropy per evaluated layer (the last: the full model).
        sums = torch.zeros(3, len(layers), dtype=torch.float64, device=acc.device)
        count = torch.zeros(1, dtype=torch.float64, device=acc.device)
        for chunk, counted in self.eval_rounds(self.data.eval):
            ids, attention, positions, select, labels = batch_inputs(self.collator(chunk), acc.device)
            hidden = module(ids, attention, positions, select, layers, unembed=False)
            full = module.stack.lm_head(hidden[-1])
            for i, l in enumerate(layers):
                logits = full if l == L - 1 else module.stack.lm_head(hidden[i])
                if not counted:
                    continue
                sums[2, i] += exit_cross_entropy(logits, labels).double().sum()
                if l < L - 1:
                    agree, accept = exit_agreement(logits, full)
                    sums[0, i] += agree.double().sum()
                    sums[1, i] += accept.double().sum()
            if counted:
                count += labels.numel()
        if acc.num_processes > 1:
            sums, count = acc.reduce(sums, reduction="sum"), acc.reduce(count, reduction="sum")
        module.train()
        n = max(1.0, float(count))
        mean = (sums / n).tolist()
        acceptance = mean[1][:-1]
        # Ranked for the chain the runtime drafts by default.
        chosen = best_exit(self.eval_exits, acceptance, L, DEFAULT_DRAFT_LENGTH)
        return {
            "full_loss": mean[2][-1],
            "eval_exits": list(self.eval_exits),
            "exit_top1_agreement": mean[0][:-1],
            "exit_expected_acceptance": acceptance,
            "exit_loss": mean[2][:-1],
            "best_exit": chosen,
            "best_exit_expected_acceptance": acceptance[self.eval_exits.index(chosen)],
            "positions": int(count),
        }

    def describe(self, step: int, result: dict) -> str:
        return format_eval(step, result)

    def drafter_kind(self) -> str:
        return "early_exit"

    def checkpoint_state(self) -> dict:
        ls = self.recipe.layerskip
        return {"layerskip": {"num_layers": self.num_layers, "lora": ls.lora.enabled, "exit_layer": ls.exit_layer}}


    # ------------------------------------------------------------------ the loop

    def train(self) -> dict:
        self.step_module.train()
        # The first evaluation is where the model starts: the figure every later one compares with.
        return loop.train_from_first_eval(self, "layerskip")


def format_eval(step: int, result: dict) -> str:
    exits, acceptance = result["eval_exits"], result["exit_expected_acceptance"]
    best = exits.index(result["best_exit"])
    return (
        f"step {step}: full-model loss {result['full_loss']:.4f}; exit {exits[best]} (best modeled speedup): top-1 agreement "
        f"{result['exit_top1_agreement'][best]:.3f}, expected acceptance {acceptance[best]:.3f}; expected acceptance at exits "
        + ", ".join(f"{e}: {a:.3f}" for e, a in zip(exits, acceptance))
        + f"  ({result['positions']} positions)"
    )
