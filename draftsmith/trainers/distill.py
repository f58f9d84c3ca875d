"""The DistillSpec trainer: a small standalone LM learns the frozen target's next-token distributions.

Per micro-batch: a fraction ``distill.lambda_onpolicy`` of the sequences get an answer written by
the current draft (data/onpolicy.py), the rest keep their fixed or target-written answer
(data.regenerate); the target scores every sequence in one forward (logits at all positions); the
draft's logits at the same positions go through the recipe's objective (``distill.divergence``:
fkl, rkl, jsd, tvd, or tvdpp on tokens sampled from the draft), averaged over answer tokens with
``masked_mean``. Only the draft (or its LoRA adapter) reaches the optimizer and the checkpoints.

Held-out evaluation reports the mean divergence, the token-level top-1 agreement with the target
and the expected one-token acceptance 1 - TVD (the probability that speculative sampling accepts
one drafted token, averaged over answer positions), with both distributions at the distillation
temperature ``distill.temperature``: the acceptance of sampling at that temperature.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor, nn

from draftsmith.data.collate import Batch
from draftsmith.distill import DIVERGENCES, distillation_loss, masked_mean, sample_draft_tokens
from draftsmith.recipe import Recipe
from draftsmith.target import FrozenTarget, load_draft
from draftsmith.trainers import engine, loop
from draftsmith.trainers.base import Trainer, trainable_parameters
from draftsmith.trainers.data import pad_token_id, prepare_shared_data, prepare_with_target


class TokenizerMismatchError(engine.TrainingError):
    """The draft and the target do not share a vocabulary: speculative decoding cannot pair them."""


def check_same_tokenizer(draft_tokenizer: Any, target_tokenizer: Any, draft_path: str, target_path: str) -> None:
    """Raise TokenizerMismatchError unless both tokenizers map the same strings to the same ids."""
    draft_vocab, target_vocab = draft_tokenizer.get_vocab(), target_tokenizer.get_vocab()
    if draft_vocab == target_vocab:
        return
    differ = sorted(set(draft_vocab.items()) ^ set(target_vocab.items()), key=lambda kv: kv[1])
    example = differ[0] if differ else ("?", -1)
    raise TokenizerMismatchError(
        f"draft {draft_path} and target {target_path} use different tokenizers ({len(draft_vocab)} vs "
        f"{len(target_vocab)} tokens; e.g. {example[0]!r} -> {example[1]} in only one of them): "
        "a drafter must share the target's vocabulary"
    )


def predicted_mask(loss_mask: Tensor, segment_ids: Optional[Tensor] = None) -> Tensor:
    """Which logits positions are trained: position t predicts token t+1, trained when token t+1 is
    an answer token (and, in packed rows, belongs to the same example as token t).

    loss_mask, segment_ids: [B,T]. Returns [B,T-1] bool, aligned with logits[:, :-1].
    """
    keep = loss_mask[:, 1:] != 0
    if segment_ids is not None:
        keep = keep & (segment_ids[:, 1:] == segment_ids[:, :-1])
    return keep


def common_vocab(draft_logits: Tensor, target_logits: Tensor) -> tuple[Tensor, Tensor]:
    """Both logit tensors cut to the shorter vocabulary: models sharing a tokenizer may pad their
    embedding matrices to different sizes, and the padded rows are tokens neither ever emits."""
    V = min(draft_logits.shape[-1], target_logits.shape[-1])
    return draft_logits[..., :V], target_logits[..., :V]


class DistillStep(nn.Module):
    """The module the engine wraps: the draft LM. Its forward returns the draft's logits [B,T,V]."""

    def __init__(self, draft: nn.Module) -> None:
        super().__init__()
        self.draft = draft

    def forward(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Optional[Tensor] = None) -> Tensor:
        return self.draft(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False).logits


