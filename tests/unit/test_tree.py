"""Draft trees: specs, validation, masks and positions against hand-built trees, dynamic trees."""

import itertools

import pytest
import torch
from transformers import DynamicCache

from draftsmith.runtime.tree import (
    DraftTree,
    DynamicTreeSpec,
    Frontier,
    TreeError,
    TreeSpec,
    ancestor_mask,
    LevelFrontier,
    build_dynamic_tree,
    build_dynamic_tree_on_device,
    default_tree,
    parse_tree,
    tree_attention_mask,
    tree_positions,
)
from draftsmith.testing import tiny_causal_lm


pytestmark = pytest.mark.usefixtures("one_thread")

# root 0 -> 1, 2; 1 -> 3, 4; 3 -> 5
HAND_PARENTS = [-1, 0, 0, 1, 1, 3]
HAND_ANCESTORS = [  # row i: ancestors-or-self of node i
    [1, 0, 0, 0, 0, 0],
    [1, 1, 0, 0, 0, 0],
    [1, 0, 1, 0, 0, 0],
    [1, 1, 0, 1, 0, 0],
    [1, 1, 0, 0, 1, 0],
    [1, 1, 0, 1, 0, 1],
]


def test_spec_orders_nodes_topologically_with_siblings_in_rank_order():
    spec = TreeSpec.from_choices([(0, 0, 0), (1,), (0, 1), (0,), (0, 0)])
    assert spec.choices == ((0,), (1,), (0, 0), (0, 1), (0, 0, 0))
    assert spec.parents == (-1, 0, 0, 1, 1, 3)
    assert spec.depths == (0, 1, 1, 2, 2, 3)
    assert spec.ranks == (0, 0, 1, 0, 1, 0)
    assert spec.num_nodes == 6 and spec.max_depth == 3
    assert spec.children(1) == [3, 4] and spec.children(5) == []


@pytest.mark.parametrize(
    "choices, detail",
    [
        ([(0,), (0,)], "appears twice"),
        ([(0,), (1, 0)], "has no parent (1,)"),
        ([(0, 0)], "has no parent (0,)"),
        ([()], "the root"),
        ([(0,), (-1,)], "non-negative"),
        ([(0,), (0.5,)], "non-negative"),
        ([0, 1], "not a tuple"),
    ],
)
def test_non_trees_raise_one_clear_line(choices, detail):
    with pytest.raises(TreeError) as info:
        TreeSpec.from_choices(choices)
    message = str(info.value)
    assert message.startswith("a tree spec that is not a tree")
    assert detail in message and "\n" not in message


def test_default_tree_is_top_k_along_the_best_path():
    spec = default_tree(4, (4, 2, 2, 1))
    assert spec.num_nodes == 1 + 4 + 2 + 2 + 1
    assert set(spec.choices) == {(0,), (1,), (2,), (3,), (0, 0), (0, 1), (0, 0, 0), (0, 0, 1), (0, 0, 0, 0)}
    assert default_tree(5, (2,)).choices == ((0,), (1,), (0, 0), (0, 0, 0), (0, 0, 0, 0), (0, 0, 0, 0, 0))
    assert TreeSpec.chain(3).parents == (-1, 0, 1, 2)


def test_parse_cli_flags():
    assert parse_tree("4,2,2,1") == default_tree(4, (4, 2, 2, 1))
    assert parse_tree(" 1,1,1 ") == TreeSpec.chain(3)
    assert parse_tree("[[0],[1],[0,0]]") == TreeSpec.from_choices([(0,), (1,), (0, 0)])
    assert parse_tree("dynamic:6,8,60") == DynamicTreeSpec(6, 8, 60)
    for bad in ("4,x", "[[0],[0]]", "[[0", "dynamic:6,8", "4,0"):
        with pytest.raises(TreeError, match="not a tree"):
            parse_tree(bad)


