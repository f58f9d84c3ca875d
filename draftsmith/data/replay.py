"""The replay buffer of online speculative decoding: what the target verified while serving.

Each served request leaves one record: the prompt and the tokens the target emitted, with two
masks over the sequence: ``loss_mask`` (1 on every token the target verified: drafted tokens it
accepted and the tokens it chose itself) and ``rejected_mask`` (1 where the target's token
replaced a drafted token it rejected: the positions where the draft was wrong).

What an update trains on (``train_on``): "rejected", online speculative decoding's choice, keeps
only the positions where the draft was wrong (``rejected_mask``: the draft already agrees with the
target elsewhere); "verified" keeps every verified token (``loss_mask``). Sampled records come
back with the chosen mask as their ``loss_mask``, so the collator and the loss need not know.

The buffer keeps tokens, not distributions. The target is frozen, so its distribution at any
verified position is a pure function of the tokens before it, and the trainer recomputes it in
one forward when it samples a batch; storing it instead would cost V floats per token (600 KB a
token for a 152k vocabulary), which is what bounds real buffers. Capacity is in records; the
oldest go first, so the buffer follows the current query distribution.
"""

from __future__ import annotations

import random
from collections import deque
from typing import Iterable, Optional, Sequence

__all__ = ["ReplayBuffer", "verified_record"]


def verified_record(prompt: Sequence[int], emitted: Sequence[int], accept_lens: Sequence[int], draft_depths: Sequence[int]) -> dict:
    """One buffer record from a speculative generation.

    prompt: the prompt's token ids; emitted: the generated ids, in order; accept_lens[s] and
    draft_depths[s]: drafted tokens accepted at step s and the depth drafted (runtime
    GenerationStats). Step s emitted accept_lens[s] accepted drafted tokens, then one token of the
    target's own: a correction of a rejected draft token when accept_lens[s] < draft_depths[s].
    Returns {"input_ids", "loss_mask", "rejected_mask", "accepted", "judged"} (the last two: drafted
    tokens accepted / judged by the target over the whole generation; judged = accepted + 1 per
    step with a rejection, as in eval.AcceptanceStats.acceptance_rate).
    """
    n = len(prompt)
    loss_mask = [0] * n + [1] * len(emitted)
    rejected = [0] * (n + len(emitted))
    position, accepted, judged = n, 0, 0
    for a, depth in zip(accept_lens, draft_depths):
        position += a
        accepted += a
        judged += min(a + 1, depth)
        if position < n + len(emitted) and a < depth:
            rejected[position] = 1
        position += 1
    return {
        "input_ids": list(prompt) + list(emitted),
        "loss_mask": loss_mask,
        "rejected_mask": rejected,
        "accepted": accepted,
        "judged": judged,
    }


TRAIN_ON = {"rejected": "rejected_mask", "verified": "loss_mask"}


class ReplayBuffer:
    """A bounded FIFO of verified records (see module docstring). ``capacity`` records at most;
    ``train_on`` ("rejected" or "verified") picks the positions updates train on."""

    def __init__(self, capacity: int, seed: int = 0, train_on: str = "rejected") -> None:
        if capacity <= 0:
            raise ValueError(f"the replay buffer needs a positive capacity, got {capacity}")
        if train_on not in TRAIN_ON:
            raise ValueError(f"train_on must be one of {sorted(TRAIN_ON)}, got {train_on!r}")
        self.capacity = capacity
        self.records: deque[dict] = deque(maxlen=capacity)
        self.seed = seed
        self.mask_key = TRAIN_ON[train_on]
        self.draws = 0  # batches drawn so far: seeds the next draw, so a resumed run draws the same

    def __len__(self) -> int:
        return len(self.records)

    def add(self, record: dict) -> None:
        self.records.append(record)

    def extend(self, records: Iterable[dict]) -> None:
        for record in records:
            self.add(record)

    def clear(self) -> None:
        """Forget every record (online speculative decoding empties its buffer after each update)."""
        self.records.clear()

    @property
    def trainable_tokens(self) -> int:
        """Positions an update can train on across the buffer (per ``train_on``)."""
        return sum(sum(r[self.mask_key]) for r in self.records)

    def sample(self, batch_size: int, count: int = 1) -> Optional[list[list[dict]]]:
        """``count`` batches of ``batch_size`` records drawn uniformly with replacement among those
        with a trainable position (one draw, seeded by the buffer's seed and draw counter), or None
        when there is none. Each record's ``loss_mask`` is the ``train_on`` mask. Processes holding
        the same buffer draw the same batches and each takes its share."""
        if self.trainable_tokens == 0:
            return None
        rng = random.Random(f"draftsmith-replay:{self.seed}:{self.draws}")
        self.draws += 1
        usable = [{**r, "loss_mask": r[self.mask_key]} for r in self.records if any(r[self.mask_key])]
        return [[rng.choice(usable) for _ in range(batch_size)] for _ in range(count)]

    def state_dict(self) -> dict:
        return {"capacity": self.capacity, "seed": self.seed, "draws": self.draws, "records": list(self.records)}

    def load_state_dict(self, state: dict) -> None:
        self.capacity = int(state["capacity"])
        self.seed = int(state["seed"])
        self.draws = int(state["draws"])
        self.records = deque(state["records"], maxlen=self.capacity)
