"""EAGLE draft heads on a frozen target (Li et al., 2024), with EAGLE-3's fused features and
training-time test as options. EAGLE-2's dynamic trees are the runtime's (runtime/tree.py).

The draft is a small autoregressive model over (feature, token) pairs. At position t it reads a
feature of the target, g_t, and the token x_{t+1} the target decided after it, and outputs a_t, its
guess of the next position's feature; the target's frozen LM head turns a_t into logits for x_{t+2}
(depth 1). To draft deeper it feeds its own output back: (a_t, x_{t+2}) -> a^(2)_t -> x_{t+3}, ...

- g_t is the target's final hidden state, the LM head's input (EAGLE-1/2), or, with
  `feature_layers`, the outputs of several decoder layers concatenated and projected to the hidden
  size (EAGLE-3); the output then goes through its own final norm before the LM head.
- Training step 1 is EAGLE-1's objective: cross-entropy of x_{t+2} (weight ce_weight) plus a
  smooth-L1 regression of a_t onto g_{t+1} (weight regression_weight; final-hidden features only).
- With train_depth = S > 1, steps 2..S unroll the draft on its own outputs (training-time test):
  the query of step s at position t attends to the step-1 entries of positions <= t (real
  features, like the prefix at run time) and to the step-2..s entries of position t itself (its
  drafted ancestors), at rotary position t + s - 1. The runtime drafting a chain computes exactly
  this, so training, evaluation (`forward`, all `depth` steps) and drafting agree (tested).

Shapes: B batch, T positions, K depth, V vocabulary, D hidden size, H heads, Dh head size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from draftsmith.heads.base import DraftHead, TargetDims, TargetFeatures, depth_labels
from draftsmith.target import FrozenTarget


@dataclass
class EagleConfig:
    kind: str = "eagle"
    # Tokens drafted beyond the target's own: the run-time tree depth and the evaluated depths.
    depth: int = 5
    # Unrolled steps that carry loss in training (1: EAGLE-1; more: EAGLE-3's training-time test).
    train_depth: int = 1
    num_layers: int = 1
    # 0 takes the target's value; the head writes back what it took, so exports are self-contained.
    num_attention_heads: int = 0
    intermediate_size: int = 0
    rms_norm_eps: float = 0.0
    rope_theta: float = 0.0
    # Decoder layers fused into the feature (EAGLE-3, e.g. [2, 15, 27]); empty: the final hidden state.
    feature_layers: list[int] = field(default_factory=list)
    ce_weight: float = 0.1
    # The feature regression (EAGLE-1); must be 0 with feature_layers (a fused feature is learned,
    # not a fixed target).
    regression_weight: float = 1.0
    # Loss weight of unrolled step s is loss_decay ** (s - 1).
    loss_decay: float = 0.8


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = torch.promote_types(x.dtype, torch.float32)
        y = x.to(dtype)
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.to(dtype) * y).to(x.dtype)


def rotary(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos, sin [..., P, Dh] for integer positions [..., P] (rotate-half convention)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float64) / head_dim))
    angles = positions.to(torch.float64).unsqueeze(-1) * inv
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + turned * sin


class DraftLayer(nn.Module):
    """A pre-norm decoder layer (attention with rotary positions, SwiGLU MLP) with two attention
    paths: the training-time-test pattern over whole sequences, and a KV cache for drafting."""

    def __init__(self, hidden: int, heads: int, intermediate: int, eps: float) -> None:
        super().__init__()
        if hidden % heads:
            raise ValueError(f"eagle: hidden size {hidden} is not divisible by {heads} attention heads")
        self.heads, self.head_dim = heads, hidden // heads
        self.attn_norm = RMSNorm(hidden, eps)
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, hidden, bias=False)
        self.v_proj = nn.Linear(hidden, hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)
        self.mlp_norm = RMSNorm(hidden, eps)
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [B,P,D] -> q, k, v [B,H,P,Dh], rotary applied (cos/sin [B or 1,P,Dh])."""
        B, P, _ = x.shape
        h = self.attn_norm(x)
        split = lambda t: t.view(B, P, self.heads, self.head_dim).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.q_proj(h)), split(self.k_proj(h)), split(self.v_proj(h))
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin), v

    def finish(self, x: Tensor, attended: Tensor) -> Tensor:
        """Residual attention output, then the MLP. attended [B,H,P,Dh]."""
        B, H, P, Dh = attended.shape
        x = x + self.o_proj(attended.transpose(1, 2).reshape(B, P, H * Dh).to(x.dtype))
        h = self.mlp_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))

    def forward_unrolled(
        self, x: Tensor, cos: Tensor, sin: Tensor, first: Optional[tuple[Tensor, Tensor]], diagonal: list[tuple[Tensor, Tensor]], allowed: Tensor
    ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """One unrolled step over whole sequences. x [B,T,D]; `first`: step 1's (k, v) [B,H,T,Dh]
        (None at step 1: this step's own); `diagonal`: (k, v) of steps 2..s-1; allowed [B,1,T,T]:
        which step-1 positions each position may see. Returns (output [B,T,D], this step's (k, v))."""
        q, k, v = self.qkv(x, cos, sin)
        k1, v1 = first if first is not None else (k, v)
        own = [*diagonal, (k, v)] if first is not None else []
        dtype = torch.promote_types(q.dtype, torch.float32)
        scale = 1.0 / math.sqrt(self.head_dim)
        scores = torch.matmul(q.to(dtype), k1.to(dtype).transpose(-1, -2)) * scale  # [B,H,T,T]
        scores = scores.masked_fill(~allowed, float("-inf"))
        diag = [(q.to(dtype) * kd.to(dtype)).sum(-1, keepdim=True) * scale for kd, _ in own]  # [B,H,T,1] each
        weights = torch.softmax(torch.cat([scores, *diag], dim=-1), dim=-1)
        T = k1.shape[2]
        attended = torch.matmul(weights[..., :T], v1.to(dtype))
        for j, (_, vd) in enumerate(own):
            attended = attended + weights[..., T + j : T + j + 1] * vd.to(dtype)
        return self.finish(x, attended), (k, v)

    def forward_cached(
        self, x: Tensor, cos: Tensor, sin: Tensor, cache: dict, visible: Tensor
    ) -> Tensor:
        """Drafting: x [1,P,D] appended after the cache's S entries; visible [P, S+P] bool says
        which entries each new one sees (prefix, its ancestors, itself). Updates `cache`."""
        q, k, v = self.qkv(x, cos, sin)
        keys = k if cache.get("k") is None else torch.cat([cache["k"], k], dim=2)
        values = v if cache.get("v") is None else torch.cat([cache["v"], v], dim=2)
        cache["k"], cache["v"] = keys, values
        dtype = torch.promote_types(q.dtype, torch.float32)
        scores = torch.matmul(q.to(dtype), keys.to(dtype).transpose(-1, -2)) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(~visible.view(1, 1, *visible.shape), float("-inf"))
        attended = torch.matmul(torch.softmax(scores, dim=-1), values.to(dtype))
        return self.finish(x, attended)


def resolve_layer_shape(cfg, dims: TargetDims) -> None:
    """Fill a head config's draft-layer shape (num_attention_heads, intermediate_size,
    rms_norm_eps, rope_theta) where it says 0 with the target's values, in place: the resolved
    config is what checkpoints and exports record, so a head rebuilds without its target."""
    hf = dims.hf_config or {}
    D = dims.hidden_size
    rope = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}
    cfg.num_attention_heads = cfg.num_attention_heads or int(hf.get("num_attention_heads", max(1, D // 64)))
    cfg.intermediate_size = cfg.intermediate_size or int(hf.get("intermediate_size", 4 * D))
    cfg.rms_norm_eps = cfg.rms_norm_eps or float(hf.get("rms_norm_eps", 1e-6))
    cfg.rope_theta = cfg.rope_theta or float(hf.get("rope_theta") or rope.get("rope_theta") or 10000.0)


class EagleHead(DraftHead):
    config_class = EagleConfig

    def __init__(self, cfg: EagleConfig, dims: TargetDims) -> None:
        super().__init__(cfg, dims)
        if cfg.depth < 1 or not 1 <= cfg.train_depth <= cfg.depth or cfg.num_layers < 1:
            raise ValueError(
                f"eagle needs depth >= 1, 1 <= train_depth <= depth and num_layers >= 1, got depth={cfg.depth}, "
                f"train_depth={cfg.train_depth}, num_layers={cfg.num_layers}"
            )
        if cfg.feature_layers and cfg.regression_weight != 0:
            raise ValueError("eagle: head.regression_weight must be 0 with head.feature_layers (a fused feature has no fixed regression target)")
        D = dims.hidden_size
        resolve_layer_shape(cfg, dims)
        self.rope_theta = cfg.rope_theta
        self.fuse = nn.Linear(len(cfg.feature_layers) * D, D, bias=False) if cfg.feature_layers else None
        self.fc = nn.Linear(2 * D, D, bias=False)
        # A comprehension: every layer its own module.
        self.layers = nn.ModuleList(
            [DraftLayer(D, cfg.num_attention_heads, cfg.intermediate_size, cfg.rms_norm_eps) for _ in range(cfg.num_layers)]
        )
        self.out_norm = RMSNorm(D, cfg.rms_norm_eps) if cfg.feature_layers else None

    @property
    def depth(self) -> int:
        return self.cfg.depth

    def required_layers(self) -> list[int]:
        return list(self.cfg.feature_layers)

    def init_from_target(self, target: FrozenTarget) -> None:
        norm = getattr(target.model.base_model, "norm", None)
        if self.out_norm is not None and norm is not None and getattr(norm, "weight", None) is not None:
            self.out_norm.weight.data.copy_(norm.weight.detach().to(self.out_norm.weight.dtype))

    def depth_weights(self) -> Tensor:
        return torch.tensor([self.cfg.loss_decay**k for k in range(self.cfg.train_depth)])

    # ------------------------------------------------------------------ pieces shared by training and drafting

    @property
    def _dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def feature(self, final_hidden: Tensor, layers: dict[int, Tensor]) -> Tensor:
        """g [...,D]: the final hidden state, or the fused decoder layers."""
        if self.fuse is None:
            return final_hidden.to(self._dtype)
        # Training features key layers by index mod num_layers, the runtime by the index asked for.
        n = self.dims.num_layers
        picked = [layers[i % n] if i % n in layers else layers[i] for i in self.cfg.feature_layers]
        return self.fuse(torch.cat([h.to(self._dtype) for h in picked], dim=-1))

    def step_input(self, feature: Tensor, token_embedding: Tensor) -> Tensor:
        """fc(cat(embed(token), feature)) [...,D]."""
        return self.fc(torch.cat([token_embedding.to(self._dtype), feature.to(self._dtype)], dim=-1))

    def logits(self, output: Tensor, lm_head) -> Tensor:
        """Draft outputs [...,D] -> logits [...,V] through the target's LM head."""
        return lm_head(self.out_norm(output) if self.out_norm is not None else output)

    # ------------------------------------------------------------------ training

    def unroll(self, features: TargetFeatures, steps: int, segment_ids: Optional[Tensor] = None) -> tuple[list[Tensor], Tensor]:
        """Outputs a^(s) [B,T,D] for s = 1..steps (teacher-forced tokens, training-time-test
        attention) and the step-1 features g [B,T,D]."""
        ids = features.input_ids
        B, T = ids.shape
        g = self.feature(features.final_hidden, features.hidden)
        # Position t may see positions t' <= t of its own example (and itself, so no row is empty).
        allowed = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril().expand(B, T, T)
        if segment_ids is not None:
            allowed = allowed & (segment_ids.unsqueeze(2) == segment_ids.unsqueeze(1))
        if features.attention_mask is not None:
            allowed = allowed & features.attention_mask.bool().unsqueeze(1)
        allowed = (allowed | torch.eye(T, dtype=torch.bool, device=ids.device)).unsqueeze(1)
        base = torch.arange(T, device=ids.device)
        outputs, previous = [], g
        firsts: list[Optional[tuple[Tensor, Tensor]]] = [None] * len(self.layers)
        diagonals: list[list[tuple[Tensor, Tensor]]] = [[] for _ in self.layers]
        for s in range(1, steps + 1):
            # Step s reads token x_{t+s}; past the end of the row there is none (padding id 0).
            tokens = torch.zeros_like(ids)
            tokens[:, : T - s] = ids[:, s:]
            x = self.step_input(previous, features.embed(tokens))
            cos, sin = rotary(base + s - 1, self.layers[0].head_dim, self.rope_theta, x.dtype)
            for i, layer in enumerate(self.layers):
                x, kv = layer.forward_unrolled(x, cos.unsqueeze(0), sin.unsqueeze(0), firsts[i], diagonals[i], allowed)
                if firsts[i] is None:
                    firsts[i] = kv
                else:
                    diagonals[i].append(kv)
            outputs.append(x)
            previous = x
        return outputs, g

    def forward(self, features: TargetFeatures) -> Tensor:
        """Logits [B,T,K,V] of all `depth` unrolled steps."""
        outputs, _ = self.unroll(features, self.depth)
        return torch.stack([self.logits(a, features.lm_head) for a in outputs], dim=-2)

    def top_tokens(self, features: TargetFeatures, k: int) -> Tensor:
        """[B,T,K,k] step by step: never all steps' [B,T,V] logits at once."""
        outputs, _ = self.unroll(features, self.depth)
        picks = []
        for a in outputs:
            logits = self.logits(a, features.lm_head)
            picks.append(logits.topk(min(k, logits.shape[-1]), dim=-1).indices)
        return torch.stack(picks, dim=-2)

    def loss(
        self, features: TargetFeatures, loss_mask: Optional[Tensor], segment_ids: Optional[Tensor] = None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Per unrolled step s: ce_weight x CE(x_{t+1+s}) + regression_weight x SmoothL1(a^(s)_t,
        g_{t+s}), over positions whose label is trained; steps weighted by loss_decay ** (s - 1).
        The LM head projects only those rows. Stats: ce/top1/count per step [S]."""
        S = self.cfg.train_depth
        outputs, g = self.unroll(features, S, segment_ids)
        labels, valid = depth_labels(features.input_ids, loss_mask, S, segment_ids)
        dtype = torch.promote_types(g.dtype, torch.float32)
        T = g.shape[1]
        step_losses, ce, top1, count = [], [], [], []
        for s, a in enumerate(outputs, start=1):
            rows = valid[..., s - 1]
            n = int(rows.sum())
            zero = a.sum() * 0.0
            if n == 0:
                step_losses.append(zero.to(dtype))
                ce.append(zero.detach().to(dtype))
                top1.append(zero.detach().to(dtype))
            else:
                logits = self.logits(a[rows], features.lm_head).to(dtype)
                target = labels[..., s - 1][rows]
                step_ce = F.cross_entropy(logits, target)
                loss = self.cfg.ce_weight * step_ce
                if self.cfg.regression_weight:
                    wanted = torch.zeros_like(g)
                    wanted[:, : T - s] = g[:, s:]
                    loss = loss + self.cfg.regression_weight * F.smooth_l1_loss(a[rows].to(dtype), wanted[rows].detach().to(dtype))
                step_losses.append(loss)
                ce.append(step_ce.detach())
                top1.append((logits.argmax(-1) == target).to(dtype).mean().detach())
            count.append(torch.tensor(float(n), dtype=dtype, device=a.device))
        weights = self.depth_weights().to(a.device, dtype)
        total = (weights * torch.stack(step_losses)).sum() / weights.sum()
        return total, {"ce": torch.stack(ce), "top1": torch.stack(top1), "count": torch.stack(count)}

    # ------------------------------------------------------------------ drafting

    def draft_step(self, feature: Tensor, tokens: Tensor, positions: Tensor, caches: list[dict], visible: Tensor, embed) -> Tensor:
        """Append entries to the drafting caches and return their outputs a [1,P,D].

        feature [1,P,D] (the target's g for decided positions, a parent's output for tree nodes);
        tokens [1,P]; positions [P] (rotary); visible [P, S+P] over the S cached entries and the new ones.
        """
        x = self.step_input(feature, embed(tokens))
        cos, sin = rotary(positions.unsqueeze(0), self.layers[0].head_dim, self.rope_theta, x.dtype)
        for layer, cache in zip(self.layers, caches):
            x = layer.forward_cached(x, cos, sin, cache, visible)
        return x