def test_ancestor_mask_positions_and_attention_mask_by_hand():
    tree = DraftTree.from_lists([9, 8, 7, 6, 5, 4], HAND_PARENTS)
    assert tree.depths.tolist() == [[0, 1, 1, 2, 2, 3]]
    anc = ancestor_mask(tree.parents)
    assert anc[0].int().tolist() == HAND_ANCESTORS
    assert tree_positions(tree.depths, 5).tolist() == [[5, 6, 6, 7, 7, 8]]
    mask = tree_attention_mask(tree.parents, prefix_len=3)
    assert mask.shape == (1, 1, 6, 9)
    visible = (mask[0, 0] == 0).int().tolist()
    for i in range(6):
        assert visible[i] == [1, 1, 1] + HAND_ANCESTORS[i]
    assert mask.min() == torch.finfo(torch.float32).min
    assert tree_attention_mask(tree.parents, 0, torch.bfloat16).dtype == torch.bfloat16


def test_padding_nodes_see_only_themselves_and_are_nobodys_children():
    tree = DraftTree(
        tokens=torch.tensor([[1, 2, 3, 4], [1, 2, 0, 0]]),
        parents=torch.tensor([[-1, 0, 1, 1], [-1, 0, -1, -1]]),
        depths=torch.tensor([[0, 1, 2, 2], [0, 1, 0, 0]]),
        num_nodes=torch.tensor([4, 2]),
    )
    tree.validate()
    anc = ancestor_mask(tree.parents)
    assert anc[1, 2].tolist() == [False, False, True, False]
    kids = tree.children_table()
    assert kids[0].tolist() == [[1, -1], [2, 3], [-1, -1], [-1, -1]]
    assert kids[1].tolist() == [[1, -1], [-1, -1], [-1, -1], [-1, -1]]


@pytest.mark.parametrize(
    "parents, depths, needle",
    [
        ([-1, 0, 2], [0, 1, 2], "has parent 2"),
        ([0, 0, 1], [0, 1, 2], "root's parent"),
        ([-1, 0, 0], [0, 1, 2], "depth"),
    ],
)
def test_draft_tree_validation(parents, depths, needle):
    tree = DraftTree(torch.tensor([[1, 2, 3]]), torch.tensor([parents]), torch.tensor([depths]), torch.tensor([3]))
    with pytest.raises(TreeError, match=needle):
        tree.validate()


@pytest.mark.parametrize(
    "parents, needle",
    [([-1, 0, 2], "node 2 of tree 0 has parent 2"), ([0, 0, 1], "root's parent"), ([], "root"), ([-1, 0, -1], "has parent -1")],
)
def test_a_tree_from_lists_is_checked_on_the_host(parents, needle):
    with pytest.raises(TreeError, match=needle):
        DraftTree.from_lists(list(range(10, 10 + len(parents))), parents)
    tree = DraftTree.from_lists([5, 6, 7, 8], [-1, 0, 1, 0])
    assert tree.max_depth == tree.known_max_depth == 2 and tree.depths.tolist() == [[0, 1, 2, 1]]
    tree.validate()  # what the host checked, the device check agrees with


def test_padding_must_be_detached():
    tree = DraftTree(torch.tensor([[1, 2, 3]]), torch.tensor([[-1, 0, 1]]), torch.tensor([[0, 1, 2]]), torch.tensor([2]))
    with pytest.raises(TreeError, match="padding"):
        tree.validate()


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tree_mask_on_a_kv_cache_reproduces_each_paths_own_forward(arch, attention):
    """One tree forward over a cached prefix gives, at every node, the logits of a plain forward
    over prefix + that node's path: the mask and positions are what an HF model needs."""
    model = tiny_causal_lm(arch, vocab_size=50, hidden_size=32, num_layers=2, seed=3)
    model.set_attn_implementation(attention)
    prefix = torch.randint(0, 50, (1, 7), generator=torch.Generator().manual_seed(0))
    tree = DraftTree.from_lists([11, 12, 13, 14, 15, 16], HAND_PARENTS)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(prefix, past_key_values=cache, use_cache=True)
        out = model(
            tree.tokens,
            attention_mask=tree_attention_mask(tree.parents, 7),
            position_ids=tree_positions(tree.depths, 7),
            past_key_values=cache,
            use_cache=True,
        )
        assert cache.get_seq_length() == 7 + 6
        for i in range(6):
            path = [j for j in range(6) if HAND_ANCESTORS[i][j]]
            full = model(torch.cat([prefix, tree.tokens[:, path]], dim=1)).logits[0, -1]
            torch.testing.assert_close(out.logits[0, i], full, atol=1e-5, rtol=1e-5)


