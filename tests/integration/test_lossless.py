"""Losslessness end to end on tiny random Llama and Qwen2 models in fp32.

Greedy: speculative output is token-identical to HF ``generate(do_sample=False)`` for every drafter
kind and tree shape. Sampling: the first generated tokens follow the target's own processed
distribution (chi-square) with static trees and with EAGLE-2 dynamic trees, and the same check
rejects a verifier that always accepts and a fixed-candidate rule that keeps a rejected
candidate's mass.
"""

import copy

import pytest
import torch

from draftsmith.heads.clover import CloverConfig, CloverHead
from draftsmith.heads.dflash import DFlashConfig, DFlashHead
from draftsmith.heads.eagle import EagleConfig, EagleHead
from draftsmith.heads.hydra import HydraConfig, HydraHead
from draftsmith.heads.medusa import MedusaConfig, MedusaHead
from draftsmith.runtime import verify as verify_module
from draftsmith.runtime.drafters import HeadDrafter, StandaloneDrafter
from draftsmith.runtime.generate import speculative_generate
from draftsmith.runtime.tree import DynamicTreeSpec, TreeSpec, default_tree
from draftsmith.runtime.verify import SamplingParams
from draftsmith.target import FrozenTarget
from draftsmith.testing import joint_p_value, tiny_causal_lm, tiny_tokenizer


pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [
    "Hi",
    "x",
    "The quick brown fox",
    "def add(a, b):\n    return",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "0123456789 abcdefghij ABCDEFGHIJ",
]
MAX_NEW = 24
EOS = 2  # the tiny models' eos_token_id


def _noisy_copy(model, scale, seed):
    """The target with every weight perturbed: agrees often, not always (partial acceptance)."""
    noisy = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in noisy.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale * p.std().clamp_min(1e-3))
    return noisy


def _random_medusa(target, seed):
    head = MedusaHead(MedusaConfig(num_heads=4, num_layers=1), target.dims)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return head


def _random_eagle(target, seed, **cfg):
    torch.manual_seed(seed)
    return EagleHead(EagleConfig(depth=4, **cfg), target.dims)


def _random_hydra(target, seed, **cfg):
    head = HydraHead(HydraConfig(num_heads=4, **cfg), target.dims)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return head


def _random_clover(target, seed, **cfg):
    """A Clover head started from the target (its augmenting block a copy of the last layer), then
    perturbed so it drafts unlike the target."""
    torch.manual_seed(seed)
    head = CloverHead(CloverConfig(**cfg), target.dims)
    head.init_from_target(target)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return head.eval()


def _random_dflash(target, seed, **cfg):
    """A DFlash head reading the target's first and last layers, perturbed from its start."""
    torch.manual_seed(seed)
    head = DFlashHead(DFlashConfig(**{"aux_layer_ids": sorted({1, target.dims.num_layers}), "num_layers": 1, **cfg}), target.dims)
    head.init_from_target(target)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return head.eval()


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def setup(request):
    arch = request.param
    tokenizer = tiny_tokenizer()
    target = FrozenTarget(tiny_causal_lm(arch, vocab_size=len(tokenizer), seed=0))
    prompts = [torch.tensor([tokenizer.encode(p)]) for p in PROMPTS]
    references = [
        target.model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=EOS, pad_token_id=0
        )
        for ids in prompts
    ]
    other = tiny_causal_lm("qwen2" if arch == "llama" else "llama", vocab_size=len(tokenizer), hidden_size=32, num_layers=1, seed=5)
    noisy = _noisy_copy(target.model, 0.15, seed=1)
    return target, prompts, references, other, noisy


