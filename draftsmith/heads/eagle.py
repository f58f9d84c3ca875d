"""EAGLE draft heads on a frozen target (Li et al., 2024): feature-level drafting, with EAGLE-3's
training-time test as an option. EAGLE-2's dynamic trees are the runtime's (runtime/tree.py);
EAGLE-3's multi-layer features and draft vocabulary are ``head.kind: eagle3`` (eagle3.py), which
shares this module's unrolling and drafting.

The draft is a small autoregressive model over (feature, token) pairs. At position t it reads the
target's feature g_t (its final hidden state, the LM head's input) and the token x_{t+1} the
target decided after it: ``fc(cat(embed(x_{t+1}), g_t))``, then ``num_layers`` decoder layers
(the first without an input norm, as in the reference), output a_t, its guess of the next
position's feature; the target's frozen LM head turns a_t into logits for x_{t+2} (depth 1). To
draft deeper it feeds its own output back: (a_t, x_{t+2}) -> a^(2)_t -> x_{t+3}, ...

- Training step 1 is EAGLE-1's objective: a token loss on x_{t+2} (weight ce_weight) against the
  target's own distribution there (``teacher``, the reference) or the data token, plus a smooth-L1
  regression of a_t onto g_{t+1} (weight regression_weight). The input features get uniform noise
  U(-input_noise/2, input_noise/2) during training (the reference's 0.2).
- With train_depth = S > 1, steps 2..S unroll the draft on its own outputs (training-time test):
  the query of step s at position t attends to the step-1 entries of positions <= t (real
  features, like the prefix at run time) and to the step-2..s entries of position t itself (its
  drafted ancestors), at rotary position t + s - 1. The runtime drafting a chain computes exactly
  this, so training, evaluation (`forward`, all `depth` steps) and drafting agree (tested).

Shapes: B batch, T positions, K depth, V vocabulary, D hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Hashable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from draftsmith.heads.base import (
    BufferedSession, DraftHead, HeadSession, TargetDims, TargetFeatures, depth_labels, depth_loss, static_tree_parts,
)  # fmt: skip
from draftsmith.heads.layers import DecoderLayer, LayerShape, Rotary, ancestor_slots, causal_allowed, preallocate_cache, tree_visibility, truncate_cache
from draftsmith.sampling import draws_inputs, draws_key, with_uniforms


@dataclass
class EagleConfig(LayerShape):
    """EAGLE-1/2. The decoder layers' shape (LayerShape: heads, key/value heads, head_dim,
    intermediate size, norm eps, rope) defaults to the target's."""

    kind: str = "eagle"
    # Tokens drafted beyond the target's own: the run-time tree depth and the evaluated depths.
    depth: int = 5
    # Unrolled steps that carry loss in training (1: EAGLE-1; more: EAGLE-3's training-time test).
    train_depth: int = 1
    num_layers: int = 1
    # fc(cat(embedding, feature)) has a bias in the reference.
    fc_bias: bool = True
    # Token loss against the target's distribution at the predicted position (the reference), or
    # against the data token (false: one vocabulary projection less per step).
    teacher: bool = True
    ce_weight: float = 0.1
    # Smooth-L1 regression of each step's output onto the target's next feature.
    regression_weight: float = 1.0
    # Width of the uniform noise added to the input features in training (0: none).
    input_noise: float = 0.2
    # Loss weight of unrolled step s is loss_decay ** (s - 1).
    loss_decay: float = 0.8

    def check(self) -> None:
        if self.depth < 1 or self.num_layers < 1:
            raise ValueError(f"recipe keys 'head.depth' and 'head.num_layers' must be >= 1, got {self.depth}, {self.num_layers}")
        if not 1 <= self.train_depth <= self.depth:
            raise ValueError(f"recipe key 'head.train_depth' must be in [1, head.depth={self.depth}], got {self.train_depth}")
        if self.ce_weight < 0 or self.regression_weight < 0 or self.ce_weight + self.regression_weight == 0:
            raise ValueError(f"recipe keys 'head.ce_weight' and 'head.regression_weight' must be >= 0 and not both 0, got {self.ce_weight}, {self.regression_weight}")
        if self.input_noise < 0 or self.loss_decay <= 0:
            raise ValueError(f"recipe keys 'head.input_noise' (>= 0) and 'head.loss_decay' (> 0): got {self.input_noise}, {self.loss_decay}")
        self.check_shape("head")