def _table_expand(table, calls):
    """An expand whose log-probs depend only on the frontier node's token."""

    def expand(frontier: Frontier):
        calls.append(list(frontier.nodes))
        return table[[frontier.tokens[n] for n in frontier.nodes]]

    return expand


def test_dynamic_tree_expands_best_frontier_and_keeps_best_budget():
    torch.manual_seed(0)
    V, depth, topk, budget = 7, 3, 2, 5
    table = torch.log_softmax(torch.randn(V, V) * 2, dim=-1)
    calls = []
    tree, ids = build_dynamic_tree(_table_expand(table, calls), root_token=3, depth=depth, topk=topk, budget=budget)

    # Brute force the same construction to know every created node and its cumulative score.
    nodes = [(3, -1, 0.0)]  # (token, parent id, score)
    frontier = [0]
    expected_calls = []
    for _ in range(depth):
        expected_calls.append(frontier)
        level = []
        for parent in frontier:
            values, tokens = torch.topk(table[nodes[parent][0]], topk)
            for v, t in zip(values.tolist(), tokens.tolist()):
                level.append(len(nodes))
                nodes.append((t, parent, nodes[parent][2] + v))
        frontier = sorted(sorted(level, key=lambda i: -nodes[i][2])[:topk])
    assert calls == expected_calls
    best = sorted(range(1, len(nodes)), key=lambda i: -nodes[i][2])[:budget]
    assert ids == [0] + sorted(best)
    assert tree.size == budget + 1
    assert tree.tokens[0].tolist() == [nodes[i][0] for i in ids]
    for new, old in enumerate(ids[1:], start=1):
        assert ids[int(tree.parents[0, new])] == nodes[old][1]  # the kept node's parent is kept


def test_dynamic_tree_keeps_ancestors_on_ties():
    """A token of probability one gives a child the same cumulative log-prob as its parent; the
    parent must still win the tie, or the kept set would not be a tree."""
    V = 4
    table = torch.full((V, V), float("-inf"))
    table[:, 1] = 0.0  # every node's only live child is token 1, with log-prob exactly 0
    tree, ids = build_dynamic_tree(_table_expand(table, []), root_token=0, depth=4, topk=3, budget=2)
    assert tree.parents[0].tolist() == [-1, 0, 1]
    assert tree.tokens[0].tolist() == [0, 1, 1]
    assert ids == [0, 1, 2]


def test_dynamic_tree_budget_larger_than_the_tree():
    table = torch.log_softmax(torch.randn(5, 5), dim=-1)
    tree, ids = build_dynamic_tree(_table_expand(table, []), root_token=0, depth=2, topk=2, budget=100)
    assert tree.size == 1 + 2 + 4 and ids == list(range(7))
    # Every node appears once with a parent before it: build_dynamic_tree validated the tree.
    assert all(p < i for i, p in itertools.islice(enumerate(tree.parents[0].tolist()), 1, None))



def _level_expand(table, calls):
    """build_dynamic_tree_on_device's twin of _table_expand: records the live frontier nodes."""

    def expand(frontier: LevelFrontier):
        calls.append(frontier)
        return table[frontier.tokens]

    return expand


