"""Drafters: static-tree growth, draws without replacement, cache compaction and rollback, Medusa placement."""

import pytest
import torch
from scipy import stats
from transformers import DynamicCache

from draftsmith.heads.medusa import MedusaConfig, MedusaHead
from draftsmith.runtime.drafters import (
    Drafter,
    DrafterError,
    DraftState,
    HeadDrafter,
    StandaloneDrafter,
    compact_cache,
    grow_static_tree,
    sample_without_replacement,
)
from draftsmith.runtime.tree import DynamicTreeSpec, Frontier, TreeSpec, default_tree
from draftsmith.runtime.verify import SamplingParams, logits_to_probs, verify_greedy
from draftsmith.target import FrozenTarget
from draftsmith.testing import tiny_causal_lm


pytestmark = pytest.mark.usefixtures("one_thread")

SPEC = TreeSpec.from_choices([(0,), (2,), (0, 0), (0, 1), (2, 0), (0, 0, 0)])
GREEDY = SamplingParams()


def _fixed_logits(table):
    """level_logits whose logits depend only on the node's token."""

    def level_logits(frontier: Frontier):
        return table[[frontier.tokens[n] for n in frontier.nodes]]

    return level_logits


def test_grow_static_tree_greedy_places_ranked_tokens():
    V = 6
    table = torch.arange(V * V, dtype=torch.float32).view(V, V).remainder(7.0)  # distinct ranks per row
    tree, spec_ids = grow_static_tree(SPEC, 1, _fixed_logits(table), GREEDY)
    order = {t: torch.argsort(table[t], descending=True, stable=True).tolist() for t in range(V)}
    tokens = tree.tokens[0].tolist()
    assert tree.parents[0].tolist() == list(SPEC.parents) and spec_ids == list(range(SPEC.num_nodes))
    assert tokens[1] == order[1][0] and tokens[2] == order[1][2]  # ranks 0 and 2 of the root
    assert tokens[3] == order[tokens[1]][0] and tokens[4] == order[tokens[1]][1]
    assert tokens[5] == order[tokens[2]][0] and tokens[6] == order[tokens[3]][0]
    assert tree.draft_probs is None


def test_grow_static_tree_sample_draws_distinct_children_and_records_q():
    V = 6
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(V, V, generator=gen)
    params = SamplingParams("sample", 0.8, top_k=5)
    for _ in range(20):
        tree, _ = grow_static_tree(SPEC, 1, _fixed_logits(table), params, gen)
        tokens = tree.tokens[0].tolist()
        assert tokens[1] != tokens[2] and tokens[3] != tokens[4]
        for node in (0, 1, 2, 3):  # nodes with children carry their processed q
            torch.testing.assert_close(tree.draft_probs[0, node], logits_to_probs(table[tokens[node]], 0.8, 5))
        assert tree.draft_probs[0, 4:].abs().sum() == 0


def test_grow_static_tree_sample_leaves_out_children_past_the_support():
    table = torch.randn(5, 5)
    tree, spec_ids = grow_static_tree(SPEC, 0, _fixed_logits(table), SamplingParams("sample", top_k=1))
    # one live token per node: only the rank-0 chain (0,) (0,0) (0,0,0) survives
    assert spec_ids == [0, 1, 3, 6] and tree.parents[0].tolist() == [-1, 0, 1, 2]


def test_sample_without_replacement_draw_order():
    """Gumbel top-k gives sequential draws without replacement: P(x1, x2) = q1 q2 / (1 - q1)."""
    q = torch.tensor([0.4, 0.3, 0.2, 0.1, 0.0], dtype=torch.float64)
    gen = torch.Generator().manual_seed(1)
    n = 20_000
    draws = torch.stack([sample_without_replacement(q, 2, gen) for _ in range(n)])
    assert (draws != 4).all() and (draws[:, 0] != draws[:, 1]).all()
    expected = torch.zeros(5, 5, dtype=torch.float64)
    for a in range(4):
        for b in range(4):
            if a != b:
                expected[a, b] = q[a] * q[b] / (1 - q[a])
    live = expected.flatten() > 0
    observed = torch.bincount(draws[:, 0] * 5 + draws[:, 1], minlength=25).double()
    assert stats.chisquare(observed[live].numpy(), (expected.flatten()[live] / expected.sum() * n).numpy()).pvalue > 1e-3
    assert sample_without_replacement(q, 9).numel() == 4  # never more than the support


def test_compact_cache_packs_kept_positions_after_the_prefix():
    cache = DynamicCache()
    keys = torch.arange(10, dtype=torch.float32).view(1, 1, 10, 1).expand(1, 2, 10, 3).contiguous()
    for layer in range(2):
        cache.update(keys.clone() + 100 * layer, -keys.clone(), layer)
    compact_cache(cache, prefix_len=4, keep=[0, 2, 5])
    for i, layer in enumerate(cache.layers):
        assert layer.keys[0, 0, :, 0].tolist() == [x + 100 * i for x in [0, 1, 2, 3, 4, 6, 9]]
        assert layer.values[0, 1, :, 2].tolist() == [-x for x in [0, 1, 2, 3, 4, 6, 9]]
    assert cache.get_seq_length() == 7


