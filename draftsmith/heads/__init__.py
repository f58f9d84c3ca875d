"""Draft heads that read a frozen target's features. Adding a head is one import and one line."""

from draftsmith.heads.base import DraftHead, TargetDims, TargetFeatures
from draftsmith.heads.clover import CloverConfig, CloverHead
from draftsmith.heads.dflash import DFlashConfig, DFlashHead
from draftsmith.heads.eagle import EagleConfig, EagleHead
from draftsmith.heads.eagle3 import Eagle3Config, Eagle3Head
from draftsmith.heads.hydra import HydraConfig, HydraHead
from draftsmith.heads.medusa import MedusaConfig, MedusaHead

HEADS: dict[str, type[DraftHead]] = {
    "medusa": MedusaHead,
    "hydra": HydraHead,
    "eagle": EagleHead,
    "eagle3": Eagle3Head,
    "clover": CloverHead,
    "dflash": DFlashHead,
}

__all__ = [
    "HEADS", "CloverConfig", "CloverHead", "DFlashConfig", "DFlashHead", "DraftHead", "Eagle3Config", "Eagle3Head", "EagleConfig", "EagleHead",
    "HydraConfig", "HydraHead", "MedusaConfig", "MedusaHead",
    "TargetDims", "TargetFeatures",
]  # fmt: skip
