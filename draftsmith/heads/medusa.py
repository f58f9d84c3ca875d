"""Medusa-1 heads on a frozen target (Cai et al., 2024).

Head k (k = 1..K) reads the target's final hidden state at position t and predicts x_{t+1+k}. Each
head is L residual blocks (h + SiLU(W h + b)), started at the identity, followed by either its own
LM head initialised from the target's, or the target's frozen LM head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from draftsmith.heads.base import DraftHead, TargetDims, TargetFeatures, depth_labels
from draftsmith.target import FrozenTarget


@dataclass
class MedusaConfig:
    kind: str = "medusa"
    num_heads: int = 4
    num_layers: int = 1
    # "own": each head gets a trainable LM head copied from the target's; "target": all heads
    # share the target's frozen LM head (far fewer parameters, the Medusa paper's cheaper variant).
    lm_head: Literal["own", "target"] = "target"
    # Loss weight of head k is loss_decay ** (k - 1).
    loss_decay: float = 0.8


class ResBlock(nn.Module):
    """h + SiLU(W h + b), zero-initialised so a fresh block is the identity."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)
        self.act = nn.SiLU()

    def forward(self, h: Tensor) -> Tensor:
        return h + self.act(self.linear(h))


class MedusaHead(DraftHead):
    config_class = MedusaConfig

    def __init__(self, cfg: MedusaConfig, dims: TargetDims) -> None:
        super().__init__(cfg, dims)
        if cfg.num_heads < 1 or cfg.num_layers < 0:
            raise ValueError(f"medusa needs num_heads >= 1 and num_layers >= 0, got {cfg.num_heads}, {cfg.num_layers}")
        D, V = dims.hidden_size, dims.vocab_size
        # A comprehension, not [block] * n: every head and every layer must be its own module.
        self.blocks = nn.ModuleList(
            nn.Sequential(*[ResBlock(D) for _ in range(cfg.num_layers)]) for _ in range(cfg.num_heads)
        )
        self.lm_heads = (
            nn.ModuleList(nn.Linear(D, V, bias=False) for _ in range(cfg.num_heads)) if cfg.lm_head == "own" else None
        )

    @property
    def depth(self) -> int:
        return self.cfg.num_heads

    def init_from_target(self, target: FrozenTarget) -> None:
        if self.lm_heads is not None:
            weight = target.lm_head_weight()
            for lm_head in self.lm_heads:
                lm_head.weight.data.copy_(weight.to(lm_head.weight.dtype))

    def depth_weights(self) -> Tensor:
        return torch.tensor([self.cfg.loss_decay**k for k in range(self.depth)])

    def head_logits(self, hidden: Tensor, lm_head) -> Tensor:
        """hidden [..., D] -> logits [..., K, V]; `lm_head` is the target's LM head callable."""
        outs = []
        for k, block in enumerate(self.blocks):
            h = block(hidden)
            outs.append(self.lm_heads[k](h) if self.lm_heads is not None else lm_head(h))
        return torch.stack(outs, dim=-2)

    def forward(self, features: TargetFeatures) -> Tensor:
        return self.head_logits(features.final_hidden, features.lm_head)

    def top_tokens(self, features: TargetFeatures, k: int) -> Tensor:
        """[B,T,K,k] one head at a time: never all heads' [B,T,V] logits at once."""
        hidden = features.final_hidden
        out = []
        for i, block in enumerate(self.blocks):
            h = block(hidden)
            logits = self.lm_heads[i](h) if self.lm_heads is not None else features.lm_head(h)
            out.append(logits.topk(min(k, logits.shape[-1]), dim=-1).indices)
        return torch.stack(out, dim=-2)

    def loss(
        self, features: TargetFeatures, loss_mask: Optional[Tensor], segment_ids: Optional[Tensor] = None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The base class's weighted cross-entropy, projecting only the rows that carry a label.

        The vocabulary projection dominates the cost (V >> D), and in chat data most positions are
        prompt tokens without a label, so each depth gathers its valid rows before its LM head.
        """
        labels, valid = depth_labels(features.input_ids, loss_mask, self.depth, segment_ids)
        hidden = features.final_hidden
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        ce, top1, count = [], [], []
        for k, block in enumerate(self.blocks):
            rows = valid[..., k]
            h = block(hidden[rows])  # [M,D]
            logits = self.lm_heads[k](h) if self.lm_heads is not None else features.lm_head(h)
            target = labels[..., k][rows]
            n = target.numel()
            if n == 0:
                ce.append(hidden.new_zeros((), dtype=dtype) + 0.0 * h.sum())
                top1.append(hidden.new_zeros((), dtype=dtype))
            else:
                ce.append(F.cross_entropy(logits.to(dtype), target))
                top1.append((logits.argmax(-1) == target).to(dtype).mean().detach())
            count.append(torch.tensor(float(n), dtype=dtype, device=hidden.device))
        ce_t, top1_t, count_t = torch.stack(ce), torch.stack(top1), torch.stack(count)
        weights = self.depth_weights().to(ce_t.device, ce_t.dtype)
        loss = (weights * ce_t).sum() / weights.sum()
        return loss, {"ce": ce_t.detach(), "top1": top1_t, "count": count_t}

    @torch.no_grad()
    def draft(self, hidden: Tensor, lm_head) -> Tensor:
        """Runtime drafting step: the last verified position's final hidden [B,D] -> logits [B,K,V]."""
        return self.head_logits(hidden, lm_head)