def _state(tokens, **kw):
    return DraftState(tokens=torch.tensor([tokens]), **kw)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("tree", [TreeSpec.chain(3), default_tree(3, (3, 2, 1)), DynamicTreeSpec(3, 2, 5)], ids=["chain", "tree", "dynamic"])
def test_standalone_cache_rolls_back_to_the_accepted_path(arch, tree):
    """After accept the drafter's cache holds exactly the decided tokens' entries minus the unseen
    tail, and its next proposal equals a fresh drafter's on the same tokens."""
    model = tiny_causal_lm(arch, vocab_size=30, hidden_size=32, num_layers=2, seed=2)
    drafter = StandaloneDrafter(model, tree)
    prompt = [5, 6, 7, 8]
    drafter.reset(torch.tensor([prompt]))
    proposed = drafter.propose(_state(prompt))
    # Pretend the target accepted the deepest path through the first child, then chose token 9.
    fake_logits = torch.zeros(1, proposed.size, 30)
    node, parents = 0, proposed.parents[0].tolist()
    for _ in range(2):
        kids = [i for i, p in enumerate(parents) if p == node]
        if not kids:
            break
        fake_logits[0, node, proposed.tokens[0, kids[0]]] = 1.0
        node = kids[0]
    fake_logits[0, node, 9] = 2.0
    result = verify_greedy(proposed, fake_logits)
    assert int(result.accept_len[0]) >= 1
    drafter.accept(result)
    a = int(result.accept_len[0])
    decided = prompt + result.accepted_tokens[0, :a].tolist() + [9]
    assert drafter.cache.get_seq_length() == drafter.cached_len <= len(decided) - 1
    again = drafter.propose(_state(decided))
    fresh = StandaloneDrafter(model, tree)
    fresh.reset(torch.tensor([decided]))
    reference = fresh.propose(_state(decided))
    assert torch.equal(again.tokens, reference.tokens) and torch.equal(again.parents, reference.parents)
    with pytest.raises(DrafterError, match="before accept"):
        drafter.propose(_state(decided))


def test_standalone_dynamic_tree_when_sampling_proposes_fixed_candidates():
    """A dynamic tree drafted in sample mode is the draft's ranking under the processed distribution,
    marked deterministic (EAGLE's rule verifies it) and without draft_probs; top-k filtering keeps
    tokens the processed draft cannot produce out of it."""
    model = tiny_causal_lm(vocab_size=20, hidden_size=16, num_layers=1)
    prompt = torch.tensor([[1, 2]])
    with torch.no_grad():
        root_logits = model(prompt).logits[0, -1]
    for params, topk in ((SamplingParams("sample", 0.7), 4), (SamplingParams("sample", 1.3, top_k=2), 4)):
        drafter = StandaloneDrafter(model, DynamicTreeSpec(2, topk, 6))
        drafter.reset(prompt)
        tree = drafter.propose(_state([1, 2], sampling=params))
        assert tree.deterministic and tree.draft_probs is None
        children = [int(t) for t, p in zip(tree.tokens[0].tolist(), tree.parents[0].tolist()) if p == 0]
        live = logits_to_probs(root_logits, params.temperature, params.top_k, params.top_p)
        ranked = torch.argsort(live, descending=True, stable=True)[: int((live > 0).sum())].tolist()
        # The kept root children are the best-ranked live tokens (the budget may drop the weakest).
        assert 1 <= len(children) <= min(topk, len(ranked)) and sorted(children) == sorted(ranked[: len(children)])
        drafter.accept(verify_greedy(tree, torch.zeros(1, tree.size, 20)))


def _medusa(num_heads=3, seed=0):
    target = FrozenTarget(tiny_causal_lm("llama", vocab_size=40, hidden_size=32, num_layers=2))
    head = MedusaHead(MedusaConfig(num_heads=num_heads, num_layers=1), target.dims)
    torch.manual_seed(seed)
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.5)  # a random head, not the identity start
    return target, head


def test_medusa_places_head_d_tokens_at_depth_d():
    target, head = _medusa()
    spec = TreeSpec.from_choices([(0,), (1,), (0, 0), (1, 0), (1, 1), (0, 0, 0)])
    drafter = HeadDrafter(head, target, spec)
    assert isinstance(drafter, Drafter)
    hidden = torch.randn(1, 5, 32)
    tree = drafter.propose(_state([9, 8, 7, 6, 3, 4], new_hidden=hidden))  # 5 cached positions, then the root
    ranked = head.head_logits(hidden[0, -1], target.lm_head).argsort(-1, descending=True)  # [K,V]
    tokens = tree.tokens[0].tolist()
    assert tokens[0] == 4
    assert tokens[1:3] == ranked[0, :2].tolist()
    assert tokens[3] == ranked[1, 0] and tokens[4:6] == ranked[1, :2].tolist()
    assert tokens[6] == ranked[2, 0]


