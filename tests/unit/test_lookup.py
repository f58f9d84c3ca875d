"""Lookup drafting without a model: the matchers, the scored (OPT-Tree) tree builder, their budgets,
and suffix matching's global cache (off unless asked)."""

import collections
import itertools
import random

import pytest
import torch

from draftsmith.runtime.drafters import DrafterError, DraftState
from draftsmith.runtime.lookup import LookupDrafter, PromptLookup, SuffixMatcher, make_matcher
from draftsmith.runtime.tree import (
    AdaptiveTreeSpec,
    Candidates,
    DynamicTreeSpec,
    TreeError,
    TreeSpec,
    build_scored_tree,
    build_scored_tree_on_device,
    parse_tree,
    seed_rows,
    tree_shape,
)


def _propose(drafter, text):
    tokens = torch.tensor([text])
    drafter.reset(tokens)
    return drafter.propose(DraftState(tokens=tokens))


def _paths(tree):
    """Every drafted node as its token path from the root (root excluded)."""
    tokens, parents = tree.tokens[0].tolist(), tree.parents[0].tolist()
    out = []
    for node in range(1, len(tokens)):
        path, n = [], node
        while n > 0:
            path.append(tokens[n])
            n = parents[n]
        out.append(tuple(reversed(path)))
    return out


def test_a_repeated_phrase_proposes_its_continuation():
    # "1 2 3 4 9 ... 1 2 3": the trigram 1 2 3 occurred before, followed by 4 9 7.
    text = [1, 2, 3, 4, 9, 7, 5, 1, 2, 3]
    tree = _propose(LookupDrafter(PromptLookup(1, 3), TreeSpec.chain(3)), text)
    assert tree.tokens[0].tolist() == [3, 4, 9, 7] and tree.parents[0].tolist() == [-1, 0, 1, 2]
    assert tree.deterministic  # fixed candidates: lossless under sampling too
    # Nothing ends the text that occurred before: nothing is drafted.
    assert _propose(LookupDrafter(PromptLookup(1, 3)), [1, 2, 3, 4]).size == 1
    # The longest n-gram wins over shorter ones, as vLLM's ngram: "2 3" -> 8 here, "1 2 3" -> 4.
    text = [2, 3, 8, 1, 2, 3, 4, 6, 1, 2, 3]
    assert _paths(_propose(LookupDrafter(PromptLookup(1, 3), TreeSpec.chain(1)), text)) == [(4,)]
    # With min 4, a trigram match is not enough.
    assert _propose(LookupDrafter(PromptLookup(4, 5)), text).size == 1


def test_the_continuation_of_an_overlapping_match_runs_on_periodically():
    # "5 6 5 6 5": the last bigram "6 5" ended at position 2, whose continuation runs into the
    # text's end; the period 2 carries it on.
    text = [5, 6, 5, 6, 5]
    tree = _propose(LookupDrafter(PromptLookup(1, 2), TreeSpec.chain(5)), text)
    assert tree.tokens[0].tolist() == [5, 6, 5, 6, 5, 6]


def test_several_matches_form_branches_ordered_by_count():
    # "1 2" is followed by 5 6 twice and by 7 8 once (distinct separators: "1 2" is the longest match).
    text = [1, 2, 5, 6, 20, 1, 2, 7, 8, 21, 1, 2, 5, 6, 22, 1, 2]
    for matcher in (PromptLookup(1, 2), SuffixMatcher(min_prob=0.0)):
        tree = _propose(LookupDrafter(matcher, DynamicTreeSpec(depth=2, topk=2, budget=4)), text)
        paths = _paths(tree)
        assert set(paths) == {(5,), (7,), (5, 6), (7, 8)}, (matcher.kind, paths)
        # The more frequent branch comes first among the root's children.
        assert [tree.tokens[0, i].item() for i in range(1, tree.size) if tree.parents[0, i] == 0] == [5, 7]
    # The probabilities behind the order: 2/3 and 1/3 of the occurrences, times the reliability.
    matcher = PromptLookup(1, 2)
    matcher.reset(text)
    seeds = matcher.candidates(depth=1, budget=8, reliability=0.5)
    assert dict(zip(seeds.tokens[1:], seeds.probs[1:])) == pytest.approx({5: 2 / 3 * 0.5, 7: 1 / 3 * 0.5})


