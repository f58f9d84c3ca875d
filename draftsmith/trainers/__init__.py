"""Trainers turn a recipe into checkpoints. Adding one is one import and one line."""

from draftsmith.trainers.distill import DistillTrainer
from draftsmith.trainers.heads import HeadTrainer

TRAINERS = {
    "heads": HeadTrainer,
    "distill": DistillTrainer,
}

__all__ = ["TRAINERS"]