def distill_objective(recipe: Recipe, draft_logits: Tensor, target_logits: Tensor, mask: Tensor) -> Tensor:
    """The recipe's distillation loss, a scalar. draft_logits, target_logits [B,T,V]; mask [B,T]."""
    d = recipe.distill
    if d.divergence == "tvdpp":
        sampled = sample_draft_tokens(draft_logits, d.temperature)
        return distillation_loss("tvdpp", draft_logits, target_logits, mask, d.temperature, sampled_tokens=sampled)
    params = {"beta": d.beta} if d.divergence == "jsd" else {}
    return distillation_loss(d.divergence, draft_logits, target_logits, mask, d.temperature, **params)


class DistillTrainer(Trainer):
    def __init__(self, recipe: Recipe, argv: Optional[list[str]] = None) -> None:
        super().__init__(recipe, argv)
        self._micro = 0
        self.onpolicy_counts = [0, 0]  # on-policy sequences, all sequences

    # ------------------------------------------------------------------ setup

    prepare = staticmethod(prepare_with_target)

    def setup(self) -> "DistillTrainer":
        from draftsmith.data import Collator
        from draftsmith.data.chat import stop_token_ids
        from draftsmith.data.onpolicy import OnPolicySampler

        r = self.recipe
        self.start_run()
        acc = self.accelerator
        self.target = FrozenTarget.from_config(r.target, acc.device)
        tokenizer = self.target.tokenizer
        self.draft, draft_tokenizer = load_draft(r.draft, self.accelerator.device)
        check_same_tokenizer(draft_tokenizer, tokenizer, r.draft.path, r.target.path)
        self.data = prepare_shared_data(r, acc, tokenizer, self.target.model)

        self.prepare_engine(DistillStep(self.draft), self.draft.parameters(), adapter_only=r.draft.lora.enabled)
        pad = pad_token_id(tokenizer)
        self.collator = Collator(pad_token_id=pad, max_length=r.data.max_length, packing=r.data.packing)
        self.stream = self.batch_stream(self.data.train, self.collator)
        self.onpolicy = OnPolicySampler(
            self.draft, pad, stop_token_ids(tokenizer, self.target.model.generation_config), r.distill.onpolicy_temperature,
            r.distill.onpolicy_max_new_tokens, r.data.max_length,
        )
        # strict=False: a LoRA checkpoint holds the adapter only (the base is the draft's own files).
        self.resume(strict=False)
        self.record(
            f"target {r.target.path}, draft {r.draft.path} ({trainable_parameters(self.draft):,} trainable parameters"
            f"{', LoRA' if r.draft.lora.enabled else ''}); divergence {r.distill.divergence}, "
            f"on-policy fraction {r.distill.lambda_onpolicy}; {len(self.data.train)} train / {len(self.data.eval)} eval examples",
        )
        return self

    # ------------------------------------------------------------------ steps

    def next_examples(self) -> list[dict]:
        """The next micro-batch's examples, a fraction lambda of them with on-policy answers."""
        from draftsmith.data.onpolicy import choose_onpolicy

        r = self.recipe
        examples = [self.stream.examples[i] for i in self.stream.next_indices()]
        chosen = choose_onpolicy(len(examples), r.distill.lambda_onpolicy, r.train.seed, self.step * r.train.grad_accum_steps + self._micro)
        picked = [e for e, c in zip(examples, chosen) if c]
        if picked:
            seed = (r.train.seed * 1_000_003 + self.step * 1009 + self._micro * 31 + self.accelerator.process_index) % (2**31)
            fresh = iter(self.onpolicy(picked, seed))
            examples = [next(fresh) if c else e for e, c in zip(examples, chosen)]
        self.onpolicy_counts[0] += len(picked)
        self.onpolicy_counts[1] += len(examples)
        return examples

    def _logits(self, batch: Batch, module) -> tuple[Tensor, Tensor, Tensor]:
        """(draft logits [B,T-1,V], target logits [B,T-1,V], trained positions [B,T-1]) of a host batch."""
        batch = batch.to(self.accelerator.device)
        ids, attention, positions = batch["input_ids"], batch["attention_mask"], batch["position_ids"]
        target_logits = self.target.features(ids, attention_mask=attention, position_ids=positions, need_logits=True).logits
        draft_logits = module(ids, attention, positions)
        draft_logits, target_logits = common_vocab(draft_logits[:, :-1], target_logits[:, :-1])
        return draft_logits, target_logits, predicted_mask(batch["loss_mask"], batch["segment_ids"])

    def advance(self) -> tuple[int, dict]:
        """One optimizer step over grad_accum_steps micro-batches. Returns (step, logged values)."""
        acc, r = self.accelerator, self.recipe
        losses = []

        def micro_loss(micro: int) -> Tensor:
            self._micro = micro
            batch = self.collator(self.next_examples())
            draft_logits, target_logits, mask = self._logits(batch, self.model)
            loss = distill_objective(r, draft_logits, target_logits, mask)
            losses.append(loss.detach())
            return loss

        grad_norm = loop.optimizer_step(self, [lambda m=m: micro_loss(m) for m in range(r.train.grad_accum_steps)], self.draft.parameters())
        mean = torch.stack(losses).mean()
        mean = acc.reduce(mean, reduction="mean") if acc.num_processes > 1 else mean
        self.step += 1
        return self.step, {
            "loss": float(mean),
            "lr": self.scheduler.get_last_lr()[0],
            "grad_norm": grad_norm,
            "onpolicy_fraction": self.onpolicy_counts[0] / max(1, self.onpolicy_counts[1]),
        }

    @torch.no_grad()
    def evaluate(self) -> dict:
        """On held-out answers: mean divergence, top-1 agreement with the target, 1 - TVD, the
        distributions softened by distill.temperature (the temperature they are sampled at)."""
        acc, r = self.accelerator, self.recipe
        self.draft.eval()
        name = r.distill.divergence if r.distill.divergence in DIVERGENCES else "tvd"
        params = {"beta": r.distill.beta} if name == "jsd" else {}
        sums = torch.zeros(4, dtype=torch.float64, device=acc.device)  # divergence, tvd, agree, positions
        for chunk, counted in self.eval_rounds(self.data.eval):
            draft_logits, target_logits, mask = self._logits(self.collator(chunk), self.step_module)
            if not counted:
                continue
            n = mask.sum()
            sums[0] += masked_mean(DIVERGENCES[name](draft_logits, target_logits, r.distill.temperature, **params), mask).double() * n
            sums[1] += masked_mean(DIVERGENCES["tvd"](draft_logits, target_logits, r.distill.temperature), mask).double() * n
            sums[2] += ((draft_logits.argmax(-1) == target_logits.argmax(-1)) & mask).sum().double()
            sums[3] += n.double()
        if acc.num_processes > 1:
            sums = acc.reduce(sums, reduction="sum")
        self.draft.train()
        count = max(1.0, float(sums[3]))
        tvd = float(sums[1]) / count
        return {
            "divergence": name,
            "divergence_value": float(sums[0]) / count,
            "tvd": tvd,
            "top1_agreement": float(sums[2]) / count,
            "expected_acceptance": 1.0 - tvd,
            "temperature": r.distill.temperature,
            "positions": int(sums[3]),
        }

    def describe(self, step: int, result: dict) -> str:
        return format_eval(step, result)

    def drafter_kind(self) -> str:
        return "standalone"

    def checkpoint_state(self) -> dict:
        return {"draft": {"path": self.recipe.draft.path, "lora": self.recipe.draft.lora.enabled}, "onpolicy_counts": self.onpolicy_counts}


    def restore(self, state) -> None:
        self.onpolicy_counts = list(state.get("onpolicy_counts", [0, 0]))

    # ------------------------------------------------------------------ the loop

    def train(self) -> dict:
        self.draft.train()
        # The first evaluation is where the draft starts: the figure every later one compares with.
        return loop.train_from_first_eval(self, "distill")


def format_eval(step: int, result: dict) -> str:
    return (
        f"step {step}: {result['divergence']} {result['divergence_value']:.4f}  top-1 agreement {result['top1_agreement']:.3f}  "
        f"expected acceptance (1 - TVD) at T={result.get('temperature', 1.0):g} {result['expected_acceptance']:.3f}  ({result['positions']} positions)"
    )