@pytest.mark.parametrize("budget", [1, 2, 3, 5])
def test_the_node_budget_is_respected_and_keeps_the_likeliest_nodes(budget):
    # Five different continuations of "1 2", one of them three times: a wide trie.
    text = []
    for follow in ([3, 4], [5, 6], [3, 4], [7, 8], [9, 10], [3, 4], [11, 12]):
        text += [1, 2] + follow + [0]
    text += [1, 2]
    tree = _propose(LookupDrafter(PromptLookup(2, 2), DynamicTreeSpec(depth=2, topk=8, budget=budget)), text)
    assert tree.size - 1 == budget
    paths = _paths(tree)
    assert paths[0] == (3,) and (budget < 2 or (3, 4) in paths)  # 3 of 7 occurrences, then its only child


def test_suffix_matching_prefers_the_longest_suffix_and_bounds_depth_by_it():
    # The text ends with "4 1 2": a match of 3 -> continuation 9 9 9; "1 2" alone is followed by 7 too.
    text = [4, 1, 2, 9, 9, 9, 0, 1, 2, 7, 7, 0, 4, 1, 2]
    tree = _propose(LookupDrafter(SuffixMatcher(), TreeSpec.chain(8)), text)
    # Suffix decoding's spec factor 1: at most as deep as the match is long.
    assert _paths(tree) == [(9,), (9, 9), (9, 9, 9)]


def test_the_global_cache_is_off_by_default_and_draws_on_earlier_answers_only_when_on():
    prompt_a, answer_a = [1, 2, 3], [40, 41, 42, 43, 44, 45]
    prompt_b = [7, 8, 9]
    for on in (False, True):
        matcher = SuffixMatcher(global_cache=on) if on else SuffixMatcher()
        drafter = LookupDrafter(matcher, TreeSpec.chain(3))
        _propose(drafter, prompt_a)
        matcher.sync(prompt_a + answer_a)  # the first generation's answer
        # A second prompt whose answer starts like the first answer: only the cache knows the rest.
        tokens = torch.tensor([prompt_b + [40, 41, 42]])
        drafter.reset(tokens[:, :3])
        tree = drafter.propose(DraftState(tokens=tokens))
        assert _paths(tree) == ([(43,), (43, 44), (43, 44, 45)] if on else []), on
    assert SuffixMatcher().global_cache is False
    with pytest.raises(DrafterError, match="suffix"):
        make_matcher("lookup", global_cache=True)


def test_the_drafter_catches_up_with_decided_tokens_and_refuses_a_shorter_state():
    drafter = LookupDrafter(PromptLookup(1, 2), TreeSpec.chain(2))
    _propose(drafter, [1, 2, 3, 1, 2])
    with pytest.raises(DrafterError, match="reset"):
        drafter.propose(DraftState(tokens=torch.tensor([[1, 2]])))


