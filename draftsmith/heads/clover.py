"""Clover draft heads on a frozen target (Xiao et al., 2024, "Clover: Regressive Lightweight
Speculative Decoding with Sequential Knowledge"), with Clover-2's refinements as the default.

Clover keeps Medusa's shape (heads on the target's last hidden state, the target's frozen LM head)
and adds three pieces:

- an Augmenting Block: ``num_layers`` decoder layers over the target's last decoder layer output
  h (pre-norm), causal over the sequence, each started as a copy of the target's last layer, then
  an RMSNorm started as the target's final norm: the state s the heads start from;
- an Attention Decoder AD(x, e): a single-key cross attention between a state x and a token
  embedding e. Per attention head j, g_j = cos(W_q RMSNorm(x), W_k e)_j gates the value
  (W_v e)_j, and AD(x, e) = x + concat_j(g_j (W_v e)_j): no softmax, no output projection;
- a Regressive Connection: depth k reads the token drafted at depth k-1 through a shared AD, so
  the heads form a recurrent chain over the drafted path.

Clover-2 (the default, ``token_first``, ``output: fc``, two layers, distillation plus regression):

    a_t     = AD_first(h_t, e(x_{t+1}))           the root token fused before the block
    s^1_t   = Norm(Augment(a)_t)                  causal over positions
    o^1_t   = HeadNorm(FC_first(s^1_t))           -> logits of x_{t+2}
    s^k_t   = AD(s^{k-1}_t, e(x_{t+k}))           k = 2..K, one AD for all depths
    o^k_t   = HeadNorm(FC([s^k_t; e(x_{t+k})]))   -> logits of x_{t+1+k}, one FC for all depths

with logits = the target's LM head (o). Clover-1's choices are the options: ``token_first: false``
runs the block on h alone and lets the shared AD read the root token at depth 1 (s^k = AD(s^{k-1},
e(x_{t+k})) for k = 1..K, s^0 = Norm(Augment(h))); ``output: residual`` gives each depth its own
residual SiLU block on the state (Medusa's) instead of the FCs.

Training is teacher forced (the data tokens feed the chain). Depth k's loss is ``ce_weight`` x the
cross-entropy of its logits (soft, against the target's distribution at t + k, with ``teacher``) plus
``regression_weight`` x SmoothL1(o^k_t, the target's post-norm hidden state at t + k), weighted
``loss_decay ** (k - 1)``. At run time only the augmenting block keeps a KV cache, of decided
positions; a tree node's state is its parent's state advanced by the node's token, so drafting needs
no tree attention and ``rollback`` just forgets the node states.

Shapes: B batch, T positions, K depth, V vocabulary, D hidden size, H attention heads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from draftsmith.heads.base import DraftHead, HeadSession, LevelSession, TargetDims, TargetFeatures, depth_labels, depth_loss
from draftsmith.heads.eagle import shifted
from draftsmith.heads.layers import DecoderLayer, LayerShape, ResidualBlock, RMSNorm, Rotary, causal_allowed
from draftsmith.runs import log
from draftsmith.target import FrozenTarget, gathered_parameters


@dataclass
class CloverConfig(LayerShape):
    """Clover-2 by default; ``num_layers: 1, token_first: false, output: residual, teacher: false,
    regression_weight: 0`` is Clover-1's architecture and (Medusa-style) loss. The augmenting
    layers' shape (LayerShape) defaults to the target's, which the copy of its last layer needs."""

    kind: str = "clover"
    # Tokens drafted beyond the target's own (Clover-2: 5 heads).
    depth: int = 5
    # Decoder layers of the augmenting block, each started as a copy of the target's last layer (Clover-2: 2; Clover-1: 1).
    num_layers: int = 2
    # Clover-2: the root token enters through its own attention decoder before the augmenting block;
    # false: Clover-1's order (the block reads the target alone; the regressive decoder reads the root token).
    token_first: bool = True
    # Clover-2 "fc": depth 1 projects the state (D -> D), deeper depths share one projection of
    # [state; token] (2D -> D); Clover-1 "residual": each depth its own residual SiLU block (Medusa's).
    output: Literal["fc", "residual"] = "fc"
    # Soft cross-entropy against the target's distribution at the predicted position (Clover-2's
    # distillation), or against the data token (false).
    teacher: bool = True
    ce_weight: float = 1.0
    # SmoothL1 of each depth's output onto the target's post-norm hidden state there (Clover-2: 10).
    regression_weight: float = 10.0
    # Loss weight of depth k is loss_decay ** (k - 1) (Clover-2: 0.7).
    loss_decay: float = 0.7

    def check(self) -> None:
        if self.depth < 1 or self.num_layers < 0:
            raise ValueError(f"recipe keys 'head.depth' (>= 1) and 'head.num_layers' (>= 0): got {self.depth}, {self.num_layers}")
        if self.output not in ("fc", "residual"):
            raise ValueError(f"recipe key 'head.output' must be 'fc' or 'residual', got {self.output!r}")
        if self.ce_weight < 0 or self.regression_weight < 0 or self.ce_weight + self.regression_weight == 0:
            raise ValueError(f"recipe keys 'head.ce_weight' and 'head.regression_weight' must be >= 0 and not both 0, got {self.ce_weight}, {self.regression_weight}")
        if self.loss_decay <= 0:
            raise ValueError(f"recipe key 'head.loss_decay' must be positive, got {self.loss_decay}")
        self.check_shape("head")


class AttentionDecoder(nn.Module):
    """Clover's Attention Decoder: x [...,D] reads one token embedding e [...,D] through a single
    key per attention head, gated by cosine similarity:

        q = W_q RMSNorm(x) + b_q,  k = W_k e + b_k,  v = W_v e + b_v      (split into H heads)
        AD(x, e) = x + concat_j(cos(q_j, k_j) v_j)

    It starts as the identity on x (W_v, b_v = 0, Clover-1's start); W_q and W_k start at the
    identity plus U(0, 0.01) noise (Clover-2's start), so the gate first compares x with e itself.
    """

    def __init__(self, hidden_size: int, heads: int, eps: float) -> None:
        super().__init__()
        self.heads, self.eps = heads, eps
        self.norm = RMSNorm(hidden_size, eps)
        self.q_proj = nn.Linear(hidden_size, hidden_size)
        self.k_proj = nn.Linear(hidden_size, hidden_size)
        self.v_proj = nn.Linear(hidden_size, hidden_size)
        with torch.no_grad():
            for proj in (self.q_proj, self.k_proj):
                nn.init.uniform_(proj.weight, 0.0, 0.01)
                proj.weight.add_(torch.eye(hidden_size))
                nn.init.zeros_(proj.bias)
            nn.init.zeros_(self.v_proj.weight)
            nn.init.zeros_(self.v_proj.bias)

    def gate(self, x: Tensor, e: Tensor) -> Tensor:
        """The cosine gates [...,H,1], in at least fp32."""
        q = self.q_proj(self.norm(x))
        k = self.k_proj(e)
        dtype = torch.promote_types(q.dtype, torch.float32)
        q = q.to(dtype).unflatten(-1, (self.heads, -1))
        k = k.to(dtype).unflatten(-1, (self.heads, -1))
        # Each norm clamped at eps, as torch.cosine_similarity does.
        norms = q.norm(dim=-1, keepdim=True).clamp_min(self.eps) * k.norm(dim=-1, keepdim=True).clamp_min(self.eps)
        return (q * k).sum(-1, keepdim=True) / norms

    def forward(self, x: Tensor, e: Tensor) -> Tensor:
        gate = self.gate(x, e)
        v = self.v_proj(e).to(gate.dtype).unflatten(-1, (self.heads, -1))
        return x + (gate * v).flatten(-2).to(x.dtype)


class CloverHead(DraftHead):
    """Clover / Clover-2 (see the module docstring)."""

    config_class = CloverConfig

    def __init__(self, cfg: CloverConfig, dims: TargetDims) -> None:
        cfg = cfg.resolved(dims)
        super().__init__(cfg, dims)
        D, K = dims.hidden_size, cfg.depth
        if D % cfg.num_attention_heads:
            raise ValueError(
                f"recipe key 'head.num_attention_heads'={cfg.num_attention_heads} must divide the hidden size {D} "
                "(the attention decoders split the hidden state into that many heads)"
            )
        eps = cfg.rms_norm_eps
        self.rotary = Rotary(cfg)
        # Comprehensions: every layer and block its own module.
        self.augment = nn.ModuleList(DecoderLayer(D, cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(D, eps)
        self.head_norm = RMSNorm(D, eps)
        self.fuse = AttentionDecoder(D, cfg.num_attention_heads, eps) if cfg.token_first else None
        # The depths that read a fresh token through the regressive decoder.
        regressive = K - 1 if cfg.token_first else K
        self.regress = AttentionDecoder(D, cfg.num_attention_heads, eps) if regressive else None
        self.fc_first = self.fc = self.blocks = None
        if cfg.output == "fc":
            if cfg.token_first:
                self.fc_first = nn.Linear(D, D)
                self._start_at_state(self.fc_first, D)
            if regressive:
                self.fc = nn.Linear(2 * D, D)
                self._start_at_state(self.fc, D)
        else:
            self.blocks = nn.ModuleList(ResidualBlock(D, 1) for _ in range(K))

    @staticmethod
    def _start_at_state(fc: nn.Linear, D: int) -> None:
        """The identity on the state's columns, zero on the token's: a fresh projection passes the
        state through (Clover-2 adds U(0, 0.01) everywhere; zeros give a fresh head a closed form)."""
        with torch.no_grad():
            nn.init.zeros_(fc.weight)
            nn.init.zeros_(fc.bias)
            fc.weight[:, :D].copy_(torch.eye(D))

    @property
    def depth(self) -> int:
        return self.cfg.depth

    @property
    def _dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    def required_layers(self) -> list[int]:
        """The target's last decoder layer, before its final norm: what the augmenting block reads."""
        return [self.dims.num_layers - 1]

    def init_from_target(self, target: FrozenTarget) -> None:
        """Augmenting layers from the target's last layer, both norms from its final norm. Warns
        when the target's embedding and LM head are untied: the reference reads tokens from the LM
        head's rows, draftsmith from the input embedding, and the two then differ."""
        embedding, head = target.model.get_input_embeddings().weight, target.model.get_output_embeddings().weight
        if embedding.data_ptr() != head.data_ptr() and embedding.shape == head.shape:
            log(
                "clover: this target's embedding and LM head are untied; Clover reads token embeddings from the LM head's rows, "
                "draftsmith from the input embedding (docs/heads.md, Clover): expect it to differ from the reference there"
            )
        last = target.layers[-1]
        final_norm = getattr(target.model.base_model, "norm", None)
        with gathered_parameters(list(last.parameters())):
            theirs = last.state_dict()
            for layer in self.augment:
                mine = layer.state_dict()
                if any(k not in theirs or theirs[k].shape != v.shape for k, v in mine.items()):
                    log(f"clover: the augmenting block is shaped unlike the target's last layer ({type(last).__name__}): random start")
                    break
                layer.load_state_dict({k: theirs[k].to(v.dtype) for k, v in mine.items()})
            else:
                left = sorted(set(theirs) - set(self.augment[0].state_dict())) if len(self.augment) else []
                if left:
                    log(f"clover: the augmenting block copies the target's last layer without {', '.join(left)}")
        weight = getattr(final_norm, "weight", None)
        if weight is not None and weight.shape == self.norm.weight.shape:
            with torch.no_grad():
                self.norm.weight.copy_(weight.to(self._dtype))
                self.head_norm.weight.copy_(weight.to(self._dtype))

    # ------------------------------------------------------------------ pieces

    def feature(self, layers: dict[int, Tensor]) -> Tensor:
        """h [...,D]: the target's last decoder layer output (pre-norm)."""
        return layers[self.dims.num_layers - 1].to(self._dtype)

    def block_input(self, h: Tensor, root_embedding: Tensor) -> Tensor:
        """What the augmenting block reads: AD_first(h, e(x_{t+1})) (Clover-2) or h (Clover-1)."""
        return self.fuse(h, root_embedding.to(self._dtype)) if self.fuse is not None else h

    def advance(self, state: Tensor, embedding: Tensor) -> Tensor:
        """The regressive step: the state after reading one more token's embedding."""
        return self.regress(state, embedding.to(self._dtype))

    def output(self, k: int, state: Tensor, embedding: Optional[Tensor]) -> Tensor:
        """o^k [...,D], the input of the LM head for depth k (1-based); `embedding` is the token
        the state read last (None for Clover-2's depth 1, whose token was fused before the block)."""
        if self.blocks is not None:
            out = self.blocks[k - 1](state)
        elif embedding is None:
            out = self.fc_first(state)
        else:
            out = self.fc(torch.cat([state, embedding.to(self._dtype)], dim=-1))
        return self.head_norm(out)

    def augment_sequence(self, x: Tensor, allowed: Tensor) -> Tensor:
        """The augmenting block over whole sequences, causal per `allowed` [B or 1,1,T,T], then its norm."""
        T = x.shape[1]
        cos, sin = self.rotary(torch.arange(T, device=x.device), x.dtype)
        for layer in self.augment:
            attn_in, residual = layer.prepare(x)
            x = layer(attn_in, residual, cos.unsqueeze(0), sin.unsqueeze(0), allowed)
        return self.norm(x)

    # ------------------------------------------------------------------ training

    def unroll(self, features: TargetFeatures, segment_ids: Optional[Tensor] = None) -> list[Tensor]:
        """Teacher-forced outputs o^k [B,T,D], k = 1..K: the chain reads the data tokens x_{t+k}."""
        ids = features.input_ids
        T = ids.shape[1]
        allowed = causal_allowed(T, ids.device, segment_ids, features.attention_mask)
        # e(x_{t+j}), j = 1..K; past the end of the row there is no token (padding id 0).
        embeddings = [features.embed(shifted(ids, j)) for j in range(1, self.depth + 1)]
        state = self.augment_sequence(self.block_input(self.feature(features.hidden), embeddings[0]), allowed)
        outputs = []
        for k in range(1, self.depth + 1):
            if self.fuse is not None and k == 1:
                outputs.append(self.output(1, state, None))
            else:
                state = self.advance(state, embeddings[k - 1])
                outputs.append(self.output(k, state, embeddings[k - 1]))
        return outputs

    def forward(self, features: TargetFeatures) -> Tensor:
        """Logits [B,T,K,V]."""
        return torch.stack([features.lm_head(o) for o in self.unroll(features)], dim=-2)

    def top_tokens(self, features: TargetFeatures, k: int) -> Tensor:
        """[B,T,K,k] one depth at a time: never all depths' [B,T,V] logits at once."""
        picks = []
        for o in self.unroll(features):
            logits = features.lm_head(o)
            picks.append(logits.topk(min(k, logits.shape[-1]), dim=-1).indices)
        return torch.stack(picks, dim=-2)

    def depth_weights(self) -> Tensor:
        return torch.tensor([self.cfg.loss_decay**k for k in range(self.depth)])

    def loss(
        self, features: TargetFeatures, loss_mask: Optional[Tensor], segment_ids: Optional[Tensor] = None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Per depth k: ce_weight x the token loss (soft against the target's distribution over
        x_{t+1+k} with ``teacher``) + regression_weight x SmoothL1(o^k_t, the target's post-norm
        hidden state at t + k), over positions whose label is trained; depths weighted
        loss_decay ** (k - 1). Stats: ce/top1/count per depth [K]."""
        cfg = self.cfg
        outputs = self.unroll(features, segment_ids)
        labels, valid = depth_labels(features.input_ids, loss_mask, self.depth, segment_ids)
        teacher_probs = self._teacher_probs(features.final_hidden, valid, features.lm_head) if cfg.teacher else None

        def teacher(k: int, rows: Tensor, _logits: Tensor) -> Tensor:
            probs, index = teacher_probs
            return probs[shifted(index, k)[rows]]

        def regression(k: int, rows: Tensor) -> Tensor:
            if not cfg.regression_weight:
                return outputs[k - 1].new_zeros(())
            wanted = shifted(features.final_hidden, k)[rows].detach()
            dtype = torch.promote_types(wanted.dtype, torch.float32)
            return cfg.regression_weight * F.smooth_l1_loss(outputs[k - 1][rows].to(dtype), wanted.to(dtype))

        return depth_loss(
            labels, valid, self.depth_weights(),
            logits_at=lambda k, rows: features.lm_head(outputs[k - 1][rows]),
            soft_targets=teacher if cfg.teacher else None,
            extra=regression, ce_weight=cfg.ce_weight,
        )  # fmt: skip

    @staticmethod
    @torch.no_grad()
    def _teacher_probs(final_hidden: Tensor, valid: Tensor, lm_head) -> tuple[Tensor, Tensor]:
        """The target's distributions at every position some depth is scored against, each computed
        once: depth k at t reads position t + k, so the depths share nearly all of them (one
        vocabulary projection instead of K). valid [B,T,K]. Returns (probs [N,V] fp32, index [B,T]:
        the row of each position, -1 where none is needed)."""
        B, T, K = valid.shape
        needed = torch.zeros(B, T, dtype=torch.bool, device=valid.device)
        for k in range(1, K + 1):
            needed[:, k:] |= valid[:, : T - k, k - 1]
        index = torch.full((B, T), -1, dtype=torch.long, device=valid.device)
        index[needed] = torch.arange(int(needed.sum()), device=valid.device)
        return torch.softmax(lm_head(final_hidden[needed]).float(), dim=-1), index

    # ------------------------------------------------------------------ drafting

    def start_drafting(self, embed, lm_head) -> HeadSession:
        return CloverSession(self, embed, lm_head)


class CloverSession(LevelSession):
    """The augmenting block's KV cache over decided positions (tree nodes never enter it) and, per
    tree node, its state: the root's is the block's output at the last decided position (advanced
    by the root token in Clover-1's order), a node's is its parent's advanced by its own token. A
    node's children come from its output o^{d+1}; ``rollback`` forgets the node states."""

    head: CloverHead
    step_attribute = "base"

    def __init__(self, head: CloverHead, embed, lm_head) -> None:
        super().__init__(head, embed, lm_head)
        self.caches: list[dict] = [{} for _ in head.augment]
        self.base: Optional[Tensor] = None  # [1,D], the block's output where the root was predicted
        self.states: dict[int, Tensor] = {}  # node id -> state [1,D]
        self.outputs: dict[int, Tensor] = {}  # node id -> o [1,D]

    def _forget(self) -> None:
        self.base, self.states, self.outputs = None, {}, {}

    def _level(self, level: int, states: Optional[Tensor], tokens: Tensor) -> tuple[Tensor, Tensor]:
        """A level's node states from their parents' (the root's from ``base``), as ``expand``."""
        head = self.head
        base = self.step_input
        if level == 1 and head.fuse is not None:  # Clover-2: the root token was fused before the block
            return base, self.lm_head(head.output(1, base, None))
        embedding = self.embed(tokens)
        state = head.advance(base if states is None else states, embedding)
        return state, self.lm_head(head.output(level, state, embedding))

    def _layer_caches(self) -> list:
        return list(zip(self.head.augment, self.caches))

    def _read(self, hidden: Tensor, layers: dict[int, Tensor], tokens: Tensor, positions: Tensor, visible: Tensor) -> Tensor:
        head = self.head
        x = head.block_input(head.feature(layers), self.embed(tokens))
        cos, sin = head.rotary(positions.unsqueeze(0), x.dtype)
        for layer, cache in zip(head.augment, self.caches):
            attn_in, residual = layer.prepare(x)
            x = layer.forward_cached(attn_in, residual, cos, sin, cache, visible)
        return head.norm(x)[0, -1:]

    def extend(self, hidden: Tensor, layers: dict[int, Tensor], tokens: Tensor) -> None:
        super().extend(hidden, layers, tokens)
        self.states, self.outputs = {}, {}

    def expand(self, frontier: Any) -> Tensor:
        head, base = self.head, self.step_input
        todo: dict[int, list[int]] = {}
        for node in frontier.nodes:
            if node not in self.outputs:
                todo.setdefault(frontier.depths[node], []).append(node)
        for d, nodes in todo.items():
            if head.fuse is not None and d == 0:
                # Clover-2: the root token was fused before the block.
                self.states[0], self.outputs[0] = base, head.output(1, base, None)
                continue
            previous = torch.cat([base if d == 0 else self.states[frontier.parents[n]] for n in nodes])
            embedding = self.embed(torch.tensor([frontier.tokens[n] for n in nodes], device=previous.device))
            state = head.advance(previous, embedding)
            out = head.output(d + 1, state, embedding)
            for row, node in enumerate(nodes):
                self.states[node], self.outputs[node] = state[row : row + 1], out[row : row + 1]
        return self.lm_head(torch.cat([self.outputs[n] for n in frontier.nodes]))

    def rollback(self) -> None:
        super().rollback()
        self.states, self.outputs = {}, {}
