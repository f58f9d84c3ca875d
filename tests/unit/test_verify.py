"""Verification: greedy by hand, sampling by hand and in distribution (with broken rules that must fail)."""

import math
import sys

import pytest
import torch
from scipy import stats

from draftsmith.runtime import verify as verify_module
from draftsmith.runtime.tree import DraftTree, TreeSpec
from draftsmith.runtime.verify import SamplingParams, logits_to_probs, verify, verify_greedy, verify_sample, verify_sample_on_device, verify_typical

LN2, LN4 = math.log(2.0), math.log(4.0)


# ---------------------------------------------------------------- logits_to_probs


def test_logits_to_probs_by_hand():
    logits = torch.tensor([0.0, LN2, LN4])
    torch.testing.assert_close(logits_to_probs(logits), torch.tensor([1, 2, 4]) / 7.0)
    torch.testing.assert_close(logits_to_probs(logits, top_k=2), torch.tensor([0, 1, 2]) / 3.0)
    torch.testing.assert_close(logits_to_probs(logits, top_p=0.5), torch.tensor([0.0, 0.0, 1.0]))
    torch.testing.assert_close(logits_to_probs(logits, top_p=0.6), torch.tensor([0, 1, 2]) / 3.0)
    s = math.sqrt(2.0)
    torch.testing.assert_close(logits_to_probs(logits, temperature=2.0), torch.tensor([1.0, s, 2.0]) / (3.0 + s))
    torch.testing.assert_close(logits_to_probs(logits, temperature=0.0), torch.tensor([0.0, 0.0, 1.0]))
    # top-k keeps ties at the boundary
    torch.testing.assert_close(logits_to_probs(torch.tensor([1.0, 1.0, 0.0]), top_k=1), torch.tensor([0.5, 0.5, 0.0]))


def test_logits_to_probs_precision_and_shape():
    logits = torch.randn(2, 3, 11)
    assert logits_to_probs(logits.to(torch.bfloat16)).dtype == torch.float32
    assert logits_to_probs(logits.double()).dtype == torch.float64
    probs = logits_to_probs(logits, 0.7, top_k=5, top_p=0.9)
    assert probs.shape == (2, 3, 11)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 3))
    assert ((probs > 0).sum(-1) <= 5).all()


