"""The Trainer base: rank-balanced evaluation rounds (every rank the same number of forwards, every
held-out example counted exactly once), and set-up that a subclass only orders."""

from types import SimpleNamespace

import pytest

from draftsmith.trainers import TRAINERS
from draftsmith.trainers.base import Trainer


def _trainer(rank: int, world: int, micro_batch_size: int) -> Trainer:
    recipe = SimpleNamespace(output_dir="unused", train=SimpleNamespace(micro_batch_size=micro_batch_size))
    trainer = Trainer(recipe, argv=["draftsmith", "train", "test"])
    trainer.accelerator = SimpleNamespace(process_index=rank, num_processes=world)
    return trainer


@pytest.mark.parametrize("count,world,size", [(7, 3, 2), (2, 4, 1), (9, 1, 4), (0, 2, 3), (8, 2, 4)])
def test_eval_rounds_give_every_rank_the_same_rounds_and_count_each_example_once(count, world, size):
    examples = [f"ex{i}" for i in range(count)]
    rounds = [list(_trainer(rank, world, size).eval_rounds(examples)) for rank in range(world)]
    assert len({len(r) for r in rounds}) == 1  # ZeRO-3 gathers weights in every forward: no rank may skip one
    counted = [e for r in rounds for chunk, ok in r if ok for e in chunk]
    assert sorted(counted) == sorted(examples)
    for r in rounds:
        for chunk, ok in r:
            assert 1 <= len(chunk) <= size
            if not ok:
                assert chunk == examples[:1]  # a stand-in runs the forward, and its figures are left out


def test_every_trainer_is_a_trainer_and_names_what_its_checkpoints_hold():
    for name, cls in TRAINERS.items():
        assert issubclass(cls, Trainer), name
        for hook in ("setup", "advance", "drafter_kind", "train"):  # the online trainer has no held-out evaluation
            assert getattr(cls, hook) is not getattr(Trainer, hook), f"{name} does not write {hook}"
    with pytest.raises(NotImplementedError):
        Trainer(SimpleNamespace(output_dir="x")).drafter_kind()
