"""Drafters: whatever proposes a draft tree each step. One protocol, one adapter per draft kind.

The decoding loop (``generate.speculative_generate``) talks to a drafter in this order, batch size 1:

    drafter.reset(prompt)
    repeat:
        tree = drafter.propose(state)     # state: DraftState, see below
        ... the target verifies the tree in one forward ...
        drafter.accept(result)            # VerifyResult: roll caches back to the accepted path

``DraftState`` hands over everything decided so far plus the target's features of the positions
that entered the target's KV cache since the previous ``propose`` (the prompt minus its last token
on the first step, then the accepted path root..best_node). That is what sequential heads (Hydra,
EAGLE: features along the accepted path) and Medusa (the last of them) read; standalone LMs and
early-exit self-drafting only need the tokens. A drafter names the decoder layers it wants with
``required_layers()``; the loop captures them during its target forwards.

Sampling contract (see ``verify``): in "sample" mode the children of a node of a static tree are
distinct tokens drawn without replacement, in index order, from the node's processed draft
distribution, which goes into ``DraftTree.draft_probs``; drafters here draw them with Gumbel top-k,
on the host a node at a time (``grow_static_tree``: a node gets no more children than its
distribution has tokens), or on the static cache all at once on the device
(``draftsmith.sampling.DeviceDraws``: the tree keeps its shape, children past the support holding
tokens of q = 0, which verification never accepts). A dynamic tree's children are chosen by rank (EAGLE-2), so it is marked ``deterministic`` and
verified as fixed candidates. In "typical" mode (NOT lossless) every tree drafts by rank.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol, Sequence, Union, runtime_checkable

import torch
from torch import Tensor, nn
from transformers import DynamicCache

from draftsmith.graphs import can_capture
from draftsmith.runtime.errors import DrafterError
from draftsmith.runtime.static import check_cache, drafting_capacity, wants_static
from draftsmith.runtime.tree import (
    AdaptiveTreeSpec,
    DraftTree,
    DynamicTreeSpec,
    Frontier,
    LevelFrontier,
    TreeSpec,
    build_dynamic_tree,
    build_dynamic_tree_on_device,
    build_scored_tree,
)
from draftsmith.runtime.verify import SamplingParams, VerifyResult, logits_to_probs
from draftsmith.sampling import DeviceDraws, draws_inputs, draws_key, gumbel, with_uniforms
from draftsmith.target import check_attention

__all__ = [
    "DrafterError",
    "DraftState",
    "Drafter",
    "DeviceDraws",
    "HeadDrafter",
    "StandaloneDrafter",
    "grow_dynamic_tree_on_device",
    "grow_static_tree",
    "grow_static_tree_on_device",
    "spec_on_device",
    "grow_tree",
    "sample_without_replacement",
    "compact_cache",
]


@dataclass
class DraftState:
    """What a drafter sees before proposing (B = 1).

    tokens [1,T]: every decided token, prompt included; ``tokens[0, -1]`` is the root of the tree
        to propose and is not yet in the target's KV cache, which holds ``prefix_len = T - 1`` tokens.
    new_hidden [1,M,D] or None: the target's final (post-norm) hidden states at the M positions that
        entered its KV cache since the previous propose; ``new_hidden[:, -1]`` is the position whose
        logits predicted the root. None when M = 0 (a one-token prompt).
    new_layers {i: [1,M,D]}: the same positions' outputs of decoder layer i (pre-norm, the
        TargetFeatures convention) for each layer in the drafter's ``required_layers()``.
    sampling, generator: how the loop chooses tokens; a sampling drafter draws its children with
        this generator (on the model's device).
    last_token: ``tokens[0, -1]`` as a Python int when the caller has it (the loop does), so that
        reading the root costs no device sync; None to read it from ``tokens``.
    host_tokens: ``tokens[0]`` as Python ints when the caller has them (the loop does: the prompt
        read once, then what each step emitted), so that a lookup reads no new tokens back; None
        to read them from ``tokens``. Read it during ``propose`` only (the caller goes on appending).
    """

    tokens: Tensor
    new_hidden: Optional[Tensor] = None
    new_layers: dict[int, Tensor] = field(default_factory=dict)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    generator: Optional[torch.Generator] = None
    last_token: Optional[int] = None
    host_tokens: Optional[Sequence[int]] = None

    @property
    def root(self) -> int:
        return int(self.tokens[0, -1]) if self.last_token is None else self.last_token

    @property
    def decided(self) -> Union[Sequence[int], Tensor]:
        """The decided tokens: ``host_tokens`` where the caller has them, else ``tokens[0]`` (on
        the device: read only what is needed of it)."""
        return self.tokens[0] if self.host_tokens is None else self.host_tokens

    @property
    def prefix_len(self) -> int:
        return self.tokens.shape[1] - 1


@runtime_checkable
class Drafter(Protocol):
    """Proposes one draft tree per step (B = 1); see the module docstring for the call order."""

    def required_layers(self) -> Sequence[int]:
        """Target decoder layers whose outputs the drafter reads from DraftState.new_layers."""
        ...

    def reset(self, prompt: Tensor) -> None:
        """Forget everything; a new generation starts from prompt [1,T]."""
        ...

    def propose(self, state: DraftState) -> DraftTree:
        """A tree rooted at ``state.root`` (tokens[0,0] must be the root); draft_probs set in sample mode."""
        ...

    def accept(self, result: VerifyResult) -> None:
        """The verdict on the last proposed tree: keep what lies on ``result.path``, drop the rest."""
        ...


def sample_without_replacement(probs: Tensor, count: int, generator: Optional[torch.Generator] = None) -> Tensor:
    """Up to ``count`` distinct tokens [m] drawn one after another without replacement from probs [V]
    (Gumbel top-k: the order of the perturbed top-k is the draw order). m = min(count, support)."""
    m = min(count, int((probs > 0).sum()))
    u = torch.rand(probs.shape, generator=generator, device=probs.device, dtype=torch.float64)
    return torch.topk(probs.double().log() + gumbel(u), m).indices


def grow_static_tree(
    spec: TreeSpec,
    root_token: int,
    level_logits: Callable[[Frontier], Tensor],
    sampling: SamplingParams,
    generator: Optional[torch.Generator] = None,
    device: Optional[torch.device] = None,
) -> tuple[DraftTree, list[int]]:
    """Draft the shape ``spec`` level by level (B = 1); the tree's tensors land on ``device``.

    ``level_logits(frontier) -> logits [F,V]``: the draft's logits after each frontier node (ids
    are tree node indices of the tree being grown, root = 0). Greedy (and typical): the child of
    rank r is the r-th most likely token. Sample: a node's children are drawn without replacement from
    ``logits_to_probs`` of its logits, in rank order; when the processed distribution has fewer
    tokens than the node has children, the extra children (and their subtrees) are left out.

    Returns (tree with draft_probs in sample mode unless it is root-only, spec_ids) where spec_ids[i] is the spec node of
    tree node i; tree nodes keep the spec's order.
    """
    tokens, parents, depths, spec_ids = [int(root_token)], [-1], [0], [0]
    probs_rows: dict[int, Tensor] = {}
    level = [0]
    for _ in range(spec.max_depth):
        frontier = [n for n in level if spec.children(spec_ids[n])]
        if not frontier:
            break
        logits = level_logits(Frontier(frontier, tokens, parents, depths))
        next_level = []
        if not sampling.sampled:
            # One top-k over the whole level and one read: each row's ranks are a prefix of it.
            widest = max(spec.ranks[k] for node in frontier for k in spec.children(spec_ids[node])) + 1
            level_top = torch.topk(logits, min(widest, logits.shape[-1]), dim=-1).indices.tolist()
        else:
            level_q = logits_to_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p)
        for row, node in enumerate(frontier):
            kids = spec.children(spec_ids[node])
            if not sampling.sampled:
                ranks = [spec.ranks[k] for k in kids]
                top = level_top[row]
                chosen = [(k, top[r]) for k, r in zip(kids, ranks) if r < len(top)]
            else:
                q = probs_rows[node] = level_q[row]
                draws = sample_without_replacement(q, len(kids), generator).tolist()
                chosen = list(zip(kids, draws))
            for spec_node, token in chosen:
                next_level.append(len(tokens))
                tokens.append(int(token))
                parents.append(node)
                depths.append(depths[node] + 1)
                spec_ids.append(spec_node)
        level = next_level
    draft_probs = None
    if probs_rows:
        first = next(iter(probs_rows.values()))
        draft_probs = first.new_zeros(len(tokens), first.shape[-1])
        for node, q in probs_rows.items():
            draft_probs[node] = q
    return DraftTree.from_lists(tokens, parents, draft_probs=draft_probs, device=device), spec_ids


# Per (spec, device), made once (a static tree's shape never changes between steps): the tree's
# parents [1,N], depths [1,N] and size [1] on the device, and what each device drafting adds to them.
_SHAPES: dict = {}
_STATIC_SHAPES: dict = {}


def spec_on_device(spec: TreeSpec, device) -> tuple[Tensor, Tensor, Tensor]:
    """(parents [1,N], depths [1,N], num_nodes [1]) of ``spec`` as long tensors on ``device``, made
    once per spec and device: a tree of that shape is ``DraftTree(tokens, *spec_on_device(...))``."""
    key = (spec, device)
    if key not in _SHAPES:
        long = dict(dtype=torch.long, device=device)
        _SHAPES[key] = (torch.tensor([spec.parents], **long), torch.tensor([spec.depths], **long), torch.tensor([spec.num_nodes], **long))
    return _SHAPES[key]


@dataclass(frozen=True)
class _Level:
    """One level of a static tree grown on the device, as index tensors: the frontier (its spec
    nodes with children, their parents, and each parent's row in the level before), and per child
    drafted there its frontier row, its rank (greedy: the rank-th most likely token) and its order
    among its siblings (sampled: the order-th draw); the widest rank and the most siblings."""

    nodes: Tensor
    parents: Tensor
    parent_rows: Tensor  # [F]: each node's parent's index among the level before's nodes (0 at level 1)
    draw_rows: Tensor  # each frontier node's row of DeviceDraws.uniforms
    kids: Tensor
    rows: Tensor
    ranks: Tensor
    orders: Tensor
    widest: int
    most: int


# Per (spec, device), made once (a static tree's shape never changes between steps).
_LEVELS: dict = {}


def _levels(spec: TreeSpec, device) -> list[_Level]:
    key = (spec, device)
    if key not in _LEVELS:
        long = dict(dtype=torch.long, device=device)
        drafting = [n for n in range(spec.num_nodes) if spec.children(n)]
        levels, before = [], [-1]
        for depth in range(spec.max_depth):
            frontier = [n for n in drafting if spec.depths[n] == depth]
            kids = [(row, order, k) for row, n in enumerate(frontier) for order, k in enumerate(spec.children(n))]
            parents = [spec.parents[n] for n in frontier]  # each drafts, so it is in the level before
            levels.append(_Level(
                *(torch.tensor(x, **long) for x in (
                    frontier, parents, [before.index(p) for p in parents], [drafting.index(n) for n in frontier], [k for *_, k in kids],
                    [row for row, *_ in kids], [spec.ranks[k] for *_, k in kids], [order for _, order, _ in kids],
                )),
                widest=max(spec.ranks[k] for *_, k in kids) + 1, most=max(order for _, order, _ in kids) + 1,
            ))  # fmt: skip
            before = frontier
        _LEVELS[key] = levels
    return _LEVELS[key]


def _fits(spec: TreeSpec, vocab: int, sampled: bool) -> bool:
    """Whether every child of ``spec`` is drafted on the device: greedy, each rank below the
    vocabulary (grow_static_tree leaves the others out); sampled, each node's children at most the
    vocabulary (the children past q's support stay in place)."""
    if not sampled:
        return max(spec.ranks) < vocab
    return max(spec.child_counts) <= vocab


def _levels_fit(spec: TreeSpec, rows: int, vocab: int, sampled: bool) -> bool:
    """Whether ``static_tree_on_device`` drafts ``spec`` from level logits [rows, vocab]."""
    return spec.num_nodes >= 2 and rows >= spec.max_depth and _fits(spec, vocab, sampled)


def _on_device_tree(spec: TreeSpec, tokens: Tensor, draft_probs: Optional[Tensor]) -> DraftTree:
    return DraftTree(
        tokens.unsqueeze(0), *spec_on_device(spec, tokens.device), draft_probs=None if draft_probs is None else draft_probs.unsqueeze(0),
        known_max_depth=spec.max_depth,
    )  # fmt: skip


def static_tree_on_device(spec: TreeSpec, root: Union[int, Tensor], levels: Tensor, draws: Optional[DeviceDraws] = None) -> Optional[DraftTree]:
    """Drafting of the static tree ``spec`` when every node at depth d takes its children from
    ``levels[d]`` ([depth,V] logits) whatever its path, on the device, no host read
    (grow_static_tree reads every level back). Greedy (``draws`` None): one top-k and one gather,
    the tree grow_static_tree makes, node for node (spec order). Sampled: each node's children
    drawn from the processed ``levels[d]`` (``DeviceDraws``), the tree grow_static_tree draws from
    the same uniforms, and draft_probs. None where it does not apply (fewer levels than the tree is
    deep, or more children than tokens). ``root``: the root token, or a [1] tensor of it."""
    depth = spec.max_depth
    if not _levels_fit(spec, levels.shape[0], levels.shape[-1], draws is not None):
        return None
    device = levels.device
    root_token = root if isinstance(root, Tensor) else torch.full((1,), root, dtype=torch.long, device=device)
    if draws is None:
        key = (spec, device)
        if key not in _STATIC_SHAPES:
            long = dict(dtype=torch.long, device=device)
            _STATIC_SHAPES[key] = (torch.tensor([d - 1 for d in spec.depths[1:]], **long), torch.tensor(spec.ranks[1:], **long))
        level, rank = _STATIC_SHAPES[key]
        top = torch.topk(levels[:depth], max(spec.ranks) + 1, dim=-1).indices  # [depth, widest]
        return _on_device_tree(spec, torch.cat([root_token, top[level, rank]]), None)
    # Every node's draws at once: a node at depth d draws from q of levels[d], whatever its path.
    drafting, depths, kid_rows, kid_orders, most = _sampled_shape(spec, device)
    q = draws.probs(levels[:depth])[depths]  # [F,V]
    top = draws.children(q, most)
    tokens = torch.cat([root_token, top[kid_rows, kid_orders]])
    return _on_device_tree(spec, tokens, q.new_zeros(spec.num_nodes, q.shape[-1]).index_copy(0, drafting, q))


def _sampled_shape(spec: TreeSpec, device) -> tuple[Tensor, Tensor, Tensor, Tensor, int]:
    """For drawing every node of ``spec`` at once: (the nodes that get children [F] in spec order,
    their depths [F], and for nodes 1..N-1 their parent's row among those [N-1] and their order
    among their siblings [N-1]; the most siblings), made once per spec and device."""
    key = (spec, device, "sampled")
    if key not in _STATIC_SHAPES:
        # The levels' plan, joined: level by level, their children are nodes 1..N-1 in spec order.
        levels = _levels(spec, device)
        _STATIC_SHAPES[key] = (
            torch.cat([level.nodes for level in levels]), torch.cat([torch.full_like(level.nodes, d) for d, level in enumerate(levels)]),
            torch.cat([level.draw_rows[level.rows] for level in levels]), torch.cat([level.orders for level in levels]),
            max(level.most for level in levels),
        )  # fmt: skip
    return _STATIC_SHAPES[key]


def grow_static_tree_on_device(
    spec: TreeSpec, root: Union[int, Tensor], level_logits: Callable[[LevelFrontier], Tensor], device, draws: Optional[DeviceDraws] = None
) -> Optional[DraftTree]:
    """Drafting of the static tree ``spec`` by a drafter whose nodes condition on their path and
    that expands a level held on the device (``HeadSession.expand_level``), with no host read:
    greedy (``draws`` None), the tree ``grow_static_tree`` makes, node for node (spec order);
    sampled, the tree it draws from the same uniforms (``DeviceDraws``), with draft_probs. Each
    level's frontier is the spec's nodes of that depth that have children. None, before anything is
    forwarded, where a child would not be drafted (``_fits``)."""
    if isinstance(root, Tensor):  # a device tensor (the whole tree as one graph): no host read
        tokens = root.to(torch.long).reshape(1).expand(spec.num_nodes).clone()
    else:
        tokens = torch.full((spec.num_nodes,), int(root), dtype=torch.long, device=device)
    draft_probs = None
    for number, level in enumerate(_levels(spec, device), start=1):
        logits = level_logits(LevelFrontier(number, level.nodes, level.parents, tokens[level.nodes], level.parent_rows))
        if number == 1 and not _fits(spec, logits.shape[-1], draws is not None):
            return None
        if draws is None:
            top = torch.topk(logits, level.widest, dim=-1).indices  # one top-k a level, as grow_static_tree
            tokens = tokens.index_copy(0, level.kids, top[level.rows, level.ranks])
            continue
        q = draws.probs(logits)
        top = draws.children(q, level.most, level.draw_rows)
        tokens = tokens.index_copy(0, level.kids, top[level.rows, level.orders])
        if draft_probs is None:
            draft_probs = q.new_zeros(spec.num_nodes, q.shape[-1])
        draft_probs = draft_probs.index_copy(0, level.nodes, q)
    return _on_device_tree(spec, tokens, draft_probs)


def grow_tree(
    spec: Union[TreeSpec, DynamicTreeSpec, AdaptiveTreeSpec], state: "DraftState", node_logits: Callable[[Frontier], Tensor], device
) -> tuple[DraftTree, list[int]]:
    """Draft ``spec`` from the root of ``state`` for a drafter whose nodes condition on their path.

    ``node_logits(frontier) -> [F,V]``: the draft's logits after each frontier node. A TreeSpec
    grows level by level (greedy or sampled, ``grow_static_tree``); a DynamicTreeSpec grows EAGLE-2
    style (``build_dynamic_tree``). When sampling, the dynamic tree ranks candidates by the draft's
    processed distribution (``logits_to_probs`` with the sampling settings: tokens it filters out
    are never proposed) and is marked ``deterministic``, so verification tests its fixed candidates
    with EAGLE's rule and stays lossless. An AdaptiveTreeSpec grows OPT-Tree style
    (``build_scored_tree``: the nodes of largest path-probability product under the budget, depth
    dynamic with a cost), by rank as well. Returns (tree, ids): ids[i] is the frontier id
    ``node_logits`` saw for tree node i.
    """
    if isinstance(spec, AdaptiveTreeSpec):
        sampling = state.sampling

        def probs_of(frontier: Frontier) -> Tensor:
            logits = node_logits(frontier)
            if not sampling.sampled:
                return torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
            return logits_to_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p)

        tree, ids, _, _ = build_scored_tree(state.root, spec, probs_of, device=device, deterministic=sampling.sampled)
        return tree, ids
    if isinstance(spec, DynamicTreeSpec):
        sampling = state.sampling
        logp = _ranking(sampling)
        return build_dynamic_tree(lambda f: logp(node_logits(f)), state.root, spec.depth, spec.topk, spec.budget, device, deterministic=sampling.sampled)
    tree, _ = grow_static_tree(spec, state.root, node_logits, state.sampling, state.generator, device)
    return tree, list(range(tree.size))  # grow_static_tree's frontier ids are tree indices


def _ranking(sampling: SamplingParams) -> Callable[[Tensor], Tensor]:
    """What an EAGLE-2 tree ranks candidates by: the draft's log-probs (greedy), or the log of its
    processed distribution when sampling (tokens the settings filter out get -inf, never proposed)."""

    def logp(logits: Tensor) -> Tensor:
        if not sampling.sampled:
            return torch.log_softmax(logits.float(), dim=-1)
        return logits_to_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p).log()

    return logp


