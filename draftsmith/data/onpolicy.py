"""On-policy training sequences: answers the draft writes itself, regenerated as training proceeds.

DistillSpec trains the draft on a mixture: a fraction ``lambda`` of the sequences get an answer
sampled from the *current* draft, the rest keep their fixed (or target-written) answer, so the
draft learns the target's distribution on the prefixes it will actually produce at decoding time.
The target then scores the whole sequence as usual; only the answer tokens carry loss.

Which sequences go on-policy is a pure function of (seed, step, index in the batch), so a resumed
run makes the same choices as an uninterrupted one. The draws of the answers themselves run under a
forked RNG seeded the same way: they neither depend on nor disturb the training RNG.
"""

from __future__ import annotations

import random
from typing import Any, Sequence

import torch

__all__ = ["choose_onpolicy", "prompt_length", "OnPolicySampler"]


def choose_onpolicy(batch_size: int, fraction: float, seed: int, step: int) -> list[bool]:
    """Which of a micro-batch's sequences get an on-policy answer: each independently with
    probability ``fraction`` (0 never, 1 always), seeded by (seed, step, index)."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"the on-policy fraction must be in [0, 1], got {fraction}")
    return [random.Random(f"draftsmith-onpolicy:{seed}:{step}:{i}").random() < fraction for i in range(batch_size)]


def prompt_length(example: dict) -> int:
    """Tokens before the first trained (assistant) token: the prompt an on-policy answer continues."""
    mask = example["loss_mask"]
    for i, m in enumerate(mask):
        if m:
            return i
    return len(mask)


class OnPolicySampler:
    """Replaces examples' first answers with answers sampled from a draft model.

    ``model``: the draft (an HF causal LM, possibly a peft model); ``stop_ids``: tokens that end an
    answer (kept in the sequence and trained on, as the chat template's own end-of-turn is).
    """

    def __init__(self, model: Any, pad_token_id: int, stop_ids: Sequence[int], temperature: float, max_new_tokens: int, max_length: int) -> None:
        self.model = model
        self.pad_token_id = int(pad_token_id)
        self.stop_ids = [int(t) for t in stop_ids]
        self.temperature = float(temperature)
        self.max_new_tokens = int(max_new_tokens)
        self.max_length = int(max_length)

    @torch.no_grad()
    def __call__(self, examples: Sequence[dict], seed: int) -> list[dict]:
        """New examples ``{"input_ids", "loss_mask"}``: each one's prompt (up to its first assistant
        token) plus an answer drawn from the draft, loss_mask 1 on the answer only.

        Left-padded batch of prompts [B,P] -> generate -> strip padding and everything after the
        first stop token. Examples whose prompt leaves no room under max_length are returned as is.
        """
        prompts = [list(e["input_ids"][: prompt_length(e)]) for e in examples]
        room = [min(self.max_new_tokens, self.max_length - len(p)) for p in prompts]
        todo = [i for i, (p, r) in enumerate(zip(prompts, room)) if p and r > 0]
        out = [dict(e) for e in examples]
        if not todo:
            return out
        width = max(len(prompts[i]) for i in todo)
        device = next(self.model.parameters()).device
        ids = torch.full((len(todo), width), self.pad_token_id, dtype=torch.long, device=device)
        attention = torch.zeros_like(ids)
        for row, i in enumerate(todo):
            p = prompts[i]
            ids[row, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            attention[row, width - len(p) :] = 1
        greedy = self.temperature == 0
        was_training = self.model.training
        self.model.eval()
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed)
            generated = self.model.generate(
                input_ids=ids,
                attention_mask=attention,
                max_new_tokens=max(room[i] for i in todo),
                do_sample=not greedy,
                temperature=None if greedy else self.temperature,
                top_p=None,
                top_k=None if greedy else 0,
                eos_token_id=self.stop_ids or None,
                pad_token_id=self.pad_token_id,
            )
        if was_training:
            self.model.train()
        for row, i in enumerate(todo):
            answer = generated[row, width:].tolist()[: room[i]]
            for j, token in enumerate(answer):
                if token in self.stop_ids:
                    answer = answer[: j + 1]
                    break
            if not answer:
                continue
            out[i] = {"input_ids": prompts[i] + answer, "loss_mask": [0] * len(prompts[i]) + [1] * len(answer)}
        return out
