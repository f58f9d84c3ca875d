"""Drafting without a trained drafter: prompt lookup and suffix matching, alone or merged with a head.

Both matchers look for the end of the decided text (prompt plus answer so far) earlier in some text
and propose what followed it there:

- ``PromptLookup`` (as vLLM's ``ngram``, transformers' prompt lookup): the longest n-gram of
  ``min_n``..``max_n`` tokens that ends the text and occurs earlier in it.
- ``SuffixMatcher`` (as suffix decoding, vLLM's ``suffix``): the longest matching suffix, of any
  length up to ``max_match``, in the text and, only when ``global_cache`` is on, in the answers
  this matcher saw in earlier generations. The cache is off by default: with it one prompt's
  drafts draw on another prompt's answers.

Every earlier occurrence of the match contributes its continuation, so several continuations form
a tree (``Candidates``): a child's probability is the share of its parent's occurrences that
continue with it, times the matcher's measured reliability (the fraction of its drafted nodes the
target accepted, given their parent was accepted, with a prior of 0.7 worth 10 nodes).

``LookupDrafter`` drafts those candidates alone; ``HybridDrafter`` merges them with a trained
head's candidates into one tree under one node budget (``build_scored_tree``), verified in the
target's one forward of the step. Their trees are fixed candidates (``DraftTree.deterministic``):
greedy verification is exact and sampled verification tests each candidate as a draw from a point
mass, which is lossless (runtime/verify.py).
"""

from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence, Union

import torch
from torch import Tensor

from draftsmith.runtime.drafters import DrafterError, DraftState, HeadDrafter, _root_only
from draftsmith.runtime.tree import (
    MAX_TREE_DEPTH,
    AdaptiveTreeSpec,
    Candidates,
    DraftTree,
    DynamicTreeSpec,
    TreeSpec,
    build_scored_tree,
    build_scored_tree_on_device,
    seed_rows,
    tree_shape,
)
from draftsmith.runtime.verify import SamplingParams, VerifyResult, logits_to_probs

__all__ = ["LOOKUP_KINDS", "HybridDrafter", "LookupDrafter", "PromptLookup", "SuffixMatcher", "Reliability", "lookup_hits", "make_matcher"]

LOOKUP_KINDS = ("lookup", "suffix")
# Earlier occurrences read per match: the most recent ones, enough for the counts to mean something.
MAX_OCCURRENCES = 64
# A hybrid drafting on the device reads its trees' expected lengths this many steps at a time.
EXPECTED_READS = 256


def _probabilities(sampling: SamplingParams, logits: Tensor) -> Tensor:
    """What a scored tree ranks a head's candidates by: its probabilities, or when sampling its
    processed distribution (tokens the settings filter out are never proposed, as in grow_tree)."""
    if sampling.sampled:
        return logits_to_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p)
    return torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)


class Reliability:
    """The fraction of drafted lookup nodes the target accepted given that their parent was
    accepted, with a Beta prior (``prior`` worth ``weight`` nodes)."""

    def __init__(self, prior: float = 0.7, weight: float = 10.0) -> None:
        self.prior, self.weight = prior, weight
        self.tested = 0
        self.accepted = 0

    @property
    def value(self) -> float:
        return (self.accepted + self.prior * self.weight) / (self.tested + self.weight)

    def record(self, tree: DraftTree, seeded: Union[Sequence[bool], Tensor], result: VerifyResult) -> None:
        """Count the seeded nodes of ``tree`` whose parent lies on the accepted path (tested) and
        those on the path (accepted). ``seeded``: a flag per node, a list or a device tensor (a
        tree drafted on the device: read here, with its parents, in one copy)."""
        # What the host lacks, in one read: the path (where the loop has not read it with the
        # verdict), the parents (a tree drafted on the device), the seeded flags (likewise).
        read, path, parents = [], result.host_path, tree.host_parents
        if path is None:
            read += [result.accept_len[:1], result.path[0]]
        if parents is None:
            read.append(tree.parents[0])
        if isinstance(seeded, Tensor):
            read.append(seeded.long())
        rest = torch.cat([x.to(torch.long) for x in read]).tolist() if read else []
        if path is None:
            a, rest = rest[0], rest[1:]
            path, rest = rest[: a + 1], rest[result.path.shape[1] :]
        n = tree.tokens.shape[1]
        if parents is None:
            parents, rest = rest[:n], rest[n:]
        if isinstance(seeded, Tensor):
            seeded = rest[:n]
        path = set(path)
        for node in range(1, len(parents)):
            if seeded[node] and parents[node] in path:
                self.tested += 1
                self.accepted += int(node in path)