def _same_tree_on_device(table, depth, topk, budget):
    """Grow the tree both ways; assert the device one keeps the host one's nodes, in the same
    order, the -inf candidates the host skips becoming padding at the end. Returns the device tree."""
    V = table.shape[-1]
    host_calls, device_calls = [], []
    host, ids = build_dynamic_tree(_table_expand(table, host_calls), root_token=1, depth=depth, topk=topk, budget=budget)
    tree, device_ids = build_dynamic_tree_on_device(_level_expand(table, device_calls), 1, depth, topk, budget, torch.device("cpu"))
    n = int(tree.num_nodes[0])
    assert n == host.size
    assert tree.tokens[0, :n].tolist() == host.tokens[0].tolist()
    assert tree.parents[0, :n].tolist() == host.parents[0].tolist()
    assert tree.depths[0, :n].tolist() == host.depths[0].tolist()
    assert tree.parents[0, n:].tolist() == [-1] * (tree.size - n) and tree.tokens[0, n:].eq(0).all()
    tree.validate()
    assert tree.depth_bound == depth and tree.max_depth == host.max_depth
    assert len(device_calls) == depth and host_calls[0] == device_calls[0].nodes.tolist() == [0]
    # Each level names its nodes' parents' rows in the level before.
    assert device_calls[0].parent_rows is None
    for before, level in zip(device_calls, device_calls[1:]):
        assert before.nodes[level.parent_rows].tolist() == level.parents.tolist()
    # ids name each kept node's creation: the token expand's top-k gave it.
    created = torch.cat([torch.tensor([1])] + [table[c.tokens].topk(min(topk, V), dim=-1).indices.flatten() for c in device_calls])
    assert created[device_ids[:n]].tolist() == host.tokens[0].tolist()
    return tree


@pytest.mark.parametrize("seed", range(12))
def test_dynamic_tree_on_device_is_the_host_tree(seed):
    """Random tables, with ties (log-probs rounded to a few values) and tokens of probability zero."""
    g = torch.Generator().manual_seed(seed)
    V = 6 + seed % 5
    table = torch.log_softmax(torch.randn(V, V, generator=g) * 2, dim=-1)
    if seed % 2:
        table = (table * 2).round() / 2
    if seed % 3 == 0:
        table[torch.rand(V, V, generator=g) < 0.6] = float("-inf")
        table[:, 0] = 0.0  # one live candidate in every row
    _same_tree_on_device(table, depth=1 + seed % 4, topk=2 + seed % 3, budget=3 + 2 * (seed % 6))


def test_dynamic_tree_on_device_pads_when_few_candidates_live():
    """One live token a row (the rest -inf): fewer real nodes than the budget, the rest padding."""
    table = torch.full((4, 4), float("-inf"))
    table[:, 1] = 0.0
    tree = _same_tree_on_device(table, depth=4, topk=3, budget=10)
    assert int(tree.num_nodes[0]) == 5 and tree.size == 11


def test_a_static_tree_grown_on_the_device_is_the_host_tree():
    """grow_static_tree_on_device against grow_static_tree (greedy), with logits that depend on
    each node's whole path: the same tokens node for node; None, before any expansion, when a
    rank is not below the vocabulary."""
    from draftsmith.runtime.drafters import grow_static_tree, grow_static_tree_on_device
    from draftsmith.runtime.verify import GREEDY

    V = 9
    table = torch.randn(V, V, generator=torch.Generator().manual_seed(3))
    spec = default_tree(4, (3, 2, 2, 1))

    def host_logits(frontier: Frontier):
        rows = []
        for n in frontier.nodes:
            path, m = [], n
            while m >= 0:
                path.append(frontier.tokens[m])
                m = frontier.parents[m]
            rows.append(table[path[0]] + 0.1 * len(path) * table[sum(path) % V])  # depends on the path, not the token alone
        return torch.stack(rows)

    tokens_of = {}  # the device version's tokens per spec node, kept to rebuild each path
    levels = []

    def device_logits(level: LevelFrontier):
        levels.append(level)
        rows = []
        for node, parent, token in zip(level.nodes.tolist(), level.parents.tolist(), level.tokens.tolist()):
            tokens_of[node] = token
            path, m = [], node
            while m >= 0:
                path.append(tokens_of[m])
                m = spec.parents[m]
            rows.append(table[path[0]] + 0.1 * len(path) * table[sum(path) % V])
        return torch.stack(rows)

    host, _ = grow_static_tree(spec, 4, host_logits, GREEDY)
    device = grow_static_tree_on_device(spec, 4, device_logits, torch.device("cpu"))
    assert device.tokens.tolist() == host.tokens.tolist() and device.parents.tolist() == host.parents.tolist()
    assert device.max_depth == host.max_depth == 4
    # Each level names its nodes' parents' rows in the level before.
    assert len(levels) == 4 and all(before.nodes[level.parent_rows].tolist() == level.parents.tolist() for before, level in zip(levels, levels[1:]))
    calls = []
    assert grow_static_tree_on_device(TreeSpec.from_choices([(0,), (12,)]), 4, lambda f: calls.append(f) or torch.zeros(1, V), torch.device("cpu")) is None
    assert len(calls) == 1  # only the root's logits were asked for