def shifted(x: Tensor, s: int) -> Tensor:
    """x [B,T,...] moved s positions left (x'[t] = x[t+s]), zeros past the end."""
    out = torch.zeros_like(x)
    out[:, : x.shape[1] - s] = x[:, s:]
    return out


class EagleHead(DraftHead):
    """EAGLE-1/2. Subclasses (EAGLE-3) change what a step reads and how outputs become logits by
    overriding ``feature``, ``step_input``, ``logits`` and ``init_from_target``; the unrolling, the
    loss's structure and the drafting session are shared."""

    config_class = EagleConfig

    def __init__(self, cfg: EagleConfig, dims: TargetDims) -> None:
        cfg = cfg.resolved(dims)
        super().__init__(cfg, dims)
        D = dims.hidden_size
        self.rotary = Rotary(cfg)
        self.build(cfg, D)

    def build(self, cfg: EagleConfig, D: int) -> None:
        """EAGLE-1's modules: fc and the decoder layers (the first reads fc's output without a norm)."""
        self.fc = nn.Linear(2 * D, D, bias=cfg.fc_bias)
        # A comprehension: every layer its own module.
        self.layers = nn.ModuleList(DecoderLayer(D, cfg, input_norm=i > 0) for i in range(cfg.num_layers))

    @property
    def depth(self) -> int:
        return self.cfg.depth

    @property
    def _dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def depth_weights(self) -> Tensor:
        return torch.tensor([self.cfg.loss_decay**k for k in range(self.cfg.train_depth)])

    # ------------------------------------------------------------------ what a step reads and writes

    def feature(self, final_hidden: Tensor, layers: dict[int, Tensor]) -> Tensor:
        """g [...,D]: what step 1 reads of the target (EAGLE: the final hidden state)."""
        return final_hidden.to(self._dtype)

    def step_input(self, feature: Tensor, token_embedding: Tensor) -> tuple[Tensor, Tensor]:
        """(attention input, residual) of the first decoder layer: fc(cat(embed(token), feature)) for both."""
        x = self.fc(torch.cat([token_embedding.to(self._dtype), feature.to(self._dtype)], dim=-1))
        return self.layers[0].prepare(x)

    def logits(self, output: Tensor, lm_head) -> Tensor:
        """Draft outputs [...,D] -> logits [...,V] over the target's vocabulary (its frozen LM head)."""
        return lm_head(output)

    def carry(self, output: Tensor) -> Tensor:
        """What a step hands to the next one (and to ``logits``): its output as it is."""
        return output

    # ------------------------------------------------------------------ training

    def unroll(
        self, features: TargetFeatures, steps: int, segment_ids: Optional[Tensor] = None, noise: float = 0.0
    ) -> tuple[list[Tensor], Tensor]:
        """Outputs a^(s) [B,T,D] for s = 1..steps (teacher-forced tokens, training-time-test
        attention) and the step-1 features g [B,T,D] (with `noise`: U(-noise/2, noise/2) added)."""
        ids = features.input_ids
        B, T = ids.shape
        g = self.feature(features.final_hidden, features.hidden)
        if noise:
            g = g + (torch.rand_like(g) - 0.5) * noise
        allowed = causal_allowed(T, ids.device, segment_ids, features.attention_mask)
        base = torch.arange(T, device=ids.device)
        outputs, previous = [], g
        firsts: list[Optional[tuple[Tensor, Tensor]]] = [None] * len(self.layers)
        diagonals: list[list[tuple[Tensor, Tensor]]] = [[] for _ in self.layers]
        for s in range(1, steps + 1):
            # Step s reads token x_{t+s}; past the end of the row there is none (padding id 0).
            attn_in, residual = self.step_input(previous, features.embed(shifted(ids, s)))
            cos, sin = self.rotary(base + s - 1, attn_in.dtype)
            x = None
            for i, layer in enumerate(self.layers):
                if x is not None:
                    attn_in, residual = layer.prepare(x)
                x, kv = layer.forward_unrolled(attn_in, residual, cos.unsqueeze(0), sin.unsqueeze(0), firsts[i], diagonals[i], allowed, steps)
                if firsts[i] is None:
                    firsts[i] = kv
                else:
                    diagonals[i].append(kv)
            x = self.carry(x)
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
        return torch.stack([self.ranked(a, features.lm_head, k) for a in outputs], dim=-2)

    def ranked(self, output: Tensor, lm_head, k: int) -> Tensor:
        """The k most likely target ids [...,k] after a step's ``output``, best first."""
        logits = self.logits(output, lm_head)
        return logits.topk(min(k, logits.shape[-1]), dim=-1).indices

    def teacher_probs(self, features: TargetFeatures, s: int, rows: Tensor) -> Tensor:
        """The target's own distribution over x_{t+1+s} at rows [B,T]: its logits at position t + s."""
        with torch.no_grad():
            return torch.softmax(features.lm_head(shifted(features.final_hidden, s)[rows]).float(), dim=-1)

    def loss(
        self, features: TargetFeatures, loss_mask: Optional[Tensor], segment_ids: Optional[Tensor] = None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Per unrolled step s: ce_weight x the token loss (soft against the target with
        ``teacher``) + regression_weight x SmoothL1(a^(s)_t, g_{t+s}), over positions whose label is
        trained; steps weighted by loss_decay ** (s - 1). Stats: ce/top1/count per step [S]."""
        cfg = self.cfg
        outputs, g = self.unroll(features, cfg.train_depth, segment_ids, cfg.input_noise if self.training else 0.0)
        labels, valid = depth_labels(features.input_ids, loss_mask, cfg.train_depth, segment_ids)
        clean = self.feature(features.final_hidden, features.hidden)

        def extra(s: int, rows: Tensor) -> Tensor:
            if not cfg.regression_weight:
                return outputs[s - 1].new_zeros(())
            wanted = shifted(clean, s)[rows].detach()
            dtype = torch.promote_types(wanted.dtype, torch.float32)
            return cfg.regression_weight * F.smooth_l1_loss(outputs[s - 1][rows].to(dtype), wanted.to(dtype))

        return depth_loss(
            labels, valid, self.depth_weights(),
            logits_at=lambda s, rows: self.logits(outputs[s - 1][rows], features.lm_head),
            soft_targets=(lambda s, rows, _logits: self.teacher_probs(features, s, rows)) if cfg.teacher else None,
            extra=extra, ce_weight=cfg.ce_weight,
        )  # fmt: skip

    # ------------------------------------------------------------------ drafting

    def draft_forward(self, feature: Tensor, tokens: Tensor, positions: Tensor, caches: list[dict], visible: Tensor, embed) -> Tensor:
        """Append entries to the drafting caches and return their outputs a [1,P,D].

        feature [1,P,D] (the target's g for decided positions, a parent's output for tree nodes);
        tokens [1,P]; positions [P] (rotary); visible [P, S+P] over the S cached entries and the new ones.
        """
        attn_in, residual = self.step_input(feature, embed(tokens))
        cos, sin = self.rotary(positions.unsqueeze(0), attn_in.dtype)
        x = None
        for layer, cache in zip(self.layers, caches):
            if x is not None:
                attn_in, residual = layer.prepare(x)
            x = layer.forward_cached(attn_in, residual, cos, sin, cache, visible)
        return self.carry(x)

    def start_drafting(self, embed, lm_head) -> HeadSession:
        return EagleSession(self, embed, lm_head)


class EagleSession(BufferedSession):
    """The head's own KV cache over decided positions (read with the target's real features) plus
    the tree being drafted. A node's input is its parent's output and its own token, at rotary
    position decided + depth - 1, seeing the decided entries, its ancestors and itself. ``rollback``
    drops every tree entry: the accepted path comes back with real features next step, as EAGLE does.

    ``preallocate`` keeps the caches in buffers written at slots and read whole under a mask: a
    tree level's forward then has the shape of its frontier alone, and on CUDA each frontier size's
    forward replays as one CUDA graph (``draftsmith.graphs``)."""

    head: EagleHead

    def __init__(self, head: EagleHead, embed, lm_head) -> None:
        super().__init__(head, embed, lm_head)
        self.caches: list[dict] = [{} for _ in head.layers]
        self.outputs: dict[int, Tensor] = {}  # node id -> its output a [1,1,D]
        self.slots: dict[int, int] = {}  # node id -> cache entry
        self.forwards = 0
        self.length = 0  # entries the caches hold: the decided positions, then this step's tree
        # On graphs a step's read (extend's hidden, layers, tokens and start) waits (``_wait``): the
        # tree's graph runs it (``_whole_tree``), or ``_settle`` does before anything else needs it.

    def _forget(self) -> None:
        self.length = 0
        self.outputs, self.slots = {}, {}
        self._pending = None

    def _grow(self, capacity: int) -> None:
        """Buffers of ``capacity`` entries holding what the caches held; graphs recaptured."""
        device = next(self.head.parameters()).device
        for layer, cache in zip(self.head.layers, self.caches):
            preallocate_cache(layer, cache, capacity, self.length, device)
        self.capacity = capacity
        self.columns = torch.arange(capacity, device=device)
        self.graphs.clear()

    def _forward(self, feature: Tensor, tokens: Tensor, positions: Tensor, visible: Tensor) -> Tensor:
        """draft_forward over P new entries after the caches' ``length``; visible [P, length+P]."""
        if not self.capacity:
            return self.head.draft_forward(feature, tokens, positions, self.caches, visible, self.embed)
        P = tokens.shape[1]
        if self.length + P > self.capacity:
            self._grow(max(2 * self.capacity, self.length + P + 64))
        full = torch.zeros(P, self.capacity, dtype=torch.bool, device=visible.device)
        full[:, : self.length + P] = visible
        inputs = (feature, tokens, positions, full, self.columns[self.length : self.length + P])
        # Tree levels and a step's few new positions replay graphs; a prompt (its length varies) runs eagerly.
        graph = self._graph(inputs) if self.graphs and P <= 32 else None
        # A graph's output buffer is overwritten by its next replay: the outputs the tree keeps are copied.
        return graph(*inputs).clone() if graph is not None else self._slotted_forward(*inputs)

    def _slotted_forward(self, feature: Tensor, tokens: Tensor, positions: Tensor, visible: Tensor, slots: Tensor) -> Tensor:
        for cache in self.caches:
            cache["slots"] = slots
        return self.head.draft_forward(feature, tokens, positions, self.caches, visible, self.embed)

    def _graph(self, inputs: tuple[Tensor, ...]):
        """The graph of this frontier size, captured on first use (its warm-ups write the slots the
        forward is about to write anyway); None, and eager from then on, where capture fails."""
        return self.graphs.get(inputs[1].shape[1], self._slotted_forward, inputs, f"the {self.head.cfg.kind} head's tree level")

    def extend(self, hidden: Tensor, layers: dict[int, Tensor], tokens: Tensor) -> None:
        M, start = hidden.shape[1], self.decided
        self.outputs, self.slots = {}, {}
        if self.capacity and self.graphs and M <= 32:
            # A step's few accepted positions: the feature, the masks and the forward on the device.
            # They wait for what reads them first: a whole tree takes them into its own graph (one
            # replay a step, extend and tree); anything else runs them first in a graph per count.
            if start + M > self.capacity:
                self._grow(max(2 * self.capacity, start + M + 64))  # drops the captured graphs
            self._wait(start, hidden, layers, tokens, start)
        else:
            feature = self.head.feature(hidden, layers)
            positions = torch.arange(start, start + M, device=hidden.device)
            visible = torch.ones(M, start + M, dtype=torch.bool, device=hidden.device).tril(diagonal=start)
            self.outputs[0] = self._forward(feature, tokens, positions, visible)[:, -1:]  # the root's output: the last decided position's
        self.forwards += 1
        self.decided = self.length = start + M

    def _read_alone(self, *pending: Any) -> None:
        """A waiting ``extend`` on its own: the root's output is then at hand."""
        root, replayed = self._extended(pending, (), lambda root_out, root_token, decided: root_out)
        # A graph's output is overwritten by its next replay: the root's output is copied.
        self.outputs[0] = (root.clone() if replayed else root).unsqueeze(0)

    def _extended(self, pending: tuple, extra: tuple[Tensor, ...], then: Callable[..., Any], name: Optional[Hashable] = None) -> tuple[Any, bool]:
        """``then(root_out [1,D], root_token [1], decided [], *extra)`` after a waiting extend's
        forward (``pending``: its hidden, layers, tokens and start), all in one function of device
        tensors (the decided length a tensor), replayed as one graph per number of new positions
        and what follows (``name``: the graph ``then`` would have been alone), the graph named
        ("extend", count, layers[, name]). The new entries follow the decided ones (the tree's were
        rolled back); the last new token is the root. Returns (what ``then`` returns, replayed)."""
        hidden, layers, tokens, start = pending
        M, keys = tokens.shape[1], sorted(layers)
        inputs = (hidden, *(layers[k] for k in keys), tokens, self.columns[start : start + 1], *extra)

        def extend_then(hidden: Tensor, *rest: Tensor) -> Any:
            states, (tokens, start), extra = rest[: len(keys)], rest[len(keys) : len(keys) + 2], rest[len(keys) + 2 :]
            feature = self.head.feature(hidden, dict(zip(keys, states)))
            positions = start + torch.arange(M, device=tokens.device)
            # Each new position sees the decided entries, the new ones before it and itself.
            visible = self.columns.unsqueeze(0) <= positions.unsqueeze(1)
            root_out = self._slotted_forward(feature, tokens, positions, visible, positions)[0, -1:]
            return then(root_out, tokens[0, -1:], start[0] + M, *extra)

        key = ("extend", M, tuple(keys)) + (() if name is None else (name,))
        return self.graphs.run(key, extend_then, inputs, f"the {self.head.cfg.kind} head's extend")

    def expand(self, frontier: Any) -> Tensor:
        self._settle()
        todo = [n for n in frontier.nodes if n not in self.outputs]
        if todo:
            cached = self.length
            ancestors = ancestor_slots(todo, frontier.parents, self.slots)
            device = self.outputs[0].device
            feature = torch.cat([self.outputs[frontier.parents[n]] for n in todo], dim=1)
            tokens = torch.tensor([[frontier.tokens[n] for n in todo]], device=device)
            positions = torch.tensor([self.decided - 1 + frontier.depths[n] for n in todo], device=device)
            out = self._forward(feature, tokens, positions, tree_visibility(self.decided, cached, ancestors, feature.device))
            self.forwards += 1
            self.length = cached + len(todo)
            for row, node in enumerate(todo):
                self.outputs[node] = out[:, row : row + 1]
                self.slots[node] = cached + row
        return self.head.logits(torch.cat([self.outputs[n] for n in frontier.nodes], dim=1)[0], self.lm_head)

    @property
    def levels_on_device(self) -> bool:
        return bool(self.capacity)  # the tree's entries go to preallocated slots, written over each step

    def expand_level(self, frontier: Any) -> Tensor:
        """``expand`` with everything on the device: level 1 reads the root's output; level L
        forwards its F nodes at once, each from its parent's output (a node of level L-1), at
        rotary position decided + L - 2, seeing the decided entries, its ancestors' entries and
        its own. The tree's entries follow the decided ones level by level, as ``expand`` writes
        them, and what a node sees is its parent's row of the last level plus its own column."""
        self._settle()
        decided = self.decided

        def forward(feature: Tensor, tokens: Tensor, seen: Tensor) -> Tensor:
            width, device = seen.shape[0], seen.device
            visible = torch.cat([torch.ones(width, decided, dtype=torch.bool, device=device), seen], dim=1)
            positions = torch.full((width,), decided + frontier.level - 2, dtype=torch.long, device=device)
            out = self._forward(feature, tokens, positions, visible)
            self.forwards += 1
            self.length += width
            return out

        self._level, logits = self._tree_level(frontier, self.outputs[0][0], getattr(self, "_level", None), forward)
        return logits

    def _tree_level(self, frontier: Any, root_out: Tensor, previous: Any, forward: Callable[[Tensor, Tensor, Tensor], Tensor]) -> tuple[Any, Tensor]:
        """One level of a tree grown on the device (``expand_level``'s and ``_dynamic_tree``'s):
        level 1 reads the root's output ``root_out`` [1,D]; level L forwards its F nodes through
        ``forward(feature [1,F,D], tokens [1,F], seen [F,W])``, each from its parent's output (a node
        of ``previous``, the level before: its node ids, outputs [F',D], visibility [F',W']), seeing
        its ancestors' tree entries (its parent's row of ``seen``) and its own. Returns (this level,
        its logits)."""
        if frontier.level == 1:
            level = (frontier.nodes, root_out, torch.zeros(1, 0, dtype=torch.bool, device=root_out.device))
            return level, self.head.logits(root_out, self.lm_head)
        nodes, outputs, seen = previous
        width = frontier.nodes.shape[0]
        # Each node's parent is one of the last level's nodes: its row there.
        rows = frontier.rows_in(nodes)
        seen = torch.cat([seen[rows], torch.eye(width, dtype=torch.bool, device=seen.device)], dim=1)
        out = forward(outputs[rows].unsqueeze(0), frontier.tokens.unsqueeze(0), seen)
        return (frontier.nodes, out[0], seen), self.head.logits(out[0], self.lm_head)

    def dynamic_tree(
        self, spec: Any, root: int, logp: Callable[[Tensor], Tensor], key: Any, deterministic: bool, build: Callable[..., Any],
        extra: tuple[Tensor, ...] = (),
    ) -> Optional[tuple[Tensor, ...]]:
        """An EAGLE-2 tree (``build``: ``runtime.tree.build_dynamic_tree_on_device``, over
        ``expand_level``'s levels ranked by ``logp`` of the logits) as one function of device
        tensors whose shapes never depend on the step: the decided length and the root token are
        tensors. On CUDA it is captured once per (spec, ``key``: what ``logp`` and ``build``
        depend on) as one CUDA graph, every level's forward, top-k and the tree's assembly in a
        single launch; elsewhere, or where capture fails, it runs eagerly. ``extra``: more inputs
        ``build`` takes after its own (a hybrid's lookup seeds). Returns the tree's (tokens, parents,
        depths, num_nodes), then what ``build`` returns after the tree and its ids: the tree grown
        level by level (tests/unit/test_static_session.py)."""

        def grow(expand: Callable[[Any], Tensor], root_token: Tensor, device, *extra: Tensor) -> tuple[Tensor, ...]:
            tree, _, *more = build(expand, root_token, spec.depth, spec.topk, spec.budget, device, deterministic, *extra)
            return (tree.tokens, tree.parents, tree.depths, tree.num_nodes, *more)

        # The levels' forwards write topk entries each after the decided ones.
        name = ("dynamic", spec.depth, spec.topk, spec.budget, key)
        return self._whole_tree(name, (spec.depth - 1) * spec.topk, spec.depth - 1, root, logp, grow, "EAGLE-2 tree", extra)

    def static_tree(self, spec: Any, root: int, build: Callable[..., Any], draws: Any = None) -> Optional[tuple[Tensor, ...]]:
        """A static tree (``build``: ``runtime.drafters.grow_static_tree_on_device``), greedy or
        sampled from ``draws``, grown as ``dynamic_tree`` grows an EAGLE-2 one: one function of
        device tensors, one CUDA graph a step on CUDA. None where a rank of a greedy spec is not
        below the vocabulary (the caller then grows the tree on the host, which leaves such nodes
        out)."""
        if draws is None and max(spec.ranks) >= self.head.dims.vocab_size:
            return None

        def grow(expand: Callable[[Any], Tensor], root_token: Tensor, device, *uniforms: Tensor) -> tuple[Tensor, ...]:
            return static_tree_parts(build(spec, root_token, expand, device, with_uniforms(draws, uniforms)))

        # Levels 2.. forward the nodes below the root that get children, one entry each.
        entries = sum(1 for n in range(1, spec.num_nodes) if spec.children(n))
        name = ("static", spec, draws_key(draws))
        return self._whole_tree(name, entries, spec.max_depth - 1, root, lambda logits: logits, grow, "static tree", draws_inputs(draws))

    def _whole_tree(
        self, name: tuple, entries: int, forwards: int, root: int, rank: Callable[[Tensor], Tensor], grow: Callable[..., tuple[Tensor, ...]], what: str,
        extra: tuple[Tensor, ...] = (),
    ) -> tuple[Tensor, ...]:
        """A tree grown through ``_tree_function`` (``grow(expand, root_token, device, *extra)``
        over levels ranked by ``rank``), captured once per ``name`` where the session has graphs,
        ``extra`` among its inputs. ``entries``: what the levels' forwards write after the decided
        ones; ``forwards``: how many they are."""
        if self.decided + entries > self.capacity:
            # Drops the captured graphs; a waiting read writes its entries into the new buffers.
            self._grow(max(2 * self.capacity, self.decided + entries + 64))

        def tree_function(root_out: Tensor, root_token: Tensor, decided: Tensor, *extra: Tensor) -> tuple[Tensor, ...]:
            return self._tree_function(rank, grow, root_out, root_token, decided, extra)

        pending = self._take_read()
        if pending is not None:
            # A step's accepted positions and the tree in one function: one graph a step on CUDA,
            # one per accepted count.
            tree, replayed = self._extended(pending, extra, tree_function, name)
        else:
            device = self.outputs[0].device
            inputs = (
                self.outputs[0][0],
                torch.full((1,), root, dtype=torch.long, device=device),
                torch.full((), self.decided, dtype=torch.long, device=device),
                *extra,
            )
            tree, replayed = self.graphs.run(name, tree_function, inputs, f"the {self.head.cfg.kind} head's {what}")
        if replayed:  # a graph's outputs are overwritten by its next replay: the tree gets its own copies
            tree = tuple(x.clone() for x in tree)
        self.forwards += forwards
        self.length = self.decided + entries
        return tree

    def _tree_function(
        self, rank: Callable[[Tensor], Tensor], grow: Callable[..., tuple[Tensor, ...]], root_out: Tensor, root_token: Tensor, decided: Tensor,
        extra: tuple[Tensor, ...] = (),
    ) -> tuple[Tensor, ...]:
        """``_whole_tree``'s function: ``expand_level`` with the decided length a tensor, so the
        visibility is over the whole buffer ([F, capacity]: the decided columns, then the tree's
        columns so far) and the slots and rotary positions are computed on the device."""
        device = root_out.device
        level_state: dict[str, Any] = {"cols": 0, "level": None}
        # Made once a tree, not once a level: the decided columns every node sees, and the slots
        # after them (each level's entries; the columns of its ancestors' entries), sliced per level.
        decided_columns = self.columns < decided
        slots_after = decided + self.columns

        def expand(frontier: Any) -> Tensor:
            cols = level_state["cols"]

            def forward(feature: Tensor, tokens: Tensor, seen: Tensor) -> Tensor:
                width = seen.shape[0]
                visible = decided_columns.expand(width, -1).clone()
                visible.index_copy_(1, slots_after[: cols + width], seen)
                positions = (decided + (frontier.level - 2)).expand(width)
                level_state["cols"] = cols + width
                return self._slotted_forward(feature, tokens, positions, visible, slots_after[cols : cols + width])

            level_state["level"], logits = self._tree_level(frontier, root_out, level_state["level"], forward)
            return rank(logits)

        return grow(expand, root_token, device, *extra)

    def rollback(self) -> None:
        self._settle()  # a read the tree never took still enters the caches
        if not self.capacity:
            for cache in self.caches:
                truncate_cache(cache, self.decided)
        self.length = self.decided  # in preallocated buffers the tree's entries are simply written over
        self.outputs, self.slots = {}, {}