class _Matcher:
    """The text a matcher searches: the current generation's tokens, with a position index."""

    def __init__(self) -> None:
        self.text: list[int] = []
        self.index: dict[int, list[int]] = {}
        self.prompt_len = 0

    def reset(self, prompt: Sequence[int]) -> None:
        self.text, self.index = [], {}
        self.extend(prompt)
        self.prompt_len = len(self.text)

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            self.index.setdefault(int(token), []).append(len(self.text))
            self.text.append(int(token))

    def sync(self, tokens: Union[Sequence[int], Tensor]) -> None:
        """Catch up with the decided tokens (they only ever grow by appending): a list, or a tensor
        [T] on any device, of which only the tokens not read yet are read."""
        if len(tokens) < len(self.text):
            raise DrafterError(f"the lookup drafter has read {len(self.text)} tokens but the state holds {len(tokens)}; call reset(prompt) first")
        if len(tokens) > len(self.text):  # nothing new: no read (on a GPU, a sync for nothing)
            new = tokens[len(self.text) :]
            self.extend(new.tolist() if isinstance(new, Tensor) else new)

    def candidates(self, depth: int, budget: int, reliability: float) -> Candidates:
        raise NotImplementedError


def _longest_match(text: list[int], index: dict[int, list[int]], query: list[int], max_len: int) -> tuple[int, list[int]]:
    """The longest suffix of ``query`` (at most ``max_len`` tokens) that ends at some position p of
    ``text`` with a token after p, and those end positions p (most recent first, at most
    MAX_OCCURRENCES). When ``text`` is the query itself its last position has no token after it,
    so the query never matches itself."""
    if not query:
        return 0, []
    last = len(text) - 1
    ends = [p for p in reversed(index.get(query[-1], [])) if p < last][: 4 * MAX_OCCURRENCES]
    length = 1 if ends else 0
    while ends and length < max_len and length < len(query):
        back = query[-1 - length]
        longer = [p for p in ends if p - length >= 0 and text[p - length] == back]
        if not longer:
            break
        ends, length = longer, length + 1
    return length, ends[:MAX_OCCURRENCES]


def _continuation(text: list[int], p: int, depth: int, own: bool) -> list[int]:
    """The ``depth`` tokens that followed end position p in ``text``. When ``text`` is the text
    being continued (``own``) and the occurrence overlaps its end, the match repeats with period
    len(text) - 1 - p, and the continuation runs on through the tokens it predicts."""
    out = text[p + 1 : p + 1 + depth]
    if own:
        period = len(text) - 1 - p
        while len(out) < depth:
            out.append(out[len(out) - period])
    return out


def _trie(continuations: list[list[int]], depth: int, budget: int, reliability: float, min_prob: float) -> Candidates:
    """Candidates from continuations: counts per trie node, probabilities count / parent count times
    ``reliability``; nodes whose path probability falls below ``min_prob`` (before reliability) are
    dropped, and at most ``budget`` nodes are kept, the most frequent paths first."""
    counts: dict[tuple[int, ...], int] = {}
    for cont in continuations:
        for d in range(1, min(depth, len(cont)) + 1):
            counts[tuple(cont[:d])] = counts.get(tuple(cont[:d]), 0) + 1
    total = len(continuations)
    if not total:
        return Candidates.empty()
    # Most frequent first, shallower first on ties, then the earlier (more recent) continuation's order.
    ranked = sorted(counts, key=lambda path: (-counts[path], len(path)))
    rank = {path: r for r, path in enumerate(ranked)}
    # A path's count never exceeds its prefix's and ties go to the shorter, so a chosen path's
    # prefixes are chosen too.
    chosen = sorted([p for p in ranked if counts[p] / total >= min_prob][:budget], key=lambda p: (len(p), rank[p]))
    out = Candidates.empty()
    node_of: dict[tuple[int, ...], int] = {(): 0}
    for path in chosen:
        node_of[path] = len(out.tokens)
        out.tokens.append(path[-1])
        out.parents.append(node_of[path[:-1]])
        out.probs.append(counts[path] / counts.get(path[:-1], total) * reliability)
    return out