def test_medusa_sample_draws_from_each_heads_distribution():
    target, head = _medusa()
    drafter = HeadDrafter(head, target, TreeSpec.from_choices([(0,), (1,), (0, 0)]))
    hidden = torch.randn(1, 1, 32)
    params = SamplingParams("sample", 0.9, top_p=0.95)
    tree = drafter.propose(_state([5, 3], new_hidden=hidden, sampling=params, generator=torch.Generator().manual_seed(0)))
    logits = head.head_logits(hidden[0, -1], target.lm_head)
    torch.testing.assert_close(tree.draft_probs[0, 0], logits_to_probs(logits[0], 0.9, 0, 0.95))
    torch.testing.assert_close(tree.draft_probs[0, 1], logits_to_probs(logits[1], 0.9, 0, 0.95))


def test_head_drafter_errors_and_root_only_start():
    target, head = _medusa(num_heads=2)
    with pytest.raises(DrafterError, match="the tree is 3 deep but the medusa head drafts 2 tokens"):
        HeadDrafter(head, target, TreeSpec.chain(3))
    with pytest.raises(DrafterError, match="the tree is 3 deep"):
        HeadDrafter(head, target, DynamicTreeSpec(3, 2, 3))
    tree = HeadDrafter(head, target, TreeSpec.chain(2)).propose(_state([7]))  # one-token prompt
    assert tree.tokens.tolist() == [[7]]


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_a_tree_rooted_elsewhere_is_refused_before_anything_is_emitted(cache):
    """The loop checks the root with the step's verdict (no sync of its own): still one clear error."""
    from draftsmith.runtime.drafters import DrafterError
    from draftsmith.runtime.generate import speculative_generate
    from draftsmith.runtime.tree import DraftTree

    class OffByOne:
        def required_layers(self):
            return []

        def reset(self, prompt):
            pass

        def propose(self, state):
            return DraftTree.from_lists([state.root + 1, 7], [-1, 0])

        def accept(self, result):
            pass

    target = FrozenTarget(tiny_causal_lm("llama", seed=0))
    with pytest.raises(DrafterError, match="OffByOne proposed a tree whose root is not the last decided token"):
        speculative_generate(target, OffByOne(), torch.tensor([[5, 6, 7]]), 8, cache=cache)


def test_a_static_tree_from_path_free_levels_is_drafted_on_the_device_as_on_the_host(monkeypatch):
    """Medusa's and DFlash's greedy static trees: one top-k and a gather (no host read), the very
    tree grow_static_tree builds level by level; and HeadDrafter takes that path for them."""
    from draftsmith.runtime import drafters
    from draftsmith.runtime.drafters import grow_static_tree, static_tree_on_device
    from draftsmith.runtime.verify import GREEDY

    gen = torch.Generator().manual_seed(0)
    specs = [TreeSpec.chain(4), default_tree(4, (4, 2, 2, 1)), default_tree(3, (3, 2, 1)), TreeSpec.from_choices([(0,), (1,), (0, 0), (1, 0), (0, 0, 0)])]
    for spec in specs:
        levels = torch.randn(5, 50, generator=gen)
        on_device = static_tree_on_device(spec, 7, levels)
        host, _ = grow_static_tree(spec, 7, lambda f: levels[[f.depths[n] for n in f.nodes]], GREEDY)
        for name in ("tokens", "parents", "depths", "num_nodes"):
            assert torch.equal(getattr(on_device, name), getattr(host, name)), (spec, name)
        on_device.validate()
    assert static_tree_on_device(TreeSpec.chain(4), 7, torch.randn(3, 50)) is None  # fewer levels than depths
    assert static_tree_on_device(default_tree(2, (4, 1)), 7, torch.randn(2, 3)) is None  # more ranks than tokens

    target = FrozenTarget(tiny_causal_lm("llama", seed=0))
    head = MedusaHead(MedusaConfig(num_heads=4, num_layers=1), target.dims)

    def host_path(*args, **kwargs):
        raise AssertionError("a Medusa static tree took the host path")

    monkeypatch.setattr(drafters, "grow_tree", host_path)
    from draftsmith.runtime.generate import speculative_generate

    ids = torch.tensor([[5, 9, 14, 20]])
    out, stats = speculative_generate(target, HeadDrafter(head, target, default_tree(4, (4, 2, 2, 1))), ids, 12)
    want = target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12, pad_token_id=0, eos_token_id=None)
    assert out.tolist() == want.tolist() and stats.steps >= 1