def test_sampling_params_validate():
    for bad in (dict(mode="beam"), dict(temperature=-1.0), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


# ---------------------------------------------------------------- greedy


def _logits(N, V, argmaxes):
    """Target logits [1,N,V] whose argmax at node i is argmaxes[i]."""
    logits = torch.zeros(1, N, V)
    for i, a in enumerate(argmaxes):
        logits[0, i, a] = 1.0
    return logits


def test_greedy_by_hand():
    # root(9) -> 1(tok 4), 2(tok 5); 1 -> 3(tok 6), 4(tok 7); 3 -> 5(tok 8)
    tree = DraftTree.from_lists([9, 4, 5, 6, 7, 8], [-1, 0, 0, 1, 1, 3])
    # target: after root 4, after node 1 -> 6, after node 3 -> 2 (node 5 drafted 8: rejected)
    result = verify_greedy(tree, _logits(6, 10, [4, 6, 5, 6, 0, 1]))
    assert result.accept_len.tolist() == [2]
    assert result.best_node.tolist() == [3]
    assert result.path.tolist() == [[0, 1, 3, -1]]
    assert result.accepted_tokens.tolist() == [[4, 6, -1]]
    assert result.bonus.tolist() == [6]  # argmax at node 3

    nothing = verify_greedy(tree, _logits(6, 10, [3, 6, 5, 6, 0, 1]))
    assert nothing.accept_len.tolist() == [0] and nothing.path.tolist() == [[0, -1, -1, -1]]
    assert nothing.accepted_tokens.tolist() == [[-1, -1, -1]] and nothing.bonus.tolist() == [3]

    everything = verify_greedy(tree, _logits(6, 10, [4, 6, 0, 8, 0, 1]))
    assert everything.accept_len.tolist() == [3] and everything.path.tolist() == [[0, 1, 3, 5]]
    assert everything.accepted_tokens.tolist() == [[4, 6, 8]] and everything.bonus.tolist() == [1]


def test_greedy_ties_go_to_the_deepest_then_lowest_index():
    # Duplicate siblings: both 1 and 2 hold token 4, which the target picks.
    tree = DraftTree.from_lists([0, 4, 4, 7], [-1, 0, 0, 2])
    deeper = verify_greedy(tree, _logits(4, 8, [4, 1, 7, 3]))
    assert deeper.best_node.tolist() == [3] and deeper.path.tolist() == [[0, 2, 3]]
    lowest = verify_greedy(tree, _logits(4, 8, [4, 1, 5, 3]))
    assert lowest.best_node.tolist() == [1] and lowest.bonus.tolist() == [1]


def test_greedy_batch_with_padding_and_a_root_only_tree():
    tree = DraftTree(
        tokens=torch.tensor([[0, 3, 4], [0, 3, 3]]),
        parents=torch.tensor([[-1, 0, 1], [-1, -1, -1]]),
        depths=torch.tensor([[0, 1, 2], [0, 0, 0]]),
        num_nodes=torch.tensor([3, 1]),
    )
    logits = torch.cat([_logits(3, 6, [3, 4, 5]), _logits(3, 6, [3, 3, 3])])
    result = verify_greedy(tree, logits)
    # Row 1's padding nodes hold the target's token, but padding is nobody's child.
    assert result.accept_len.tolist() == [2, 0]
    assert result.path.tolist() == [[0, 1, 2], [0, -1, -1]]
    assert result.bonus.tolist() == [5, 3]

    root_only = verify_greedy(DraftTree.from_lists([7], [-1]), _logits(1, 9, [2]))
    assert root_only.accept_len.tolist() == [0] and root_only.path.tolist() == [[0]]
    assert root_only.accepted_tokens.shape == (1, 0) and root_only.bonus.tolist() == [2]


# ---------------------------------------------------------------- sampling by hand


def _probs_tree(tokens, parents, q_rows, V):
    q = torch.zeros(len(tokens), V)
    for node, row in q_rows.items():
        q[node] = torch.tensor(row)
    return DraftTree.from_lists(tokens, parents, draft_probs=q)


def _log(p_rows):
    return torch.tensor(p_rows).clamp_min(1e-30).log().unsqueeze(0)


def test_sample_chain_by_hand():
    tree = _probs_tree([3, 0], [-1, 0], {0: [1.0, 0, 0, 0]}, 4)
    logits = _log([[0.5, 0.5, 0, 0], [0.25, 0.25, 0.25, 0.25]])
    accepted = verify_sample(tree, logits, uniforms=torch.tensor([[0.0, 0.4, 0.6]]))
    assert accepted.accept_len.tolist() == [1] and accepted.bonus.tolist() == [2]  # leaf: cdf 0.5 < 0.6 <= 0.75
    rejected = verify_sample(tree, logits, uniforms=torch.tensor([[0.0, 0.6, 0.01]]))
    # residual max(p - q, 0) = [0, 0.5, 0, 0] -> token 1 whatever the bonus uniform
    assert rejected.accept_len.tolist() == [0] and rejected.bonus.tolist() == [1]


def test_sample_siblings_by_hand():
    # root -> children tokens 0 then 1, drawn without replacement from q = [0.5, 0.5, 0, 0]
    tree = _probs_tree([3, 0, 1], [-1, 0, 0], {0: [0.5, 0.5, 0, 0]}, 4)
    logits = _log([[0.2, 0.6, 0.2, 0.0], [1, 0, 0, 0], [0, 0, 0, 1]])

    def run(u1, u2, ub=0.5):
        r = verify_sample(tree, logits, uniforms=torch.tensor([[0.0, u1, u2, ub]]))
        return r.best_node.item(), r.bonus.item()

    # first child: accept iff u1 * 0.5 < 0.2
    assert run(0.39, 0.99) == (1, 0)
    # after rejecting token 0: p = [0, 1/3, 2/3, 0], q = [0, 1, 0, 0]; accept token 1 iff u2 < 1/3
    assert run(0.41, 0.32) == (2, 3)
    # both rejected: residual max(p - q, 0) = [0, 0, 2/3, 0] -> token 2
    assert run(0.41, 0.34, 0.99) == (0, 2)


def test_sample_at_temperature_zero_is_greedy():
    gen = torch.Generator().manual_seed(5)
    V = 6
    for _ in range(30):
        # a random tree with distinct sibling tokens (the sampling contract)
        parents, tokens, used = [-1], [0], {0: set()}
        for i in range(1, 10):
            p = int(torch.randint(0, i, (1,), generator=gen))
            free = [t for t in range(V) if t not in used[p]]
            if not free:
                continue
            tok = free[int(torch.randint(0, len(free), (1,), generator=gen))]
            used[p].add(tok)
            used[len(tokens)] = set()
            parents.append(p)
            tokens.append(tok)
        q = torch.softmax(torch.randn(len(tokens), V, generator=gen), -1)
        tree = DraftTree.from_lists(tokens, parents, draft_probs=q)
        logits = torch.randn(1, len(tokens), V, generator=gen) * 3
        greedy = verify_greedy(tree, logits)
        sampled = verify(tree, logits, SamplingParams("sample", 0.0), generator=gen)
        for field in ("accept_len", "best_node", "path", "accepted_tokens", "bonus"):
            assert torch.equal(getattr(greedy, field), getattr(sampled, field)), field


def test_sample_needs_draft_probs_and_right_uniforms():
    tree = DraftTree.from_lists([1, 2], [-1, 0])
    with pytest.raises(ValueError, match="draft_probs"):
        verify_sample(tree, torch.zeros(1, 2, 4))
    tree.draft_probs = torch.full((1, 2, 4), 0.25)
    with pytest.raises(ValueError, match="uniforms"):
        verify_sample(tree, torch.zeros(1, 2, 4), uniforms=torch.zeros(1, 2))
    with pytest.raises(ValueError, match="mode"):
        verify(tree, torch.zeros(1, 2, 4), SamplingParams("beam"))


# ---------------------------------------------------------------- sampling in distribution

V = 6
ROOT = 2


def _markov(seed):
    """Target logits and draft logits as Markov chains: row t is the next-token law after token t."""
    gen = torch.Generator().manual_seed(seed)
    target = torch.randn(V, V, generator=gen) * 1.2
    draft = target + torch.randn(V, V, generator=gen) * 1.5  # a related but clearly different law
    return target, draft


def _gumbel_topk(probs, m, gen):
    """m draws without replacement from each row of probs [B,V], in draw order. Draws past a row's
    support hold any token (a random one here): what a tree drafted on the device keeps there."""
    u = torch.rand(probs.shape, generator=gen, dtype=torch.float64).clamp_min(1e-300)
    keys, draws = torch.topk(probs.log() - torch.log(-torch.log(u)), m, dim=-1)
    past = keys == float("-inf")
    return torch.where(past, torch.randint(0, probs.shape[-1], draws.shape, generator=gen), draws)


def _markov_step(spec, roots, target_logits, draft_probs, params, gen):
    """One speculative step for B rows: draft the spec's tree from the Markov draft, verify it."""
    B, N = roots.shape[0], spec.num_nodes
    tokens = torch.zeros(B, N, dtype=torch.long)
    tokens[:, 0] = roots
    for node in range(N):
        kids = spec.children(node)
        if kids:
            tokens[:, kids] = _gumbel_topk(draft_probs[tokens[:, node]], len(kids), gen)
    tree = DraftTree(
        tokens=tokens,
        parents=spec.parents_tensor().expand(B, N),
        depths=spec.depths_tensor().expand(B, N),
        num_nodes=torch.full((B,), N),
        draft_probs=draft_probs[tokens],
    )
    return verify_sample(tree, target_logits[tokens], params.temperature, params.top_k, params.top_p, generator=gen)


def _topk_step(spec, roots, target_logits, draft_probs, params, gen, as_drawn=False):
    """One speculative step whose children are fixed candidates: the child of rank r is the r-th
    most likely token of the draft (EAGLE-2's dynamic trees choose this way). ``as_drawn`` verifies
    them with the rule for drawn children instead (q = the draft's law): the mistake the test catches."""
    B, N = roots.shape[0], spec.num_nodes
    tokens = torch.zeros(B, N, dtype=torch.long)
    tokens[:, 0] = roots
    ranked = torch.argsort(draft_probs, dim=-1, descending=True, stable=True)
    for node in range(N):
        for kid in spec.children(node):
            tokens[:, kid] = ranked[tokens[:, node], spec.ranks[kid]]
    tree = DraftTree(
        tokens=tokens,
        parents=spec.parents_tensor().expand(B, N),
        depths=spec.depths_tensor().expand(B, N),
        num_nodes=torch.full((B,), N),
        draft_probs=draft_probs[tokens] if as_drawn else None,
        deterministic=not as_drawn,
    )
    return verify_sample(tree, target_logits[tokens], params.temperature, params.top_k, params.top_p, generator=gen)


def _first_two_tokens(spec, params, n, seed, step=_markov_step):
    """The first two emitted tokens of n independent runs from ROOT, running a second step where
    the first emitted only one token."""
    target, draft = _markov(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    draft_probs = logits_to_probs(draft, params.temperature, params.top_k, params.top_p).double()
    roots = torch.full((n,), ROOT, dtype=torch.long)
    first = step(spec, roots, target, draft_probs, params, gen)
    a, acc, bonus = first.accept_len, first.accepted_tokens, first.bonus
    t1 = torch.where(a >= 1, acc[:, 0], bonus)
    second = step(spec, bonus, target, draft_probs, params, gen)
    t2_second_step = torch.where(second.accept_len >= 1, second.accepted_tokens[:, 0], second.bonus)
    t2 = torch.where(a >= 2, acc[:, min(1, acc.shape[1] - 1)], torch.where(a == 1, bonus, t2_second_step))
    p = logits_to_probs(target.double(), params.temperature, params.top_k, params.top_p)
    expected = p[ROOT].unsqueeze(1) * p  # joint law of (t1, t2)
    return t1 * V + t2, expected.flatten()


def _p_value(cells, expected, n):
    observed = torch.bincount(cells, minlength=V * V).double()
    live = expected > 0
    if observed[~live].sum() > 0:
        return 0.0  # a token the target can never produce
    return float(stats.chisquare(observed[live].numpy(), (expected[live] / expected[live].sum() * n).numpy()).pvalue)


CHAIN = TreeSpec.chain(3)
TREE = TreeSpec.from_choices([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
PARAMS = {
    "plain": SamplingParams("sample", 1.0),
    "temp-topk": SamplingParams("sample", 0.7, top_k=4),
    "topp": SamplingParams("sample", 1.3, top_p=0.8),
    # Two tokens kept where the root drafts three children: its third is a draw past q's support,
    # as a tree drafted on the device holds it (q(x) = 0, q out of mass).
    "topk-2": SamplingParams("sample", 1.0, top_k=2),
}


def _always_accept(u, p_x, q_x):
    return torch.ones_like(p_x, dtype=torch.bool)


def _residual_is_p(p, q):
    return p


def _residual_unnormalised(p, q):
    return (p - q).clamp_min(0)


def _q_not_updated(q, x):
    return q


def _accepts_past_the_support(u, p_x, q_x):
    return u * q_x < p_x


BROKEN = {
    "always-accept": ("_accepts", _always_accept),
    "residual-is-p": ("_residual", _residual_is_p),
    "residual-unnormalised": ("_residual", _residual_unnormalised),
    "q-kept-after-reject": ("_without", _q_not_updated),
}

CASES = [
    ("chain", CHAIN, "plain", None),
    ("chain", CHAIN, "temp-topk", None),
    ("chain", CHAIN, "topp", None),
    ("tree", TREE, "plain", None),
    ("tree", TREE, "temp-topk", None),
    ("chain", CHAIN, "plain", "always-accept"),
    ("chain", CHAIN, "plain", "residual-is-p"),
    ("tree", TREE, "plain", "always-accept"),
    ("tree", TREE, "plain", "residual-is-p"),
    ("tree", TREE, "plain", "residual-unnormalised"),
    ("tree", TREE, "plain", "q-kept-after-reject"),
    ("tree", TREE, "topk-2", None),
]


@pytest.mark.parametrize("shape, spec, params, broken", CASES, ids=[f"{c[0]}-{c[2]}-{c[3] or 'correct'}" for c in CASES])
def test_sampled_tokens_follow_the_target(shape, spec, params, broken, monkeypatch):
    """The joint law of the first two emitted tokens equals the target's processed law (chi-square
    over 36 cells); the same test with a broken rule must reject."""
    if broken is not None:
        monkeypatch.setattr(verify_module, *BROKEN[broken])
    n = 40_000
    cells, expected = _first_two_tokens(spec, PARAMS[params], n, seed=11)
    p_value = _p_value(cells, expected, n)
    if broken is None:
        assert p_value > 1e-3
    else:
        assert p_value < 1e-6


@pytest.mark.parametrize("broken", [False, True], ids=["correct", "accepts-past-the-support"])
def test_children_past_the_draft_support_change_nothing(broken, monkeypatch):
    """A root drafts three children where q keeps one token (top-p): the two draws past q's support
    hold random tokens, as a tree drafted on the device keeps them. The first emitted token still
    follows the target's p; accepting such a child where p allows it (the rule before) does not."""
    if broken:
        monkeypatch.setattr(verify_module, "_accepts", _accepts_past_the_support)
    gen = torch.Generator().manual_seed(21)
    n, params = 20_000, SamplingParams("sample", 1.0, top_p=0.9)
    target_logits = torch.log(torch.tensor([0.05, 0.4, 0.25, 0.15, 0.1, 0.05]))
    draft_logits = torch.log(torch.tensor([0.95, 0.01, 0.01, 0.01, 0.01, 0.01]))
    q = logits_to_probs(draft_logits, params.temperature, params.top_k, params.top_p)
    assert int((q > 0).sum()) == 1
    tokens = torch.cat([torch.full((n, 1), ROOT), torch.zeros(n, 1, dtype=torch.long), torch.randint(0, V, (n, 2), generator=gen)], dim=1)
    tree = DraftTree(
        tokens=tokens, parents=torch.tensor([[-1, 0, 0, 0]]).expand(n, 4), depths=torch.tensor([[0, 1, 1, 1]]).expand(n, 4),
        num_nodes=torch.full((n,), 4), draft_probs=q.expand(n, 4, V),
    )  # fmt: skip
    got = verify_sample(tree, target_logits.expand(n, 4, V), params.temperature, params.top_k, params.top_p, generator=gen)
    first = torch.where(got.accept_len >= 1, got.accepted_tokens[:, 0], got.bonus)
    p = logits_to_probs(target_logits.double(), params.temperature, params.top_k, params.top_p)
    observed = torch.bincount(first, minlength=V).double()
    live = p > 0
    assert observed[~live].sum() == 0
    p_value = float(stats.chisquare(observed[live].numpy(), (p[live] * n).numpy()).pvalue)
    assert (p_value < 1e-6) if broken else (p_value > 1e-3), p_value


def _checked_against_the_walk_on_the_device(tree, target_logits, temperature, top_k, top_p, generator):
    """verify_sample, after checking that verify_sample_on_device decides the same from the same
    uniforms (half the rows cut to a smaller tree, padding after it)."""
    B, N = tree.tokens.shape
    if N > 4:
        cut = torch.arange(B) % 2 == 1
        index = torch.arange(N).unsqueeze(0)
        parents = torch.where(cut.unsqueeze(1) & (index >= 4), -1, tree.parents)
        depths = torch.where(cut.unsqueeze(1) & (index >= 4), 0, tree.depths)
        tree = DraftTree(tree.tokens, parents, depths, torch.where(cut, 4, tree.num_nodes), tree.draft_probs, tree.deterministic)
    uniforms = torch.rand(B, N + 1, generator=generator, dtype=torch.float64)
    want = verify_module.verify_sample(tree, target_logits, temperature, top_k, top_p, uniforms=uniforms)
    probs = logits_to_probs(target_logits, temperature, top_k, top_p)
    draft = None if tree.deterministic else tree.draft_probs
    got = verify_sample_on_device(tree.tokens, tree.parents, tree.depths, tree.num_nodes, probs, draft, uniforms, tree.depth_bound)
    for name in ("accept_len", "best_node", "path", "accepted_tokens", "bonus"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    return want


@pytest.mark.parametrize("step", ["drawn", "fixed"])
@pytest.mark.parametrize("params", list(PARAMS), ids=list(PARAMS))
def test_the_walk_on_the_device_decides_what_verify_sample_decides(params, step, monkeypatch):
    """verify_sample_on_device (what a CUDA graph holds on the CPU) against verify_sample over the
    chi-square test's trees: drawn children (with children past the draft's support at top-k 2)
    and fixed candidates, chains and trees, full and padded; every decision the same."""
    monkeypatch.setattr(sys.modules[__name__], "verify_sample", _checked_against_the_walk_on_the_device)
    for spec in (CHAIN, TREE):
        _first_two_tokens(spec, PARAMS[params], 2_000, seed=3, step=_markov_step if step == "drawn" else _topk_step)


@pytest.mark.parametrize("params", list(PARAMS), ids=list(PARAMS))
def test_expected_acceptance_of_one_token_is_one_minus_tvd(params):
    params = PARAMS[params]
    target, draft = _markov(seed=4)
    p = logits_to_probs(target[ROOT].double(), params.temperature, params.top_k, params.top_p)
    q = logits_to_probs(draft[ROOT].double(), params.temperature, params.top_k, params.top_p)
    expected = 1.0 - 0.5 * (p - q).abs().sum().item()
    n = 100_000
    gen = torch.Generator().manual_seed(0)
    draft_probs = logits_to_probs(draft, params.temperature, params.top_k, params.top_p).double()
    result = _markov_step(TreeSpec.chain(1), torch.full((n,), ROOT), target, draft_probs, params, gen)
    rate = result.accept_len.double().mean().item()
    assert abs(rate - expected) < 5 * math.sqrt(expected * (1 - expected) / n) + 1e-9


# ---------------------------------------------------------------- fixed candidates (EAGLE-2's rule)

TOPK_TREE = TreeSpec.from_choices([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
TOPK_CASES = [
    ("chain", CHAIN, "plain", None),
    ("tree", TOPK_TREE, "plain", None),
    ("tree", TOPK_TREE, "temp-topk", None),
    ("tree", TOPK_TREE, "topp", None),
    # On rejection p(x) must go to 0: testing the next sibling against the unchanged p is biased.
    ("tree", TOPK_TREE, "plain", "residual-is-p"),
    ("tree", TOPK_TREE, "plain", "always-accept"),
    # Fixed candidates verified as if they had been drawn from the draft: biased too.
    ("tree", TOPK_TREE, "plain", "as-drawn"),
    ("chain", CHAIN, "temp-topk", "as-drawn"),
]


@pytest.mark.parametrize("shape, spec, params, broken", TOPK_CASES, ids=[f"{c[0]}-{c[2]}-{c[3] or 'correct'}" for c in TOPK_CASES])
def test_fixed_candidates_follow_the_target(shape, spec, params, broken, monkeypatch):
    """Deterministic top-k candidates, tested each with probability p(x) and removed from p on
    rejection: the first two emitted tokens follow the target's processed law (chi-square); a
    broken rule, or the drawn-children rule applied to fixed candidates, is rejected."""
    as_drawn = broken == "as-drawn"
    if broken is not None and not as_drawn:
        monkeypatch.setattr(verify_module, *BROKEN[broken])
    n = 40_000
    step = lambda *a: _topk_step(*a, as_drawn=as_drawn)  # noqa: E731
    cells, expected = _first_two_tokens(spec, PARAMS[params], n, seed=11, step=step)
    p_value = _p_value(cells, expected, n)
    if broken is None:
        assert p_value > 1e-3
    else:
        assert p_value < 1e-6


def test_fixed_candidate_by_hand():
    """Root p = (0.5, 0.3, 0.2) over 3 tokens, candidates 0 then 1 (leaves below the root):
    u = 0.6 rejects token 0 (0.6 >= 0.5); p becomes (0, 0.6, 0.4); u = 0.55 accepts token 1
    (0.55 < 0.6). With u = 0.7 for token 1 as well, the bonus comes from (0, 0, 1)."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2], [1 / 3, 1 / 3, 1 / 3], [1 / 3, 1 / 3, 1 / 3]])).unsqueeze(0)
    tree = DraftTree.from_lists([2, 0, 1], [-1, 0, 0], deterministic=True)
    got = verify_sample(tree, logits, uniforms=torch.tensor([[0.0, 0.6, 0.55, 0.99]]))
    assert int(got.accept_len[0]) == 1 and int(got.best_node[0]) == 2
    got = verify_sample(tree, logits, uniforms=torch.tensor([[0.0, 0.6, 0.7, 0.5]]))
    assert int(got.accept_len[0]) == 0 and int(got.bonus[0]) == 2


# ---------------------------------------------------------------- typical acceptance (Medusa, NOT lossless)


def _typical_by_definition(tree, logits, T, eps, alpha):
    """The best node and bonus by walking every path with the definition written out."""
    tokens, parents = tree.tokens[0].tolist(), tree.parents[0].tolist()

    def ok(i):
        p = torch.softmax(logits[0, parents[i]].double() / T, -1)
        H = -sum(float(x) * math.log(float(x)) for x in p if x > 0)
        return float(p[tokens[i]]) > min(eps, alpha * math.exp(-H))

    def path(i):
        out = []
        while i > 0:
            out.append(i)
            i = parents[i]
        return out[::-1]

    def log_lik(i):
        return sum(math.log(float(torch.softmax(logits[0, parents[j]].double() / T, -1)[tokens[j]])) for j in path(i))

    accepted = [0] + [i for i in range(1, len(tokens)) if all(ok(j) for j in path(i))]
    deepest = max(len(path(i)) for i in accepted)
    best = max((i for i in accepted if len(path(i)) == deepest), key=lambda i: (log_lik(i) if i else 0.0, -i))
    return best, int(logits[0, best].argmax())


@pytest.mark.parametrize("seed", range(6))
def test_typical_acceptance_matches_its_definition(seed):
    """p(x) > min(posterior_threshold, posterior_alpha * exp(-H(p))) along the path; the deepest
    accepted node, ties to the most likely path; bonus = the target's argmax there."""
    gen = torch.Generator().manual_seed(seed)
    spec = TreeSpec.from_choices([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (1, 1), (0, 0, 0), (1, 0, 0)])
    V = 6
    logits = torch.randn(1, spec.num_nodes, V, generator=gen) * 2.0
    tokens = torch.randint(0, V, (1, spec.num_nodes), generator=gen)
    tree = DraftTree(tokens, spec.parents_tensor().unsqueeze(0), spec.depths_tensor().unsqueeze(0), torch.tensor([spec.num_nodes]))
    for T, eps, alpha in ((0.7, 0.09, 0.3), (1.0, 0.3, 0.09), (1.5, 0.05, 0.5)):
        got = verify_typical(tree, logits, T, eps, alpha)
        best, bonus = _typical_by_definition(tree, logits, T, eps, alpha)
        assert (int(got.best_node[0]), int(got.bonus[0])) == (best, bonus), (T, eps, alpha)
        assert int(got.accept_len[0]) == int(tree.depths[0, best])


def test_typical_acceptance_accepts_what_sampling_could_reject_and_checks_settings():
    """Not lossless by design: a token with p(x) = 0.4 is always accepted (the threshold is
    min(0.09, 0.3 exp(-H)) < 0.4), where exact sampling would accept it with probability
    min(1, p/q) = 0.4 for a draft sure of it. Unsupported settings fail in one line."""
    logits = torch.log(torch.tensor([[0.4, 0.35, 0.25], [1 / 3, 1 / 3, 1 / 3]])).unsqueeze(0)
    tree = DraftTree.from_lists([2, 0], [-1, 0])
    assert int(verify(tree, logits, SamplingParams("typical", 1.0)).accept_len[0]) == 1
    assert int(verify_typical(tree, logits, 1.0, posterior_threshold=0.5, posterior_alpha=3.0).accept_len[0]) == 0  # min(0.5, 1.02) > 0.4
    for bad in (dict(mode="typical", temperature=0.0), dict(mode="typical", top_p=0.9), dict(mode="typical", top_k=3),
                dict(mode="typical", posterior_alpha=0.0)):
        with pytest.raises(ValueError, match="typical"):
            SamplingParams(**bad)