class PromptLookup(_Matcher):
    """n-gram prompt lookup over the prompt and the answer so far: the longest n-gram of ``min_n``
    to ``max_n`` tokens ending the text that occurs earlier (vLLM's ``prompt_lookup_min`` /
    ``prompt_lookup_max``); each earlier occurrence proposes the tokens that followed it."""

    kind = "lookup"

    def __init__(self, min_n: int = 1, max_n: int = 3) -> None:
        if not 1 <= min_n <= max_n:
            raise DrafterError(f"prompt lookup needs 1 <= min <= max n-gram size, got {min_n}..{max_n}")
        super().__init__()
        self.min_n, self.max_n = min_n, max_n

    def describe(self) -> str:
        return f"prompt lookup, n-grams {self.min_n}-{self.max_n}"

    def candidates(self, depth: int, budget: int, reliability: float) -> Candidates:
        n, ends = _longest_match(self.text, self.index, self.text, self.max_n)
        if n < self.min_n:
            return Candidates.empty()
        return _trie([_continuation(self.text, p, depth, True) for p in ends], depth, budget, reliability, 0.0)


class SuffixMatcher(_Matcher):
    """Suffix matching over the prompt and the answer so far and, with ``global_cache``, the answers
    of earlier generations of this matcher (suffix decoding's cache; OFF by default). The longest
    matching suffix (up to ``max_match`` tokens) wins; its occurrences in every searched text
    propose their continuations, at most ``spec_factor`` x the match length deep, and continuations
    rarer than ``min_prob`` of the occurrences are left out (suffix decoding's defaults: 1.0, 0.1)."""

    kind = "suffix"

    def __init__(self, global_cache: bool = False, max_match: int = 32, spec_factor: float = 1.0, min_prob: float = 0.1, max_cached: int = 10000) -> None:
        super().__init__()
        self.global_cache = global_cache
        self.max_match, self.spec_factor, self.min_prob, self.max_cached = max_match, spec_factor, min_prob, max_cached
        self.cache: list[tuple[list[int], dict[int, list[int]]]] = []

    def describe(self) -> str:
        return f"suffix matching{' with the global cache of earlier answers' if self.global_cache else ''}"

    def reset(self, prompt: Sequence[int]) -> None:
        # The finished generation's answer joins the cache (only when the cache is on).
        if self.global_cache and len(self.text) > self.prompt_len:
            answer = self.text[self.prompt_len :]
            index: dict[int, list[int]] = {}
            for pos, token in enumerate(answer):
                index.setdefault(token, []).append(pos)
            self.cache.append((answer, index))
            del self.cache[: max(0, len(self.cache) - self.max_cached)]
        super().reset(prompt)

    def candidates(self, depth: int, budget: int, reliability: float) -> Candidates:
        found = [(*_longest_match(self.text, self.index, self.text, self.max_match), self.text)]
        if self.global_cache:
            found += [(*_longest_match(text, index, self.text, self.max_match), text) for text, index in self.cache]
        best = max(length for length, _, _ in found)
        if best == 0:
            return Candidates.empty()
        depth = max(1, min(depth, int(self.spec_factor * best)))
        continuations = [
            _continuation(text, p, depth, text is self.text) for length, ends, text in found if length == best for p in ends
        ]
        return _trie(continuations[: MAX_OCCURRENCES * 4], depth, budget, reliability, self.min_prob)


def lookup_hits(tokens: Sequence[int], matcher: _Matcher) -> list[bool]:
    """hits[j]: whether ``matcher``, having read tokens[:j], proposes tokens[j] among its first
    candidates (a lookup drafter's depth 1 at that point of the text). hits[0] is False."""
    hits = [False] * len(tokens)
    matcher.reset(list(tokens[:1]))
    for j in range(1, len(tokens)):
        found = matcher.candidates(1, MAX_OCCURRENCES, 1.0)
        hits[j] = int(tokens[j]) in found.tokens[1:]
        matcher.extend([tokens[j]])
    return hits


def make_matcher(kind: str, prompt_lookup_min: int = 1, prompt_lookup_max: int = 3, global_cache: bool = False) -> _Matcher:
    """A matcher by name: "lookup" (PromptLookup) or "suffix" (SuffixMatcher)."""
    if kind == "lookup":
        if global_cache:
            raise DrafterError("the global cache of earlier answers belongs to suffix matching: use --drafter suffix (or --hybrid suffix)")
        return PromptLookup(prompt_lookup_min, prompt_lookup_max)
    if kind == "suffix":
        return SuffixMatcher(global_cache=global_cache)
    raise DrafterError(f"unknown lookup drafter {kind!r}: choose one of {', '.join(LOOKUP_KINDS)}")


Spec = Union[TreeSpec, DynamicTreeSpec, AdaptiveTreeSpec]
# A lookup drafter's default structure: up to 5 deep, 3 continuations a node, 10 nodes.
DEFAULT_LOOKUP_TREE = DynamicTreeSpec(depth=5, topk=3, budget=10)