DRAFTERS = {
    # name: (build(target, other, noisy), must everything be accepted?)
    "medusa-chain": (lambda t, o, n: HeadDrafter(_random_medusa(t, 1), t, TreeSpec.chain(4)), False),
    "medusa-tree": (lambda t, o, n: HeadDrafter(_random_medusa(t, 2), t, default_tree(4, (4, 2, 2, 1))), False),
    "hydra-tree": (lambda t, o, n: HeadDrafter(_random_hydra(t, 6), t, default_tree(4, (4, 2, 2, 1))), False),
    "hydra++-dynamic": (lambda t, o, n: HeadDrafter(_random_hydra(t, 7, prefix_attention=True), t, DynamicTreeSpec(depth=4, topk=3, budget=10)), False),
    "eagle-chain": (lambda t, o, n: HeadDrafter(_random_eagle(t, 3), t, TreeSpec.chain(4)), False),
    "eagle-tree": (lambda t, o, n: HeadDrafter(_random_eagle(t, 4, num_layers=2), t, default_tree(4, (4, 2, 2, 1))), False),
    "eagle-dynamic": (lambda t, o, n: HeadDrafter(_random_eagle(t, 5), t, DynamicTreeSpec(depth=4, topk=3, budget=10)), False),
    # Clover-2 (the root token fused before the augmenting block) and Clover-1's order and outputs.
    "clover-tree": (lambda t, o, n: HeadDrafter(_random_clover(t, 9, depth=4), t, default_tree(4, (4, 2, 2, 1))), False),
    "clover1-dynamic": (
        lambda t, o, n: HeadDrafter(
            _random_clover(t, 10, depth=4, num_layers=1, token_first=False, output="residual"), t, DynamicTreeSpec(depth=4, topk=3, budget=10)
        ),
        False,
    ),
    # DFlash: one block forward per step; a chain, and a product tree of each slot's top candidates.
    "dflash-chain": (lambda t, o, n: HeadDrafter(_random_dflash(t, 12, block_size=5), t, TreeSpec.chain(4)), False),
    "dflash-tree": (lambda t, o, n: HeadDrafter(_random_dflash(t, 13, block_size=5, causal=True), t, default_tree(4, (4, 2, 2, 1))), False),
    "medusa-dynamic": (lambda t, o, n: HeadDrafter(_random_medusa(t, 8), t, DynamicTreeSpec(depth=3, topk=3, budget=8)), False),
    "other-lm-chain": (lambda t, o, n: StandaloneDrafter(o, TreeSpec.chain(3)), False),
    "noisy-chain": (lambda t, o, n: StandaloneDrafter(n, TreeSpec.chain(4)), False),
    "noisy-tree": (lambda t, o, n: StandaloneDrafter(n, default_tree(4, (3, 2, 2, 1))), False),
    "noisy-dynamic": (lambda t, o, n: StandaloneDrafter(n, DynamicTreeSpec(depth=4, topk=3, budget=10)), False),
    "self-chain": (lambda t, o, n: StandaloneDrafter(t.model, TreeSpec.chain(4)), True),
    "self-tree": (lambda t, o, n: StandaloneDrafter(t.model, default_tree(3, (3, 2, 1))), True),
}


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("kind", list(DRAFTERS))
def test_greedy_speculative_equals_hf_greedy(setup, kind, cache):
    """On transformers' DynamicCache (the reference) and on the preallocated StaticSession (what
    a GPU replays as CUDA graphs; eager here): every drafter kind, token for token. A draft
    model's and an EAGLE head's own caches follow the target's."""
    target, prompts, references, other, noisy = setup
    build, all_accepted = DRAFTERS[kind]
    drafter = build(target, other, noisy)
    if isinstance(drafter, StandaloneDrafter):
        drafter = StandaloneDrafter(drafter.model, drafter.tree, cache=cache)
        assert (drafter.static is not None) == (cache == "static")
    elif isinstance(drafter, HeadDrafter):  # EAGLE's own caches preallocated too
        drafter = HeadDrafter(drafter.head, target, drafter.tree, cache=cache)
    accepted = drafted_depth = 0
    for ids, reference in zip(prompts, references):
        out, stats_ = speculative_generate(target, drafter, ids, MAX_NEW, eos_token_id=EOS, cache=cache)
        assert out.tolist() == reference.tolist(), f"{kind}: prompt {ids.tolist()}"
        accepted += sum(stats_.accept_lens)
        drafted_depth += sum(stats_.draft_depths)
        if all_accepted:
            # The target drafting for itself: every drafted token of every step is accepted.
            assert stats_.accept_lens == stats_.draft_depths[: len(stats_.accept_lens)]
            assert all(d > 0 for d in stats_.draft_depths[1:])
    if kind.startswith(("noisy", "clover")):
        # Partial acceptance: rollbacks really happen (Clover: its node states are forgotten and the
        # augmenting block's cache must hold decided positions only).
        assert 0 < accepted < drafted_depth


