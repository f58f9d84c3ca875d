"""The order in which examples are trained on: seeded epochs, sharded across ranks, resumable.

The stream is the concatenation of epoch permutations, each a pure function of (seed, epoch).
A global batch is the next ``batch_size * world_size`` examples of that stream (it may run from the
end of one epoch into the next, so nothing is dropped and a data set smaller than a batch still
works); rank r takes the r-th slice of it. The whole state is (epoch, position), so a resumed run
sees exactly the batches the uninterrupted run would have seen.
"""

from __future__ import annotations

import random
from typing import Callable, Sequence

from draftsmith.data.errors import DataError


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """The permutation of range(n) used in one epoch."""
    order = list(range(n))
    if shuffle:
        # A string seed is hashed with sha512: stable across runs, processes and Python versions.
        random.Random(f"draftsmith-epoch:{seed}:{epoch}").shuffle(order)
    return order


class BatchStream:
    """Endless batches over ``examples`` for one rank.

    ``next_batch()`` returns ``collator(list of batch_size examples)``. Every rank of a run builds
    its own stream with the same seed and takes a disjoint slice of each global batch
    (global batch = batch_size * world_size).
    """

    def __init__(
        self,
        examples: Sequence[dict],
        batch_size: int,
        collator: Callable[[list[dict]], dict],
        seed: int = 0,
        shuffle: bool = True,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if not examples:
            raise DataError("no training examples to draw batches from")
        if batch_size <= 0:
            raise DataError(f"train.micro_batch_size must be positive, got {batch_size}")
        if not 0 <= rank < world_size:
            raise DataError(f"rank {rank} is outside world_size {world_size}")
        self.examples = examples
        self.batch_size = batch_size
        self.collator = collator
        self.seed = seed
        self.shuffle = shuffle
        self.rank = rank
        self.world_size = world_size
        self.epoch = 0
        self.position = 0
        self._order = epoch_order(len(examples), seed, 0, shuffle)

    def _advance_epoch(self) -> None:
        self.epoch += 1
        self.position = 0
        self._order = epoch_order(len(self.examples), self.seed, self.epoch, self.shuffle)

    def next_indices(self) -> list[int]:
        """Indices into ``examples`` of this rank's next batch (advances the stream)."""
        global_batch: list[int] = []
        need = self.batch_size * self.world_size
        while len(global_batch) < need:
            if self.position >= len(self._order):
                self._advance_epoch()
            take = self._order[self.position : self.position + need - len(global_batch)]
            global_batch.extend(take)
            self.position += len(take)
        return global_batch[self.rank * self.batch_size : (self.rank + 1) * self.batch_size]

    def next_batch(self) -> dict:
        """This rank's next batch, collated."""
        return self.collator([self.examples[i] for i in self.next_indices()])

    def state_dict(self) -> dict:
        """Where the stream stands: ``{"epoch", "position", "num_examples", "seed"}``."""
        return {"epoch": self.epoch, "position": self.position, "num_examples": len(self.examples), "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved position. The data set and seed must be the ones it was saved with."""
        n = state.get("num_examples", len(self.examples))
        if n != len(self.examples):
            raise DataError(
                f"cannot resume the batch order: it was saved over {n} examples, this run has {len(self.examples)} "
                "(the data or data.* settings changed)"
            )
        if state.get("seed", self.seed) != self.seed:
            raise DataError(f"cannot resume the batch order: it was saved with data.seed={state['seed']}, this run has {self.seed}")
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._order = epoch_order(len(self.examples), self.seed, self.epoch, self.shuffle)