class LookupDrafter:
    """A matcher (PromptLookup or SuffixMatcher) as a drafter: each step its candidate trie, the
    nodes of largest estimated acceptance kept under the tree's node budget (``tree_shape`` of the
    spec: depth, budget and, for an AdaptiveTreeSpec, the cost that cuts unpromising levels). No
    model, no forward; the tree is fixed candidates."""

    # What it carries from one generation to the next (reset() keeps it): the measured reliability,
    # the matcher (with its cross-answer cache), the trees' expected lengths.
    carried = ("reliability", "matcher", "expected")

    def __init__(self, matcher: _Matcher, tree: Spec = DEFAULT_LOOKUP_TREE) -> None:
        self.matcher = matcher
        self.tree = tree
        self.shape = tree_shape(tree)
        self.reliability = Reliability()
        self.forwards = 0  # no draft model
        self.expected: list[float] = []  # the expected accepted length of each proposed tree
        self._last: Optional[tuple[DraftTree, list[bool]]] = None

    def required_layers(self) -> Sequence[int]:
        return []

    def reset(self, prompt: Optional[Tensor]) -> None:
        self.matcher.reset([] if prompt is None else prompt[0].tolist())
        self._last = None

    @torch.no_grad()
    def propose(self, state: DraftState) -> DraftTree:
        self.matcher.sync(state.decided)
        seeds = self.matcher.candidates(self.shape.depth, self.shape.budget * 4, self.reliability.value)
        tree, _, seeded, expected = build_scored_tree(state.root, self.shape, seeds=seeds, device=state.tokens.device, deterministic=True)
        self.expected.append(expected)
        self._last = (tree, seeded)
        return tree

    def accept(self, result: VerifyResult) -> None:
        if self._last is not None:
            self.reliability.record(*self._last, result)
        self._last = None