# ---------------------------------------------------------------- sampling

V = 8
PROMPT = torch.tensor([[3, 4, 5]])
TEMPERATURE, TOP_P = 0.8, 0.9


def _peaky(seed):
    """A tiny model whose next-token laws are far from uniform, so draft and target disagree."""
    model = tiny_causal_lm("llama", vocab_size=V, hidden_size=16, num_layers=1, seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(15.0)
    return model


def _speculative_joint_p_value(n, seed, drafter_kind="static", head=None, cache="auto", trees=None, top_p=TOP_P, prompt=PROMPT):
    """Chi-square p-value of n sampled pairs of first tokens against the target's law. The drafter:
    a second peaky model drafting a static tree ("static") or an EAGLE-2 dynamic tree ("dynamic"),
    a perturbed EAGLE head drafting a dynamic tree ("eagle-dynamic"), or `head(target)` drafting the
    static tree; ``cache`` the target's and the drafter's; ``trees``, a list: the proposed trees;
    ``top_p`` the sampling's (temperature TEMPERATURE); ``prompt`` [1,3]."""
    target_model, draft_model = _peaky(0), _peaky(1)
    target = FrozenTarget(target_model)
    static = TreeSpec.from_choices([(0,), (1,), (0, 0), (1, 0)])
    if head is not None:
        drafter = HeadDrafter(head(target), target, static, cache=cache)
    elif drafter_kind == "static":
        drafter = StandaloneDrafter(draft_model, static, cache=cache)
    elif drafter_kind == "dynamic":
        # EAGLE-2's dynamic tree: fixed top candidates, verified with EAGLE's rule.
        drafter = StandaloneDrafter(draft_model, DynamicTreeSpec(depth=2, topk=3, budget=5))
    else:
        torch.manual_seed(seed + 3)
        eagle = EagleHead(EagleConfig(depth=2), target.dims)
        with torch.no_grad():
            for p in eagle.parameters():
                p.add_(torch.randn_like(p) * 0.5)
        drafter = HeadDrafter(eagle, target, DynamicTreeSpec(depth=2, topk=3, budget=5))
    if trees is not None:
        propose = drafter.propose
        drafter.propose = lambda state: trees.append(propose(state)) or trees[-1]
    gen = torch.Generator().manual_seed(seed)
    pairs = []
    for _ in range(n):
        out, _ = speculative_generate(target, drafter, prompt, 2, SamplingParams("sample", TEMPERATURE, top_p=top_p), generator=gen, cache=cache)
        pairs.append((int(out[0, 3]), int(out[0, 4])))
    return joint_p_value(pairs, target_model, prompt, TEMPERATURE, top_p)


@pytest.mark.parametrize("drafter_kind", ["static", "dynamic", "eagle-dynamic"])
def test_sampled_speculative_tokens_follow_the_target(drafter_kind):
    """Static trees (children drawn without replacement) and EAGLE-2 dynamic trees (fixed top
    candidates) from a standalone draft LM and from an EAGLE head: lossless at temperature > 0."""
    assert _speculative_joint_p_value(500, seed=0, drafter_kind=drafter_kind) > 1e-3


def test_sampled_speculative_tokens_follow_the_target_with_a_clover_head():
    assert _speculative_joint_p_value(500, seed=0, head=lambda t: _random_clover(t, 11, depth=2)) > 1e-3


def test_sampled_speculative_tokens_follow_the_target_with_a_dflash_head():
    """A block of 3 (anchor + 2 slots) drafts the static tree's two depths in one forward."""
    head = lambda t: _random_dflash(t, 14, block_size=3, mask_token_id=V - 1, draft_vocab_size=6)  # noqa: E731
    assert _speculative_joint_p_value(500, seed=0, head=head) > 1e-3


STATIC_HEADS = {
    "clover": lambda t: _random_clover(t, 11, depth=2),
    "dflash": lambda t: _random_dflash(t, 14, block_size=3, mask_token_id=V - 1, draft_vocab_size=6),
}


def _past_the_support(trees) -> int:
    """Drafted nodes whose token has q = 0 at their parent: children past the draft's support."""
    return sum(int(t.draft_probs[0, int(t.parents[0, n]), int(t.tokens[0, n])] == 0) for t in trees for n in range(1, t.size))


# After this prompt, at top-p 0.7, the draft model keeps one token where the root has two children
# and the target keeps four: the root's second child is past the draft's support at every first step.
NARROW_DRAFT, NARROW_TOP_P = torch.tensor([[0, 2, 0]]), 0.7


@pytest.mark.parametrize("drafter_kind", ["static", "clover", "dflash"])
def test_sampled_trees_drawn_on_the_device_follow_the_target(drafter_kind):
    """The same check on the static cache, where a static tree's draws run on the device
    (draftsmith.sampling.DeviceDraws) and the tree keeps its fixed shape. With the draft model,
    children past the draft's support (q = 0) are in the trees, which verification must never
    accept."""
    trees = []
    head = STATIC_HEADS.get(drafter_kind)
    assert _speculative_joint_p_value(500, seed=0, head=head, cache="static", trees=trees, top_p=NARROW_TOP_P, prompt=NARROW_DRAFT) > 1e-3
    assert all(t.draft_probs is not None and t.size == 5 for t in trees)  # drawn on the device: the spec's five nodes every step
    assert drafter_kind != "static" or _past_the_support(trees) >= 500


@pytest.mark.parametrize("drafter_kind", ["static", "clover"])
def test_sampled_decoding_through_the_graphs_follows_the_target(drafter_kind):
    """The same check through the graphs a GPU captures (draftsmith.testing.simulated_cuda_graphs):
    the draws inside the drafter's graph and the sampled verification inside the target's
    (``verify_sample_on_device`` here, the fused kernel on CUDA), children past the support and all."""
    from draftsmith.testing import simulated_cuda_graphs

    trees = []
    with simulated_cuda_graphs() as graphs:
        p_value = _speculative_joint_p_value(
            500, seed=1, head=STATIC_HEADS.get(drafter_kind), cache="static", trees=trees, top_p=NARROW_TOP_P, prompt=NARROW_DRAFT
        )  # fmt: skip
    assert p_value > 1e-3
    assert graphs.captured and all(graph.replays for graph in graphs.captured)
    assert drafter_kind != "static" or _past_the_support(trees) >= 500


def test_the_sampling_check_rejects_accepting_children_past_the_draft_support(monkeypatch):
    """Accepting a child of q(x) = 0 wherever p(x) > 0 (the rule before trees kept such children)
    over-produces whatever token the device put there: the check on the static cache sees it."""
    monkeypatch.setattr(verify_module, "_accepts", lambda u, p_x, q_x: u * q_x < p_x)
    assert _speculative_joint_p_value(500, seed=0, cache="static", top_p=NARROW_TOP_P, prompt=NARROW_DRAFT) < 1e-6


def test_the_sampling_check_rejects_a_verifier_that_always_accepts(monkeypatch):
    monkeypatch.setattr(verify_module, "_accepts", lambda u, p_x, q_x: torch.ones_like(p_x, dtype=torch.bool))
    assert _speculative_joint_p_value(200, seed=0) < 1e-6


def test_the_sampling_check_rejects_fixed_candidates_that_keep_their_mass(monkeypatch):
    """A dynamic tree whose rejected candidate is not removed from p before its sibling is tested
    (and before the bonus draw) over-produces the candidates: the same check must see it."""
    monkeypatch.setattr(verify_module, "_residual", lambda p, q: p)
    assert _speculative_joint_p_value(500, seed=0, drafter_kind="dynamic") < 1e-6