def test_a_static_trees_levels_name_their_parents_rows_as_comparing_ids_finds_them():
    """A branching spec: level 3's nodes have parents at rows 0, 1, 1 of level 2 (a mutant giving
    every node row 0, as a one-node level would, fails)."""
    from draftsmith.runtime.drafters import grow_static_tree_on_device

    spec = TreeSpec.from_choices([(0,), (1,), (0, 0), (0, 1), (1, 0), (1, 1), (0, 0, 0), (1, 1, 0), (1, 0, 0)])
    levels = []
    grow_static_tree_on_device(spec, 4, lambda level: levels.append(level) or torch.randn(level.nodes.shape[0], 9), torch.device("cpu"))
    assert [level.parent_rows.tolist() for level in levels] == [[0], [0, 0], [0, 1, 1]]
    for before, level in zip(levels, levels[1:]):
        by_ids = LevelFrontier(level.level, level.nodes, level.parents, level.tokens).rows_in(before.nodes)
        assert level.rows_in(before.nodes).tolist() == by_ids.tolist()
        assert before.nodes[level.parent_rows].tolist() == level.parents.tolist()


@pytest.mark.parametrize("seed", range(6))
def test_dynamic_tree_on_device_over_a_draft_vocabulary_is_the_same_tree(seed):
    """``columns`` (a draft vocabulary: the only tokens a row can give a finite log-prob) makes the
    top-k read those columns alone and gives the tree the whole rows give: the same tokens, parents,
    depths, node count and creation ids, with live candidates fewer than topk in some rows."""
    g = torch.Generator().manual_seed(seed)
    V, C = 40, 9 + seed
    columns = torch.randperm(V, generator=g)[:C].sort().values
    table = torch.full((V, V), float("-inf"))
    table[:, columns] = torch.log_softmax(torch.randn(V, C, generator=g) * 2, dim=-1)
    if seed % 2:
        table[torch.rand(V, V, generator=g) < 0.5] = float("-inf")
        table[:, columns[0]] = 0.0  # one live candidate in every row
    depth, topk, budget = 2 + seed % 3, 3 + seed % 2, 6 + 3 * seed
    whole, whole_ids = build_dynamic_tree_on_device(_level_expand(table, []), 1, depth, topk, budget, torch.device("cpu"))
    read, read_ids = build_dynamic_tree_on_device(_level_expand(table, []), 1, depth, topk, budget, torch.device("cpu"), columns=columns)
    for name in ("tokens", "parents", "depths", "num_nodes"):
        assert torch.equal(getattr(read, name), getattr(whole, name)), name
    assert torch.equal(read_ids, whole_ids)
    assert set(read.tokens[0, 1 : int(read.num_nodes[0])].tolist()) <= set(columns.tolist())
    # A vocabulary smaller than topk is read whole: the same tree, level shapes and all.
    few = columns[: topk - 1]
    table[:, [c for c in range(V) if c not in set(few.tolist())]] = float("-inf")
    whole, _ = build_dynamic_tree_on_device(_level_expand(table, []), 1, depth, topk, budget, torch.device("cpu"))
    read, _ = build_dynamic_tree_on_device(_level_expand(table, []), 1, depth, topk, budget, torch.device("cpu"), columns=few)
    assert all(torch.equal(getattr(read, name), getattr(whole, name)) for name in ("tokens", "parents", "depths", "num_nodes"))