class HybridDrafter:
    """A trained head's candidates and a matcher's merged into one tree under one node budget,
    verified in the step's one target forward (``build_scored_tree``: the head expands level by
    level, by rank, and a continuation both propose keeps the larger estimate).

    The head reads the target's features as HeadDrafter does: each step the positions that entered
    the target's cache, i.e. the accepted path whichever branch it came from; after verification
    its session forgets the whole tree (``rollback``), so a head with its own cache (EAGLE's) holds
    only decided positions, with the target's real features. ``tree`` sets depth, children per
    node, the one node budget and, for an AdaptiveTreeSpec, the cost of dynamic depth; its depth
    bounds the head's levels (the lookup may draft deeper, up to ``lookup_depth``).
    """

    # What it carries from one generation to the next, as LookupDrafter (the expected lengths in
    # their two lists).
    carried = ("reliability", "matcher", "_expected", "_unread")

    def __init__(self, head: HeadDrafter, matcher: _Matcher, tree: Optional[Spec] = None, lookup_depth: int = 8) -> None:
        if not isinstance(head, HeadDrafter):
            raise DrafterError(f"a hybrid merges lookup with a trained head; a {type(head).__name__} cannot join one (its state follows its own tree)")
        self.head = head
        self.matcher = matcher
        self.tree = tree if tree is not None else head.tree
        self.shape = tree_shape(self.tree)
        if self.shape.depth > head.head.depth:
            raise DrafterError(
                f"the tree is {self.shape.depth} deep but the {head.head.cfg.kind} head drafts {head.head.depth} tokens: give --tree a depth of at most "
                f"{head.head.depth} (in a hybrid the lookup drafts deeper on its own, up to {lookup_depth})"
            )
        self.lookup_depth = max(lookup_depth, self.shape.depth)
        # The lookup's candidates a step (``candidates``' budget), and how deep a tree can reach.
        self.seed_capacity = self.shape.budget * 4
        self.depth_bound = min(max(self.lookup_depth, self.shape.depth), MAX_TREE_DEPTH)
        self.reliability = Reliability()
        self._expected: list[float] = []
        self._unread: list[Tensor] = []  # the expected lengths of trees drafted on the device, not read yet
        self._last: Optional[tuple[DraftTree, Union[list[bool], Tensor]]] = None

    @property
    def expected(self) -> list[float]:
        """The expected accepted length of each tree proposed."""
        self._read_expected()
        return list(self._expected)

    def _read_expected(self) -> None:
        """A tree drafted on the device keeps its expected length there: they are read in one copy
        when asked, or every ``EXPECTED_READS`` steps (no read a step, and no device memory held
        for the life of a server)."""
        if self._unread:
            self._expected.extend(torch.stack(self._unread).tolist())
            self._unread = []

    def required_layers(self) -> Sequence[int]:
        return self.head.required_layers()

    @property
    def forwards(self) -> Optional[int]:
        return self.head.forwards

    def reset(self, prompt: Optional[Tensor]) -> None:
        self.head.reset(prompt)
        self.matcher.reset([] if prompt is None else prompt[0].tolist())
        self._last = None

    @torch.no_grad()
    def propose(self, state: DraftState) -> DraftTree:
        device = state.tokens.device
        self.matcher.sync(state.decided)
        seeds = self.matcher.candidates(self.lookup_depth, self.seed_capacity, self.reliability.value)
        # Uploaded before the head's drafting is queued: a copy from pageable host memory waits
        # for the stream to drain first, so here it waits for nothing.
        rows = torch.tensor(seed_rows(seeds, self.seed_capacity), dtype=torch.float64).to(device) if self.head.static_cache else None
        if not self.head.read(state):
            return _root_only(state.root, device)
        probs = functools.partial(_probabilities, state.sampling)
        drafted = None if rows is None else self._on_device(state, rows, probs)
        if drafted is None:  # the reference: the head's levels on the host, a read a level
            drafted = build_scored_tree(state.root, self.shape, lambda frontier: probs(self.head.session.expand(frontier)), seeds, device, deterministic=True)
        tree, _, seeded, expected = drafted
        if isinstance(expected, Tensor):
            self._unread.append(expected)
            if len(self._unread) >= EXPECTED_READS:
                self._read_expected()
        else:
            self._read_expected()  # in order
            self._expected.append(expected)
        self._last = (tree, seeded)
        return tree

    def _on_device(self, state: DraftState, rows: Tensor, probs: Callable[[Tensor], Tensor]) -> Optional[tuple]:
        """``build_scored_tree``'s tree built on the device (``build_scored_tree_on_device``) from
        the lookup's candidates uploaded in one copy (``rows``: ``seed_rows``): on the static
        cache, one CUDA graph a step for a head that grows its whole tree (EAGLE, EAGLE-3; Hydra and
        Clover with graphs) or drafts from its level logits (Medusa's heads, DFlash's block: the
        graph of the step's read), its levels on the device otherwise. None where the head's
        session can do none of these (the host builds it)."""
        session, device, shape = self.head.session, state.tokens.device, self.shape
        build = functools.partial(build_scored_tree_on_device, cost=shape.cost, depth_bound=self.depth_bound)
        sampling = state.sampling
        key = ("hybrid", shape.cost, self.seed_capacity, self.depth_bound, sampling.sampled, sampling.temperature, sampling.top_k, sampling.top_p)

        def from_levels(levels: Tensor, root: Tensor, rows: Tensor) -> tuple:
            # Every node at depth d takes its children from row d (Medusa, DFlash).
            return build(lambda f: probs(levels[f.level - 1]).expand(f.nodes.shape[0], -1), root, shape.depth, shape.topk, shape.budget, device, True, rows)

        def parts_of(levels: Tensor, root: Tensor, rows: Tensor) -> tuple[Tensor, ...]:
            tree, _, seeded, expected = from_levels(levels, root, rows)
            return (tree.tokens, tree.parents, tree.depths, tree.num_nodes, seeded, expected)

        root = torch.full((1,), state.root, dtype=torch.long, device=device)
        parts = None
        if session.drafts_by_level:  # in the graph of the step's read where the session has one
            parts = session.after_levels(parts_of, ("dynamic", shape.depth, shape.topk, shape.budget, key), (rows,))
        if parts is None:
            levels = session.level_logits()
            if levels is not None:
                return from_levels(levels, root, rows)
            if not session.levels_on_device:
                return None
            parts = session.dynamic_tree(shape, state.root, probs, key, True, build, (rows,))
        if parts is None:  # a session without graphs grows it level by level
            return build(lambda f: probs(session.expand_level(f)), root, shape.depth, shape.topk, shape.budget, device, True, rows)
        tokens, parents, depths, num_nodes, seeded, expected = parts
        tree = DraftTree(tokens=tokens, parents=parents, depths=depths, num_nodes=num_nodes, deterministic=True, known_depth_bound=self.depth_bound)
        return tree, None, seeded, expected

    def accept(self, result: VerifyResult) -> None:
        """Forget the tree in the head (the accepted path, lookup branch or not, returns with the
        target's features next step) and update the lookup's reliability."""
        if self._last is not None:
            self.reliability.record(*self._last, result)
        self._last = None
        self.head.accept(result)
