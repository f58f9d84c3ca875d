"""DFlash block drafters (z-lab, arXiv 2602.06036): one draft forward proposes a whole block of
tokens. The draft is the one vLLM 0.32 serves as method "dflash" (``qwen3_dflash.py``), SGLang as
DFLASH, and speculators and SpecForge train (docs/heads.md compares them).

When the target has decided x_0..x_{t+1} (x_{t+1}, the anchor, is the token it decided last and
not yet in its cache), the draft reads:

    c_j  = hidden_norm(fc(cat(a_1(j), .., a_n(j))))   j <= t: the target's auxiliary states, projected
    e    = embed([x_{t+1}, m, .., m])                  block_size slots at positions t+1 .. t+block_size;
                                                       the target's embedding, m = mask_token_id (or a
                                                       learned vector that replaces that id's row)
    per layer (Qwen3: q_norm/k_norm, RoPE with the target's settings):
        queries from the block; keys/values from the block and from every c_j through the layer's
        own k_proj/k_norm/v_proj, RoPE at j (the context skips input_layernorm and the MLP)
    logits of slot k = lm_head(norm(out_k))            k = 1 .. block_size-1: the guess of x_{t+1+k}

Attention inside the block is bidirectional (``causal: true`` makes it causal, as speculators
trains by default); the context is seen strictly before the anchor, within the anchor's example.
Slot k is draft depth k whatever the other slots hold, so a chain and a product tree of each
slot's top candidates verify alike (as Medusa's heads do), from one draft forward per step.

Auxiliary layer ids follow vLLM's capture convention, as EAGLE-3's do (id L = the input of decoder
layer L), default (2, N//2, N-3): the two heads share one feature cache. ``aux_layer_rule:
per_draft_layer`` takes z-lab's and SpecForge's instead, one target layer per draft layer
(``per_draft_layer_ids``). vLLM's ``dflash_config.target_layer_ids`` are these ids minus one.

Training: anchors at answer tokens, up to ``max_anchors`` per row drawn without replacement (all of
them when there are fewer), as speculators and SpecForge draw them; by default any answer token
whose block has a scored slot, with ``anchors: full_block`` only those whose every slot is scored
(the references leave the last block of a row out). Each block's slots are scored by cross-entropy
against the data tokens (z-lab, SpecForge), or with ``labels: target_argmax`` against the target's
greedy token at each slot (speculators 0.9.0's ``ce`` loss, its DFlash default); with
``data.regenerate`` the answers are the target's own greedy tokens, and the two coincide but where
batched regeneration rounds a near-tie the other way. Slots are weighted by D-PACE, exponential
decay or uniformly (``dpace_weights``, ``decay_weights``), summed and divided by the number of
scored slots (``block_loss``).

Shapes: B batch, T positions, N anchors, S = block_size, K = S - 1 drafted slots, V vocabulary,
D hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from draftsmith.heads.base import BufferedSession, DraftHead, HeadSession, TargetDims, TargetFeatures, depth_labels
from draftsmith.heads.eagle3 import resolve_aux_layer_ids
from draftsmith.heads.layers import BlockEntries, DecoderLayer, LayerShape, RMSNorm, Rotary, attend_in_training, causal_allowed
from draftsmith.heads.vocab import draft_vocabulary, to_target_vocab
from draftsmith.target import FrozenTarget

# Anchors whose blocks run through the draft at once in the dense forward (evaluation): bounds the
# attention scores [B,H,chunk*S,T] of long rows.
ANCHOR_CHUNK = 128


@dataclass
class DFlashConfig(LayerShape):
    """DFlash. The decoder layers' shape (LayerShape) defaults to the target's."""

    kind: str = "dflash"
    # Slots of a block: the anchor and block_size - 1 masks, the tokens drafted per step. The engines
    # serve it with num_speculative_tokens = block_size - 1.
    block_size: int = 8
    # Qwen3 decoder layers (speculators and z-lab: 5).
    num_layers: int = 5
    # The target's auxiliary hidden states, vLLM's convention as for EAGLE-3 (id L = input of
    # decoder layer L); empty: chosen by aux_layer_rule.
    aux_layer_ids: list[int] = field(default_factory=list)
    # What an empty aux_layer_ids means. "eagle3": the engines' (2, N//2, N-3), EAGLE-3's layers (one
    # feature cache serves both heads); "per_draft_layer": z-lab's and SpecForge's, one target layer
    # per draft layer spread over the target, the middle one for a one-layer draft.
    aux_layer_rule: Literal["eagle3", "per_draft_layer"] = "eagle3"
    # The token id of the mask slots, a row of the target's embedding; -1: chosen at the start of
    # training, a row no text produces or a special token the data never holds (``choose_mask_token``).
    mask_token_id: int = -1
    # A learned mask vector replaces the embedding row of mask_token_id (vLLM reads it from
    # mask_embedding.pt; SGLang and speculators cannot carry it).
    mask_embedding: bool = False
    # Causal attention inside the block (speculators' default training) instead of bidirectional.
    causal: bool = False
    # Tokens of an own LM head over the most frequent answer tokens (with d2t, as EAGLE-3's); 0:
    # the target's LM head over its whole vocabulary (the references' default).
    draft_vocab_size: int = 0
    # That own LM head (started from the target's rows) trains; false keeps it frozen, as
    # speculators does. The target's LM head (draft_vocab_size 0) never trains.
    train_lm_head: bool = True
    # Blocks trained per row, anchored at answer tokens drawn without replacement.
    max_anchors: int = 512
    # Which answer tokens may anchor a block. "scored": any whose block has a scored slot, the
    # example's last blocks included; "full_block": only those whose every slot is scored, so no
    # block runs past its example's end (speculators and SpecForge).
    anchors: Literal["scored", "full_block"] = "scored"
    # What a slot is scored against. "data": the data's token (z-lab, SpecForge); "target_argmax":
    # the target's greedy token there, given the data before it (speculators' ``ce``). With
    # data.regenerate the two differ only where batched regeneration rounds a near-tie.
    labels: Literal["data", "target_argmax"] = "data"
    # Per-slot loss weights: D-PACE (speculators' default), exp(-(k-1)/decay_gamma) (SpecForge), or 1.
    loss_weighting: Literal["dpace", "exp", "uniform"] = "dpace"
    # D-PACE's smoothing: a slot's confidence is (1 - alpha) * p(label) + alpha.
    dpace_alpha: float = 0.5
    decay_gamma: float = 4.0

    def check(self) -> None:
        if self.block_size < 2:
            raise ValueError(f"recipe key 'head.block_size' must be >= 2 (the anchor and at least one drafted slot), got {self.block_size}")
        if self.num_layers < 1 or self.max_anchors < 1:
            raise ValueError(f"recipe keys 'head.num_layers' and 'head.max_anchors' must be >= 1, got {self.num_layers}, {self.max_anchors}")
        if self.mask_token_id < -1:
            raise ValueError(f"recipe key 'head.mask_token_id' must be a token id (or -1: chosen from the data), got {self.mask_token_id}")
        if self.draft_vocab_size < 0:
            raise ValueError(f"recipe key 'head.draft_vocab_size' must be >= 0, got {self.draft_vocab_size}")
        if not 0 < self.dpace_alpha <= 1 or self.decay_gamma <= 0:
            raise ValueError(f"recipe keys 'head.dpace_alpha' in (0, 1] and 'head.decay_gamma' > 0: got {self.dpace_alpha}, {self.decay_gamma}")
        self.check_shape("head")

    def resolve_draft(self, dims: TargetDims) -> None:
        """Fill aux_layer_ids for this target (in place) and check what must fit it."""
        V = dims.vocab_size
        ids = self.aux_layer_ids
        if not ids and self.aux_layer_rule == "per_draft_layer":
            ids = per_draft_layer_ids(dims.num_layers, self.num_layers)
        self.aux_layer_ids = resolve_aux_layer_ids(ids, dims.num_layers)
        if self.mask_token_id >= V:
            raise ValueError(f"recipe key 'head.mask_token_id'={self.mask_token_id} is outside the target's vocabulary of {V} (ids 0..{V - 1})")
        if self.draft_vocab_size > V:
            raise ValueError(f"recipe key 'head.draft_vocab_size'={self.draft_vocab_size} is larger than the target's vocabulary of {V}")


def per_draft_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's (and SpecForge's) choice of target layers, one per draft layer, in vLLM's capture
    convention: a one-layer draft reads the output of layer N//2; n layers read the outputs of
    layers round(1 + i (N - 4) / (n - 1)), i = 0..n-1, from layer 1 to layer N-3."""
    N, n = num_target_layers, num_draft_layers
    outputs = [N // 2] if n == 1 else [round(1 + i * (N - 4) / (n - 1)) for i in range(n)]
    return [o + 1 for o in outputs]


# ----------------------------------------------------------------------------- losses


def dpace_weights(q: Tensor, scored: Tensor, alpha: float) -> Tensor:
    """D-PACE slot weights (speculators' ``dpace_loss_decay``): the expected number of tokens
    accepted from a slot onward, under smoothed draft confidences.

    q [...,K]: the draft's probability of each slot's label (no gradient; 0 for a label the draft
    cannot propose); scored [...,K] bool: slots with a label. With s_k = (1 - alpha) q_k + alpha on
    scored slots and 1 elsewhere, P_k = prod_{j<=k} s_j and w_k = m_k sum_{i>=k} m_i P_i.
    Returns w [...,K] in at least fp32.
    """
    dtype = torch.promote_types(q.dtype, torch.float32)
    m = scored.to(dtype)
    s = torch.where(scored, (1 - alpha) * q.detach().to(dtype) + alpha, torch.ones_like(m))
    reach = m * torch.cumprod(s, dim=-1)
    return m * reach.flip(-1).cumsum(-1).flip(-1)


def decay_weights(K: int, gamma: Optional[float], device=None, dtype: torch.dtype = torch.float32) -> Tensor:
    """Slot weights exp(-(k-1)/gamma) for k = 1..K (gamma None: all 1) [K], in at least fp32."""
    k = torch.arange(K, dtype=torch.promote_types(dtype, torch.float32), device=device)
    return torch.ones_like(k) if gamma is None else torch.exp(-k / gamma)


def block_loss(ce: Tensor, trained: Tensor, weights: Tensor) -> Tensor:
    """sum of weights * ce over trained slots / their number (speculators' reduction: a slot's
    weight scales its term, the mean is over slots, not over weight).

    ce [...,K] (any value where not trained), trained [...,K] bool, weights [...,K] (broadcast).
    Returns a scalar in at least fp32; 0 (in the graph of ce) when nothing is trained.
    """
    dtype = torch.promote_types(ce.dtype, torch.float32)
    terms = torch.where(trained, weights.to(dtype) * ce.to(dtype), torch.zeros((), dtype=dtype, device=ce.device))
    return terms.sum() / trained.sum().clamp_min(1)


def target_argmax_labels(features: TargetFeatures, labels: Tensor, valid: Tensor, chunk: int = 512) -> Tensor:
    """labels [B,T,K] with every valid one replaced by the target's greedy token there: depth k at
    position t is the argmax of the target's logits at position t + k (its guess of x_{t+1+k} from
    the data before it). Only the positions some valid label reads are projected, `chunk` at a time."""
    B, T, K = labels.shape
    needed = torch.zeros(B, T, dtype=torch.bool, device=labels.device)
    for k in range(1, K + 1):
        needed[:, k:] |= valid[:, : T - k, k - 1]
    with torch.no_grad():
        rows = features.final_hidden[needed]
        best = torch.cat([features.lm_head(part).argmax(-1) for part in rows.split(chunk)]) if rows.shape[0] else rows.new_zeros(0, dtype=torch.long)
        greedy = torch.zeros(B, T, dtype=labels.dtype, device=labels.device)
        greedy[needed] = best.to(labels.dtype)
    out = labels.clone()
    for k in range(1, K + 1):
        out[:, : T - k, k - 1] = torch.where(valid[:, : T - k, k - 1], greedy[:, k:], labels[:, : T - k, k - 1])
    return out


def sample_anchors(eligible: Tensor, max_anchors: int) -> Tensor:
    """Anchor positions per row: every eligible position, or max_anchors of them drawn without
    replacement (torch's global generator), ascending. eligible [B,T] bool -> [B,N] long, -1 pads."""
    rows = []
    for row in eligible:
        where = row.nonzero().flatten()
        if where.numel() > max_anchors:
            where = where[torch.randperm(where.numel(), device=where.device)[:max_anchors]].sort().values
        rows.append(where)
    N = max([1, *(r.numel() for r in rows)])
    out = torch.full((eligible.shape[0], N), -1, dtype=torch.long, device=eligible.device)
    for b, where in enumerate(rows):
        out[b, : where.numel()] = where
    return out


def choose_mask_token(vocab_size: int, tokenizer=None, seen: Sequence[int] = ()) -> tuple[int, str]:
    """A mask token id the target never reads in the data nor is asked to emit: the first row of
    the embedding no text produces (ids past the tokenizer, z-lab's choice for Qwen3), else the
    highest special token that is not bos/eos/pad/unk and never occurs in the data, else the highest
    id the data never holds. Returns (id, why) for the log."""
    seen = set(int(i) for i in seen)
    if tokenizer is not None and len(tokenizer) < vocab_size:
        return len(tokenizer), f"the first embedding row past the tokenizer's {len(tokenizer)} tokens"
    if tokenizer is not None:
        reserved = {getattr(tokenizer, f"{name}_token_id", None) for name in ("bos", "eos", "pad", "unk")}
        special = set(tokenizer.all_special_ids) | {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special}
        free = sorted(i for i in special if i not in reserved and i not in seen and 0 <= i < vocab_size)
        if free:
            return free[-1], f"special token {tokenizer.convert_ids_to_tokens(free[-1])!r}, absent from the training data"
    for i in range(vocab_size - 1, -1, -1):
        if i not in seen:
            return i, "the highest token id absent from the training data"
    raise ValueError("every token id occurs in the training data: set recipe key 'head.mask_token_id'")


# ----------------------------------------------------------------------------- the head


class DFlashHead(DraftHead):
    """DFlash (see the module docstring): ``forward`` gives every position's block, ``loss`` trains
    sampled blocks, ``start_drafting`` drafts one block per step."""

    config_class = DFlashConfig

    def __init__(self, cfg: DFlashConfig, dims: TargetDims) -> None:
        cfg = cfg.resolved(dims)  # the head's own copy: resolve_draft below fills it too
        super().__init__(cfg, dims)  # checks the recipe's own values before they meet the target
        cfg.resolve_draft(dims)
        D, V = dims.hidden_size, dims.vocab_size
        self.rotary = Rotary(cfg)
        self.fc = nn.Linear(len(cfg.aux_layer_ids) * D, D, bias=False)
        self.hidden_norm = RMSNorm(D, cfg.rms_norm_eps)
        # A comprehension: every layer its own module.
        self.layers = nn.ModuleList(DecoderLayer(D, cfg, qk_norm=True) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(D, cfg.rms_norm_eps)
        self.mask_embedding = nn.Parameter(torch.zeros(D)) if cfg.mask_embedding else None
        self.lm_head = None
        if cfg.draft_vocab_size:
            Vd = cfg.draft_vocab_size
            self.lm_head = nn.Linear(D, Vd, bias=False)
            self.lm_head.weight.requires_grad_(cfg.train_lm_head)
            # The draft vocabulary (heads/vocab.py); the first Vd ids until init_from_data chooses.
            self.register_buffer("d2t", torch.zeros(Vd, dtype=torch.int64))
            t2d = torch.zeros(V, dtype=torch.bool)
            t2d[:Vd] = True
            self.register_buffer("t2d", t2d)
        self._data_tokens: Optional[Tensor] = None  # ids the training data holds (init_from_data)

    @property
    def depth(self) -> int:
        return self.cfg.block_size - 1

    @property
    def _dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def mask_id(self) -> int:
        if self.cfg.mask_token_id < 0:
            raise ValueError("the dflash head's mask token is not chosen yet (init_from_target chooses it): set recipe key 'head.mask_token_id'")
        return self.cfg.mask_token_id

    def required_layers(self) -> list[int]:
        """Our layer i is the output of decoder layer i: vLLM's id L is our layer L - 1."""
        return [i - 1 for i in self.cfg.aux_layer_ids]

    @property
    def draft_ids(self) -> Tensor:
        """Target ids of the draft vocabulary, ascending [Vd] (draft vocabulary only)."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    # ------------------------------------------------------------------ set-up

    def init_from_data(self, examples: Sequence[dict]) -> Optional[str]:
        """Remember the data's tokens (the mask token must be none of them) and choose the draft
        vocabulary when there is one. An explicit mask token that is an answer token is refused."""
        ids = [torch.as_tensor(e["input_ids"], dtype=torch.int64) for e in examples]
        self._data_tokens = torch.unique(torch.cat(ids)) if ids else torch.zeros(0, dtype=torch.int64)
        mask = self.cfg.mask_token_id
        if mask >= 0:
            answers = sum(int((i[torch.as_tensor(e["loss_mask"], dtype=torch.bool)] == mask).sum()) for i, e in zip(ids, examples))
            if answers:
                raise ValueError(
                    f"recipe key 'head.mask_token_id'={mask} is a token of the training answers ({answers} times): the target emits it, "
                    "and the draft cannot tell an anchor with that id from a mask slot; choose an id the data never holds, or -1"
                )
        if self.lm_head is None:
            return None
        vocab = draft_vocabulary(examples, self.dims.vocab_size, self.cfg.draft_vocab_size)
        self.d2t.copy_(vocab.d2t)
        self.t2d.copy_(vocab.t2d)
        return f"draft vocabulary of {self.cfg.draft_vocab_size} tokens covers {vocab.coverage:.1%} of the trained tokens"

    def init_from_target(self, target: FrozenTarget) -> Optional[str]:
        """Choose the mask token when the recipe leaves it to us; start the final norm from the
        target's, the mask vector from the mask token's embedding row and an own LM head from the
        target's rows of the draft vocabulary."""
        note = None
        if self.cfg.mask_token_id < 0:
            seen = [] if self._data_tokens is None else self._data_tokens.tolist()
            self.cfg.mask_token_id, why = choose_mask_token(self.dims.vocab_size, target.tokenizer, seen)
            note = f"mask token id {self.cfg.mask_token_id}: {why}"
        norm = getattr(target.model.base_model, "norm", None)
        if getattr(norm, "weight", None) is not None:
            self.norm.weight.data.copy_(norm.weight.detach().to(self.norm.weight.dtype))
        if self.mask_embedding is not None:
            row = target.embed(torch.tensor([self.mask_id], device=target.device))[0]
            self.mask_embedding.data.copy_(row.detach().to(self.mask_embedding.dtype))
        if self.lm_head is not None:
            weight = target.lm_head_weight()
            self.lm_head.weight.data.copy_(weight[self.draft_ids.to(weight.device)].to(self.lm_head.weight.dtype))
        return note

    # ------------------------------------------------------------------ the draft's pieces

    def context(self, layers: dict[int, Tensor]) -> Tensor:
        """hidden_norm(fc(cat(auxiliary states))) [...,D] from the target's layers {i: [...,D]}."""
        n = self.dims.num_layers
        return self.hidden_norm(self.fc(torch.cat([layers[i % n].to(self._dtype) for i in self.required_layers()], dim=-1)))

    def context_kv(self, context: Tensor, positions: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Each layer's keys and values of the context [B,C,D] at rotary positions [C] (or [B,C]):
        [(k, v) [B,Hkv,C,Dh]] per layer."""
        cos, sin = self.rotary(positions if positions.dim() == 2 else positions.unsqueeze(0), context.dtype)
        return [layer.self_attn.kv(context, cos, sin) for layer in self.layers]

    def embed_block(self, ids: Tensor, embed) -> Tensor:
        """The block's input vectors [...,D]: the target's embedding of ids [...], the learned mask
        vector wherever the id is the mask token (as vLLM substitutes it, by id)."""
        x = embed(ids).to(self._dtype)
        if self.mask_embedding is not None:
            x = torch.where((ids == self.mask_id).unsqueeze(-1), self.mask_embedding.to(x.dtype), x)
        return x

    def run_blocks(self, ids: Tensor, positions: Tensor, kv: list[tuple[Tensor, Tensor]], visible: Tensor, embed) -> Tensor:
        """The draft over N blocks per row: ids and rotary positions [B,N,S], the context's
        per-layer keys/values [B,Hkv,C,Dh] and visible [B or 1,N,C] (which context entries each
        block sees). Returns the final-normed outputs [B,N,S,D]."""
        B, N, S = ids.shape
        P = N * S
        x = self.embed_block(ids, embed).reshape(B, P, -1)
        cos, sin = self.rotary(positions.reshape(positions.shape[0], P), x.dtype)
        allowed = visible.unsqueeze(2).expand(-1, -1, S, -1).reshape(visible.shape[0], 1, P, visible.shape[-1])
        # Slot i of a block sees slot j of the same block: always, or for j <= i when causal.
        seen = torch.ones(S, S, dtype=torch.bool, device=ids.device)
        seen = seen.tril() if self.cfg.causal else seen
        for layer, (ck, cv) in zip(self.layers, kv):
            attn_in, residual = layer.prepare(x)
            q, k, v = layer.self_attn.qkv(attn_in, cos, sin)
            x = layer.finish(residual, attend_in_training(q, ck, cv, allowed, BlockEntries(k, v, S, seen)))
        return self.norm(x).view(B, N, S, -1)

    def vocab_logits(self, out: Tensor, lm_head) -> Tensor:
        """Final-normed outputs [...,D] -> logits over the draft's vocabulary [...,Vd] (own LM head)
        or the target's [...,V] (its LM head)."""
        return self.lm_head(out) if self.lm_head is not None else lm_head(out)

    def logits(self, out: Tensor, lm_head) -> Tensor:
        """Final-normed outputs [...,D] -> logits over the target's vocabulary [...,V]."""
        logits = self.vocab_logits(out, lm_head)
        return to_target_vocab(logits, self.draft_ids, self.dims.vocab_size) if self.lm_head is not None else logits

    # ------------------------------------------------------------------ teacher forcing

    def _context_of(self, features: TargetFeatures, segment_ids: Optional[Tensor]) -> tuple[list, Tensor]:
        """The context's keys/values over the rows [B,Hkv,T,Dh] per layer (rotary positions 0..T-1:
        relative distances inside a packed example are its own) and which positions each position
        may see [B or 1,T,T] (its example, real tokens)."""
        ids = features.input_ids
        T = ids.shape[1]
        kv = self.context_kv(self.context(features.hidden), torch.arange(T, device=ids.device))
        return kv, causal_allowed(T, ids.device, segment_ids, features.attention_mask)[:, 0]

    def _blocks_at(self, features: TargetFeatures, kv: list, allowed: Tensor, anchors: Tensor) -> Tensor:
        """Outputs [B,N,S,D] of the blocks anchored after positions anchors [B,N] (t: the block
        starts with x_{t+1} at position t+1 and sees positions <= t of x_{t+1}'s example; -1 pads).
        Past the row's end the anchor token is 0."""
        ids = features.input_ids
        B, T = ids.shape
        S = self.cfg.block_size
        t = anchors.clamp_min(0)
        after = (t + 1).clamp_max(T - 1)
        anchor_ids = torch.where(t + 1 < T, ids.gather(1, after), torch.zeros_like(t))
        block = torch.cat([anchor_ids.unsqueeze(-1), anchor_ids.new_full((B, t.shape[1], S - 1), self.mask_id)], dim=-1)
        positions = t.unsqueeze(-1) + 1 + torch.arange(S, device=ids.device)
        # Row t+1 of the example's visibility (the row of t at the end), then strictly before t+1.
        rows = allowed.expand(B, -1, -1).gather(1, after.unsqueeze(-1).expand(-1, -1, T))
        visible = rows & (torch.arange(T, device=ids.device) <= t.unsqueeze(-1))
        return self.run_blocks(block, positions, kv, visible, features.embed)

    def _all_positions(self, features: TargetFeatures, step) -> Tensor:
        """`step(outputs [B,n,K,D])` for the blocks after every position, ANCHOR_CHUNK at a time,
        concatenated along positions."""
        B, T = features.input_ids.shape
        kv, allowed = self._context_of(features, None)
        device = features.input_ids.device
        parts = []
        for start in range(0, T, ANCHOR_CHUNK):
            anchors = torch.arange(start, min(T, start + ANCHOR_CHUNK), device=device).expand(B, -1)
            parts.append(step(self._blocks_at(features, kv, allowed, anchors)[:, :, 1:]))
        return torch.cat(parts, dim=1)

    def forward(self, features: TargetFeatures) -> Tensor:
        """Logits [B,T,K,V]: depth k at position t is slot k of the block anchored at x_{t+1}."""
        return self._all_positions(features, lambda out: self.logits(out, features.lm_head))

    def top_tokens(self, features: TargetFeatures, k: int) -> Tensor:
        """[B,T,K,k], never more than ANCHOR_CHUNK positions' logits at once."""

        def best(out: Tensor) -> Tensor:
            logits = self.logits(out, features.lm_head)
            return logits.topk(min(k, logits.shape[-1]), dim=-1).indices

        return self._all_positions(features, best)

    def slot_weights(self, q: Tensor, scored: Tensor) -> Tensor:
        """The loss weight of each slot [...,K] per head.loss_weighting (q, scored: dpace_weights')."""
        cfg = self.cfg
        if cfg.loss_weighting == "dpace":
            return dpace_weights(q, scored, cfg.dpace_alpha)
        return decay_weights(self.depth, cfg.decay_gamma if cfg.loss_weighting == "exp" else None, q.device, q.dtype)

    def loss(
        self, features: TargetFeatures, loss_mask: Optional[Tensor], segment_ids: Optional[Tensor] = None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Blocks anchored at answer tokens (x_{t+1} trained, some slot labelled), up to max_anchors
        per row; slot k scored against x_{t+1+k} where that token is trained, in the anchor's
        example and (with a draft vocabulary) inside it; weighted per head.loss_weighting; reduced by
        ``block_loss``. Stats: ce/top1/count per slot [K] (top-1 compares target ids)."""
        ids = features.input_ids
        B, T = ids.shape
        K = self.depth
        labels, valid = depth_labels(ids, loss_mask, K, segment_ids)  # [B,T,K]: x_{t+1+k} and whether it is scored
        if self.cfg.labels == "target_argmax":
            labels = target_argmax_labels(features, labels, valid)
        trained_token = torch.ones_like(ids, dtype=torch.bool) if loss_mask is None else loss_mask.bool()
        eligible = torch.zeros_like(trained_token)
        scored_block = valid[:, :-1].all(-1) if self.cfg.anchors == "full_block" else valid[:, :-1].any(-1)
        eligible[:, :-1] = trained_token[:, 1:] & scored_block
        anchors = sample_anchors(eligible, self.cfg.max_anchors) if self.training else sample_anchors(eligible, T)
        kv, allowed = self._context_of(features, segment_ids)
        out = self._blocks_at(features, kv, allowed, anchors)[:, :, 1:]  # [B,N,K,D]
        real = (anchors >= 0).unsqueeze(-1)
        at = anchors.clamp_min(0).unsqueeze(-1).expand(-1, -1, K)
        slot_labels, scored = labels.gather(1, at), valid.gather(1, at) & real  # [B,N,K]
        inside = self.t2d[slot_labels] if self.lm_head is not None else torch.ones_like(scored)
        trained = scored & inside
        logits = self.vocab_logits(out[trained], features.lm_head)  # [M,V or Vd]
        dtype = torch.promote_types(logits.dtype, torch.float32)
        logits = logits.to(dtype)
        # Labels as rows of the logits: target ids, or their index in the draft vocabulary.
        target = slot_labels[trained]
        if self.lm_head is not None:
            target = torch.cumsum(self.t2d.long(), 0)[target] - 1
        ce = torch.zeros(B, anchors.shape[1], K, dtype=dtype, device=ids.device)
        ce = ce.masked_scatter(trained, F.cross_entropy(logits, target, reduction="none"))
        # The draft's probability of each label: 0 where it lies outside the draft vocabulary.
        q = torch.where(trained, torch.exp(-ce.detach()), torch.zeros_like(ce))
        loss = block_loss(ce, trained, self.slot_weights(q, scored))
        if not bool(trained.any()):
            loss = loss + out.sum() * 0.0  # every parameter stays in the graph (DDP expects a gradient for each)
        with torch.no_grad():
            hit = torch.zeros_like(trained)
            guess = logits.argmax(-1)
            hit[trained] = (self.draft_ids[guess] if self.lm_head is not None else guess) == slot_labels[trained]
            count = trained.sum(dim=(0, 1)).to(dtype)
            stats = {
                "ce": torch.where(trained, ce, torch.zeros_like(ce)).sum(dim=(0, 1)) / count.clamp_min(1),
                "top1": hit.sum(dim=(0, 1)).to(dtype) / count.clamp_min(1),
                "count": count,
            }
        return loss, stats

    # ------------------------------------------------------------------ drafting

    def start_drafting(self, embed, lm_head) -> HeadSession:
        return DFlashSession(self, embed, lm_head)


class DFlashSession(BufferedSession):
    """The context's keys/values per layer over the decided positions (extended as the target
    decides more; never rolled back: a tree never enters it), and one block forward per step: the
    root is the anchor, slot d gives the children of every node at depth d - 1.

    ``preallocate`` keeps the context's keys/values in buffers of a fixed capacity, read whole under
    a mask: the block forward then always has the same shapes, and on CUDA it replays (with the
    logits) as one CUDA graph (``draftsmith.graphs``)."""

    head: DFlashHead
    drafts_by_level = True

    def __init__(self, head: DFlashHead, embed, lm_head) -> None:
        super().__init__(head, embed, lm_head)
        self.kv: list[Optional[tuple[Tensor, Tensor]]] = [None for _ in head.layers]
        self.slot_logits: Optional[Tensor] = None  # [K,V] of the current step
        # On graphs, a step's read (its layers, tokens and start) waits (``_wait``): the step's static
        # tree runs it in its own graph (``after_levels``), or ``_settle`` does before anything else needs it.
        self.forwards = 0  # one block forward per step; the context's keys/values are projections, not a pass

    def _forget(self) -> None:
        self.slot_logits, self._pending = None, None

    def _grow(self, capacity: int) -> None:
        """Context buffers of ``capacity`` entries holding the decided ones; the graph recaptured."""
        device = next(self.head.parameters()).device
        grown = []
        for layer, old in zip(self.head.layers, self.kv):
            attn = layer.self_attn
            shape = (1, attn.kv_heads, capacity, attn.head_dim)
            k, v = (torch.zeros(shape, dtype=attn.k_proj.weight.dtype, device=device) for _ in range(2))
            if old is not None and self.decided:
                k[:, :, : self.decided], v[:, :, : self.decided] = old[0][:, :, : self.decided], old[1][:, :, : self.decided]
            grown.append((k, v))
        self.kv, self.capacity = grown, capacity
        self.columns = torch.arange(capacity, device=device)
        self.graphs.clear()

    def _block_logits(self, block: Tensor, positions: Tensor, visible: Tensor) -> Tensor:
        out = self.head.run_blocks(block, positions, self.kv, visible, self.embed)
        return self.head.logits(out[0, 0, 1:], self.lm_head)

    def extend(self, hidden: Tensor, layers: dict[int, Tensor], tokens: Tensor) -> None:
        head, M, start = self.head, hidden.shape[1], self.decided
        device = hidden.device
        if self.capacity and self.graphs and M <= 32:
            # A step's few accepted positions: their context entries and the block in one graph per count.
            if start + M > self.capacity:
                self._grow(max(2 * self.capacity, start + M + 64))  # drops the captured graphs
            self._wait(start, layers, tokens, start)
            self.decided = start + M
            self.forwards += 1
            return
        new = head.context_kv(head.context(layers), torch.arange(start, start + M, device=device))
        if self.capacity:
            if start + M > self.capacity:
                self._grow(max(2 * self.capacity, start + M + 64))
            for (k, v), (nk, nv) in zip(self.kv, new):
                k[:, :, start : start + M], v[:, :, start : start + M] = nk, nv
        else:
            self.kv = [n if old is None else (torch.cat([old[0], n[0]], 2), torch.cat([old[1], n[1]], 2)) for old, n in zip(self.kv, new)]
        self.decided = start + M
        S = head.cfg.block_size
        root = tokens[:, -1:]
        block = torch.cat([root, root.new_full((1, S - 1), head.mask_id)], dim=1).view(1, 1, S)
        positions = (self.decided + torch.arange(S, device=device)).view(1, 1, S)
        if not self.capacity:
            self.slot_logits = self._block_logits(block, positions, torch.ones(1, 1, self.decided, dtype=torch.bool, device=device))
        else:
            inputs = (block, positions, (self.columns < self.decided).view(1, 1, -1))
            # The block alone, after a prompt's context (its length varies); a graph's logits are
            # overwritten by its next replay, and the tree reads them before that.
            self.slot_logits, _ = self.graphs.run("block", self._block_logits, inputs, "the dflash head's block")
        self.forwards += 1

    def _step_graphed(self, pending: tuple, then: Optional[Any] = None, name: Any = None, extra: tuple[Tensor, ...] = ()) -> tuple[Any, bool]:
        """A waiting read (``pending``: its layers, tokens and start) on the preallocated context as
        one function of device tensors (the decided length a tensor): the new positions' keys and
        values written at their slots, then the block after them, then ``then(slot logits, root
        token [1], *extra)`` where given; captured once per number of new positions (and ``name``,
        what ``then`` bakes in). Returns (the slots' logits, or what ``then`` returns; replayed)."""
        head = self.head
        layers, tokens, start = pending
        M, keys = tokens.shape[1], sorted(layers)
        inputs = (*(layers[k] for k in keys), tokens, self.columns[start : start + 1], *extra)
        S = head.cfg.block_size

        def step(*rest: Tensor) -> Any:
            states, (tokens, start), extra = rest[: len(keys)], rest[len(keys) : len(keys) + 2], rest[len(keys) + 2 :]
            slots = start + torch.arange(tokens.shape[1], device=tokens.device)
            for (k, v), (nk, nv) in zip(self.kv, head.context_kv(head.context(dict(zip(keys, states))), slots)):
                k.index_copy_(2, slots, nk)
                v.index_copy_(2, slots, nv)
            decided = start + tokens.shape[1]
            root = tokens[:, -1:]
            block = torch.cat([root, root.new_full((1, S - 1), head.mask_id)], dim=1).view(1, 1, S)
            positions = (decided + torch.arange(S, device=tokens.device)).view(1, 1, S)
            logits = self._block_logits(block, positions, (self.columns < decided).view(1, 1, -1))
            return logits if then is None else then(logits, root[0], *extra)

        key = ("step", M, tuple(keys)) + (() if name is None else (name,))
        return self.graphs.run(key, step, inputs, "the dflash head's step")

    def _read_alone(self, *pending: Any) -> None:
        """A waiting read on its own: its slots' logits are then at hand. One graph per number of
        new positions; its logits are overwritten by its next replay, and the tree reads them
        before that."""
        self.slot_logits = self._step_graphed(pending)[0]

    def after_levels(self, then: Any, name: Any, extra: tuple[Tensor, ...] = ()) -> Optional[tuple[Tensor, ...]]:
        pending = self._take_read()
        if pending is None:
            return None
        out, replayed = self._step_graphed(pending, then, name, extra)
        self.slot_logits = None  # they lived in the graph: nothing reads them after the tree
        return tuple(x.clone() for x in out) if replayed else out

    def rollback(self) -> None:
        self._settle()  # a read no tree took still writes its context entries

    def expand(self, frontier: Any) -> Tensor:
        return self.level_logits()[[frontier.depths[n] for n in frontier.nodes]]

    def level_logits(self) -> Optional[Tensor]:
        self._settle()
        return self.slot_logits


__all__ = [
    "ANCHOR_CHUNK", "DFlashConfig", "DFlashHead", "DFlashSession", "block_loss", "choose_mask_token", "decay_weights",
    "dpace_weights", "per_draft_layer_ids", "sample_anchors", "target_argmax_labels",
]  # fmt: skip
