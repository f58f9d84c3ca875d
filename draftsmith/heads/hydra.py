"""Hydra heads on a frozen target (Ankner et al., 2024): Medusa-style heads made sequentially
dependent, and the Hydra++ options.

Head k (k = 1..K) predicts x_{t+1+k} from the target's last hidden state h_t and the embeddings of
the tokens between: x_{t+1} (the target's own next token, the tree root at run time) and the
drafted x_{t+2}, ..., x_{t+k}. Its input is concat(h_t, e(x_{t+1}), ..., e(x_{t+k})) [(k+1)D],
projected to D (started at h_t: the embeddings' columns are zero), then `num_layers` residual SiLU
blocks (started at the identity) and an LM head: the target's frozen one, or an own copy. A fresh
head is therefore Medusa's fresh head; training teaches it to use the path.

Hydra++ options: `prefix_attention` runs one decoder layer over the target's hidden states first
(causal; heads read its output at t instead of h_t), `teacher` trains each head on the target's own
distribution at the position it predicts (soft cross-entropy) instead of the data token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from draftsmith.heads.base import TargetDims, TargetFeatures, depth_labels
from draftsmith.heads.eagle import DraftLayer, resolve_layer_shape, rotary
from draftsmith.heads.medusa import MedusaHead


@dataclass
class HydraConfig:
    kind: str = "hydra"
    num_heads: int = 4
    num_layers: int = 1
    lm_head: Literal["own", "target"] = "target"
    # Loss weight of head k is loss_decay ** (k - 1).
    loss_decay: float = 0.8
    # Hydra++: one decoder layer over the target's hidden states before the heads.
    prefix_attention: bool = False
    # Hydra++: soft cross-entropy against the target's distribution instead of the data token.
    teacher: bool = False
    # Prefix layer shape; 0 takes the target's value (written back, so exports are self-contained).
    num_attention_heads: int = 0
    intermediate_size: int = 0
    rms_norm_eps: float = 0.0
    rope_theta: float = 0.0


class HydraHead(MedusaHead):
    """Medusa's heads, blocks, LM heads, initialisation and depth weights, with path inputs."""

    config_class = HydraConfig

    def __init__(self, cfg: HydraConfig, dims: TargetDims) -> None:
        super().__init__(cfg, dims)
        D = dims.hidden_size
        # Head k reads h and k token embeddings; it starts at h (Medusa's fresh head).
        self.inputs = nn.ModuleList(nn.Linear((k + 1) * D, D) for k in range(1, cfg.num_heads + 1))
        for proj in self.inputs:
            nn.init.zeros_(proj.weight)
            nn.init.zeros_(proj.bias)
            with torch.no_grad():
                proj.weight[:, :D].copy_(torch.eye(D))
        self.prefix = None
        if cfg.prefix_attention:
            resolve_layer_shape(cfg, dims)
            self.prefix = DraftLayer(D, cfg.num_attention_heads, cfg.intermediate_size, cfg.rms_norm_eps)

    @property
    def _dtype(self) -> torch.dtype:
        return self.inputs[0].weight.dtype

    # ------------------------------------------------------------------ pieces

    def context(self, hidden: Tensor, attention_mask: Optional[Tensor] = None, segment_ids: Optional[Tensor] = None) -> Tensor:
        """What the heads read at every position [B,T,D]: h, or the prefix layer's causal output."""
        hidden = hidden.to(self._dtype)
        if self.prefix is None:
            return hidden
        B, T, _ = hidden.shape
        allowed = torch.ones(T, T, dtype=torch.bool, device=hidden.device).tril().expand(B, T, T)
        if segment_ids is not None:
            allowed = allowed & (segment_ids.unsqueeze(2) == segment_ids.unsqueeze(1))
        if attention_mask is not None:
            allowed = allowed & attention_mask.bool().unsqueeze(1)
        allowed = (allowed | torch.eye(T, dtype=torch.bool, device=hidden.device)).unsqueeze(1)
        cos, sin = rotary(torch.arange(T, device=hidden.device), self.prefix.head_dim, self.cfg.rope_theta, hidden.dtype)
        out, _ = self.prefix.forward_unrolled(hidden, cos.unsqueeze(0), sin.unsqueeze(0), None, [], allowed)
        return out

    def path_logits(self, k: int, context: Tensor, path_embeddings: Tensor, lm_head) -> Tensor:
        """Head k (1-based): context [...,D] and the k path embeddings [...,k,D] -> logits [...,V]."""
        flat = path_embeddings.to(self._dtype).flatten(-2)
        h = self.blocks[k - 1](self.inputs[k - 1](torch.cat([context, flat], dim=-1)))
        return self.lm_heads[k - 1](h) if self.lm_heads is not None else lm_head(h)

    def _paths(self, features: TargetFeatures) -> Tensor:
        """Teacher-forced path embeddings [B,T,K,D]: e(x_{t+1}), ..., e(x_{t+K}) (0 past the row)."""
        ids = features.input_ids
        T = ids.shape[1]
        shifted = torch.zeros(*ids.shape, self.depth, dtype=ids.dtype, device=ids.device)
        for j in range(1, self.depth + 1):
            shifted[:, : max(T - j, 0), j - 1] = ids[:, j:]
        return features.embed(shifted)

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
        dtype = torch.promote_types(context.dtype, torch.float32)
        T = context.shape[1]
        ce, top1, count = [], [], []
        for k in range(1, self.depth + 1):
            rows = valid[..., k - 1]
            n = int(rows.sum())
            if n == 0:
                ce.append(self.inputs[k - 1].weight.sum().to(dtype) * 0.0)  # keeps the graph connected
                top1.append(context.new_zeros((), dtype=dtype))
            else:
                logits = self.path_logits(k, context[rows], paths[:, :, :k][rows], features.lm_head).to(dtype)
                target = labels[..., k - 1][rows]
                if self.cfg.teacher:
                    # The target's distribution over x_{t+1+k}: its own logits at position t + k.
                    shifted = torch.zeros_like(features.final_hidden)
                    shifted[:, : T - k] = features.final_hidden[:, k:]
                    with torch.no_grad():
                        teacher = torch.softmax(features.lm_head(shifted[rows]).to(dtype), dim=-1)
                    ce.append(-(teacher * torch.log_softmax(logits, dim=-1)).sum(-1).mean())
                else:
                    ce.append(F.cross_entropy(logits, target))
                top1.append((logits.argmax(-1) == target).to(dtype).mean().detach())
            count.append(torch.tensor(float(n), dtype=dtype, device=context.device))
        ce_t = torch.stack(ce)
        weights = self.depth_weights().to(ce_t.device, ce_t.dtype)
        loss = (weights * ce_t).sum() / weights.sum()
        return loss, {"ce": ce_t.detach(), "top1": torch.stack(top1), "count": torch.stack(count)}

    # ------------------------------------------------------------------ drafting

    def draft_context(self, hidden: Tensor, positions: Tensor, cache: dict, visible: Tensor) -> Tensor:
        """The context of new decided positions [1,P,D] when drafting: h itself, or the prefix
        layer's output over its cache of earlier positions (which it extends)."""
        hidden = hidden.to(self._dtype)
        if self.prefix is None:
            return hidden
        cos, sin = rotary(positions.unsqueeze(0), self.prefix.head_dim, self.cfg.rope_theta, hidden.dtype)
        return self.prefix.forward_cached(hidden, cos, sin, cache, visible)
