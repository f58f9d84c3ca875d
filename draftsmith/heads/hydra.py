"""Hydra heads on a frozen target (Ankner et al., 2024): Medusa-style heads made sequentially
dependent. The defaults are Hydra++, the paper's tuned recipe as its reference code builds it.

Head k (k = 1..K) predicts x_{t+1+k} from a context c_t of position t and the embeddings of the
tokens between: x_{t+1} (the target's own next token, the tree root at run time) and the drafted
x_{t+2}, ..., x_{t+k}. Its MLP is, as in the reference:

- a first block on the whole concatenation x = concat(c_t, e(x_{t+1}), ..., e(x_{t+k})) [(k+1)D]:
  R x + SiLU(W x + b), where R [(k+1)D -> D] carries the residual past the width change and W
  starts at zero;
- ``num_layers - 1`` residual blocks h + SiLU(W h + b) on the hidden size (Hydra++: 4 layers in all);
- an LM head: an own copy of the target's (the reference's) or the target's frozen one.

R starts at [I, 0, ...] (reading c_t only) and every W at zero, so a fresh head is Medusa's fresh
head: the target's next-token logits at t (the reference initialises R at random).

The context (``prefix_attention``, Hydra++): one decoder layer over the target's hidden states,
causal, followed by a final RMSNorm (the reference builds it as a one-layer Llama model, whose
output is normed); c_t is its output at t. Without it c_t is the target's last hidden state h_t.

Training (Hydra++): ``token_weight`` x the cross-entropy against the data token plus
``teacher_weight`` x the soft cross-entropy against the target's own distribution at the predicted
position, per head, heads weighted ``loss_decay ** (k - 1)`` (1: the reference sums them); NEFTune
noise on the token embeddings (``input_noise``: uniform in +-alpha / sqrt(L D), L the row's real
tokens), and on h_t too without the prefix layer, as the reference does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from draftsmith.heads.base import HeadSession, LevelSession, TargetDims, TargetFeatures, depth_labels, depth_loss, path_tokens
from draftsmith.heads.eagle import shifted
from draftsmith.heads.layers import DecoderLayer, LayerShape, RMSNorm, Rotary, causal_allowed
from draftsmith.heads.medusa import MedusaConfig, MedusaHead


@dataclass
class HydraConfig(LayerShape, MedusaConfig):
    """Medusa's keys (num_heads, num_layers, lm_head, loss_decay) with Hydra++'s defaults, the
    Hydra++ options, and the prefix layer's shape (LayerShape; 0 takes the target's value)."""

    kind: str = "hydra"
    # MLP layers per head, the concatenation block included (Hydra++: 4).
    num_layers: int = 4
    # Each head its own LM head, initialised from the target's (the reference's).
    lm_head: Literal["own", "target"] = "own"
    # The reference sums the heads' losses unweighted.
    loss_decay: float = 1.0
    # Hydra++: one decoder layer and a final norm over the target's hidden states before the heads.
    prefix_attention: bool = True
    # Weights of the cross-entropy against the data token and of the soft cross-entropy against
    # the target's distribution at the predicted position (Hydra++ adds both).
    token_weight: float = 1.0
    teacher_weight: float = 1.0
    # NEFTune alpha of the training noise on the token embeddings (0: none).
    input_noise: float = 5.0

    def check(self) -> None:
        MedusaConfig.check(self)
        if self.num_layers < 1:
            raise ValueError(f"recipe key 'head.num_layers' must be >= 1 for hydra (the concatenation block), got {self.num_layers}")
        if self.token_weight < 0 or self.teacher_weight < 0 or self.token_weight + self.teacher_weight == 0:
            raise ValueError(
                f"recipe keys 'head.token_weight' and 'head.teacher_weight' must be >= 0 and not both 0, got {self.token_weight}, {self.teacher_weight}"
            )
        if self.input_noise < 0:
            raise ValueError(f"recipe key 'head.input_noise' must be >= 0, got {self.input_noise}")
        self.check_shape("head")


class ConcatBlock(nn.Module):
    """R x + SiLU(W x + b) from a concatenation [in_size] down to the hidden size [out_size]: the
    nonlinearity sees the whole input. R starts at [I, 0, ...] and W, b at zero, so a fresh block
    returns the first out_size features of its input."""

    def __init__(self, in_size: int, out_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(in_size, out_size)
        self.residual = nn.Linear(in_size, out_size, bias=False)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)
        nn.init.zeros_(self.residual.weight)
        with torch.no_grad():
            self.residual.weight[:, :out_size].copy_(torch.eye(out_size))

    def forward(self, x: Tensor) -> Tensor:
        return self.residual(x) + F.silu(self.linear(x))


def neftune_noise(like: Tensor, alpha: float, lengths: Tensor) -> Tensor:
    """Uniform noise in +-alpha / sqrt(L D) shaped like [B,T,D], L = lengths [B] (real tokens per row)."""
    scale = alpha / torch.sqrt(lengths.clamp_min(1).to(like.dtype) * like.shape[-1])
    return (torch.rand_like(like) * 2 - 1) * scale.view(-1, 1, 1)


class HydraHead(MedusaHead):
    """Medusa's heads, residual blocks, LM heads and their initialisation, with path inputs."""

    config_class = HydraConfig

    def __init__(self, cfg: HydraConfig, dims: TargetDims) -> None:
        cfg = cfg.resolved(dims)
        super().__init__(cfg, dims)
        D = dims.hidden_size
        # Head k reads the context and k token embeddings.
        self.inputs = nn.ModuleList(ConcatBlock((k + 1) * D, D) for k in range(1, cfg.num_heads + 1))
        self.prefix = DecoderLayer(D, cfg) if cfg.prefix_attention else None
        self.prefix_norm = RMSNorm(D, cfg.rms_norm_eps) if cfg.prefix_attention else None
        self.rotary = Rotary(cfg) if cfg.prefix_attention else None

    def block_layers(self) -> int:
        """The concatenation block is the first of num_layers."""
        return self.cfg.num_layers - 1

    # ------------------------------------------------------------------ pieces

    def context(self, hidden: Tensor, attention_mask: Optional[Tensor] = None, segment_ids: Optional[Tensor] = None) -> Tensor:
        """What the heads read at every position [B,T,D]: h, or the prefix layer's causal output, normed."""
        hidden = hidden.to(self._dtype)
        if self.prefix is None:
            return hidden
        T = hidden.shape[1]
        allowed = causal_allowed(T, hidden.device, segment_ids, attention_mask)
        cos, sin = self.rotary(torch.arange(T, device=hidden.device), hidden.dtype)
        attn_in, residual = self.prefix.prepare(hidden)
        return self.prefix_norm(self.prefix(attn_in, residual, cos.unsqueeze(0), sin.unsqueeze(0), allowed))

    def path_logits(self, k: int, context: Tensor, path_embeddings: Tensor, lm_head) -> Tensor:
        """Head k (1-based): context [...,D] and the k path embeddings [...,k,D] -> logits [...,V]."""
        flat = path_embeddings.to(self._dtype).flatten(-2)
        return self.project(k, self.blocks[k - 1](self.inputs[k - 1](torch.cat([context, flat], dim=-1))), lm_head)

    def _paths(self, embeddings: Tensor) -> Tensor:
        """Teacher-forced path embeddings [B,T,K,D] from the row's token embeddings [B,T,D]:
        e(x_{t+1}), ..., e(x_{t+K}) (0 past the row)."""
        return torch.stack([shifted(embeddings, j) for j in range(1, self.depth + 1)], dim=2)

    def _inputs(
        self, features: TargetFeatures, segment_ids: Optional[Tensor] = None, noise: float = 0.0
    ) -> tuple[Tensor, Tensor]:
        """(context [B,T,D], path embeddings [B,T,K,D]), with NEFTune noise of alpha `noise`."""
        hidden = features.final_hidden.to(self._dtype)
        embeddings = features.embed(features.input_ids).to(self._dtype)
        if noise:
            if segment_ids is not None:
                lengths = (segment_ids > 0).sum(-1)
            elif features.attention_mask is not None and features.attention_mask.dim() == 2:
                lengths = features.attention_mask.sum(-1)
            else:
                lengths = torch.full((hidden.shape[0],), hidden.shape[1], device=hidden.device)
            embeddings = embeddings + neftune_noise(embeddings, noise, lengths)
            if self.prefix is None:
                hidden = hidden + neftune_noise(hidden, noise, lengths)
        return self.context(hidden, features.attention_mask, segment_ids), self._paths(embeddings)

    # ------------------------------------------------------------------ training

    def forward(self, features: TargetFeatures) -> Tensor:
        """Logits [B,T,K,V], teacher forced."""
        context, paths = self._inputs(features)
        return torch.stack(
            [self.path_logits(k, context, paths[:, :, :k], features.lm_head) for k in range(1, self.depth + 1)], dim=-2
        )

    def top_tokens(self, features: TargetFeatures, k: int) -> Tensor:
        """[B,T,K,k], one head at a time."""
        context, paths = self._inputs(features)
        picks = []
        for head in range(1, self.depth + 1):
            logits = self.path_logits(head, context, paths[:, :, :head], features.lm_head)
            picks.append(logits.topk(min(k, logits.shape[-1]), dim=-1).indices)
        return torch.stack(picks, dim=-2)

    def loss(
        self, features: TargetFeatures, loss_mask: Optional[Tensor], segment_ids: Optional[Tensor] = None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Per head: token_weight x the cross-entropy against the data token + teacher_weight x the
        soft cross-entropy against the target's distribution, over positions whose label is
        trained; only those rows reach the LM head. Stats: ce/top1/count per head [K] (ce: the
        teacher term when it is on)."""
        cfg = self.cfg
        labels, valid = depth_labels(features.input_ids, loss_mask, self.depth, segment_ids)
        context, paths = self._inputs(features, segment_ids, cfg.input_noise if self.training else 0.0)

        def teacher(k: int, rows: Tensor, _logits: Tensor) -> Tensor:
            # The target's distribution over x_{t+1+k}: its own logits at position t + k.
            with torch.no_grad():
                return torch.softmax(features.lm_head(shifted(features.final_hidden, k)[rows]).float(), dim=-1)

        with_teacher = cfg.teacher_weight > 0
        return depth_loss(
            labels, valid, self.depth_weights(),
            logits_at=lambda k, rows: self.path_logits(k, context[rows], paths[:, :, :k][rows], features.lm_head),
            soft_targets=teacher if with_teacher else None,
            ce_weight=cfg.teacher_weight if with_teacher else cfg.token_weight,
            label_weight=cfg.token_weight if with_teacher else 0.0,
        )  # fmt: skip

    # ------------------------------------------------------------------ drafting

    def start_drafting(self, embed, lm_head) -> HeadSession:
        return HydraSession(self, embed, lm_head)


class HydraSession(LevelSession):
    """The children of a node at depth d-1 come from head d, which reads the context of the
    position that predicted the root and the embeddings of the path from the root to the node.
    With Hydra++'s prefix layer the session keeps that layer's cache of decided positions (tree
    nodes never enter it, so ``rollback`` has nothing to drop). On the static cache a level's
    state is its nodes' paths [F, level] (LevelSession: the whole tree one graph on CUDA)."""

    head: HydraHead
    step_attribute = "context"  # [D]: h, or the prefix layer's normed output, where the root was predicted

    def __init__(self, head: HydraHead, embed, lm_head) -> None:
        super().__init__(head, embed, lm_head)
        self.cache: dict = {}

    def _level(self, level: int, states: Optional[Tensor], tokens: Tensor) -> tuple[Tensor, Tensor]:
        paths = tokens.unsqueeze(1) if states is None else torch.cat([states, tokens.unsqueeze(1)], dim=1)  # root first
        return paths, self.head.path_logits(level, self.step_input.expand(paths.shape[0], -1), self.embed(paths), self.lm_head)

    def _layer_caches(self) -> list:
        return [] if self.head.prefix is None else [(self.head.prefix, self.cache)]

    def _read(self, hidden: Tensor, layers: dict[int, Tensor], tokens: Tensor, positions: Tensor, visible: Tensor) -> Tensor:
        head = self.head
        hidden = hidden.to(head._dtype)
        if head.prefix is None:
            return hidden[0, -1]
        cos, sin = head.rotary(positions.unsqueeze(0), hidden.dtype)
        attn_in, residual = head.prefix.prepare(hidden)
        return head.prefix_norm(head.prefix.forward_cached(attn_in, residual, cos, sin, self.cache, visible)[0, -1])

    def expand(self, frontier: Any) -> Tensor:
        rows: list[Optional[Tensor]] = [None] * len(frontier.nodes)
        by_depth: dict[int, list[int]] = {}
        for row, node in enumerate(frontier.nodes):
            by_depth.setdefault(frontier.depths[node] + 1, []).append(row)
        for k, members in by_depth.items():
            # Root first: the k tokens x_{t+1} .. x_{t+k}.
            paths = torch.tensor([path_tokens(frontier, frontier.nodes[row]) for row in members], device=self.step_input.device)
            logits = self.head.path_logits(k, self.step_input.expand(len(members), -1), self.embed(paths), self.lm_head)
            for i, row in enumerate(members):
                rows[row] = logits[i]
        return torch.stack(rows)
