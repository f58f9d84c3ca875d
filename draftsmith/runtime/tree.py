"""Draft trees: static trees from Medusa-style choice lists, dynamic trees (EAGLE-2 style), masks, positions.

Conventions shared by the whole runtime (the fused kernel codes against them):

- A tree has N nodes in topological order: ``parents[i] < i``. Node 0 is the root; ``parents[0] = -1``.
- The root holds the last token already decided (the previous step's bonus token, or the last prompt
  token). It is not yet in the target's KV cache; the target reads it in the same forward pass as the
  drafted nodes 1..N-1.
- ``depths[i]`` is the number of edges from the root, so node i sits at sequence position
  ``prefix_len + depths[i]`` where ``prefix_len`` is the number of tokens already in the KV cache.
- In one target forward over the N nodes, ``target_logits[:, i]`` predicts the token that follows
  node i's path.
- Trees in a batch may have fewer nodes than N: nodes ``i >= num_nodes[b]`` are padding with
  ``parents = -1``, ``depths = 0`` and token 0. A padding node is nobody's child, so verification
  never tests it, and in the attention mask it sees only the prefix and itself.

Shapes: B trees, N nodes, V vocabulary.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

__all__ = [
    "TreeError",
    "TreeSpec",
    "DynamicTreeSpec",
    "AdaptiveTreeSpec",
    "Candidates",
    "DraftTree",
    "Frontier",
    "default_tree",
    "parse_tree",
    "ancestor_mask",
    "tree_positions",
    "tree_attention_mask",
    "LevelFrontier",
    "build_dynamic_tree",
    "build_dynamic_tree_on_device",
    "build_scored_tree",
    "build_scored_tree_on_device",
    "seed_rows",
    "tree_shape",
    "sparse_tree",
    "SparseTree",
]


class TreeError(ValueError):
    """A tree spec or a draft tree that is not a tree. The message is one line."""


# The largest trees the runtime drafts: every drafted node is a row of the target's verification
# forward, and a few hundred already cost more than they save on any hardware.
MAX_TREE_NODES = 1024
MAX_TREE_DEPTH = 64


def _check_size(nodes: int, depth: int) -> None:
    if nodes > MAX_TREE_NODES or depth > MAX_TREE_DEPTH:
        raise TreeError(f"a tree of {nodes} drafted nodes and depth {depth} is past the runtime's limits ({MAX_TREE_NODES} nodes, depth {MAX_TREE_DEPTH})")


def _not_a_tree(detail: str) -> TreeError:
    return TreeError(f"a tree spec that is not a tree: {detail}")


@dataclass(frozen=True)
class TreeSpec:
    """A static draft tree shape from a Medusa-style choice list.

    Each drafted node is a tuple of child ranks from the root: ``(1,)`` is the root's second-best
    child, ``(0, 2)`` the third-best child of the root's best child. Rank r means "the r-th best
    candidate" when drafting greedily and "the r-th draw without replacement" when sampling (the
    children of one node are then drawn in rank order; gaps in the ranks are closed up).

    Nodes are ordered by depth, then lexicographically, which is topological and puts siblings in
    rank order. ``parents``, ``depths`` and ``ranks`` are per node, root included (N = len(choices) + 1).
    """

    choices: tuple[tuple[int, ...], ...]
    parents: tuple[int, ...]
    depths: tuple[int, ...]
    ranks: tuple[int, ...]

    @classmethod
    def from_choices(cls, choices: Sequence[Sequence[int]]) -> "TreeSpec":
        """Validate a choice list: non-negative integer ranks, no duplicates, every prefix present,
        at most MAX_TREE_NODES nodes and MAX_TREE_DEPTH deep."""
        _check_size(len(choices), max((len(c) for c in choices if isinstance(c, (list, tuple))), default=0))
        normalized = []
        for choice in choices:
            if isinstance(choice, int) or not isinstance(choice, (list, tuple)):
                raise _not_a_tree(f"node {choice!r} is not a tuple of child ranks")
            if len(choice) == 0:
                raise _not_a_tree("the empty tuple is the root, which is implicit; leave it out")
            if not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in choice):
                raise _not_a_tree(f"node {tuple(choice)!r} has a rank that is not a non-negative integer")
            normalized.append(tuple(choice))
        seen = set()
        for choice in normalized:
            if choice in seen:
                raise _not_a_tree(f"node {choice!r} appears twice")
            seen.add(choice)
        for choice in normalized:
            if len(choice) > 1 and choice[:-1] not in seen:
                raise _not_a_tree(f"node {choice!r} has no parent {choice[:-1]!r}")
        ordered = tuple(sorted(normalized, key=lambda c: (len(c), c)))
        index = {choice: i + 1 for i, choice in enumerate(ordered)}
        parents = (-1,) + tuple(index[c[:-1]] if len(c) > 1 else 0 for c in ordered)
        depths = (0,) + tuple(len(c) for c in ordered)
        ranks = (0,) + tuple(c[-1] for c in ordered)
        return cls(choices=ordered, parents=parents, depths=depths, ranks=ranks)

    @classmethod
    def chain(cls, length: int) -> "TreeSpec":
        """A chain of ``length`` drafted tokens (one child per node): classic speculative decoding."""
        if length < 0:
            raise _not_a_tree(f"a chain needs a length >= 0, got {length}")
        return cls.from_choices([(0,) * d for d in range(1, length + 1)])

    @property
    def num_nodes(self) -> int:
        """N, root included."""
        return len(self.parents)

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    def children(self, node: int) -> list[int]:
        """Children of ``node`` in index order (= rank order)."""
        return [i for i, p in enumerate(self.parents) if p == node]

    @functools.cached_property
    def child_counts(self) -> tuple[int, ...]:
        """How many children each node has, counted once (a decoding step asks every time)."""
        counts = [0] * len(self.parents)
        for parent in self.parents[1:]:
            counts[parent] += 1
        return tuple(counts)

    def parents_tensor(self, device=None) -> Tensor:
        """parents as a long tensor [N]."""
        return torch.tensor(self.parents, dtype=torch.long, device=device)

    def depths_tensor(self, device=None) -> Tensor:
        """depths as a long tensor [N]."""
        return torch.tensor(self.depths, dtype=torch.long, device=device)


@dataclass(frozen=True)
class DynamicTreeSpec:
    """An EAGLE-2 style dynamic tree: ``depth`` levels, the best ``topk`` frontier nodes expanded per
    level with ``topk`` children each, and the best ``budget`` drafted nodes kept (see build_dynamic_tree).

    Its children are chosen by rank of draft probability, not drawn, so when sampling the tree is
    verified as deterministic candidates (``DraftTree.deterministic``: EAGLE's rule, lossless).
    """

    depth: int
    topk: int
    budget: int

    def __post_init__(self) -> None:
        if self.depth < 1 or self.topk < 1 or self.budget < 1:
            raise _not_a_tree(f"a dynamic tree needs depth, topk and budget >= 1, got {self.depth}, {self.topk}, {self.budget}")
        _check_size(self.budget, self.depth)
        if self.topk > MAX_TREE_NODES:
            raise TreeError(f"a dynamic tree's topk {self.topk} is past the runtime's limit of {MAX_TREE_NODES}")


@dataclass(frozen=True)
class AdaptiveTreeSpec:
    """A draft structure chosen per step (OPT-Tree's objective): the ``budget`` drafted nodes with the
    largest expected accepted length, from the draft's probabilities and the lookup's match
    statistics (``build_scored_tree``), at most ``depth`` deep, ``topk`` children per expanded node.

    ``cost`` (tokens, >= 0) makes the depth dynamic: drafting stops after a level whose expected
    gain (the growth of the expected accepted length of the best tree of ``budget`` nodes) falls
    below it, and levels whose chosen nodes add less than it are left out. 0 never stops early.
    Children are chosen by rank, so when sampling the tree is verified as deterministic candidates.
    """

    depth: int
    topk: int
    budget: int
    cost: float = 0.0

    def __post_init__(self) -> None:
        if self.depth < 1 or self.topk < 1 or self.budget < 1:
            raise _not_a_tree(f"an adaptive tree needs depth, topk and budget >= 1, got {self.depth}, {self.topk}, {self.budget}")
        if not self.cost >= 0:
            raise _not_a_tree(f"an adaptive tree's cost must be >= 0, got {self.cost}")
        _check_size(self.budget, self.depth)
        if self.topk > MAX_TREE_NODES:
            raise TreeError(f"an adaptive tree's topk {self.topk} is past the runtime's limit of {MAX_TREE_NODES}")


def tree_shape(spec) -> AdaptiveTreeSpec:
    """Depth, children per node, node budget and cost of any tree spec, as the scored builder
    (``build_scored_tree``) reads them: a static tree's deepest node, widest node and node count
    (cost 0), a dynamic tree's own numbers (cost 0), an adaptive tree as it is."""
    if isinstance(spec, AdaptiveTreeSpec):
        return spec
    if isinstance(spec, DynamicTreeSpec):
        return AdaptiveTreeSpec(spec.depth, spec.topk, spec.budget)
    widest = max((spec.parents.count(i) for i in range(spec.num_nodes)), default=1)
    return AdaptiveTreeSpec(max(spec.max_depth, 1), max(widest, 1), max(spec.num_nodes - 1, 1))


def default_tree(depth: int = 4, widths: Sequence[int] = (4, 2, 2, 1)) -> TreeSpec:
    """Top-k per depth along the best path: the best node at depth d-1 gets ``widths[d-1]`` children.

    ``default_tree(4, (4, 2, 2, 1))`` has 4 + 2 + 2 + 1 = 9 drafted nodes. Depths beyond
    ``len(widths)`` get one child.
    """
    widths = list(widths) + [1] * max(0, depth - len(widths))
    if any(int(w) < 1 for w in widths[:depth]):
        raise _not_a_tree(f"every width must be >= 1, got {tuple(widths[:depth])}")
    _check_size(sum(int(w) for w in widths[:depth]), depth)
    choices = []
    for d in range(depth):
        best_path = (0,) * d
        choices.extend(best_path + (r,) for r in range(int(widths[d])))
    return TreeSpec.from_choices(choices)


@dataclass(frozen=True)
class SparseTree:
    """A static tree chosen from measured per-depth, per-rank accuracies (``sparse_tree``).

    ``spec``: the tree; ``expected_accept_length``: 1 + the sum over its nodes of the product of
    the accuracies along each node's path (tokens per target forward if ranks and depths were
    independent); ``rank_accuracy`` [K][R]: the accuracies it was built from. ``to_dict`` is what
    checkpoints and exports store under "tree"; ``from_dict`` reads it back.
    """

    spec: TreeSpec
    expected_accept_length: float
    rank_accuracy: tuple[tuple[float, ...], ...]

    def to_dict(self) -> dict:
        return {
            "kind": "sparse",
            "choices": [list(c) for c in self.spec.choices],
            "nodes": len(self.spec.choices),
            "expected_accept_length": self.expected_accept_length,
            "rank_accuracy": [list(row) for row in self.rank_accuracy],
        }

    @classmethod
    def from_dict(cls, data: dict) -> "SparseTree":
        if not isinstance(data, dict) or not isinstance(data.get("choices"), list):
            raise TreeError(f"a stored tree needs a list of choices, got {data!r:.80}")
        spec = TreeSpec.from_choices([tuple(c) if isinstance(c, list) else c for c in data["choices"]])
        rows = tuple(tuple(float(a) for a in row) for row in data.get("rank_accuracy", []))
        return cls(spec, float(data.get("expected_accept_length", 0.0)), rows)


def sparse_tree(rank_accuracy: Sequence[Sequence[float]], nodes: int) -> SparseTree:
    """The tree of ``nodes`` drafted nodes with the largest expected accepted length (Medusa's
    tree search).

    rank_accuracy [K][R]: rank_accuracy[d-1][r] is the measured probability that the rank-r
    candidate at depth d is the target's token, given that the path above it was accepted. A node
    whose path takes ranks (r_1, ..., r_d) is accepted with probability prod_j a[j-1][r_j] under
    independence, and the expected accepted length of a tree is 1 + the sum of that over its nodes.
    A child's product never exceeds its parent's, so the ``nodes`` largest products form a tree:
    adding the best child of the tree so far, one node at a time, finds it (ties go to the
    shallower, then the lexicographically smaller node). Ranks may leave gaps when a lower rank
    measured better than a higher one.
    """
    if nodes < 1:
        raise _not_a_tree(f"a sparse tree needs at least one node, got {nodes}")
    rows = [[min(max(float(a), 0.0), 1.0) for a in row] for row in rank_accuracy]
    if not rows or not all(rows):
        raise _not_a_tree("a sparse tree needs an accuracy for at least one rank at every depth")
    value = {(): 1.0}
    chosen: list[tuple[int, ...]] = []
    while len(chosen) < nodes:
        best = None
        for path, v in value.items():
            if len(path) >= len(rows):
                continue
            for r, a in enumerate(rows[len(path)]):
                child = path + (r,)
                if child in value:
                    continue
                key = (-v * a, len(child), child)
                if best is None or key < best[0]:
                    best = (key, child, v * a)
        if best is None:
            break  # every rank of every depth is in the tree already
        value[best[1]] = best[2]
        chosen.append(best[1])
    spec = TreeSpec.from_choices(chosen)
    expected = 1.0 + sum(value[c] for c in chosen)
    return SparseTree(spec, expected, tuple(tuple(row) for row in rows))


def parse_tree(text: str):
    """Parse a CLI tree flag.

    - ``"4,2,2,1"``: widths per depth along the best path (default_tree); ``"1,1,1"`` is a chain of 3.
    - ``"[[0],[1],[0,0]]"``: a JSON list of choices (TreeSpec.from_choices).
    - ``"dynamic:6,8,60"``: a DynamicTreeSpec(depth=6, topk=8, budget=60).
    - ``"adaptive:6,8,60,0.1"``: an AdaptiveTreeSpec(depth=6, topk=8, budget=60, cost=0.1); the
      cost may be left out (0).
    """
    text = text.strip()
    if text.startswith("adaptive:"):
        parts = text[len("adaptive:") :].split(",")
        try:
            if len(parts) not in (3, 4):
                raise ValueError
            depth, topk, budget = (int(x) for x in parts[:3])
            cost = float(parts[3]) if len(parts) == 4 else 0.0
        except ValueError:
            raise _not_a_tree(f"{text!r}: expected adaptive:DEPTH,TOPK,BUDGET[,COST]") from None
        return AdaptiveTreeSpec(depth, topk, budget, cost)
    if text.startswith("dynamic:"):
        try:
            depth, topk, budget = (int(x) for x in text[len("dynamic:") :].split(","))
        except ValueError:
            raise _not_a_tree(f"{text!r}: expected dynamic:DEPTH,TOPK,BUDGET") from None
        return DynamicTreeSpec(depth, topk, budget)
    if text.startswith("["):
        try:
            choices = json.loads(text)
        except json.JSONDecodeError as err:
            raise _not_a_tree(f"{text!r} is not valid JSON ({err.msg})") from None
        if not isinstance(choices, list):
            raise _not_a_tree(f"{text!r} is not a list of choices")
        if not choices:
            raise _not_a_tree(f"{text!r} drafts nothing: give at least one choice, e.g. [[0]]")
        return TreeSpec.from_choices([tuple(c) if isinstance(c, list) else c for c in choices])
    try:
        widths = [int(x) for x in text.split(",")]
    except ValueError:
        raise _not_a_tree(f"{text!r}: expected widths like 4,2,2,1, a JSON list of choices, dynamic:D,K,B or adaptive:D,K,B[,C]") from None
    return default_tree(len(widths), widths)


@dataclass
class DraftTree:
    """A batch of drafted trees (conventions in the module docstring).

    tokens [B,N] long; parents [B,N] long (root and padding: -1); depths [B,N] long;
    num_nodes [B] long; draft_probs [B,N,V] float or None. ``draft_probs[b, i]`` is the draft
    distribution at node i from which i's children were drawn, after the same temperature / top-k /
    top-p processing the target gets (``logits_to_probs``). Sampled verification needs it; rows of
    nodes without children are unused (zeros are fine).

    ``deterministic``: the children of every node are fixed candidates chosen without randomness
    (the draft's top-k, an EAGLE-2 dynamic tree), not draws from draft_probs. Sampled verification
    then tests each candidate as a draw from a point mass (runtime/verify.py) and needs no
    draft_probs.
    """

    tokens: Tensor
    parents: Tensor
    depths: Tensor
    num_nodes: Tensor
    draft_probs: Optional[Tensor] = None
    deterministic: bool = False
    # The deepest node, when the tree was built on the host (from_lists): max_depth without a sync.
    known_max_depth: Optional[int] = field(default=None, repr=False, compare=False)
    # A depth no node exceeds, when the builder knows one but not the deepest node (a tree grown
    # on the device: its spec's depth).
    known_depth_bound: Optional[int] = field(default=None, repr=False, compare=False)
    # The parents on the host, when the tree was built there (from_lists): read without a sync.
    host_parents: Optional[tuple[int, ...]] = field(default=None, repr=False, compare=False)

    @classmethod
    def from_lists(
        cls, tokens: Sequence[int], parents: Sequence[int], draft_probs: Optional[Tensor] = None, device=None, deterministic: bool = False
    ) -> "DraftTree":
        """One tree (B = 1) from python lists; depths are computed. draft_probs [N,V] or None.
        Checked on the host, before anything reaches the device (no device syncs)."""
        if not tokens or len(parents) != len(tokens):
            raise TreeError(f"a draft tree that is not a tree: {len(tokens)} tokens and {len(parents)} parents (every tree needs its root)")
        if parents[0] != -1:
            raise TreeError("a draft tree that is not a tree: the root's parent must be -1")
        depths = [0]
        for i, p in enumerate(parents[1:], start=1):
            if not 0 <= p < i:
                raise TreeError(f"a draft tree that is not a tree: node {i} of tree 0 has parent {p}")
            depths.append(depths[p] + 1)
        if draft_probs is not None and draft_probs.shape[0] != len(tokens):
            raise TreeError(f"a draft tree that is not a tree: draft_probs has shape {tuple(draft_probs.shape)}, tokens (1, {len(tokens)})")
        # One upload (a copy to a GPU is a launch and a wait): tokens, parents, depths and the size.
        n = len(tokens)
        flat = torch.tensor([*tokens, *parents, *depths, n], dtype=torch.long).to(device)
        rows = flat[: 3 * n].view(3, 1, n).unbind(0)
        return cls(
            tokens=rows[0],
            parents=rows[1],
            depths=rows[2],
            num_nodes=flat[3 * n :],
            draft_probs=None if draft_probs is None else draft_probs.unsqueeze(0),
            deterministic=deterministic,
            known_max_depth=max(depths),
            host_parents=tuple(parents),
        )

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def size(self) -> int:
        """N, the padded number of nodes."""
        return self.tokens.shape[1]

    @property
    def max_depth(self) -> int:
        if self.known_max_depth is not None:
            return self.known_max_depth
        return int(self.depths.max().item()) if self.depths.numel() else 0

    @property
    def depth_bound(self) -> int:
        """A depth no node exceeds, without a device sync where the builder knew one: what sizes
        verification's paths (they are -1 past the accepted node anyway). ``max_depth`` otherwise."""
        if self.known_max_depth is not None:
            return self.known_max_depth
        return self.known_depth_bound if self.known_depth_bound is not None else self.max_depth

    def validate(self) -> None:
        """Raise TreeError unless shapes agree and every real node's parent precedes it."""
        B, N = self.tokens.shape
        for name in ("parents", "depths"):
            if getattr(self, name).shape != (B, N):
                raise TreeError(f"a draft tree that is not a tree: {name} has shape {tuple(getattr(self, name).shape)}, tokens {(B, N)}")
        if self.draft_probs is not None and self.draft_probs.shape[:2] != (B, N):
            raise TreeError(f"a draft tree that is not a tree: draft_probs has shape {tuple(self.draft_probs.shape)}, tokens {(B, N)}")
        index = torch.arange(N, device=self.parents.device)
        real = index.unsqueeze(0) < self.num_nodes.unsqueeze(1)
        if N == 0 or (self.num_nodes < 1).any():
            raise TreeError("a draft tree that is not a tree: every tree needs its root")
        if (self.parents[:, 0] != -1).any():
            raise TreeError("a draft tree that is not a tree: the root's parent must be -1")
        drafted = real & (index > 0)
        bad = drafted & ((self.parents < 0) | (self.parents >= index))
        if bad.any():
            b, i = (int(x) for x in bad.nonzero()[0])
            raise TreeError(f"a draft tree that is not a tree: node {i} of tree {b} has parent {int(self.parents[b, i])}")
        if (~real & (self.parents != -1)).any():
            raise TreeError("a draft tree that is not a tree: padding nodes (index >= num_nodes) must have parent -1")
        parent_depth = self.depths.gather(1, self.parents.clamp_min(0))
        if (drafted & (self.depths != parent_depth + 1)).any():
            raise TreeError("a draft tree that is not a tree: a node's depth is not its parent's depth + 1")

    def children_table(self) -> Tensor:
        """kids [B,N,C] long: kids[b,n,j] is the j-th child of node n in index order, -1 past the last.

        C is the largest number of children of any node (at least 1).
        """
        B, N = self.parents.shape
        is_child = self.parents.unsqueeze(1) == torch.arange(N, device=self.parents.device).view(1, N, 1)  # [B,n,i]
        counts = is_child.sum(-1)
        C = max(1, int(counts.max().item()) if counts.numel() else 1)
        # Rank of child i among its siblings = how many earlier nodes share its parent.
        order = torch.cumsum(is_child.long(), dim=-1) - 1
        kids = torch.full((B, N, C), -1, dtype=torch.long, device=self.parents.device)
        b, n, i = is_child.nonzero(as_tuple=True)
        kids[b, n, order[b, n, i]] = i
        return kids


def ancestor_mask(parents: Tensor) -> Tensor:
    """anc [B,N,N] bool: anc[b, i, j] is True iff node j is an ancestor of node i or i itself.

    parents [B,N] long, topological (parents[i] < i), -1 for the root and padding.

    Reachability by squaring: R starts as "itself or its parent"; after k squarings R holds every
    ancestor up to 2**k levels up, so ceil(log2 N) squarings reach the root. A few small matmuls
    and no host sync, where a walk over the nodes would launch kernels per node.
    """
    B, N = parents.shape
    reach = torch.eye(N, device=parents.device).expand(B, N, N).clone()
    has_parent = parents >= 0
    reach.scatter_add_(2, parents.clamp_min(0).unsqueeze(-1), has_parent.unsqueeze(-1).to(reach.dtype))
    reach.clamp_max_(1)
    for _ in range(max(N - 1, 1).bit_length()):
        reach = torch.bmm(reach, reach).clamp_max_(1)
    return reach > 0


def tree_positions(depths: Tensor, prefix_len: int) -> Tensor:
    """position_ids [B,N] = prefix_len + depths: a node sits right after its path in the sequence."""
    return depths + prefix_len


def tree_attention_mask(parents: Tensor, prefix_len: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """Additive attention mask [B,1,N,prefix_len+N] for N tree nodes on top of a KV cache.

    Every node sees the whole cached prefix and, among the tree nodes, its ancestors and itself.
    Visible entries are 0 and hidden ones ``finfo(dtype).min``. transformers (5.x) hands a 4D mask
    to the attention function untouched; eager attention adds it to the scores, SDPA accepts it as a
    float mask, so one additive mask serves both. Flash-attention kernels take no custom mask:
    FrozenTarget and StandaloneDrafter refuse such models (``target.check_attention``).
    """
    B, N = parents.shape
    visible = torch.cat(
        [torch.ones(B, N, prefix_len, dtype=torch.bool, device=parents.device), ancestor_mask(parents)], dim=-1
    )
    mask = torch.zeros(B, 1, N, prefix_len + N, dtype=dtype, device=parents.device)
    return mask.masked_fill_(~visible.unsqueeze(1), torch.finfo(dtype).min)


@dataclass
class Frontier:
    """What build_dynamic_tree asks ``expand`` about.

    ``nodes``: ids of the frontier nodes to expand, in creation order. ``tokens``, ``parents`` and
    ``depths``: every node created so far, indexed by id (id 0 is the root; parents precede children).
    """

    nodes: list[int]
    tokens: list[int]
    parents: list[int]
    depths: list[int]


def build_dynamic_tree(
    expand: Callable[[Frontier], Tensor], root_token: int, depth: int, topk: int, budget: int, device=None, deterministic: bool = False
) -> tuple[DraftTree, list[int]]:
    """Grow an EAGLE-2 style dynamic tree for one sequence (B = 1) and keep its best nodes.

    ``expand(frontier) -> log-probs [F,V]`` for each frontier node. Level 1 expands the root; each
    later level expands the ``topk`` nodes of the previous level with the highest cumulative path
    log-prob, each getting its ``topk`` most likely tokens as children (tokens of probability zero
    are skipped). Finally the ``budget`` drafted nodes with the highest cumulative log-prob are kept.
    A child's cumulative log-prob never exceeds its parent's and ties go to the earlier-created node,
    so every kept node's ancestors are kept too.

    Returns (tree with 1 + kept nodes, in topological order, on ``device``, marked ``deterministic``
    as asked; ids) where ``ids[i]`` is the creation id that ``expand`` saw for tree node i
    (ids[0] = 0, the root).
    """
    tokens, parents, depths, scores = [int(root_token)], [-1], [0], [0.0]
    frontier = [0]
    for _ in range(depth):
        logp = expand(Frontier(list(frontier), tokens, parents, depths))
        if logp.shape[0] != len(frontier):
            raise ValueError(f"expand returned {logp.shape[0]} rows for {len(frontier)} frontier nodes")
        values, candidates = torch.topk(logp.float(), min(topk, logp.shape[-1]), dim=-1)
        values, candidates = values.tolist(), candidates.tolist()  # one read per level, not per row
        level = []
        for row, parent in enumerate(frontier):
            for value, token in zip(values[row], candidates[row]):
                if value == float("-inf"):
                    continue
                level.append(len(tokens))
                tokens.append(int(token))
                parents.append(parent)
                depths.append(depths[parent] + 1)
                # min(., 0): a log-prob above 0 (rounding, or a sloppy expand) would let a child
                # outrank its parent and break the ancestor-closure of the kept set.
                scores.append(scores[parent] + min(value, 0.0))
        if not level:
            break
        # Stable sort on the score: ties go to the earlier node.
        frontier = sorted(sorted(level, key=lambda i: -scores[i])[:topk])
    drafted = sorted(range(1, len(tokens)), key=lambda i: (-scores[i], i))[:budget]
    kept = [0] + sorted(drafted)  # creation order is topological
    new_index = {old: new for new, old in enumerate(kept)}
    tree = DraftTree.from_lists(
        [tokens[i] for i in kept], [-1] + [new_index[parents[i]] for i in kept[1:]], device=device, deterministic=deterministic
    )
    return tree, kept


@dataclass
class LevelFrontier:
    """What a tree grown on the device asks ``expand`` about: the nodes of one level, on the device.

    ``level``: 1 expands the root, L expands nodes of depth L-1, whose parents are nodes of the
    level before. ``nodes`` [F]: their ids, ascending (build_dynamic_tree_on_device's creation ids;
    spec node ids for grow_static_tree_on_device); ``parents`` [F]: their parents' ids (-1 for the
    root); ``tokens`` [F]. In a dynamic tree F is always ``topk`` from level 2 on: where fewer nodes
    are worth expanding, the rest are nodes of score -inf, whose children are never kept.
    ``parent_rows`` [F] or None: each node's parent's row in the level before (its index among that
    level's ``nodes``), where the builder knows it (build_dynamic_tree_on_device, and
    grow_static_tree_on_device from the spec).
    """

    level: int
    nodes: Tensor
    parents: Tensor
    tokens: Tensor
    parent_rows: Optional[Tensor] = None

    def rows_in(self, before: Tensor) -> Tensor:
        """Each node's parent's row among ``before`` [F'] (the level before's node ids):
        ``parent_rows`` where the builder gave them, else found by comparing ids."""
        if self.parent_rows is not None:
            return self.parent_rows
        return (self.parents.unsqueeze(1) == before.unsqueeze(0)).int().argmax(dim=1)


def _expanded(expand: Callable[[LevelFrontier], Tensor], frontier: LevelFrontier) -> Tensor:
    """``expand(frontier)``, checked to give one row per frontier node."""
    rows = expand(frontier)
    if rows.shape[0] != frontier.nodes.shape[0]:
        raise ValueError(f"expand returned {rows.shape[0]} rows for {frontier.nodes.shape[0]} frontier nodes")
    return rows


def build_dynamic_tree_on_device(
    expand: Callable[[LevelFrontier], Tensor], root_token: int | Tensor, depth: int, topk: int, budget: int, device, deterministic: bool = False,
    *, columns: Optional[Tensor] = None,
) -> tuple[DraftTree, Tensor]:
    """``build_dynamic_tree`` without reading anything back: the same tree, grown and pruned on
    the device, so that a step's only host read is its verdict.

    Every level has a fixed shape (``topk`` frontier nodes, ``topk`` children each), so the
    drafter's level forwards replay as CUDA graphs. Where the host version skips a candidate of
    log-prob -inf, this one keeps it with score -inf: never chosen while a finite one is left, and
    its children -inf too. Ties break as there (stable sorts over creation order), scores add in
    float64 as Python floats do, so the kept nodes are the same. Kept nodes of score -inf (fewer
    finite candidates than the budget) become padding after the real nodes (``num_nodes``).

    ``root_token`` may be a one-element device tensor (a captured step reads it from a buffer).
    ``columns`` [C] (ascending token ids): the only columns where ``expand``'s rows can be finite (a
    draft vocabulary of at least ``topk`` tokens; a smaller one is read whole); the top-k then reads
    those alone, a quarter of the row at a Llama-3 target with a 32,000-token draft vocabulary, and
    finds the same candidates but where values tie exactly (bf16 logits tie often): which of the tied
    ones top-k returns is left open, here as over the whole row.
    Returns (tree, ids [N] on the device: the creation id ``expand`` saw for each tree node,
    padding included). The tree's depth is not read: ``known_depth_bound`` is ``depth``.
    """
    long = dict(dtype=torch.long, device=device)
    tokens = [root_token.view(1).long() if isinstance(root_token, Tensor) else torch.full((1,), int(root_token), **long)]
    parents = [torch.full((1,), -1, **long)]
    depths = [torch.zeros(1, **long)]
    scores = [torch.zeros(1, dtype=torch.float64, device=device)]
    frontier = LevelFrontier(1, torch.zeros(1, **long), parents[0], tokens[0])
    frontier_scores, created = scores[0], 1
    for level in range(1, depth + 1):
        logp = _expanded(expand, frontier)
        F = frontier.nodes.shape[0]
        if columns is None or columns.shape[0] < topk:
            values, candidates = torch.topk(logp.float(), min(topk, logp.shape[-1]), dim=-1)
        else:
            values, picked = torch.topk(logp.float().index_select(-1, columns), topk, dim=-1)
            candidates = columns[picked]
        k = values.shape[-1]
        level_scores = (frontier_scores.unsqueeze(1) + values.double().clamp_max(0.0)).flatten()  # -inf stays -inf
        level_parents = frontier.nodes.repeat_interleave(k)
        tokens.append(candidates.flatten())
        parents.append(level_parents)
        depths.append(torch.full((F * k,), level, **long))
        scores.append(level_scores)
        if level < depth:
            # Candidate j of the level (flattened) has id created + j and its parent in row j // k.
            best = torch.sort(level_scores, descending=True, stable=True).indices[:topk].sort().values
            frontier = LevelFrontier(level + 1, best + created, level_parents[best], candidates.flatten()[best], best.div(k, rounding_mode="floor"))
            frontier_scores = level_scores[best]
        created += F * k
    tokens_all, parents_all, depths_all, scores_all = (torch.cat(x) for x in (tokens, parents, depths, scores))
    keep = min(budget, created - 1)
    chosen = torch.sort(scores_all[1:], descending=True, stable=True).indices[:keep] + 1
    real = torch.isfinite(scores_all[chosen])
    # Real nodes first in creation order (topological), padding after them.
    order = torch.sort(chosen + (~real).long() * created).indices
    chosen, real = chosen[order], real[order]
    kept = torch.cat([torch.zeros(1, **long), chosen])
    new_index = torch.full((created,), -1, **long)
    new_index[kept] = torch.arange(keep + 1, **long)
    real = torch.cat([torch.ones(1, dtype=torch.bool, device=device), real])
    old_parents = parents_all[kept]
    tree_parents = torch.where(real & (old_parents >= 0), new_index[old_parents.clamp_min(0)], torch.full_like(old_parents, -1))
    zeros = torch.zeros_like(old_parents)
    tree = DraftTree(
        tokens=torch.where(real, tokens_all[kept], zeros).unsqueeze(0),
        parents=tree_parents.unsqueeze(0),
        depths=torch.where(real, depths_all[kept], zeros).unsqueeze(0),
        num_nodes=real.sum().view(1),
        deterministic=deterministic,
        known_depth_bound=depth,
    )
    return tree, kept


@dataclass
class Candidates:
    """Continuations proposed without a draft model (lookup, suffix matching), as a trie under a root.

    Node 0 is the root (token unused); ``parents[i] < i``. ``probs[i]`` is the estimated probability
    that node i is the target's token given that its parent's path was accepted (the match
    statistics: the share of the parent's occurrences that continue with this token, times the
    lookup's measured reliability). ``tokens``, ``parents`` and ``probs`` are per node.
    """

    tokens: list[int]
    parents: list[int]
    probs: list[float]

    @classmethod
    def empty(cls) -> "Candidates":
        return cls([-1], [-1], [1.0])

    @property
    def size(self) -> int:
        """Candidate nodes, the root excluded."""
        return len(self.tokens) - 1


def _seed_nodes(seeds: Candidates) -> tuple[list[int], list[int], list[int], list[float]]:
    """Lookup candidates as the nodes 1.. of a scored tree's pool (node 0 is the root): their
    tokens, parents, depths and values, a value being the product of its path's ``probs``, never
    above its parent's. A continuation listed twice is one node (the larger value); nodes deeper
    than MAX_TREE_DEPTH are left out."""
    tokens, parents, depths, values = [0], [-1], [0], [1.0]
    pool_id, child_of = {0: 0}, {}
    for i in range(1, len(seeds.tokens)):
        parent = pool_id.get(seeds.parents[i])
        if parent is None or depths[parent] >= MAX_TREE_DEPTH:
            continue
        token, value = int(seeds.tokens[i]), min(values[parent] * float(seeds.probs[i]), values[parent])
        node = child_of.get((parent, token))
        if node is None:
            node = child_of[(parent, token)] = len(tokens)
            tokens.append(token)
            parents.append(parent)
            depths.append(depths[parent] + 1)
            values.append(value)
        else:
            values[node] = max(values[node], value)
        pool_id[i] = node
    return tokens[1:], parents[1:], depths[1:], values[1:]


def build_scored_tree(
    root_token: int,
    shape: AdaptiveTreeSpec,
    expand: Optional[Callable[[Frontier], Tensor]] = None,
    seeds: Optional[Candidates] = None,
    device=None,
    deterministic: bool = False,
) -> tuple[DraftTree, list[int], list[bool], float]:
    """The draft tree of at most ``shape.budget`` nodes with the largest expected accepted length,
    from a draft's probabilities (``expand``) and lookup candidates (``seeds``), for one sequence.

    A node's value is the product of its path's acceptance probabilities (OPT-Tree): the chance it
    is accepted, so a tree's expected accepted length is 1 + the sum of its nodes' values. The
    seeds enter the pool first, with their ``probs``. Then, when ``expand`` is given, level by
    level up to ``shape.depth``: ``expand(frontier) -> probs [F,V]`` (probabilities, not logits)
    gives each frontier node's ``shape.topk`` most likely children; a child that is also a seed
    keeps the larger value. The next frontier is the ``topk`` nodes of the new level, among the
    children (drafted or seeded) of the nodes just expanded, with the largest values (a node is
    only expanded after its parent, as path-conditioned drafts need). With ``shape.cost`` > 0 the
    growth stops after a level that raised the expected accepted length of the best tree by less
    than the cost (dynamic depth).

    Finally the ``budget`` nodes of largest value are kept (ties: shallower, then earlier), and
    with a cost, levels whose kept nodes add less than the cost are cut off. A child's value never
    exceeds its parent's, so the kept nodes always include their ancestors.

    Returns (tree marked ``deterministic`` as asked, ids, seeded, expected) where ``ids[i]`` is the
    pool id ``expand`` saw for tree node i, ``seeded[i]`` says whether node i came from the seeds
    (possibly drafted as well), and ``expected`` is 1 + the kept nodes' values.
    """
    tokens, parents, depths, values, seeded = [int(root_token)], [-1], [0], [1.0], [False]
    if seeds is not None:
        for column in zip(*_seed_nodes(seeds)):
            for pool, value in zip((tokens, parents, depths, values), column):
                pool.append(value)
            seeded.append(True)
    child_of = {(parents[i], tokens[i]): i for i in range(1, len(tokens))}

    def add(parent: int, token: int, value: float) -> None:
        """A drafted child; one the seeds hold already keeps the larger value (and stays seeded)."""
        value = min(value, values[parent])  # rounding must not lift a child above its parent
        node = child_of.get((parent, token))
        if node is None:
            child_of[(parent, token)] = len(tokens)
            tokens.append(token)
            parents.append(parent)
            depths.append(depths[parent] + 1)
            values.append(value)
            seeded.append(False)
        else:
            values[node] = max(values[node], value)

    def best_total() -> float:
        return _added(sorted(values[1:], reverse=True)[: shape.budget])

    if expand is not None:
        frontier, total = [0], best_total()
        for level in range(1, shape.depth + 1):
            probs = expand(Frontier(list(frontier), tokens, parents, depths))
            if probs.shape[0] != len(frontier):
                raise ValueError(f"expand returned {probs.shape[0]} rows for {len(frontier)} frontier nodes")
            top_p, top_tokens = torch.topk(probs.double(), min(shape.topk, probs.shape[-1]), dim=-1)
            for row, parent in enumerate(frontier):
                for p, token in zip(top_p[row].tolist(), top_tokens[row].tolist()):
                    if p > 0:
                        add(parent, int(token), values[parent] * min(p, 1.0))
            expanded = set(frontier)
            level_nodes = [i for i in range(1, len(tokens)) if depths[i] == level and parents[i] in expanded]
            frontier = sorted(sorted(level_nodes, key=lambda i: (-values[i], i))[: shape.topk])
            new_total = best_total()
            if not frontier or (shape.cost > 0 and new_total - total < shape.cost):
                break
            total = new_total

    ranked = sorted(range(1, len(tokens)), key=lambda i: (-values[i], depths[i], i))
    kept = sorted(i for i in ranked[: shape.budget] if values[i] > 0)
    if shape.cost > 0:
        gain: dict[int, float] = {}
        for i in kept:
            gain[depths[i]] = gain.get(depths[i], 0.0) + values[i]
        last = 0
        while gain.get(last + 1, 0.0) >= shape.cost:
            last += 1
        kept = [i for i in kept if depths[i] <= last]
    # Pool ids are topological (a node is added after its parent), so the kept ids in ascending order are too.
    kept = [0] + kept
    new_index = {old: new for new, old in enumerate(kept)}
    tree = DraftTree.from_lists(
        [tokens[i] for i in kept], [-1] + [new_index[parents[i]] for i in kept[1:]], device=device, deterministic=deterministic
    )
    expected = 1.0 + _added(values[i] for i in kept[1:])
    return tree, kept, [seeded[i] for i in kept], expected


def _added(values) -> float:
    """The values added one after another, left to right, as ``build_scored_tree_on_device``'s
    cumsum adds them on the CPU (Python 3.12's ``sum`` compensates its rounding instead)."""
    total = 0.0
    for value in values:
        total += value
    return total


def seed_rows(seeds: Candidates, capacity: int) -> list[list[float]]:
    """``build_scored_tree_on_device``'s seeds: rows [4, capacity] (tokens, parents, depths, values)
    of the pool nodes 1..capacity that ``build_scored_tree`` makes of ``seeds`` (a parent is a
    pool id, 0 the root), the rest padding (depth 0), for one upload. Raises where the seeds make
    more nodes than ``capacity``."""
    columns = _seed_nodes(seeds)
    n = len(columns[0])
    if n > capacity:
        raise ValueError(f"{n} lookup candidates do not fit the {capacity} seed slots of the tree")
    padding = (0, -1, 0, 0.0)
    return [[float(x) for x in column] + [pad] * (capacity - n) for column, pad in zip(columns, padding)]


def build_scored_tree_on_device(
    expand: Callable[[LevelFrontier], Tensor],
    root_token: int | Tensor,
    depth: int,
    topk: int,
    budget: int,
    device,
    deterministic: bool,
    seeds: Tensor,
    *,
    depth_bound: int,
    cost: float = 0.0,
) -> tuple[DraftTree, Tensor, Tensor, Tensor]:
    """``build_scored_tree`` without reading anything back: the same tree, from the same draft
    probabilities and seeds, grown and pruned on the device, so that a hybrid's step (a head's
    tree merged with lookup's) replays as one CUDA graph and reads nothing until its verdict.

    ``seeds`` [4, S] float64 on the device: ``seed_rows``. The pool holds the root (id 0), the S
    seed slots (ids 1..S, padding that never exists included), then each level's children, ``k``
    (``topk``, at most the vocabulary) for each of its frontier's rows, in the order the host
    creates them; a child the seeds hold already raises that seed's value instead. Every level
    expands ``topk`` rows from level 2 on (``expand`` gets a ``LevelFrontier``), rows past the
    nodes worth expanding have negative ids and no children. Growth that the host stops (an empty
    frontier, or with ``cost`` a level that gained less) goes on here with nothing added. Ties break
    as there (stable sorts over pool ids); values multiply in float64 and add one after another, as
    the host adds them. On the CPU that is the host's arithmetic to the bit; CUDA's scans and
    atomic adds may round a sum differently, which can move a cost's decision that falls on the
    boundary to the last bit, and ``expected`` by as much.

    ``depth_bound``: the deepest a seed can reach (the tree's ``known_depth_bound``: seeds may be
    deeper than ``depth``). Returns (tree of ``budget`` + 1 rows, padding after ``num_nodes``; ids
    [budget+1]: each row's pool id; seeded [budget+1] bool; expected: a 0-dim float64 tensor, 1 +
    the kept nodes' values).
    """
    long = dict(dtype=torch.long, device=device)
    S = seeds.shape[1]
    seed_tokens, seed_parents, seed_depths = seeds[0].long(), seeds[1].long(), seeds[2].long()
    seed_values = seeds[3].to(torch.float64)
    seed_exists = seed_depths > 0
    seed_ids = torch.arange(1, S + 1, **long)
    root = root_token.view(1).long() if isinstance(root_token, Tensor) else torch.full((1,), int(root_token), **long)
    # The drafted children, a level at a time (values and existence settle as they are made).
    tokens, parents, depths, values, exists = [], [], [], [], []

    def best_total() -> Tensor:  # the budget's largest values, summed largest first as the host sums them
        pool = torch.cat([torch.where(seed_exists, seed_values, 0.0), *(torch.where(e, v, 0.0) for v, e in zip(values, exists))])
        return torch.sort(pool, descending=True).values.cumsum(0)[min(budget, pool.shape[0]) - 1]

    frontier = LevelFrontier(1, torch.zeros(1, **long), torch.full((1,), -1, **long), root)
    frontier_values = torch.ones(1, dtype=torch.float64, device=device)
    frontier_real = torch.ones(1, dtype=torch.bool, device=device)
    alive, total, created = torch.ones((), dtype=torch.bool, device=device), best_total(), 1 + S
    for level in range(1, depth + 1):
        probs = _expanded(expand, frontier)
        F = frontier.nodes.shape[0]
        top_p, top_tokens = torch.topk(probs.double(), min(topk, probs.shape[-1]), dim=-1)
        k = top_p.shape[-1]
        parent_values = frontier_values.unsqueeze(1)
        child_values = torch.minimum(parent_values * top_p.clamp_max(1.0), parent_values).flatten()
        child_parents, child_tokens = frontier.nodes.repeat_interleave(k), top_tokens.flatten()
        made = alive & frontier_real.repeat_interleave(k) & (top_p.flatten() > 0)
        # A child the lookup proposed too is that seed, with the larger value.
        same = made.unsqueeze(1) & seed_exists & (seed_parents == child_parents.unsqueeze(1)) & (seed_tokens == child_tokens.unsqueeze(1))
        seed_values = torch.maximum(seed_values, torch.where(same, child_values.unsqueeze(1), 0.0).amax(dim=0))
        made = made & ~same.any(dim=1)
        ids = torch.arange(created, created + F * k, **long)
        created += F * k
        tokens.append(child_tokens)
        parents.append(child_parents)
        depths.append(torch.full((F * k,), level, **long))
        values.append(child_values)
        exists.append(made)
        if level < depth:
            # The next frontier: the level's nodes (seeded or drafted) under a node just expanded,
            # the topk of largest value, in pool order; rows past them are padding.
            expanded = torch.where(frontier_real, frontier.nodes, -2)
            under = seed_exists & (seed_depths == level) & (seed_parents.unsqueeze(1) == expanded).any(dim=1)
            score = torch.cat([torch.where(under, seed_values, -1.0), torch.where(made, child_values, -1.0)])
            best = torch.sort(score, descending=True, stable=True).indices[:topk]
            real = score[best] >= 0
            best = best[torch.sort(best + (~real).long() * created).indices]
            real = score[best] >= 0
            pool_ids, pool_parents, pool_tokens = (torch.cat(x) for x in ((seed_ids, ids), (seed_parents, child_parents), (seed_tokens, child_tokens)))
            padding = -2 - torch.arange(best.shape[0], **long)  # ids nobody's parent holds
            frontier = LevelFrontier(level + 1, torch.where(real, pool_ids[best], padding), pool_parents[best], pool_tokens[best])
            frontier_values, frontier_real = score[best].clamp_min(0.0), real
        else:
            real = frontier_real
        new_total = best_total()
        stop = ~real.any() if level < depth else torch.zeros((), dtype=torch.bool, device=device)
        if cost > 0:
            stop = stop | (new_total - total < cost)
        total = torch.where(alive & ~stop, new_total, total)
        alive = alive & ~stop

    # The pool in id order: the root, the seed slots, each level's children.
    all_tokens = torch.cat([root, seed_tokens, *tokens])
    all_parents = torch.cat([torch.full((1,), -1, **long), seed_parents, *parents])
    all_depths = torch.cat([torch.zeros(1, **long), seed_depths, *depths])
    all_values = torch.cat([torch.ones(1, dtype=torch.float64, device=device), seed_values, *values])
    all_exists = torch.cat([torch.zeros(1, dtype=torch.bool, device=device), seed_exists, *exists])  # the root is no candidate
    all_seeded = torch.cat([torch.zeros(1, dtype=torch.bool, device=device), seed_exists, torch.zeros(created - 1 - S, dtype=torch.bool, device=device)])
    # The nodes below the root ranked by value, then shallower, then earlier: stable sorts, the last key first.
    score = torch.where(all_exists, all_values, -1.0)[1:]
    by_depth = torch.sort(torch.where(all_exists, all_depths, MAX_TREE_DEPTH + 1)[1:], stable=True).indices
    ranked = by_depth[torch.sort(score[by_depth], descending=True, stable=True).indices][:budget]
    keep = score[ranked] > 0
    ranked = ranked + 1

    def in_id_order(chosen: Tensor, keep: Tensor) -> tuple[Tensor, Tensor]:  # the kept ones first, ascending
        order = torch.sort(chosen + (~keep).long() * created).indices
        return chosen[order], keep[order]

    chosen, keep = in_id_order(ranked, keep)
    if cost > 0:
        # Levels whose kept nodes add less than the cost are cut, from the first such level on.
        gain = torch.zeros(MAX_TREE_DEPTH + 2, dtype=torch.float64, device=device)
        gain.index_add_(0, all_depths[chosen], torch.where(keep, all_values[chosen], 0.0))
        last = (gain[1:] >= cost).long().cumprod(0).sum()
        chosen, keep = in_id_order(chosen, keep & (all_depths[chosen] <= last))
    kept = torch.cat([torch.zeros(1, **long), chosen])
    real = torch.cat([torch.ones(1, dtype=torch.bool, device=device), keep])
    new_index = torch.full((created,), -1, **long)
    new_index[kept] = torch.arange(kept.shape[0], **long)
    old_parents = all_parents[kept]
    zeros = torch.zeros_like(old_parents)
    tree = DraftTree(
        tokens=torch.where(real, all_tokens[kept], zeros).unsqueeze(0),
        parents=torch.where(real & (old_parents >= 0), new_index[old_parents.clamp_min(0)], torch.full_like(old_parents, -1)).unsqueeze(0),
        depths=torch.where(real, all_depths[kept], zeros).unsqueeze(0),
        num_nodes=real.sum().view(1),
        deterministic=deterministic,
        known_depth_bound=max(depth, depth_bound),
    )
    expected = 1.0 + torch.where(real[1:], all_values[chosen], 0.0).cumsum(0)[-1]
    return tree, kept, real & all_seeded[kept], expected