def test_a_lookup_step_reads_nothing_but_the_verdict():
    """Under SimulatedDevice a lookup step reads nothing of its own: the loop hands the matcher the
    decided tokens on the host (the prompt read once, then what each step emitted), of which it
    takes what the step before emitted, and the acceptance bookkeeping takes the path the loop
    read with the verdict and the parents the tree was built from. The output is the target's
    greedy output."""
    from draftsmith.runtime.generate import speculative_generate
    from draftsmith.target import FrozenTarget
    from draftsmith.testing import SimulatedDevice, tiny_causal_lm

    device = torch.device("cpu")
    with SimulatedDevice() as guard:
        target = FrozenTarget(tiny_causal_lm("llama", seed=0).to(device))
        ids = torch.tensor([[5, 9, 14, 20, 5, 9, 14, 20, 5, 9]]).to(device)
        drafter, synced = LookupDrafter(SuffixMatcher()), []
        sync = drafter.matcher.sync
        drafter.matcher.sync = lambda tokens: synced.append((torch.is_tensor(tokens), len(tokens) - len(drafter.matcher.text))) or sync(tokens)
        before = len(guard.reads)
        out, stats = speculative_generate(target, drafter, ids, 20, cache="static")
        want = target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=20, pad_token_id=0, eos_token_id=None)
    assert out.tolist() == want.tolist()
    steps, reads = len(stats.accept_lens), [r for r in guard.reads[before:] if "lookup.py" in r]
    assert not any(tensor for tensor, _ in synced) and synced[0][1] == 0, synced
    assert all(0 < n <= 1 + max(stats.accept_lens) for _, n in synced[1:]), synced
    assert len(reads) == 1, reads  # reset's read of the prompt, and no step's
    assert sum("generate.py" in r and r.startswith("tolist") for r in guard.reads[before:]) == steps + 1  # the prompt, then a verdict a step
    assert sum(stats.accept_lens) > 0 and drafter.reliability.tested > 0


def test_a_matcher_synced_from_the_device_reads_only_the_new_tokens():
    """Given the decided tokens as a device tensor (a caller without them on the host), the matcher
    reads the ones it has not read yet, in one copy, and nothing when there are none."""
    from draftsmith.testing import SimulatedDevice

    with SimulatedDevice() as guard:
        tokens = torch.tensor([5, 9, 14, 20, 5, 9, 7, 7]).to(torch.device("cpu"))
        matcher = SuffixMatcher()
        matcher.reset([5, 9, 14, 20, 5])
        before = len(guard.reads)
        matcher.sync(tokens[:5])
        assert len(guard.reads) == before
        matcher.sync(tokens)
    assert len(guard.reads) == before + 1 and matcher.text == tokens.tolist()


# ---------------------------------------------------------------- the scored tree (OPT-Tree)


def _fixed_expand(table, calls=None):
    """expand() over a fixed law: table[depth] is the probability vector after any node at that depth."""

    def expand(frontier):
        if calls is not None:
            calls.append(len(frontier.nodes))
        return torch.stack([torch.tensor(table[frontier.depths[n]], dtype=torch.float64) for n in frontier.nodes])

    return expand


def _brute_best(table, depth, topk, budget):
    """The largest expected accepted length of any ancestor-closed set of at most `budget` nodes
    among the topk children of every node, by enumeration."""
    nodes = {(): 1.0}
    for d in range(depth):
        probs = torch.tensor(table[d])
        top = torch.topk(probs, topk)
        for path, value in list(nodes.items()):
            if len(path) == d:
                for p, t in zip(top.values.tolist(), top.indices.tolist()):
                    nodes[path + (t,)] = value * p
    drafted = [n for n in nodes if n]
    best = 0.0
    for k in range(1, budget + 1):
        for subset in itertools.combinations(drafted, k):
            chosen = set(subset)
            if all(p[:-1] in chosen or len(p) == 1 for p in chosen):
                best = max(best, sum(nodes[p] for p in chosen))
    return 1.0 + best


@pytest.mark.parametrize("budget", [1, 3, 5])
def test_the_scored_tree_maximises_the_expected_accepted_length(budget):
    table = [[0.5, 0.3, 0.2, 0.0], [0.9, 0.05, 0.05, 0.0], [0.4, 0.4, 0.2, 0.0]]
    tree, ids, _, expected = build_scored_tree(0, AdaptiveTreeSpec(depth=3, topk=2, budget=budget), _fixed_expand(table))
    assert tree.size - 1 == budget
    assert expected == pytest.approx(_brute_best(table, 3, 2, budget))
    # Frontier ids are the pool's, root first and topological.
    assert ids[0] == 0 and ids == sorted(ids)


