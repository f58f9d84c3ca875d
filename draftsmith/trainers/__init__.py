"""Trainers turn a recipe into checkpoints. Adding one is one import and one line."""

from draftsmith.trainers.distill import DistillTrainer
from draftsmith.trainers.heads import HeadTrainer
from draftsmith.trainers.layerskip import LayerSkipTrainer
from draftsmith.trainers.online import OnlineTrainer

TRAINERS = {
    "heads": HeadTrainer,
    "distill": DistillTrainer,
    "online": OnlineTrainer,
    "layerskip": LayerSkipTrainer,
}

__all__ = ["TRAINERS"]