def grow_dynamic_tree_on_device(spec: DynamicTreeSpec, state: "DraftState", level_logits: Callable[[LevelFrontier], Tensor], device) -> DraftTree:
    """``grow_tree`` of a DynamicTreeSpec for a drafter that expands a level held on the device
    (``HeadSession.expand_level``): the same tree (``build_dynamic_tree_on_device``), no host read."""
    sampling = state.sampling
    logp = _ranking(sampling)
    tree, _ = build_dynamic_tree_on_device(
        lambda f: logp(level_logits(f)), state.root, spec.depth, spec.topk, spec.budget, device, deterministic=sampling.sampled
    )
    return tree


def compact_cache(cache, prefix_len: int, keep: Sequence[int] | Tensor) -> None:
    """Keep the first ``prefix_len`` positions of an HF DynamicCache plus positions
    ``prefix_len + keep[j]`` (keep ascending), packed right after the prefix; drop the rest.

    Works on the cache's layer objects (``cache.layers[i].keys / .values``, [B,H,S,Dh]) in place:
    the prefix is never copied or recomputed. Sliding-window layers are refused: their tensors do
    not hold one entry per position.
    """
    keep = torch.as_tensor(keep, dtype=torch.long)
    m = int(keep.numel())
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False):
            raise DrafterError(f"cannot roll back a sliding-window cache layer ({type(layer).__name__}); use full attention")
        keys = getattr(layer, "keys", None)
        if keys is None or keys.numel() == 0:
            continue
        index = (keep + prefix_len).to(keys.device)
        # keep[j] >= j, so writing slot prefix+j from slot prefix+keep[j] never reads a slot already
        # overwritten; the gather copies first anyway.
        keys[..., prefix_len : prefix_len + m, :] = keys.index_select(-2, index)
        layer.values[..., prefix_len : prefix_len + m, :] = layer.values.index_select(-2, index)
        layer.keys = keys[..., : prefix_len + m, :]
        layer.values = layer.values[..., : prefix_len + m, :]