def test_dynamic_depth_stops_when_a_level_gains_less_than_its_cost():
    # A confident first level, then a flat law: level 2 adds (0.9 + 0.1) * 0.25 * 2 = 0.5 tokens.
    table = [[0.9, 0.1, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25], [0.25, 0.25, 0.25, 0.25], [0.25, 0.25, 0.25, 0.25]]
    calls = []
    tree, _, _, _ = build_scored_tree(0, AdaptiveTreeSpec(depth=4, topk=2, budget=8), _fixed_expand(table, calls))
    assert len(calls) == 4 and tree.max_depth == 3  # no cost: every level is drafted (depth 4 loses to depth 2's siblings)
    calls.clear()
    build_scored_tree(0, AdaptiveTreeSpec(depth=4, topk=2, budget=8, cost=0.5), _fixed_expand(table, calls))
    assert len(calls) == 3  # level 2 gains 0.5, enough; level 3 gains 0.175, not
    calls.clear()
    tree, _, _, expected = build_scored_tree(0, AdaptiveTreeSpec(depth=4, topk=2, budget=8, cost=0.6), _fixed_expand(table, calls))
    # Level 1 gains 1.0 >= 0.6 and goes on; level 2 gains 0.5 < 0.6: drafting stops, level 2 is cut.
    assert len(calls) == 2 and tree.max_depth == 1
    assert expected == pytest.approx(2.0)


def test_seeds_merge_with_drafted_children_keeping_the_larger_estimate():
    table = [[0.6, 0.3, 0.1, 0.0]]
    seeds = Candidates([-1, 1, 3, 2], [-1, 0, 1, 0], [1.0, 0.8, 0.5, 0.2])  # 1 -> 3 and 2 under the root
    tree, _, seeded, expected = build_scored_tree(9, AdaptiveTreeSpec(depth=1, topk=2, budget=10), _fixed_expand(table), seeds)
    paths = dict(zip(_paths(tree), seeded[1:]))
    # Token 1 is both a seed (0.8) and the draft's second choice (0.3): one node, seeded; token 0 drafted only.
    assert paths == {(1,): True, (2,): True, (1, 3): True, (0,): False}
    assert expected == pytest.approx(1 + 0.8 + 0.6 + 0.8 * 0.5 + 0.2)


def test_parse_and_shape_of_adaptive_trees():
    assert parse_tree("adaptive:6,4,20,0.25") == AdaptiveTreeSpec(6, 4, 20, 0.25)
    assert parse_tree("adaptive:6,4,20") == AdaptiveTreeSpec(6, 4, 20, 0.0)
    for bad in ("adaptive:6,4", "adaptive:a,b,c", "adaptive:0,4,20", "adaptive:6,4,20,-1"):
        with pytest.raises(TreeError):
            parse_tree(bad)
    assert tree_shape(parse_tree("4,2,2,1")) == AdaptiveTreeSpec(4, 4, 9)
    assert tree_shape(DynamicTreeSpec(5, 3, 10)) == AdaptiveTreeSpec(5, 3, 10)


def test_lookup_hits_say_where_a_lookup_drafter_would_have_drafted_the_token():
    from draftsmith.runtime.lookup import lookup_hits

    text = [1, 2, 3, 1, 2, 3, 4, 1, 2]
    # Position 3 (token 1 after "3", never seen): miss; 4 (2 after "1", as at 0-1): hit; 5 (3 after
    # "1 2"): hit; 6 (4 after "1 2 3", which went on with 1): miss; 8 (2 after "1"): hit.
    assert lookup_hits(text, SuffixMatcher()) == [False, False, False, False, True, True, False, False, True]
    # Token 1 at 7 follows "4", new: a miss for both; prompt lookup agrees on this text.
    assert lookup_hits(text, PromptLookup(1, 3)) == lookup_hits(text, SuffixMatcher())
    assert lookup_hits([], SuffixMatcher()) == [] and lookup_hits([5], SuffixMatcher()) == [False]


