"""The contract every draft head keeps: training forward, loss, and the drafting interface the runtime calls.

Depth convention: at position t the target has read x_0..x_t and its own LM head predicts
x_{t+1}. Draft depth k (1-indexed, k = 1..K) predicts x_{t+1+k}. A head's training forward returns
logits [B,T,K,V]; logits[b, t, k-1] is scored against x_{t+1+k}.

Drafting (batch size 1) goes through a ``HeadSession``, one per generation:

    session = head.start_drafting(embed, lm_head)
    repeat:
        session.extend(hidden, layers, tokens)   # positions that entered the target's KV cache
        logits = session.expand(frontier)        # children of tree nodes, as often as the tree needs
        session.rollback()                        # after verification: forget the tree

A frontier (draftsmith.runtime.tree.Frontier) names the tree nodes to expand: ``nodes`` (ids),
and per id ``tokens``, ``parents`` (-1 for the root) and ``depths``; node 0 is the root, the token
the target decided last, not yet in its cache. ``expand`` returns the logits over the target's
vocabulary of each frontier node's next token: depth d+1 of the draft for a node at depth d, given
the tokens on the node's path. The contract test (tests/unit/test_head_contract.py) checks, for
every registered head, that these are exactly the teacher-forced training logits for the same
tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Hashable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from draftsmith.graphs import Graphs, can_capture
from draftsmith.heads.layers import preallocate_cache
from draftsmith.sampling import draws_inputs, draws_key, with_uniforms
from draftsmith.target import FrozenTarget, TargetDims, TargetFeatures

__all__ = [
    "DraftHead", "HeadSession", "LevelSession", "TargetDims", "TargetFeatures", "WaitingRead", "depth_label_weights", "depth_labels", "depth_loss",
    "path_tokens",
]  # fmt: skip


def depth_labels(
    input_ids: Tensor, loss_mask: Optional[Tensor], depth: int, segment_ids: Optional[Tensor] = None
) -> tuple[Tensor, Tensor]:
    """Labels and validity for K draft depths.

    input_ids [B,T]; loss_mask [B,T] (1 where a token is trained on, e.g. assistant tokens) or None;
    segment_ids [B,T] (packed rows: which example each token belongs to) or None.
    Returns labels [B,T,K] (x_{t+1+k}, 0 where out of range) and valid [B,T,K] (bool). A label is
    valid only inside the same packed example as position t.
    """
    B, T = input_ids.shape
    labels = input_ids.new_zeros(B, T, depth)
    valid = torch.zeros(B, T, depth, dtype=torch.bool, device=input_ids.device)
    mask = torch.ones_like(input_ids, dtype=torch.bool) if loss_mask is None else loss_mask.bool()
    for k in range(1, depth + 1):
        shift = 1 + k
        if shift >= T:
            break
        labels[:, : T - shift, k - 1] = input_ids[:, shift:]
        valid[:, : T - shift, k - 1] = mask[:, shift:]
        if segment_ids is not None:
            valid[:, : T - shift, k - 1] &= segment_ids[:, shift:] == segment_ids[:, : T - shift]
    return labels, valid


def depth_label_weights(token_weights: Tensor, depth: int) -> Tensor:
    """weights [B,T,K]: the weight of each position's label at each depth, shifted as
    ``depth_labels`` shifts the tokens (depth k's label at t is token t+1+k); 0 out of range."""
    B, T = token_weights.shape
    out = token_weights.new_zeros(B, T, depth)
    for k in range(1, depth + 1):
        if 1 + k >= T:
            break
        out[:, : T - 1 - k, k - 1] = token_weights[:, 1 + k :]
    return out


class _SoftCrossEntropy(torch.autograd.Function):
    """Per row, -sum_v p_v log softmax(z)_v, in the targets' dtype (at least fp32).

    Autograd through log_softmax keeps an fp32 [M,V] log-softmax and the product's operands for
    backward; this keeps the logits as they came (bf16 under autocast: half the bytes) and the
    targets, and its backward is a softmax and three passes in place:
    dz = (softmax(z) sum_v p_v - p) x grad. The targets get no gradient (teachers are frozen).
    Targets given as rows ``index`` [M] of a ``table`` [R,V] are gathered in forward and again in
    backward: only the index is kept, not an [M,V] copy (the table is alive anyway)."""

    @staticmethod
    def forward(ctx, logits: Tensor, table: Tensor, index: Optional[Tensor]) -> Tensor:
        ctx.save_for_backward(logits, table, index)
        probs = table if index is None else table.index_select(0, index)
        return -torch.linalg.vecdot(probs, torch.log_softmax(logits, dim=-1, dtype=probs.dtype))

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        logits, table, index = ctx.saved_tensors
        probs = table if index is None else table.index_select(0, index)
        dz = torch.softmax(logits, dim=-1, dtype=probs.dtype)
        dz.mul_(probs.sum(-1, keepdim=True)).sub_(probs).mul_(grad.unsqueeze(-1))
        return dz.to(logits.dtype), None, None


def soft_cross_entropy(logits: Tensor, probs: Tensor, index: Optional[Tensor] = None) -> Tensor:
    """Cross-entropy of logits [M,V] against target distributions probs [M,V] (probs' dtype, at
    least fp32), per row [M]: -sum_v probs log_softmax(logits). With ``index`` [M], the targets are
    rows ``index`` of ``probs`` [R,V] (a teacher table shared by several losses, shifted per depth),
    gathered twice rather than kept. Equal to the autograd formula in value and gradient
    (tests/unit/test_heads.py), in less memory and time; targets that need a gradient take the
    autograd formula."""
    probs = probs.to(torch.promote_types(probs.dtype, torch.float32))
    if probs.requires_grad:
        rows = probs if index is None else probs[index]
        return -(rows * torch.log_softmax(logits.to(probs.dtype), dim=-1)).sum(-1)
    return _SoftCrossEntropy.apply(logits, probs, index)


def depth_loss(
    labels: Tensor,
    valid: Tensor,
    weights: Tensor,
    logits_at: Callable[[int, Tensor], Tensor],
    soft_targets: Optional[Callable[[int, Tensor, Tensor], Tensor]] = None,
    extra: Optional[Callable[[int, Tensor], Tensor]] = None,
    ce_weight: float = 1.0,
    predicted: Optional[Callable[[Tensor], Tensor]] = None,
    label_weight: float = 0.0,
    label_weights: Optional[Tensor] = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The weighted per-depth loss every head trains with, over trained positions only.

    labels, valid [B,T,K]; weights [K]. For depth k = 1..K, ``logits_at(k, rows)`` gives the
    logits [M,V] of the M positions where ``rows = valid[..., k-1]`` ([B,T] bool): only those reach
    the vocabulary projection, which dominates the cost (V >> D) while most chat positions carry no
    label. The depth's term is ``ce_weight`` x the cross-entropy against the labels, or against
    ``soft_targets(k, rows, logits)`` (probabilities [M,V], e.g. the target's own distribution, or
    a (table [R,V], index [M]) pair naming them as rows of a table every depth shares), plus
    ``label_weight`` x the cross-entropy against the labels when soft targets replace them (both
    objectives at once, Hydra++'s), plus ``extra(k, rows)`` (e.g. a feature regression).
    ``predicted(logits) -> ids`` maps a draft's argmax to the labels' vocabulary (default: argmax
    itself). ``label_weights`` [B,T,K] (``depth_label_weights``) turns each depth's mean over its
    positions into a weighted mean (cross-entropies only; None: every position counts 1). A depth
    without positions adds 0 x its logits, which keeps every parameter in the graph (DDP expects a
    gradient for each).

    Returns (sum_k w_k term_k / sum_k w_k, stats: ce, top1, count per depth [K]).
    """
    K = labels.shape[-1]
    terms, ce, top1, count = [], [], [], []
    for k in range(1, K + 1):
        rows = valid[..., k - 1]
        logits = logits_at(k, rows)  # as the head computes them (bf16 under autocast); losses run in fp32 or wider
        dtype = torch.promote_types(logits.dtype, torch.float32)
        n = logits.shape[0]
        if n == 0:
            zero = logits.sum().to(dtype) * 0.0
            terms.append(zero)
            ce.append(zero.detach())
            top1.append(zero.detach())
        else:
            target = labels[..., k - 1][rows]
            w = None if label_weights is None else label_weights[..., k - 1][rows].to(dtype)

            def mean(each: Tensor) -> Tensor:  # over the depth's positions, weighted where label_weights says
                return each.mean() if w is None else (each * w).sum() / w.sum().clamp_min(torch.finfo(dtype).tiny)

            def hard_ce() -> Tensor:
                wide = logits.to(dtype)
                return F.cross_entropy(wide, target) if w is None else mean(F.cross_entropy(wide, target, reduction="none"))

            if soft_targets is not None:
                teacher = soft_targets(k, rows, logits)
                table, index = teacher if isinstance(teacher, tuple) else (teacher, None)
                depth_ce = mean(soft_cross_entropy(logits, table.to(dtype), index))
            else:
                depth_ce = hard_ce()
            term = ce_weight * depth_ce
            if soft_targets is not None and label_weight:
                term = term + label_weight * hard_ce()
            if extra is not None:
                term = term + extra(k, rows)
            terms.append(term)
            ce.append(depth_ce.detach())
            with torch.no_grad():
                guess = predicted(logits) if predicted is not None else logits.argmax(-1)
                top1.append((guess == target).to(dtype).mean())
        count.append(torch.tensor(float(n), dtype=dtype, device=logits.device))
    stacked = torch.stack(terms)
    w = weights.to(stacked.device, stacked.dtype)
    return (w * stacked).sum() / w.sum(), {"ce": torch.stack(ce), "top1": torch.stack(top1), "count": torch.stack(count)}


def path_tokens(frontier: Any, node: int) -> list[int]:
    """The tokens from the root to `node` of a frontier, root first."""
    path = []
    while node >= 0:
        path.append(frontier.tokens[node])
        node = frontier.parents[node]
    return path[::-1]


def static_tree_parts(tree: Any) -> tuple[Tensor, ...]:
    """A static tree's tensors as ``HeadSession.static_tree`` returns them (draft_probs fifth
    where it has them)."""
    parts = (tree.tokens, tree.parents, tree.depths, tree.num_nodes)
    return parts if tree.draft_probs is None else (*parts, tree.draft_probs)


@dataclass
class WaitingRead:
    """A step's read kept back, on graphs, until the tree drafted from it runs it inside the tree's
    own graph (``HeadSession._take_read``: one replay a step, read and tree), or until something
    else needs what it computes (``HeadSession._settle`` runs it alone). ``parts``: what the
    session's read takes. ``start``: the first position it reads; a prompt's read (start 0) runs
    alone, its length varying, so that each prompt length does not capture one more whole tree
    (None: the read has one shape whatever it reads, Medusa's)."""

    start: Optional[int]
    parts: tuple


class HeadSession:
    """One generation's drafting state of a head (batch size 1); see the module docstring.

    ``decided`` counts the target's positions the session has read. Subclasses implement
    ``extend`` and ``expand``; ``rollback`` drops whatever the tree added (default: nothing).
    ``forwards`` counts the passes through the head's layer stack in this session, where drafting
    is such passes (EAGLE, EAGLE-3, DFlash); None for heads whose per-depth projections are not.
    """

    forwards: Optional[int] = None
    graphs = Graphs(False)  # the session's CUDA graphs: none until preallocate asks (this one never captures)
    # Whether every tree node takes its children from its depth's ``level_logits`` (Medusa, DFlash):
    # a static tree is then drafted from them, where the session can right after its read (``after_levels``).
    drafts_by_level = False

    # A step's read waiting for the tree drafted from it (``WaitingRead``; on graphs only).
    _pending: Optional[WaitingRead] = None

    def __init__(self, head: "DraftHead", embed: Callable[[Tensor], Tensor], lm_head: Callable[[Tensor], Tensor]) -> None:
        self.head = head
        self.embed = embed
        self.lm_head = lm_head
        self.decided = 0

    def _wait(self, start: Optional[int], *parts: Any) -> None:
        """Keep a step's read back (``WaitingRead``)."""
        self._pending = WaitingRead(start, parts)

    def _settle(self) -> None:
        """Run a read still waiting, alone (``_read_alone``): what it computes is then at hand."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self._read_alone(*pending.parts)

    def _read_alone(self, *parts: Any) -> None:
        """A waiting read's ``parts`` run on their own (a graph of their own on graphs)."""
        raise NotImplementedError

    def _take_read(self) -> Optional[tuple]:
        """The waiting read's parts, handed to a tree to run inside its own graph (None: none
        waits); a prompt's read runs alone first."""
        if self._pending is not None and self._pending.start == 0:
            self._settle()
        pending, self._pending = self._pending, None
        return None if pending is None else pending.parts

    def extend(self, hidden: Tensor, layers: dict[int, Tensor], tokens: Tensor) -> None:
        """Read M decided positions j = decided .. decided+M-1: the target's final hidden states
        hidden [1,M,D] (post-norm), its decoder layers {i: [1,M,D]} (``required_layers``) and
        tokens [1,M], x_{j+1} for each (the last is the root of the next tree)."""
        raise NotImplementedError

    def expand(self, frontier: Any) -> Tensor:
        """Logits [F,V] (target vocabulary) of the next token after each node of ``frontier.nodes``."""
        raise NotImplementedError

    def preallocate(self, capacity: int, graphs: bool) -> bool:
        """Keep the head's own keys and values in preallocated buffers of ``capacity`` entries, so
        that a drafting forward's shapes depend only on how many nodes it reads, and with
        ``graphs`` (CUDA) replay each such forward as a CUDA graph. True where the head can (EAGLE,
        EAGLE-3); the default keeps growing caches and says False."""
        return False

    def restart(self, capacity: int) -> bool:
        """Start a new generation in this session, keeping its preallocated buffers (grown to
        ``capacity`` if smaller) and so its captured graphs. False where the session holds none:
        the caller starts a fresh one."""
        return False

    @property
    def vocabulary_columns(self) -> Optional[Tensor]:
        """``head.vocabulary_columns()``, read once for the session: a graph a session captures
        keeps reading the tensor it captured."""
        if "_columns" not in self.__dict__:
            self._columns = self.head.vocabulary_columns()
        return self._columns

    @property
    def levels_on_device(self) -> bool:
        """Whether ``expand_level`` serves: an EAGLE-2 tree (``runtime.tree.build_dynamic_tree_on_device``)
        or a greedy static tree (``runtime.drafters.grow_static_tree_on_device``) can then grow on the
        device without a host read per level."""
        return False

    def dynamic_tree(
        self, spec: Any, root: int, logp: Callable[[Tensor], Tensor], key: Any, deterministic: bool, build: Callable[..., Any],
        extra: tuple[Tensor, ...] = (),
    ) -> Optional[tuple[Tensor, ...]]:
        """The whole EAGLE-2 tree of a step grown by the session itself (EAGLE, EAGLE-3: one CUDA
        graph a step on CUDA): ``build`` (``runtime.tree.build_dynamic_tree_on_device``, or
        ``build_scored_tree_on_device`` for a hybrid) over the session's levels ranked by ``logp``,
        ``key`` naming what ``logp`` and ``build`` depend on, ``extra`` more device inputs ``build``
        takes after its own. Returns the tree's (tokens, parents, depths, num_nodes), then what
        ``build`` returns after the tree and its ids; None (the default) where the session does
        not: the caller grows it level by level through ``expand_level``."""
        return None

    def static_tree(self, spec: Any, root: int, build: Callable[..., Any], draws: Any = None) -> Optional[tuple[Tensor, ...]]:
        """A static tree of a step grown by the session itself, as ``dynamic_tree`` (``build``:
        ``runtime.drafters.grow_static_tree_on_device``): greedy, or sampled from ``draws``
        (``runtime.drafters.DeviceDraws``, its uniforms an input of the graph), the tree's
        draft_probs then fifth. None (the default) where the session does not."""
        return None

    def expand_level(self, frontier: Any) -> Tensor:
        """``expand`` for a frontier held on the device (``runtime.tree.LevelFrontier``: one tree
        level, its nodes' parents in the level before), where ``levels_on_device``."""
        raise NotImplementedError

    def level_logits(self) -> Optional[Tensor]:
        """Logits [depth,V] when every node at depth d takes its children from row d whatever its
        path (Medusa's heads, DFlash's block slots): a static tree is then drafted on the device
        in one top-k, without a host read. None for heads whose nodes condition on their path."""
        return None

    def after_levels(self, then: Callable[..., tuple[Tensor, ...]], name: Hashable, extra: tuple[Tensor, ...] = ()) -> Optional[tuple[Tensor, ...]]:
        """``then(levels [depth,V], root_token [1], *extra)`` run right after the step's read
        that makes ``level_logits``, in the same function: on CUDA one graph per (read, ``name``:
        what ``then`` bakes in), so the logits and the root token never leave it. Returns copies of
        what ``then`` returns (tensors that outlive the next replay); None where the session has
        no read waiting for it (the default: the caller reads ``level_logits`` itself)."""
        return None

    def rollback(self) -> None:
        """Forget the tree drafted since the last extend."""


class LevelSession(HeadSession):
    """A session whose tree nodes condition on their path through states computed level by level
    from one per-step tensor that ``extend`` sets (Hydra's context, Clover's block output at the
    root), so a tree level expands on the device from the level before it.

    On the static cache (``preallocate``) ``expand_level`` serves: greedy static trees and EAGLE-2
    trees grow on the device, and where the session has graphs (CUDA) a step's whole tree, every
    level's head forward, top-k and the tree's assembly, replays as one CUDA graph per tree shape,
    the step tensor copied in. Elsewhere the host's ``expand`` serves, the reference path.
    Subclasses name ``step_attribute`` (where the per-step tensor is) and implement ``_read`` (what
    ``extend`` computes it from) and ``_level(level, parent_states, tokens) -> (states, logits)``."""

    on_device = False
    capacity = 0  # entries of the preallocated caches of ``_layer_caches`` (0: growing ones)
    # ``extend`` of at most this many positions (a step's accepted path) replays a graph per count.
    GRAPHED_EXTEND = 32
    # Such a read on graphs waits (``_wait``: its read function, inputs, count and layers): the step's
    # whole tree runs it inside its own graph (``_whole_tree``), or ``_settle`` does before anything
    # else reads the step tensor.

    def preallocate(self, capacity: int, graphs: bool) -> bool:
        device = next(self.head.parameters()).device
        if graphs and not can_capture(device):
            raise ValueError(f"CUDA graphs need the head on a CUDA device; it is on {device}")
        self.graphs, self.on_device = Graphs(graphs), True
        self._grow(capacity)
        return True

    def restart(self, capacity: int) -> bool:
        if not self.on_device:
            return False
        self.decided, self._pending = 0, None
        self._forget()
        if capacity > self.capacity:
            self._grow(capacity)
        return True

    def _forget(self) -> None:
        """What a new generation resets besides ``decided`` (the preallocated caches stay: what
        they hold is masked until written again)."""

    def _layer_caches(self) -> list[tuple[nn.Module, dict]]:
        """The decoder layers ``_read`` runs over decided positions, each with its cache
        (``DecoderLayer.forward_cached``'s): Hydra++'s prefix layer, Clover's augmenting block."""
        return []

    def _grow(self, capacity: int) -> None:
        """Preallocated caches of ``capacity`` entries holding what the caches held; graphs dropped."""
        device = next(self.head.parameters()).device
        for layer, cache in self._layer_caches():
            preallocate_cache(layer, cache, capacity, self.decided, device)
        self.capacity = capacity
        self.columns = torch.arange(capacity, device=device)
        self.graphs.clear()

    def _read(self, hidden: Tensor, layers: dict[int, Tensor], tokens: Tensor, positions: Tensor, visible: Tensor) -> Tensor:
        """The step tensor after M decided positions at ``positions`` [M] (``extend``'s inputs),
        running ``_layer_caches`` with ``visible`` [M, entries] (the caches' slots set)."""
        raise NotImplementedError

    def extend(self, hidden: Tensor, layers: dict[int, Tensor], tokens: Tensor) -> None:
        M, start = tokens.shape[1], self.decided
        caches = [cache for _, cache in self._layer_caches()]
        if self.capacity and start + M > self.capacity:
            self._grow(max(2 * self.capacity, start + M + 64))  # drops the captured graphs
        if self.capacity:
            # The preallocated caches, written at their slots and read whole, the start a tensor: one
            # function of device tensors, a graph per count for a step's few accepted positions.
            keys = sorted(layers)

            def read(hidden: Tensor, *rest: Tensor) -> Tensor:
                *states, tokens, start = rest
                positions = start + torch.arange(tokens.shape[1], device=tokens.device)
                for cache in caches:
                    cache["slots"] = positions
                return self._read(hidden, dict(zip(keys, states)), tokens, positions, self.columns <= positions.unsqueeze(1))

            inputs = (hidden, *(layers[k] for k in keys), tokens, self.columns[start : start + 1])
            if self.graphs and caches and M <= self.GRAPHED_EXTEND:
                self._wait(start, read, inputs, M, tuple(keys))
                self.decided = start + M
                return
            step = read(*inputs)
        else:
            positions = torch.arange(start, start + M, device=tokens.device)
            visible = torch.ones(M, start + M, dtype=torch.bool, device=tokens.device).tril(diagonal=start)
            step = self._read(hidden, layers, tokens, positions, visible)
        self.step_input = step
        self.decided = start + M

    def _read_alone(self, read: Callable[..., Tensor], inputs: tuple, M: int, keys: tuple) -> None:
        """A waiting read on its own, a graph per count: the step tensor is then at hand."""
        step, replayed = self.graphs.run(("extend", M, keys), read, inputs, f"the {self.head.cfg.kind} head's extend")
        self.step_input = step.clone() if replayed else step  # a graph's output is overwritten by its next replay

    step_attribute = ""  # the attribute holding the per-step tensor ``extend`` sets

    @property
    def step_input(self) -> Tensor:
        """The per-step tensor ``extend`` sets (a read still waiting runs first)."""
        self._settle()
        return getattr(self, self.step_attribute)

    @step_input.setter
    def step_input(self, value: Tensor) -> None:
        setattr(self, self.step_attribute, value)

    def _level(self, level: int, states: Optional[Tensor], tokens: Tensor) -> tuple[Tensor, Tensor]:
        """Tree level ``level``'s nodes, each a child of the row of ``states`` (the level before's
        node states [F,...]; None at level 1, the root) holding token ``tokens`` [F]: (their states,
        the logits [F,V] of their children)."""
        raise NotImplementedError

    @property
    def levels_on_device(self) -> bool:
        return self.on_device

    def expand_level(self, frontier: Any) -> Tensor:
        if frontier.level == 1:
            states = None
        else:
            nodes, previous = self._previous
            # Each node's parent is one of the last level's nodes: its row there.
            states = previous[frontier.rows_in(nodes)]
        states, logits = self._level(frontier.level, states, frontier.tokens)
        self._previous = (frontier.nodes, states)
        return logits

    def dynamic_tree(
        self, spec: Any, root: int, logp: Callable[[Tensor], Tensor], key: Any, deterministic: bool, build: Callable[..., Any],
        extra: tuple[Tensor, ...] = (),
    ) -> Optional[tuple[Tensor, ...]]:
        def grow(root_token: Tensor, device, *extra: Tensor) -> tuple[Tensor, ...]:
            tree, _, *more = build(lambda f: logp(self.expand_level(f)), root_token, spec.depth, spec.topk, spec.budget, device, deterministic, *extra)
            return (tree.tokens, tree.parents, tree.depths, tree.num_nodes, *more)

        return self._whole_tree(("dynamic", spec.depth, spec.topk, spec.budget, key), root, grow, "EAGLE-2 tree", extra)

    def static_tree(self, spec: Any, root: int, build: Callable[..., Any], draws: Any = None) -> Optional[tuple[Tensor, ...]]:
        if draws is None and max(spec.ranks) >= self.head.dims.vocab_size:
            return None  # the host's tree leaves such nodes out

        def grow(root_token: Tensor, device, *uniforms: Tensor) -> tuple[Tensor, ...]:
            return static_tree_parts(build(spec, root_token, self.expand_level, device, with_uniforms(draws, uniforms)))

        return self._whole_tree(("static", spec, draws_key(draws)), root, grow, "static tree", draws_inputs(draws))

    def _whole_tree(
        self, name: tuple, root: int, grow: Callable[..., tuple[Tensor, ...]], what: str, extra: tuple[Tensor, ...] = ()
    ) -> Optional[tuple[Tensor, ...]]:
        """``grow(root_token, device, *extra)`` as one function of the step tensor, the root token
        and ``extra``, captured once per ``name``; None where the session has no graphs (the caller
        then grows the same tree level by level through ``expand_level``). A step's waiting read
        runs in the same function."""
        if not self.graphs:
            return None
        pending = self._take_read()
        device = (getattr(self, self.step_attribute) if pending is None else pending[1][0]).device

        def tree_function(step: Tensor, root_token: Tensor, *extra: Tensor) -> tuple[Tensor, ...]:
            self.step_input = step  # the levels read the graph's own copy
            return grow(root_token, device, *extra)

        what = f"the {self.head.cfg.kind} head's {what}"
        if pending is None:
            step = self.step_input
            tree, replayed = self.graphs.run(name, tree_function, (step, torch.full((1,), root, dtype=torch.long, device=device), *extra), what)
            self.step_input = step
        else:
            # The step's read and its tree in one function (one graph a step on CUDA): the step
            # tensor and the root token (the last one read) never leave it.
            read, inputs, M, keys = pending
            n = len(inputs)

            def read_then_tree(*args: Tensor) -> tuple[Tensor, ...]:
                return tree_function(read(*args[:n]), args[n - 2][0, -1:], *args[n:])

            tree, replayed = self.graphs.run(("extend", M, keys, name), read_then_tree, (*inputs, *extra), what)
            setattr(self, self.step_attribute, None)  # the step tensor lived in the graph: nothing reads it after the tree
        return tuple(x.clone() for x in tree) if replayed else tree

    def rollback(self) -> None:
        self._settle()  # a read the tree never took still enters the caches
        self._previous = None


class BufferedSession(HeadSession):
    """A session that can keep its own keys and values in preallocated buffers (EAGLE's caches,
    DFlash's context). Subclasses implement ``_grow(capacity)`` (buffers of that many entries
    holding what they held; captured graphs dropped) and ``_forget()`` (what a new generation
    resets besides the counters)."""

    capacity = 0  # preallocated entries (0: growing caches)

    def preallocate(self, capacity: int, graphs: bool) -> bool:
        device = next(self.head.parameters()).device
        if graphs and not can_capture(device):
            raise ValueError(f"CUDA graphs need the head on a CUDA device; it is on {device}")
        self.graphs = Graphs(graphs)
        self._grow(capacity)
        return True

    def restart(self, capacity: int) -> bool:
        if not self.capacity:
            return False
        self.decided = self.forwards = 0
        self._forget()
        if capacity > self.capacity:
            self._grow(capacity)
        return True

    def _grow(self, capacity: int) -> None:
        raise NotImplementedError

    def _forget(self) -> None:
        raise NotImplementedError


class DraftHead(nn.Module):
    """Base class of draft heads that read a frozen target's features.

    Subclasses set `config_class` (a dataclass with a `kind` field and a ``check()`` that raises
    ValueError naming the recipe key), implement `forward`, `start_drafting` and `depth`, and may
    override `loss`, `top_tokens`, `required_layers` and `init_from_target`.
    """

    config_class: ClassVar[type]

    def __init__(self, cfg: Any, dims: TargetDims) -> None:
        super().__init__()
        cfg.check()
        self.cfg = cfg
        self.dims = dims

    @property
    def depth(self) -> int:
        """K, the number of tokens the head drafts beyond the target's own next token."""
        raise NotImplementedError

    def required_layers(self) -> list[int]:
        """Decoder layers whose outputs the head reads (besides final_hidden)."""
        return []

    def vocabulary_columns(self) -> Optional[Tensor]:
        """The target token ids the head's logits can be finite at, ascending (a draft vocabulary
        smaller than the target's), or None (the default): every token."""
        return None

    def init_from_data(self, examples: Sequence[dict]) -> Optional[str]:
        """Choose what the head takes from the training data (examples with input_ids and
        loss_mask), once, before init_from_target and training; a resumed run restores it from the
        checkpoint instead. Returns a line for the log, or None (default: nothing to choose)."""
        return None

    def init_from_target(self, target: FrozenTarget) -> Optional[str]:
        """Initialise parameters (and whatever the head chooses from the target, such as a token id)
        before training starts. Returns a line for the log, or None (default: nothing to do)."""
        return None

    def forward(self, features: TargetFeatures) -> Tensor:  # pragma: no cover - abstract
        """Teacher-forced logits [B,T,K,V]."""
        raise NotImplementedError

    def top_tokens(self, features: TargetFeatures, k: int) -> Tensor:
        """The k most likely tokens per position and depth [B,T,K,k], best first (for evaluation).
        Heads override it to avoid holding all depths' logits [B,T,K,V] at once."""
        logits = self(features)
        return logits.topk(min(k, logits.shape[-1]), dim=-1).indices

    def depth_weights(self) -> Tensor:
        """Loss weight of each depth [K] (default: equal)."""
        return torch.ones(self.depth)

    def loss(
        self, features: TargetFeatures, loss_mask: Optional[Tensor], segment_ids: Optional[Tensor] = None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Weighted cross-entropy over depths. Returns (scalar loss, stats with ce/top1/count per depth [K])."""
        logits = self(features)
        labels, valid = depth_labels(features.input_ids, loss_mask, self.depth, segment_ids)
        return depth_loss(labels, valid, self.depth_weights(), lambda k, rows: logits[:, :, k - 1][rows])

    def start_drafting(self, embed: Callable[[Tensor], Tensor], lm_head: Callable[[Tensor], Tensor]) -> HeadSession:
        """A fresh drafting session for one generation, reading the target through `embed` and `lm_head`."""
        raise NotImplementedError

    def runtime_state_dict(self) -> dict[str, Tensor]:
        """The weights an export needs: the head's own parameters and buffers, nothing of the target."""
        return {k: v.detach().contiguous() for k, v in self.state_dict().items()}