def _root_only(root: int, device=None) -> DraftTree:
    """A tree without drafted nodes: the target just takes one plain step."""
    return DraftTree.from_lists([root], [-1], device=device)


def check_tree_depth(tree: Union[TreeSpec, DynamicTreeSpec, AdaptiveTreeSpec], head) -> None:
    """DrafterError, one line, where ``tree`` is deeper than ``head`` drafts."""
    depth = tree.max_depth if isinstance(tree, TreeSpec) else tree.depth  # dynamic and adaptive trees both have .depth
    if depth > head.depth:
        raise DrafterError(f"the tree is {depth} deep but the {head.cfg.kind} head drafts {head.depth} tokens: give --tree a depth of at most {head.depth}")


class HeadDrafter:
    """Any draft head of draftsmith.heads as a drafter, through the head's own drafting session
    (DraftHead.start_drafting, heads/base.py).

    Each step the session first reads the positions that entered the target's KV cache since the
    last step, with the target's features (on the first step: the prompt minus its last token);
    then the tree grows: a TreeSpec level by level (greedy or sampled), a DynamicTreeSpec EAGLE-2
    style (greedy or sampled, verified as fixed candidates). After verification the session
    forgets the tree; the accepted path comes back with the target's real features on the next
    step.
    """

    def __init__(self, head: nn.Module, target, tree: Union[TreeSpec, DynamicTreeSpec, AdaptiveTreeSpec], cache: str = "auto") -> None:
        check_tree_depth(tree, head)
        self.head = head.eval()
        self.target = target
        self.tree = tree
        # "static": the head's own caches preallocated, its tree levels replayed as CUDA graphs on a
        # GPU, where the head can (HeadSession.preallocate: EAGLE, EAGLE-3); "auto" on CUDA.
        self.cache_kind = check_cache(cache)
        self.session = None
        self.reset(None)

    def required_layers(self) -> Sequence[int]:
        return list(self.head.required_layers())

    def reset(self, prompt: Optional[Tensor]) -> None:
        device = next(self.head.parameters()).device
        preallocated, capacity = wants_static(self.cache_kind, device), drafting_capacity(prompt)
        self.static_cache = preallocated
        # A session with preallocated buffers starts over in them: its graphs are captured once.
        if preallocated and self.session is not None and self.session.restart(capacity):
            return
        self.session = self.head.start_drafting(self.target.embed, self.target.lm_head)
        if preallocated:
            self.session.preallocate(capacity, graphs=can_capture(device))

    @property
    def forwards(self) -> Optional[int]:
        """Passes through the head's layer stack since reset (None for heads without one)."""
        return self.session.forwards

    @torch.no_grad()
    def read(self, state: DraftState) -> bool:
        """Let the session read the positions that entered the target's cache since the last step.
        False when nothing has predicted the root yet (a one-token prompt): no drafting this step."""
        if state.new_hidden is None or state.new_hidden.shape[1] == 0:
            return False
        M = state.new_hidden.shape[1]
        start = state.prefix_len - M
        if start != self.session.decided:
            raise DrafterError(
                f"the {self.head.cfg.kind} drafter holds {self.session.decided} positions but the state continues at {start}; "
                "call reset(prompt) first"
            )
        # x_{j+1} for each new position j; the last one is the root.
        self.session.extend(state.new_hidden, state.new_layers, state.tokens[:, start + 1 :])
        return True

    @torch.no_grad()
    def propose(self, state: DraftState) -> DraftTree:
        device = state.tokens.device
        if not self.read(state):
            # Nothing has predicted the root yet (one-token prompt): let the target take one plain step.
            return _root_only(state.root, device)
        sampling = state.sampling
        # A static tree grows on the device, greedy, or sampled on the static cache (elsewhere a
        # sampled one grows on the host: the reference path).
        static = isinstance(self.tree, TreeSpec) and (not sampling.sampled or self.static_cache)
        # A head whose every node takes its children from its depth's logits (Medusa, DFlash) drafts a
        # static tree from them on the device, where it can in the graph of the step's read.
        by_level = self.session.drafts_by_level
        levels = self.session.level_logits() if static and not by_level else None
        by_level = static and (by_level or levels is not None)
        draws = None
        if static and sampling.sampled and (by_level or self.session.levels_on_device):
            static = _fits(self.tree, self.head.dims.vocab_size, True)
            draws = DeviceDraws.draw(self.tree, sampling, self.head.dims.vocab_size, state.generator, device) if static else None
        tree = None
        if by_level and static:
            tree = self._tree_after_levels(draws)
            if tree is None:
                tree = static_tree_on_device(self.tree, state.root, self.session.level_logits() if levels is None else levels, draws)
        if tree is None and self.session.levels_on_device:
            # A path-conditioned head on preallocated caches (EAGLE, EAGLE-3): the tree grows on the device.
            if isinstance(self.tree, DynamicTreeSpec):
                # The session grows the whole tree itself where it can (EAGLE: one CUDA graph a step).
                key = (sampling.sampled, sampling.temperature, sampling.top_k, sampling.top_p)
                columns = self.session.vocabulary_columns  # a draft vocabulary: the top-k reads its columns alone
                build = build_dynamic_tree_on_device if columns is None else functools.partial(build_dynamic_tree_on_device, columns=columns)
                parts = self.session.dynamic_tree(self.tree, state.root, _ranking(sampling), key, sampling.sampled, build)
                if parts is not None:
                    tokens, parents, depths, num_nodes = parts
                    tree = DraftTree(tokens=tokens, parents=parents, depths=depths, num_nodes=num_nodes,
                                     deterministic=sampling.sampled, known_depth_bound=self.tree.depth)  # fmt: skip
                else:
                    tree = grow_dynamic_tree_on_device(self.tree, state, self.session.expand_level, device)
            elif static:
                # The session grows the whole tree itself where it can (EAGLE, Hydra, Clover: one CUDA graph a step).
                parts = self.session.static_tree(self.tree, state.root, grow_static_tree_on_device, draws)
                if parts is not None:
                    tokens, parents, depths, num_nodes, *probs = parts
                    tree = DraftTree(tokens=tokens, parents=parents, depths=depths, num_nodes=num_nodes, draft_probs=probs[0] if probs else None,
                                     known_max_depth=self.tree.max_depth)  # fmt: skip
                else:
                    tree = grow_static_tree_on_device(self.tree, state.root, self.session.expand_level, device, draws)
        if tree is None:
            tree, _ = grow_tree(self.tree, state, self.session.expand, device)
        return tree

    def _tree_after_levels(self, draws: Optional[DeviceDraws]) -> Optional[DraftTree]:
        """The static tree drafted from the level logits in the function of the step's read (on
        CUDA one graph: ``HeadSession.after_levels``); None where the session has no read waiting
        or the tree does not fit the levels (``static_tree_on_device`` would say None)."""
        spec = self.tree
        if not _levels_fit(spec, self.head.depth, self.head.dims.vocab_size, draws is not None):
            return None

        def tree_from(levels: Tensor, root_token: Tensor, *uniforms: Tensor) -> tuple[Tensor, ...]:
            tree = static_tree_on_device(spec, root_token, levels, with_uniforms(draws, uniforms))
            return (tree.tokens[0],) if tree.draft_probs is None else (tree.tokens[0], tree.draft_probs[0])

        parts = self.session.after_levels(tree_from, ("static", spec, draws_key(draws)), draws_inputs(draws))
        return None if parts is None else _on_device_tree(spec, parts[0], parts[1] if len(parts) > 1 else None)

    def accept(self, result: VerifyResult) -> None:
        """Forget the tree; the accepted path returns with real features next step."""
        self.session.rollback()


