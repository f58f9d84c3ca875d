"""Trainers turn a recipe into checkpoints. Adding one is one import and one line."""

from draftsmith.trainers.heads import HeadTrainer

TRAINERS = {
    "heads": HeadTrainer,
}

__all__ = ["TRAINERS"]
