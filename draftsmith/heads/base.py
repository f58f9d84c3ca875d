"""What every draft head shares: the target's dimensions, its features, and the depth loss.

Depth convention: at position t the target has read x_0..x_t and its own LM head predicts
x_{t+1}. Draft depth k (1-indexed, k = 1..K) predicts x_{t+1+k}. A head's training forward returns
logits [B,T,K,V]; logits[b, t, k-1] is scored against x_{t+1+k}.
"""

from __future__ import annotations

from typing import Any, ClassVar, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from draftsmith.target import FrozenTarget, TargetDims, TargetFeatures

__all__ = ["DraftHead", "TargetDims", "TargetFeatures", "depth_labels", "depth_cross_entropy"]


def depth_labels(
    input_ids: Tensor, loss_mask: Optional[Tensor], depth: int, segment_ids: Optional[Tensor] = None
) -> tuple[Tensor, Tensor]:
    """Labels and validity for K draft depths.

    input_ids [B,T]; loss_mask [B,T] (1 where a token is trained on, e.g. assistant tokens) or None;
    segment_ids [B,T] (packed rows: which example each token belongs to) or None.
    Returns labels [B,T,K] (x_{t+1+k}, 0 where out of range) and valid [B,T,K] (bool). A label is
    valid only inside the same packed example as position t.
    """
    B, T = input_ids.shape
    labels = input_ids.new_zeros(B, T, depth)
    valid = torch.zeros(B, T, depth, dtype=torch.bool, device=input_ids.device)
    mask = torch.ones_like(input_ids, dtype=torch.bool) if loss_mask is None else loss_mask.bool()
    for k in range(1, depth + 1):
        shift = 1 + k
        if shift >= T:
            break
        labels[:, : T - shift, k - 1] = input_ids[:, shift:]
        valid[:, : T - shift, k - 1] = mask[:, shift:]
        if segment_ids is not None:
            valid[:, : T - shift, k - 1] &= segment_ids[:, shift:] == segment_ids[:, : T - shift]
    return labels, valid


def depth_cross_entropy(logits: Tensor, labels: Tensor, valid: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Mean cross-entropy per depth.

    logits [B,T,K,V], labels [B,T,K], valid [B,T,K]. Returns (ce [K], top1 [K], count [K]), where
    top1 is the fraction of valid positions whose argmax equals the label.
    """
    B, T, K, V = logits.shape
    dtype = torch.promote_types(logits.dtype, torch.float32)
    flat = logits.reshape(-1, V).to(dtype)
    ce = F.cross_entropy(flat, labels.reshape(-1), reduction="none").view(B, T, K)
    weight = valid.to(dtype)
    count = weight.sum(dim=(0, 1))
    ce_mean = (ce * weight).sum(dim=(0, 1)) / count.clamp_min(1)
    with torch.no_grad():
        hits = (logits.argmax(-1) == labels).to(dtype) * weight
        top1 = hits.sum(dim=(0, 1)) / count.clamp_min(1)
    return ce_mean, top1, count


class DraftHead(nn.Module):
    """Base class of draft heads that read a frozen target's features.

    Subclasses set `config_class` (a dataclass with a `kind` field), implement `forward` and the
    runtime drafting step, and may override `loss` (EAGLE adds a feature-regression term).
    """

    config_class: ClassVar[type]

    def __init__(self, cfg: Any, dims: TargetDims) -> None:
        super().__init__()
        self.cfg = cfg
        self.dims = dims

    @property
    def depth(self) -> int:
        """K, the number of tokens the head drafts beyond the target's own next token."""
        raise NotImplementedError

    def required_layers(self) -> list[int]:
        """Decoder layers whose outputs the head reads (besides final_hidden)."""
        return []

    def init_from_target(self, target: FrozenTarget) -> None:
        """Initialise parameters from the target before training starts (default: nothing)."""

    def forward(self, features: TargetFeatures) -> Tensor:  # pragma: no cover - abstract
        """Teacher-forced logits [B,T,K,V]."""
        raise NotImplementedError

    def top_tokens(self, features: TargetFeatures, k: int) -> Tensor:
        """The k most likely tokens per position and depth [B,T,K,k], best first (for evaluation).
        Heads that can override it to avoid holding all depths' logits [B,T,K,V] at once."""
        logits = self(features)
        return logits.topk(min(k, logits.shape[-1]), dim=-1).indices

    def depth_weights(self) -> Tensor:
        """Loss weight of each depth [K] (default: equal)."""
        return torch.ones(self.depth)

    def loss(
        self, features: TargetFeatures, loss_mask: Optional[Tensor], segment_ids: Optional[Tensor] = None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Weighted cross-entropy over depths. Returns (scalar loss, stats with ce/top1/count per depth [K])."""
        logits = self(features)
        labels, valid = depth_labels(features.input_ids, loss_mask, self.depth, segment_ids)
        ce, top1, count = depth_cross_entropy(logits, labels, valid)
        weights = self.depth_weights().to(ce.device, ce.dtype)
        loss = (weights * ce).sum() / weights.sum()
        return loss, {"ce": ce.detach(), "top1": top1, "count": count}

    def runtime_state_dict(self) -> dict[str, Tensor]:
        """The weights an export needs: the head's own parameters and buffers, nothing of the target."""
        return {k: v.detach().contiguous() for k, v in self.state_dict().items()}
