"""A draft vocabulary: the target-vocabulary tokens a drafter predicts over (EAGLE-3's reduced LM head),
chosen from the training data (DraftHead.init_from_data).

The tokens are chosen by frequency among the tokens training actually scores (loss_mask = 1: the
answers a drafter must predict), kept in ascending target-id order, and described the way the
serving engines read them:

- ``d2t`` [Vd] int64: draft id i -> offset to its target id, target_id = i + d2t[i];
- ``t2d`` [V] bool: which target ids are in the draft vocabulary.

Ascending order makes ``target_logits[..., t2d]`` line up with draft ids, which is how the
target's distribution is restricted to the draft vocabulary in training.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor


@dataclass
class DraftVocabulary:
    d2t: Tensor  # [Vd] int64
    t2d: Tensor  # [V] bool
    coverage: float  # fraction of the scored training tokens inside the draft vocabulary

    @property
    def ids(self) -> Tensor:
        """The target ids of the draft vocabulary, ascending [Vd]."""
        return torch.arange(self.d2t.numel(), dtype=torch.int64) + self.d2t


def draft_vocabulary(examples: Sequence[dict], vocab_size: int, draft_vocab_size: int) -> DraftVocabulary:
    """The `draft_vocab_size` most frequent scored tokens of `examples` (each with input_ids and
    loss_mask); ties go to the lower id. When the data has fewer distinct scored tokens, the rest
    of the draft vocabulary is filled with the lowest unused ids, so its size is always exact."""
    if not 0 < draft_vocab_size <= vocab_size:
        raise ValueError(f"a draft vocabulary of {draft_vocab_size} tokens does not fit a target vocabulary of {vocab_size}")
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for example in examples:
        ids = torch.as_tensor(example["input_ids"], dtype=torch.int64)
        scored = ids[torch.as_tensor(example["loss_mask"], dtype=torch.bool)]
        if scored.numel() and int(scored.max()) >= vocab_size:
            raise ValueError(f"token id {int(scored.max())} in the training data is outside the target vocabulary of {vocab_size}")
        counts += torch.bincount(scored, minlength=vocab_size)
    total = int(counts.sum())
    if total == 0:
        raise ValueError("the training data scores no token (every loss_mask is 0): nothing to choose a draft vocabulary from")
    # Stable sort on the count, descending: among equal counts the lower id comes first.
    order = torch.sort(-counts, stable=True).indices
    chosen = torch.sort(order[:draft_vocab_size]).values
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[chosen] = True
    d2t = chosen - torch.arange(draft_vocab_size, dtype=torch.int64)
    return DraftVocabulary(d2t=d2t, t2d=t2d, coverage=float(counts[chosen].sum()) / total)


def to_target_vocab(draft_logits: Tensor, draft_ids: Tensor, vocab_size: int) -> Tensor:
    """Draft-vocabulary logits [...,Vd] as logits over the target's vocabulary [...,V]: the draft's
    at its tokens (``draft_ids`` [Vd], ascending target ids), -inf elsewhere, so a draft never
    proposes a token outside its vocabulary."""
    full = draft_logits.new_full((*draft_logits.shape[:-1], vocab_size), float("-inf"))
    return full.index_copy(-1, draft_ids, draft_logits)


__all__ = ["DraftVocabulary", "draft_vocabulary", "to_target_vocab"]
