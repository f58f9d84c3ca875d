"""Draft heads that read a frozen target's features. Adding a head is one import and one line."""

from draftsmith.heads.base import DraftHead, TargetDims, TargetFeatures
from draftsmith.heads.eagle import EagleConfig, EagleHead
from draftsmith.heads.medusa import MedusaConfig, MedusaHead

HEADS: dict[str, type[DraftHead]] = {
    "medusa": MedusaHead,
    "eagle": EagleHead,
}

__all__ = ["HEADS", "DraftHead", "EagleConfig", "EagleHead", "MedusaConfig", "MedusaHead", "TargetDims", "TargetFeatures"]