def test_lookup_token_weights_read_each_packed_example_on_its_own():
    from draftsmith.trainers.heads import lookup_token_weights

    row = [1, 2, 1, 2, 1, 2, 0, 0]
    segments = [1, 1, 1, 1, 2, 2, 0, 0]  # the second example starts over at 4: "1 2" there is new to it
    weights = lookup_token_weights(torch.tensor([row]), torch.tensor([segments]), "suffix", 0.25)
    assert weights[0].tolist() == [1.0, 1.0, 1.0, 0.25, 1.0, 1.0, 1.0, 1.0]


def _random_scored_case(seed):
    """A random scored-tree problem: a law per (depth, token) over a small vocabulary (ties and
    zeros in half the cases), a random trie of seeds (some of them the draft's own choices, some
    deeper than the draft goes, some worth nothing), a random shape with or without a cost."""
    rng = random.Random(seed)
    V = rng.choice([3, 5, 8])
    shape = AdaptiveTreeSpec(depth=rng.randint(1, 5), topk=rng.randint(1, 4), budget=rng.randint(1, 12), cost=rng.choice([0.0, 0.0, 0.05, 0.2, 0.5]))
    table = torch.rand(shape.depth + 1, V, V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    if rng.random() < 0.5:
        table = (table * 4).floor() / 4
    table = (table / table.sum(-1, keepdim=True).clamp_min(1e-9)).float()
    tokens, parents, probs, depths = [-1], [-1], [1.0], [0]
    for _ in range(rng.randint(0, 4 * shape.budget)):
        parent, token = rng.randrange(len(tokens)), rng.randrange(V)
        if depths[parent] < 7 and not any(parents[j] == parent and tokens[j] == token for j in range(1, len(tokens))):
            tokens.append(token), parents.append(parent), depths.append(depths[parent] + 1)
            probs.append(rng.choice([0.0, 0.25, 0.5, rng.random(), 1.0]))
    return shape, table, Candidates(tokens, parents, probs), rng.randrange(V)


def test_the_scored_tree_built_on_the_device_is_the_host_tree():
    """build_scored_tree_on_device (a hybrid's tree on the static cache, one graph a step on CUDA)
    keeps the nodes the host keeps, in its order, with its seeded flags and expected length, on 400
    random problems: seeds merged with drafted children, frontiers that run dry, costs that stop
    growth and cut levels, ties. The device expands a fixed number of rows a level."""
    for seed in range(400):
        shape, table, seeds, root = _random_scored_case(seed)
        host_expand = lambda f: torch.stack([table[f.depths[n], f.tokens[n]] for n in f.nodes])  # noqa: E731
        rows = []

        def device_expand(f):
            rows.append(f.nodes.shape[0])
            return table[f.level - 1][f.tokens]

        want, _, seeded, expected = build_scored_tree(root, shape, host_expand, seeds, deterministic=True)
        pool = torch.tensor(seed_rows(seeds, 4 * shape.budget), dtype=torch.float64)
        tree, ids, got_seeded, got_expected = build_scored_tree_on_device(
            device_expand, root, shape.depth, shape.topk, shape.budget, torch.device("cpu"), True, pool, cost=shape.cost, depth_bound=8
        )
        n = int(tree.num_nodes)
        case = (seed, shape)
        assert tree.tokens.shape[1] == shape.budget + 1 and tree.deterministic and tree.known_depth_bound == 8, case
        assert (tree.tokens[0, :n].tolist(), tree.parents[0, :n].tolist(), tree.depths[0, :n].tolist()) == (
            want.tokens[0].tolist(), want.parents[0].tolist(), want.depths[0].tolist()), case  # fmt: skip
        assert (tree.parents[0, n:] == -1).all() and not got_seeded[n:].any() and got_seeded[:n].tolist() == seeded, case
        assert float(got_expected) == expected and ids[0] == 0, case
        assert rows == [1] + [shape.topk] * (shape.depth - 1), case


def test_seed_rows_pad_to_their_slots_and_refuse_more():
    seeds = Candidates([-1, 1, 3, 2], [-1, 0, 1, 0], [1.0, 0.8, 0.5, 0.2])
    tokens, parents, depths, values = seed_rows(seeds, 5)
    assert (tokens, parents, depths) == ([1, 3, 2, 0, 0], [0, 1, 0, -1, -1], [1, 2, 1, 0, 0])
    assert values == pytest.approx([0.8, 0.4, 0.2, 0.0, 0.0])
    with pytest.raises(ValueError, match="3 lookup candidates do not fit the 2 seed slots"):
        seed_rows(seeds, 2)


@pytest.mark.parametrize("kind", ["eagle3", "medusa"])
def test_a_hybrid_step_on_the_static_cache_reads_its_verdict_and_its_bookkeeping_once(kind):
    """Under SimulatedDevice a hybrid's step on the static cache builds its tree on the device:
    nothing is read while the head's levels and the lookup's candidates merge (on the host that
    was a read per frontier row a level, 34 a step at the bench shape); the lookup takes the new
    tokens from the host, and its bookkeeping reads the tree's parents and seeded flags in one copy
    (the path comes with the verdict). The output is the target's greedy output."""
    import inspect

    from draftsmith.heads.eagle3 import Eagle3Config, Eagle3Head
    from draftsmith.heads.medusa import MedusaConfig, MedusaHead
    from draftsmith.runtime.drafters import HeadDrafter
    from draftsmith.runtime.generate import speculative_generate
    from draftsmith.runtime.lookup import HybridDrafter, Reliability
    from draftsmith.runtime.tree import DraftTree, default_tree
    from draftsmith.target import FrozenTarget
    from draftsmith.testing import SimulatedDevice, tiny_causal_lm

    device = torch.device("cpu")
    with SimulatedDevice() as guard:
        torch.manual_seed(5)
        target = FrozenTarget(tiny_causal_lm("llama", seed=0).to(device))
        if kind == "eagle3":
            head = Eagle3Head(Eagle3Config(depth=4, train_depth=4, draft_vocab_size=64, aux_layer_ids=[1, 2, 3]), target.dims)
            head.init_from_target(target)
            spec = DynamicTreeSpec(depth=4, topk=3, budget=10)
        else:
            head, spec = MedusaHead(MedusaConfig(num_heads=4, num_layers=1), target.dims), default_tree(4, (4, 2, 2, 1))
        drafter = HybridDrafter(HeadDrafter(head.to(device).eval(), target, spec, cache="static"), SuffixMatcher())
        ids = torch.tensor([[5, 9, 14, 20, 5, 9, 14, 20, 5, 9]]).to(device)
        before = len(guard.reads)
        out, stats = speculative_generate(target, drafter, ids, 24, cache="static")
        after = len(guard.reads)
        want = target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24, pad_token_id=0, eos_token_id=None)
    assert out.tolist() == want.tolist()
    lines, first = inspect.getsourcelines(DraftTree.validate)
    checks = {f"tree.py:{n}" for n in range(first, first + len(lines))}
    # What CUDA reads: the torch reference verification and its tree checks are the CPU's.
    reads = [r for r in guard.reads[before:after] if not r.split(" at ")[1].startswith("verify.py") and r.split(" at ")[1] not in checks]
    steps = len(stats.accept_lens)
    lines, first = inspect.getsourcelines(Reliability.record)
    record = [r for r in reads if r.split(" at ")[1] in {f"lookup.py:{n}" for n in range(first, first + len(lines))}]
    assert guard.checked > 200 and steps > 3
    assert not [r for r in reads if "tree.py" in r or "heads/" in r], reads  # the tree grew and merged on the device
    assert len(record) == steps, record  # the bookkeeping's one read a step
    assert sum("generate.py" in r and r.startswith("tolist") for r in reads) == steps + 1  # the prompt, then the verdict
    assert len(reads) == 2 * steps + 2, collections.Counter(reads)  # and the prompt at reset
    assert drafter.reliability.tested > 0
