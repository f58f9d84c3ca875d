"""Hydra heads on a frozen target (Ankner et al., 2024): Medusa-style heads made sequentially
dependent, and the Hydra++ options.

Head k (k = 1..K) predicts x_{t+1+k} from the target's last hidden state h_t and the embeddings of
the tokens between: x_{t+1} (the target's own next token, the tree root at run time) and the
drafted x_{t+2}, ..., x_{t+k}. Its input is concat(h_t, e(x_{t+1}), ..., e(x_{t+k})) [(k+1)D],
projected to D (started at h_t: the embeddings' columns are zero), then a residual SiLU block
(started at the identity) and an LM head: the target's frozen one, or an own copy. A fresh head is
therefore Medusa's fresh head; training teaches it to use the path.

Hydra++ options: `prefix_attention` runs one decoder layer over the target's hidden states first
(causal; heads read its output at t instead of h_t), `teacher` trains each head on the target's own
distribution at the position it predicts (soft cross-entropy) instead of the data token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor, nn

from draftsmith.heads.base import HeadSession, TargetDims, TargetFeatures, depth_labels, depth_loss, path_tokens
from draftsmith.heads.eagle import shifted
from draftsmith.heads.layers import DecoderLayer, LayerShape, Rotary, causal_allowed
from draftsmith.heads.medusa import MedusaConfig, MedusaHead


@dataclass
class HydraConfig(LayerShape, MedusaConfig):
    """Medusa's keys (num_heads, num_layers, lm_head, loss_decay), the Hydra++ options, and the
    prefix layer's shape (LayerShape; 0 takes the target's value)."""

    kind: str = "hydra"
    # Hydra++: one decoder layer over the target's hidden states before the heads.
    prefix_attention: bool = False
    # Hydra++: soft cross-entropy against the target's distribution instead of the data token.
    teacher: bool = False

    def check(self) -> None:
        MedusaConfig.check(self)
        self.check_shape("head")


class HydraHead(MedusaHead):
    """Medusa's heads, blocks, LM heads, initialisation and depth weights, with path inputs."""

    config_class = HydraConfig

    def __init__(self, cfg: HydraConfig, dims: TargetDims) -> None:
        cfg.resolve(dims)
        super().__init__(cfg, dims)
        D = dims.hidden_size
        # Head k reads h and k token embeddings; it starts at h (Medusa's fresh head).
        self.inputs = nn.ModuleList(nn.Linear((k + 1) * D, D) for k in range(1, cfg.num_heads + 1))
        for proj in self.inputs:
            nn.init.zeros_(proj.weight)
            nn.init.zeros_(proj.bias)
            with torch.no_grad():
                proj.weight[:, :D].copy_(torch.eye(D))
        self.prefix = DecoderLayer(D, cfg) if cfg.prefix_attention else None
        self.rotary = Rotary(cfg) if cfg.prefix_attention else None

    # ------------------------------------------------------------------ pieces

    def context(self, hidden: Tensor, attention_mask: Optional[Tensor] = None, segment_ids: Optional[Tensor] = None) -> Tensor:
        """What the heads read at every position [B,T,D]: h, or the prefix layer's causal output."""
        hidden = hidden.to(self._dtype)
        if self.prefix is None:
            return hidden
        T = hidden.shape[1]
        allowed = causal_allowed(T, hidden.device, segment_ids, attention_mask)
        cos, sin = self.rotary(torch.arange(T, device=hidden.device), hidden.dtype)
        attn_in, residual = self.prefix.prepare(hidden)
        return self.prefix(attn_in, residual, cos.unsqueeze(0), sin.unsqueeze(0), allowed)

    def path_logits(self, k: int, context: Tensor, path_embeddings: Tensor, lm_head) -> Tensor:
        """Head k (1-based): context [...,D] and the k path embeddings [...,k,D] -> logits [...,V]."""
        flat = path_embeddings.to(self._dtype).flatten(-2)
        return self.project(k, self.blocks[k - 1](self.inputs[k - 1](torch.cat([context, flat], dim=-1))), lm_head)

    def _paths(self, features: TargetFeatures) -> Tensor:
        """Teacher-forced path embeddings [B,T,K,D]: e(x_{t+1}), ..., e(x_{t+K}) (0 past the row)."""
        ids = features.input_ids
        return features.embed(torch.stack([shifted(ids, j) for j in range(1, self.depth + 1)], dim=-1))

    # ------------------------------------------------------------------ training

    def forward(self, features: TargetFeatures) -> Tensor:
        """Logits [B,T,K,V], teacher forced."""
        context = self.context(features.final_hidden, features.attention_mask)
        paths = self._paths(features)
        return torch.stack(
            [self.path_logits(k, context, paths[:, :, :k], features.lm_head) for k in range(1, self.depth + 1)], dim=-2
        )

    def top_tokens(self, features: TargetFeatures, k: int) -> Tensor:
        """[B,T,K,k], one head at a time."""
        context = self.context(features.final_hidden, features.attention_mask)
        paths = self._paths(features)
        picks = []
        for head in range(1, self.depth + 1):
            logits = self.path_logits(head, context, paths[:, :, :head], features.lm_head)
            picks.append(logits.topk(min(k, logits.shape[-1]), dim=-1).indices)
        return torch.stack(picks, dim=-2)

    def loss(
        self, features: TargetFeatures, loss_mask: Optional[Tensor], segment_ids: Optional[Tensor] = None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Weighted (soft, with `teacher`) cross-entropy per head over positions whose label is
        trained; only those rows reach the LM head. Stats: ce/top1/count per head [K]."""
        labels, valid = depth_labels(features.input_ids, loss_mask, self.depth, segment_ids)
        context = self.context(features.final_hidden, features.attention_mask, segment_ids)
        paths = self._paths(features)

        def teacher(k: int, rows: Tensor, _logits: Tensor) -> Tensor:
            # The target's distribution over x_{t+1+k}: its own logits at position t + k.
            with torch.no_grad():
                return torch.softmax(features.lm_head(shifted(features.final_hidden, k)[rows]).float(), dim=-1)

        return depth_loss(
            labels, valid, self.depth_weights(),
            logits_at=lambda k, rows: self.path_logits(k, context[rows], paths[:, :, :k][rows], features.lm_head),
            soft_targets=teacher if self.cfg.teacher else None,
        )  # fmt: skip

    # ------------------------------------------------------------------ drafting

    def start_drafting(self, embed, lm_head) -> HeadSession:
        return HydraSession(self, embed, lm_head)


class HydraSession(HeadSession):
    """The children of a node at depth d-1 come from head d, which reads the context of the
    position that predicted the root and the embeddings of the path from the root to the node.
    With Hydra++'s prefix layer the session keeps that layer's cache of decided positions (tree
    nodes never enter it, so ``rollback`` has nothing to drop)."""

    head: HydraHead

    def __init__(self, head: HydraHead, embed, lm_head) -> None:
        super().__init__(head, embed, lm_head)
        self.cache: dict = {}

    def extend(self, hidden: Tensor, layers: dict[int, Tensor], tokens: Tensor) -> None:
        head, M, start = self.head, hidden.shape[1], self.decided
        hidden = hidden.to(head._dtype)
        if head.prefix is None:
            self.context = hidden[0, -1]
        else:
            visible = torch.ones(M, start + M, dtype=torch.bool, device=hidden.device).tril(diagonal=start)
            cos, sin = head.rotary(torch.arange(start, start + M, device=hidden.device).unsqueeze(0), hidden.dtype)
            attn_in, residual = head.prefix.prepare(hidden)
            self.context = head.prefix.forward_cached(attn_in, residual, cos, sin, self.cache, visible)[0, -1]
        self.decided = start + M

    def expand(self, frontier: Any) -> Tensor:
        rows: list[Optional[Tensor]] = [None] * len(frontier.nodes)
        by_depth: dict[int, list[int]] = {}
        for row, node in enumerate(frontier.nodes):
            by_depth.setdefault(frontier.depths[node] + 1, []).append(row)
        for k, members in by_depth.items():
            # Root first: the k tokens x_{t+1} .. x_{t+k}.
            paths = torch.tensor([path_tokens(frontier, frontier.nodes[row]) for row in members], device=self.context.device)
            logits = self.head.path_logits(k, self.context.expand(len(members), -1), self.embed(paths), self.lm_head)
            for i, row in enumerate(members):
                rows[row] = logits[i]
        return torch.stack(rows)