def test_dynamic_tree_on_device_level_shapes_are_fixed():
    """Every level past the first expands exactly topk nodes (CUDA graphs replay one shape)."""
    table = torch.log_softmax(torch.randn(9, 9), dim=-1)
    calls = []
    build_dynamic_tree_on_device(_level_expand(table, calls), 0, 5, 3, 10, torch.device("cpu"))
    assert [c.nodes.numel() for c in calls] == [1, 3, 3, 3, 3]
    assert [c.level for c in calls] == [1, 2, 3, 4, 5]
    for c in calls[1:]:
        assert c.nodes.tolist() == sorted(c.nodes.tolist())


# ---------------------------------------------------------------- sparse trees from measured accuracies


def _expected_length(choices, acc):
    total = 1.0
    for choice in choices:
        value = 1.0
        for depth, rank in enumerate(choice):
            value *= acc[depth][rank]
        total += value
    return total


def test_sparse_tree_is_the_best_tree_of_its_size():
    """Against every tree of N nodes drawn from the candidate paths (brute force): none has a
    larger expected accepted length (1 + sum over nodes of the product of rank accuracies)."""
    from draftsmith.runtime.tree import sparse_tree

    acc = [[0.45, 0.15, 0.1], [0.35, 0.12, 0.05], [0.3, 0.1, 0.02]]
    paths = [p for d in (1, 2, 3) for p in itertools.product(range(3), repeat=d)]
    for nodes in (1, 3, 5, 6):
        tree = sparse_tree(acc, nodes)
        assert len(tree.spec.choices) == nodes
        assert tree.expected_accept_length == pytest.approx(_expected_length(tree.spec.choices, acc))
        best = 0.0
        for subset in itertools.combinations(paths, nodes):
            chosen = set(subset)
            if all(len(p) == 1 or p[:-1] in chosen for p in chosen):  # a tree: every parent present
                best = max(best, _expected_length(subset, acc))
        assert tree.expected_accept_length == pytest.approx(best), nodes


def test_sparse_tree_follows_the_accuracies_and_round_trips():
    from draftsmith.runtime.tree import SparseTree, sparse_tree

    # A weak first head puts width at depth 1; strong later heads make the best path deep.
    wide = sparse_tree([[0.2, 0.18, 0.16, 0.15], [0.1, 0.05], [0.1, 0.05]], 4)
    assert wide.spec.choices == ((0,), (1,), (2,), (3,))
    deep = sparse_tree([[0.9, 0.05], [0.9, 0.05], [0.9, 0.05]], 4)
    assert deep.spec.choices == ((0,), (1,), (0, 0), (0, 0, 0))
    # A rank that measured better than the one above it enters first: ranks may leave gaps.
    gappy = sparse_tree([[0.3, 0.01, 0.2]], 2)
    assert gappy.spec.choices == ((0,), (2,))
    # More nodes than candidate paths: all of them.
    assert len(sparse_tree([[0.5, 0.4]], 8).spec.choices) == 2
    stored = deep.to_dict()
    assert stored["nodes"] == 4 and stored["kind"] == "sparse"
    assert SparseTree.from_dict(stored) == deep
    with pytest.raises(TreeError):
        SparseTree.from_dict({"choices": [[0], [1, 0]]})  # (1,) is missing
    with pytest.raises(TreeError):
        sparse_tree([[0.5]], 0)
