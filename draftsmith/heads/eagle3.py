"""EAGLE-3 draft heads (Li et al., 2025), exactly the draft that vLLM (llama_eagle3.py), SGLang and
SpecForge run, so a trained head serves in those engines unchanged (export --format vllm|sglang|
speculators).

Step 1 at position t reads three of the target's hidden states and the token x_{t+1}:

    g   = fc(cat(a_1, a_2, a_3))                       a_i: auxiliary states, ascending layer id, 3H -> H
                                                       (EAGLE-3.1: input_norm of the concatenation first,
                                                       norm_before_fc; or fc_norm_i of each a_i, fc_norm)
    e   = input_layernorm(embed(x_{t+1}))              the target's embedding (frozen, never a head weight)
    h   = hidden_norm(g);  residual = g  (h with norm_before_residual)
    r   = residual + o_proj(attention(cat(e, h)))     q/k/v read the 2H-wide concatenation
    s   = r + mlp(post_attention_layernorm(r))         the midlayer's output, fed back at the next step
    logits = lm_head(norm(s))                          over the draft vocabulary; id i is target id i + d2t[i]

Steps 2..K read the previous step's s in place of g (no fc) and the drafted token, at the next
position; with norm_output (EAGLE-3.1) they read norm(s) instead, the state the logits came from.
The three EAGLE-3.1 switches are speculators' and vLLM's (speculators' trainer turns
norm_before_fc and norm_output on by default, as its folders record). Auxiliary layer ids follow vLLM's convention: id L is the residual stream entering decoder
layer L (the output of layer L-1, before any norm; id N is the last layer's output), default
(2, N//2, N-3). SGLang's ids mean the same since 2026-05 (see docs/heads.md for the older offset).

Training is EAGLE-3's: training-time test over ``train_depth`` unrolled steps (heads/eagle.py), step
s weighted ``loss_decay ** (s - 1)``, each a soft cross-entropy against the target's own
distribution at the predicted position restricted to the draft vocabulary; positions whose token
lies outside the draft vocabulary are left out (``out_of_vocab: keep`` trains them too, against
that renormalised distribution, as speculators does). The draft vocabulary is the ``draft_vocab_size``
most frequent scored tokens of the training data (heads/vocab.py).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from torch import Tensor, nn

from draftsmith.heads.base import TargetDims, TargetFeatures, depth_label_weights, depth_labels, depth_loss
from draftsmith.heads.eagle import EagleHead
from draftsmith.heads.layers import DecoderLayer, LayerShape, RMSNorm
from draftsmith.heads.vocab import draft_vocabulary, to_target_vocab
from draftsmith.target import FrozenTarget

# The draft vocabulary when the recipe leaves it at 0 (SpecForge's default), capped at the target's.
DEFAULT_DRAFT_VOCAB = 32000


@dataclass
class Eagle3Config(LayerShape):
    """EAGLE-3. The midlayer's shape (LayerShape) defaults to the target's."""

    kind: str = "eagle3"
    # Tokens drafted beyond the target's own: the run-time tree depth and the evaluated depths.
    depth: int = 7
    # Unrolled steps of training-time test that carry loss (EAGLE-3: 7).
    train_depth: int = 7
    # The target's auxiliary hidden states, vLLM's convention (id L = input of decoder layer L);
    # empty: (2, N//2, N-3) of an N-layer target.
    aux_layer_ids: list[int] = field(default_factory=list)
    # Tokens of the draft LM head; 0 takes min(32000, the target's vocabulary).
    draft_vocab_size: int = 0
    # The residual of the midlayer starts from hidden_norm(g) instead of g.
    norm_before_residual: bool = False
    # EAGLE-3.1: one RMSNorm over the concatenated auxiliary states before fc (tensor input_norm).
    norm_before_fc: bool = False
    # EAGLE-3.1: an RMSNorm per auxiliary state before the concatenation (tensors fc_norm.{i}).
    fc_norm: bool = False
    # EAGLE-3.1: a step hands norm(s) to the next step instead of s (no tensor).
    norm_output: bool = False
    # Loss weight of unrolled step s is loss_decay ** (s - 1).
    loss_decay: float = 0.8
    # The draft LM head (started from the target's rows) trains; false keeps it frozen, as
    # speculators does.
    train_lm_head: bool = True
    # Positions whose token lies outside the draft vocabulary: "skip" leaves them out of the loss
    # (they can never be drafted); "keep" trains them against the target's distribution
    # renormalised over the draft vocabulary, as speculators does.
    out_of_vocab: str = "skip"
    # Train for what lookup misses (issue 33, an experiment): an answer token that the lookup
    # drafter `lookup_matcher` ("suffix" or "lookup") would have proposed from the text before it
    # counts lookup_hit_weight as a label instead of 1 (trainers.heads.lookup_token_weights), so
    # the head spends itself where a hybrid's lookup half cannot help. 1 is off.
    lookup_hit_weight: float = 1.0
    lookup_matcher: str = "suffix"

    def check(self) -> None:
        if self.depth < 1 or not 1 <= self.train_depth <= self.depth:
            raise ValueError(f"recipe keys 'head.depth' >= 1 and 'head.train_depth' in [1, head.depth]: got {self.depth}, {self.train_depth}")
        if self.draft_vocab_size < 0:
            raise ValueError(f"recipe key 'head.draft_vocab_size' must be >= 0, got {self.draft_vocab_size}")
        if self.loss_decay <= 0:
            raise ValueError(f"recipe key 'head.loss_decay' must be positive, got {self.loss_decay}")
        if self.out_of_vocab not in ("skip", "keep"):
            raise ValueError(f"recipe key 'head.out_of_vocab' must be 'skip' or 'keep', got {self.out_of_vocab!r}")
        if not 0 <= self.lookup_hit_weight <= 1:
            raise ValueError(f"recipe key 'head.lookup_hit_weight' must be in [0, 1] (1 is off), got {self.lookup_hit_weight}")
        if self.lookup_matcher not in ("suffix", "lookup"):
            raise ValueError(f"recipe key 'head.lookup_matcher' must be 'suffix' or 'lookup', got {self.lookup_matcher!r}")
        self.check_shape("head")

    def resolve_draft(self, dims: TargetDims) -> None:
        """Fill aux_layer_ids and draft_vocab_size for this target (in place) and check them: three
        distinct ids within 1..N, a draft vocabulary no larger than the target's."""
        V = dims.vocab_size
        self.aux_layer_ids = resolve_aux_layer_ids(self.aux_layer_ids, dims.num_layers, count=3)
        if self.draft_vocab_size > V:
            raise ValueError(f"recipe key 'head.draft_vocab_size'={self.draft_vocab_size} is larger than the target's vocabulary of {V}")
        self.draft_vocab_size = self.draft_vocab_size or min(DEFAULT_DRAFT_VOCAB, V)


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """vLLM's and SGLang's default auxiliary layers of an N-layer target: (2, N//2, N-3)."""
    return [2, num_layers // 2, num_layers - 3]


def resolve_aux_layer_ids(ids: Sequence[int], num_layers: int, count: Optional[int] = None) -> list[int]:
    """The target layers a head reads, in vLLM's convention (id L = the input of decoder layer L,
    the output of layer L - 1; ids 1..N), ascending as the engines concatenate them: `ids`, or
    when empty the engines' default (2, N//2, N-3). ValueError naming head.aux_layer_ids when they
    are not `count` (default: at least one) distinct layers of this N-layer target."""
    N = num_layers
    if not ids:
        ids = default_aux_layer_ids(N)
        if len(set(ids)) < 3 or min(ids) < 1:
            raise ValueError(
                f"the default auxiliary layers (2, N//2, N-3) = {tuple(ids)} of a {N}-layer target are not three distinct "
                "layers: set recipe key 'head.aux_layer_ids' (vLLM convention, ids in 1..N)"
            )
    ids = list(ids)
    if len(set(ids)) != len(ids) or (count is not None and len(ids) != count) or not ids:
        raise ValueError(f"recipe key 'head.aux_layer_ids' must name {count or 'one or more'} distinct layers, got {ids}")
    if not all(1 <= i <= N for i in ids):
        raise ValueError(
            f"recipe key 'head.aux_layer_ids'={ids} lies outside the target: ids run from 1 (the output of decoder layer 0) "
            f"to {N} (the last layer's output) for this {N}-layer target"
        )
    return sorted(ids)


class Eagle3Layer(DecoderLayer):
    """EAGLE-3's midlayer: attention reads cat(input_layernorm(embedding), hidden_norm(feature))."""

    def __init__(self, hidden_size: int, shape: LayerShape) -> None:
        super().__init__(hidden_size, shape, input_size=2 * hidden_size)
        self.hidden_norm = RMSNorm(hidden_size, shape.rms_norm_eps)


class Eagle3Head(EagleHead):
    config_class = Eagle3Config

    def __init__(self, cfg: Eagle3Config, dims: TargetDims) -> None:
        cfg = copy.deepcopy(cfg)  # resolved for this target on the head's own copy: the recipe's stays as written
        cfg.resolve_draft(dims)
        super().__init__(cfg, dims)

    def build(self, cfg: Eagle3Config, D: int) -> None:
        V, Vd = self.dims.vocab_size, cfg.draft_vocab_size
        self.fc = nn.Linear(3 * D, D, bias=False)
        if cfg.norm_before_fc:
            self.input_norm = RMSNorm(3 * D, cfg.rms_norm_eps)
        if cfg.fc_norm:
            # A comprehension: every auxiliary state its own norm.
            self.fc_norm = nn.ModuleList(RMSNorm(D, cfg.rms_norm_eps) for _ in range(3))
        self.layers = nn.ModuleList([Eagle3Layer(D, cfg)])
        self.norm = RMSNorm(D, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(D, Vd, bias=False)
        self.lm_head.weight.requires_grad_(cfg.train_lm_head)
        # The draft vocabulary (heads/vocab.py); the identity until init_from_data chooses one.
        self.register_buffer("d2t", torch.zeros(Vd, dtype=torch.int64))
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[:Vd] = True
        self.register_buffer("t2d", t2d)

    def required_layers(self) -> list[int]:
        """Our layer i is the output of decoder layer i: vLLM's id L is our layer L - 1."""
        return [i - 1 for i in self.cfg.aux_layer_ids]

    @property
    def draft_ids(self) -> Tensor:
        """Target ids of the draft vocabulary, ascending [Vd]."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def vocabulary_columns(self) -> Optional[Tensor]:
        return self.draft_ids if self.d2t.numel() < self.dims.vocab_size else None

    def init_from_data(self, examples: Sequence[dict]) -> Optional[str]:
        vocab = draft_vocabulary(examples, self.dims.vocab_size, self.cfg.draft_vocab_size)
        self.d2t.copy_(vocab.d2t)
        self.t2d.copy_(vocab.t2d)
        return f"draft vocabulary of {self.cfg.draft_vocab_size} tokens covers {vocab.coverage:.1%} of the trained tokens"

    def init_from_target(self, target: FrozenTarget) -> None:
        """Start the final norm and the LM head from the target's (the LM head's rows of the draft
        vocabulary), so a fresh head already speaks the target's output space."""
        norm = getattr(target.model.base_model, "norm", None)
        if getattr(norm, "weight", None) is not None:
            self.norm.weight.data.copy_(norm.weight.detach().to(self.norm.weight.dtype))
        weight = target.lm_head_weight()
        self.lm_head.weight.data.copy_(weight[self.draft_ids.to(weight.device)].to(self.lm_head.weight.dtype))

    # ------------------------------------------------------------------ what a step reads and writes

    def feature(self, final_hidden: Tensor, layers: dict[int, Tensor]) -> Tensor:
        """g = fc(cat(a_1, a_2, a_3)) in ascending layer order [...,D], with the EAGLE-3.1 norms
        where they are on (input_norm over the concatenation, then fc_norm per state: vLLM's order)."""
        n = self.dims.num_layers
        states = [layers[i % n].to(self._dtype) for i in self.required_layers()]
        x = torch.cat(states, dim=-1)
        if self.cfg.norm_before_fc:
            x = self.input_norm(x)
        if self.cfg.fc_norm:
            x = torch.cat([norm(part) for norm, part in zip(self.fc_norm, x.chunk(3, dim=-1))], dim=-1)
        return self.fc(x)

    def step_input(self, feature: Tensor, token_embedding: Tensor) -> tuple[Tensor, Tensor]:
        layer = self.layers[0]
        feature = feature.to(self._dtype)
        h = layer.hidden_norm(feature)
        attn_in = torch.cat([layer.input_layernorm(token_embedding.to(self._dtype)), h], dim=-1)
        return attn_in, (h if self.cfg.norm_before_residual else feature)

    def carry(self, output: Tensor) -> Tensor:
        """With norm_output the next step (and the logits) read norm(s); otherwise s."""
        return self.norm(output) if self.cfg.norm_output else output

    def draft_logits(self, output: Tensor) -> Tensor:
        """Logits over the draft vocabulary [...,Vd] of a carried state (already normed with norm_output)."""
        return self.lm_head(output if self.cfg.norm_output else self.norm(output))

    def logits(self, output: Tensor, lm_head=None) -> Tensor:
        """Logits over the target's vocabulary [...,V] (-inf outside the draft vocabulary)."""
        return to_target_vocab(self.draft_logits(output), self.draft_ids, self.dims.vocab_size)

    def ranked(self, output: Tensor, lm_head, k: int) -> Tensor:
        """Ranked over the draft vocabulary and named in target ids: the logits are never spread
        over the target's vocabulary (at evaluation's [B,T] positions, 8 x 2048 x 128k floats a
        step at a Llama-3 target). At most the draft vocabulary's size of picks: the tokens past it
        cannot be drafted (evaluation counts the ranks it gets)."""
        logits = self.draft_logits(output)
        return self.draft_ids[logits.topk(min(k, logits.shape[-1]), dim=-1).indices]

    # ------------------------------------------------------------------ training

    def loss(
        self, features: TargetFeatures, loss_mask: Optional[Tensor], segment_ids: Optional[Tensor] = None, token_weights: Optional[Tensor] = None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Per unrolled step s: soft cross-entropy of the draft-vocabulary logits against the target's
        distribution over x_{t+1+s} restricted to the draft vocabulary, at positions whose label is
        trained and inside the draft vocabulary; steps weighted loss_decay ** (s - 1). With
        ``token_weights`` [B,T] each position's term is weighted by its label token's weight.
        Stats: ce/top1/count per step [S] (top-1 compares target ids)."""
        S = self.cfg.train_depth
        outputs, _ = self.unroll(features, S, segment_ids)
        labels, valid = depth_labels(features.input_ids, loss_mask, S, segment_ids)
        if self.cfg.out_of_vocab == "skip":
            valid = valid & self.t2d[labels]
        # The target's distribution at every position some step predicts, computed once: position
        # j = t + s holds the target's law of x_{j+1}.
        needed = torch.zeros_like(valid[..., 0])
        for s in range(1, S + 1):
            needed[:, s:] |= valid[:, : valid.shape[1] - s, s - 1]
        with torch.no_grad():
            target = features.lm_head(features.final_hidden[needed], vocab=self.draft_ids)
            dtype = torch.promote_types(target.dtype, torch.float32)
            probs = torch.zeros(*needed.shape, target.shape[-1], dtype=dtype, device=target.device)
            probs[needed] = torch.softmax(target.to(dtype), dim=-1)
        draft_ids = self.draft_ids

        table, T = probs.view(-1, probs.shape[-1]), probs.shape[1]

        def teacher(s: int, rows: Tensor, _logits: Tensor) -> tuple[Tensor, Tensor]:
            b, t = rows.nonzero(as_tuple=True)  # valid rows have t + s inside the row
            # Rows of the one table, not a copy per step: 7 steps at 4 x 2048 positions and a
            # 32k draft vocabulary kept 7 GB of copies for backward.
            return table, b * T + t + s

        return depth_loss(
            labels, valid, self.depth_weights(),
            logits_at=lambda s, rows: self.draft_logits(outputs[s - 1][rows]),
            soft_targets=teacher,
            predicted=lambda logits: draft_ids[logits.argmax(-1)],
            label_weights=None if token_weights is None else depth_label_weights(token_weights, S),
        )  # fmt: skip
