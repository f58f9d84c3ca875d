"""Medusa-1 heads on a frozen target (Cai et al., 2024).

Head k (k = 1..K) reads the target's final hidden state at position t and predicts x_{t+1+k}. Each
head is a residual block (``num_layers`` steps of h + SiLU(W h + b), started at the identity)
followed by either its own LM head initialised from the target's, or the target's frozen LM head.
At run time a node's children at depth d come from head d whatever the path above it (Medusa's
product tree).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Optional

import torch
from torch import Tensor, nn

from draftsmith.graphs import Graphs
from draftsmith.heads.base import DraftHead, HeadSession, TargetDims, TargetFeatures, depth_labels, depth_loss
from draftsmith.heads.layers import ResidualBlock
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

    def check(self) -> None:
        if self.num_heads < 1:
            raise ValueError(f"recipe key 'head.num_heads' must be >= 1, got {self.num_heads}")
        if self.num_layers < 0:
            raise ValueError(f"recipe key 'head.num_layers' must be >= 0, got {self.num_layers}")
        if self.loss_decay <= 0:
            raise ValueError(f"recipe key 'head.loss_decay' must be positive, got {self.loss_decay}")


class MedusaHead(DraftHead):
    config_class = MedusaConfig

    def __init__(self, cfg: MedusaConfig, dims: TargetDims) -> None:
        super().__init__(cfg, dims)
        D, V = dims.hidden_size, dims.vocab_size
        # A comprehension, not [block] * n: every head and every layer must be its own module.
        self.blocks = nn.ModuleList(ResidualBlock(D, self.block_layers()) for _ in range(cfg.num_heads))
        self.lm_heads = (
            nn.ModuleList(nn.Linear(D, V, bias=False) for _ in range(cfg.num_heads)) if cfg.lm_head == "own" else None
        )

    def block_layers(self) -> int:
        """Residual layers of each head's block on the hidden size."""
        return self.cfg.num_layers

    @property
    def depth(self) -> int:
        return self.cfg.num_heads

    @property
    def _dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def init_from_target(self, target: FrozenTarget) -> None:
        if self.lm_heads is not None:
            weight = target.lm_head_weight()
            for lm_head in self.lm_heads:
                lm_head.weight.data.copy_(weight.to(lm_head.weight.dtype))

    def depth_weights(self) -> Tensor:
        return torch.tensor([self.cfg.loss_decay**k for k in range(self.depth)])

    def project(self, k: int, h: Tensor, lm_head) -> Tensor:
        """Head k's LM head (1-based): its own, or the target's `lm_head` callable. h [...,D] -> [...,V]."""
        return self.lm_heads[k - 1](h) if self.lm_heads is not None else lm_head(h)

    def head_logits(self, hidden: Tensor, lm_head) -> Tensor:
        """hidden [..., D] -> logits [..., K, V]. On the target's LM head the K heads' states go
        through it in one product, which reads its weight once instead of K times: the LM head is
        the largest matrix a drafting step reads (1 GB in bf16 at Llama-3.1-8B's 128k vocabulary)."""
        hidden = hidden.to(self._dtype)
        if self.lm_heads is None:
            return lm_head(torch.stack([block(hidden) for block in self.blocks], dim=-2))
        return torch.stack([self.project(k, block(hidden), lm_head) for k, block in enumerate(self.blocks, start=1)], dim=-2)

    def forward(self, features: TargetFeatures) -> Tensor:
        return self.head_logits(features.final_hidden, features.lm_head)

    def top_tokens(self, features: TargetFeatures, k: int) -> Tensor:
        """[B,T,K,k] one head at a time: never all heads' [B,T,V] logits at once."""
        hidden = features.final_hidden.to(self._dtype)
        out = []
        for i, block in enumerate(self.blocks, start=1):
            logits = self.project(i, block(hidden), features.lm_head)
            out.append(logits.topk(min(k, logits.shape[-1]), dim=-1).indices)
        return torch.stack(out, dim=-2)

    def loss(
        self, features: TargetFeatures, loss_mask: Optional[Tensor], segment_ids: Optional[Tensor] = None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The weighted per-head cross-entropy, projecting only the rows that carry a label."""
        labels, valid = depth_labels(features.input_ids, loss_mask, self.depth, segment_ids)
        hidden = features.final_hidden.to(self._dtype)

        def logits_at(k: int, rows: Tensor) -> Tensor:
            return self.project(k, self.blocks[k - 1](hidden[rows]), features.lm_head)

        return depth_loss(labels, valid, self.depth_weights(), logits_at)

    def start_drafting(self, embed, lm_head) -> HeadSession:
        return MedusaSession(self, embed, lm_head)


class MedusaSession(HeadSession):
    """All K heads run once per step on the hidden state that predicted the root; a node at depth d
    gets its children from head d + 1."""

    head: MedusaHead
    drafts_by_level = True

    def preallocate(self, capacity: int, graphs: bool) -> bool:
        """Medusa keeps no cache; on CUDA its K heads and their logits replay as one CUDA graph
        ("heads")."""
        self.graphs = Graphs(graphs)
        return graphs

    # On graphs, a step's heads wait (``_wait``: the hidden state that predicted the root, the root
    # token; one shape whatever the step read, so a prompt's wait too): the step's static tree runs
    # them in its own graph (``after_levels``), or ``_settle`` does before anything else reads the logits.

    def restart(self, capacity: int) -> bool:
        if not (self.graphs and self.graphs.captured):  # nothing captured yet, or a capture failed
            return False
        self.decided, self._pending = 0, None
        return True

    def _logits(self, last: Tensor) -> Tensor:
        return self.head.head_logits(last, self.lm_head)  # [K,V]

    def extend(self, hidden: Tensor, layers: dict[int, Tensor], tokens: Tensor) -> None:
        self.decided += hidden.shape[1]
        if self.graphs:
            self._wait(None, hidden[0, -1], tokens[0, -1:])
        else:
            self.logits = self._logits(hidden[0, -1])

    def _read_alone(self, last: Tensor, root: Tensor) -> None:
        """The waiting heads on their own ("heads": one graph). A graph's logits are overwritten by
        its next replay, at the next step: the tree reads them before."""
        self.logits, _ = self.graphs.run("heads", self._logits, (last,), "the medusa heads")

    def after_levels(self, then: Any, name: Any, extra: tuple[Tensor, ...] = ()) -> Optional[tuple[Tensor, ...]]:
        pending = self._take_read()
        if pending is None:
            return None

        def heads_then(last: Tensor, root_token: Tensor, *extra: Tensor) -> tuple[Tensor, ...]:
            return then(self._logits(last), root_token, *extra)

        out, replayed = self.graphs.run(("heads", name), heads_then, (*pending, *extra), "the medusa heads and the tree")
        self.logits = None  # this step's lived in the graph: an earlier step's must not pass for them
        return tuple(x.clone() for x in out) if replayed else out

    def expand(self, frontier: Any) -> Tensor:
        return self.level_logits()[[frontier.depths[n] for n in frontier.nodes]]

    def level_logits(self) -> Tensor:
        self._settle()
        return self.logits

    def rollback(self) -> None:
        self._pending = None  # heads nothing read: Medusa keeps no cache they would have written