class StandaloneDrafter:
    """A small HF causal LM with its own KV cache (same vocabulary as the target).

    ``tree``: a TreeSpec (``TreeSpec.chain(k)`` for classic speculative decoding, or any static
    tree, greedy or sampled) or a DynamicTreeSpec (EAGLE-2 style, greedy or sampled). Each step
    the model first reads the decided tokens it has not seen (the root included), then one forward
    per tree level over the nodes that get children, with a tree mask on its cache. ``accept`` keeps the
    cache entries of the accepted path and drops the other tree nodes.
    """

    def __init__(
        self, model: nn.Module, tree: Union[TreeSpec, DynamicTreeSpec, AdaptiveTreeSpec] = TreeSpec.chain(4), cache: str = "auto"
    ) -> None:
        check_attention(model, "draft")  # its tree levels attend through a custom mask too
        self.model = model.eval()
        self.tree = tree
        # "static": the draft model on a preallocated cache, its forwards replayed as CUDA graphs on
        # a GPU (runtime/static.py), as the target's are; "auto" takes it on CUDA.
        self.cache_kind = check_cache(cache)
        self._static_model = None  # the model wrapped for StaticSession, made once: its graphs stay
        self.static = None
        self.cache = None
        self.cached_len = 0
        self._slots: dict[int, int] = {}  # node id -> cache position, for the tree being drafted
        self._tree_ids: list[int] = []  # tree node index -> node id
        self._prefix = 0  # cache length before the tree nodes (decided tokens, root included)
        self._rows: Optional[list[int]] = None  # a static tree drafted on the device: each node's entry after the prefix (-1: none)
        self._entries: Optional[Tensor] = None  # the same for an EAGLE-2 tree, on the device
        self.reset(None)

    def required_layers(self) -> Sequence[int]:
        return []

    def reset(self, prompt: Optional[Tensor]) -> None:
        self.cache = DynamicCache(config=self.model.config)
        self.static = self._static_session(prompt)
        self.cached_len = 0
        self._slots, self._tree_ids, self._prefix, self._rows, self._entries = {}, [], 0, None, None
        self.forwards = 0  # draft model forwards since reset

    def _static_session(self, prompt: Optional[Tensor]):
        from draftsmith.runtime.static import StaticSession, static_session_supported
        from draftsmith.target import FrozenTarget

        if not wants_static(self.cache_kind, next(self.model.parameters()).device):
            return None
        if self._static_model is None:
            self._static_model = FrozenTarget(self.model)
            if not static_session_supported(self._static_model):
                if self.cache_kind == "static":
                    raise DrafterError(f"{type(self.model).__name__} cannot run on the static cache (its layers do not run one by one with full attention)")
                self.cache_kind = "dynamic"
                return None
        return StaticSession.for_target(self._static_model, (), drafting_capacity(prompt))

    @property
    def _dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def _forward(self, ids: Tensor, positions: Tensor, mask: Optional[Tensor]) -> Tensor:
        out = self.model(input_ids=ids, position_ids=positions, attention_mask=mask, past_key_values=self.cache, use_cache=True)
        self.forwards += 1
        return out.logits[0]

    @torch.no_grad()
    def propose(self, state: DraftState) -> DraftTree:
        T = state.tokens.shape[1]
        device = state.tokens.device
        if self._tree_ids or self._rows is not None or self._entries is not None:
            raise DrafterError("propose was called again before accept: the drafter's cache still holds the last tree")
        if self.cached_len >= T:
            raise DrafterError(f"the drafter has seen {self.cached_len} tokens but the state holds {T}; call reset(prompt) first")
        unseen = state.tokens[:, self.cached_len :]
        if self.static is not None and isinstance(self.tree, DynamicTreeSpec) and self.tree.topk <= self._vocab:
            # An EAGLE-2 tree on the static cache: the read and every level on the device, one CUDA
            # graph a step on a GPU (StaticSession.draft_dynamic_tree), nothing read back.
            sampling = state.sampling
            key = (sampling.sampled, sampling.temperature, sampling.top_k, sampling.top_p)
            tokens, parents, depths, num_nodes, self._entries = self.static.draft_dynamic_tree(
                self.tree, unseen, build_dynamic_tree_on_device, _ranking(sampling), key, sampling.sampled
            )  # fmt: skip
            self.cached_len, self._prefix = self.static.length, T
            self.forwards += self.tree.depth  # the read, then one forward a level past the first
            return DraftTree(tokens, parents, depths, num_nodes, deterministic=sampling.sampled, known_depth_bound=self.tree.depth)
        draws = self._draws_on_device(state)
        if draws is not False:
            # A static tree on the static cache, greedy or sampled: the read and every level on the
            # device, one CUDA graph a step on a GPU (StaticSession.draft_tree), nothing read back.
            tokens, draft_probs = self.static.draft_tree(self.tree, unseen, grow_static_tree_on_device, draws)
            self._rows = self.static.tree_rows(self.tree)
            self.cached_len, self._prefix = self.static.length, T
            self.forwards += self.tree.max_depth  # the read, then one forward a level below the root
            return DraftTree(tokens, *spec_on_device(self.tree, device), draft_probs=draft_probs, known_max_depth=self.tree.max_depth)
        positions = torch.arange(self.cached_len, T, device=device).unsqueeze(0)
        if self.static is not None:
            # Causal over the cache; a few tokens (a step's accepted path) replay a graph, a prompt runs eagerly.
            visible = torch.ones(T - self.cached_len, T, dtype=torch.bool, device=device).tril(diagonal=self.cached_len)
            logits, _, _ = self.static.append(unseen, positions, visible, "all" if unseen.shape[1] <= 8 else "last")
            self.forwards += 1
            root_logits = logits[0, -1]
        else:
            root_logits = self._forward(unseen, positions, None)[-1]
        self.cached_len = self._prefix = T
        logits_of: dict[int, Tensor] = {0: root_logits}
        self._slots = {0: T - 1}

        def node_logits(frontier: Frontier) -> Tensor:
            todo = [n for n in frontier.nodes if n not in logits_of]
            if todo:
                self._forward_nodes(todo, frontier, T, device, logits_of)
            return torch.stack([logits_of[n] for n in frontier.nodes])

        tree, self._tree_ids = grow_tree(self.tree, state, node_logits, device)
        return tree

    def _draws_on_device(self, state: DraftState) -> Union[DeviceDraws, None, bool]:
        """False where this step drafts on the host; else it drafts through
        ``StaticSession.draft_tree`` (the static cache, a static tree of drafted nodes, each child
        drafted: ``_fits``), and this is its DeviceDraws, None when greedy (or typical)."""
        if self.static is None or not isinstance(self.tree, TreeSpec) or self.tree.num_nodes < 2:
            return False
        if not _fits(self.tree, self._vocab, state.sampling.sampled):
            return False
        return DeviceDraws.draw(self.tree, state.sampling, self._vocab, state.generator, state.tokens.device)

    @property
    def _vocab(self) -> int:
        """The draft model's logits per position."""
        return getattr(self.model.get_output_embeddings(), "out_features", None) or self.model.config.vocab_size

    def _forward_nodes(self, todo: list[int], frontier: Frontier, T: int, device, logits_of: dict) -> None:
        """One draft forward over tree nodes ``todo`` on top of the cache (prefix + earlier tree nodes)."""
        from draftsmith.heads.layers import ancestor_slots, tree_visibility

        L = self.cached_len
        n = len(todo)
        # Decided tokens (root included), the cache slots of its ancestors, itself: one upload.
        visible = tree_visibility(T, L, ancestor_slots(todo, frontier.parents, self._slots), device)
        ids = torch.tensor([[frontier.tokens[i] for i in todo]], device=device)
        positions = torch.tensor([[T - 1 + frontier.depths[i] for i in todo]], device=device)
        if self.static is not None:
            logits = self.static.append(ids, positions, visible, "all")[0][0]
            self.forwards += 1
        else:
            mask = torch.zeros(1, 1, n, L + n, dtype=self._dtype, device=device)
            mask.masked_fill_(~visible.view(1, 1, n, L + n), torch.finfo(self._dtype).min)
            logits = self._forward(ids, positions, mask)
        for row, node in enumerate(todo):
            self._slots[node] = L + row
            logits_of[node] = logits[row]
        self.cached_len = L + n

    def accept(self, result: VerifyResult) -> None:
        """Keep the decided tokens and the accepted path's tree entries; drop the other nodes."""
        if self._entries is not None:
            # An EAGLE-2 tree drafted on the device, its entries known there only. Every accepted
            # node but the deepest has a child on the path, so it was forwarded and has an entry;
            # the deepest may be a leaf, never forwarded, so its entry (if any) is dropped and its
            # token read again with the bonus next step. How many are kept comes with the verdict:
            # nothing is read here.
            accepted = len(result.host_path) - 1 if result.host_path is not None else int(result.accept_len[0])
            kept = max(accepted - 1, 0)
            if kept:
                self.static.pack(self._prefix, self._entries[result.path[0, 1 : 1 + kept]] + self._prefix)  # depth order: ascending
            else:
                self.static.keep_entries(self._prefix, [])
            self.cached_len, self._entries = self._prefix + kept, None
            return
        if self._rows is not None:
            # The path as the loop read it with the verdict, else one read; a chain's accepted
            # entries are in place.
            path = result.host_path if result.host_path is not None else result.path[0].tolist()
            kept = [self._rows[node] for node in path[1:] if node >= 0 and self._rows[node] >= 0]
            self.static.keep_entries(self._prefix, kept)
            self.cached_len, self._rows = self._prefix + len(kept), None
            return
        accepted = result.host_path[1:] if result.host_path is not None else result.path[0, 1 : int(result.accept_len[0]) + 1].tolist()
        path = [self._tree_ids[i] for i in accepted]
        # Path nodes that got children were forwarded; the last one may not have been.
        kept = [self._slots[node] - self._prefix for node in path if node in self._slots]
        if self.static is not None:
            self.static.pack(self._prefix, torch.tensor(kept, dtype=torch.long) + self._prefix)
        else:
            compact_cache(self.cache, self._prefix, kept)
        self.cached_len = self._prefix + len(kept)
        self._slots, self._tree_ids = {}, []
