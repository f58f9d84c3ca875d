"""Lookup, suffix, hybrid and adaptive drafting are lossless, on tiny random Llama and Qwen2 models
in fp32: greedy output token-identical to HF ``generate``; sampled first tokens following the
target's processed law (chi-square), a check that catches a verifier keeping a rejected
candidate's mass. A hybrid head stays in step with the target whichever branch was accepted."""

import pytest
import torch

from draftsmith.heads.eagle import EagleConfig, EagleHead
from draftsmith.heads.eagle3 import Eagle3Config, Eagle3Head
from draftsmith.runtime import lookup as lookup_module
from draftsmith.runtime import verify as verify_module
from draftsmith.runtime.drafters import HeadDrafter, StandaloneDrafter
from draftsmith.runtime.generate import TargetSession, speculative_generate
from draftsmith.runtime.lookup import HybridDrafter, LookupDrafter, PromptLookup, SuffixMatcher
from draftsmith.runtime.tree import AdaptiveTreeSpec, DynamicTreeSpec, Frontier, TreeSpec, default_tree
from draftsmith.runtime.verify import SamplingParams
from draftsmith.target import FrozenTarget
from draftsmith.testing import joint_p_value, tiny_causal_lm, tiny_tokenizer

from tests.integration.test_lossless import _noisy_copy, _peaky, _random_clover, _random_dflash, _random_eagle, _random_hydra, _random_medusa

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [
    "Hi",
    "The quick brown fox. The quick brown fox. The quick",
    "abc abc abc abc ab",
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n",
    "<|im_start|>user\nrepeat: red cat red cat<|im_end|>\n<|im_start|>assistant\nred cat red",
]
MAX_NEW = 32
EOS = 2


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def setup(request):
    tokenizer = tiny_tokenizer()
    target = FrozenTarget(tiny_causal_lm(request.param, vocab_size=len(tokenizer), seed=0))
    prompts = [torch.tensor([tokenizer.encode(p)]) for p in PROMPTS]
    references = [
        target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=EOS, pad_token_id=0)
        for ids in prompts
    ]
    return target, prompts, references


def _random_eagle3(target, seed):
    """An EAGLE-3 head on the tiny target's three layers with a reduced draft vocabulary (d2t)."""
    torch.manual_seed(seed)
    return Eagle3Head(Eagle3Config(aux_layer_ids=[1, 2, 3], draft_vocab_size=48, depth=4, train_depth=3), target.dims).eval()


def _confident_noisy_copy(model):
    """The target perturbed, its LM head scaled up: sure of its (often right) guesses, so a cost
    leaves some levels in and cuts others."""
    noisy = _noisy_copy(model, 0.15, seed=1)
    with torch.no_grad():
        noisy.lm_head.weight.mul_(8.0)
    return noisy


ADAPTIVE = AdaptiveTreeSpec(depth=4, topk=3, budget=10, cost=0.2)
DRAFTERS = {
    "lookup-tree": lambda t: LookupDrafter(PromptLookup(1, 3)),
    "lookup-chain": lambda t: LookupDrafter(PromptLookup(2, 4), TreeSpec.chain(3)),
    "suffix-tree": lambda t: LookupDrafter(SuffixMatcher()),
    "suffix-adaptive": lambda t: LookupDrafter(SuffixMatcher(), AdaptiveTreeSpec(6, 3, 12, cost=0.3)),
    "hybrid-medusa-suffix": lambda t: HybridDrafter(HeadDrafter(_random_medusa(t, 2), t, default_tree(4, (4, 2, 2, 1))), SuffixMatcher()),
    "hybrid-medusa-lookup-adaptive": lambda t: HybridDrafter(HeadDrafter(_random_medusa(t, 1), t, ADAPTIVE), PromptLookup(1, 3)),
    "hybrid-eagle-suffix": lambda t: HybridDrafter(HeadDrafter(_random_eagle(t, 4, num_layers=2), t, DynamicTreeSpec(4, 3, 10)), SuffixMatcher()),
    "hybrid-eagle-lookup-adaptive": lambda t: HybridDrafter(HeadDrafter(_random_eagle(t, 5), t, ADAPTIVE), PromptLookup(1, 3)),
    "hybrid-eagle3-suffix": lambda t: HybridDrafter(HeadDrafter(_random_eagle3(t, 7), t, DynamicTreeSpec(4, 3, 10)), SuffixMatcher()),
    "hybrid-clover-lookup": lambda t: HybridDrafter(HeadDrafter(_random_clover(t, 9, depth=4), t, default_tree(4, (4, 2, 2, 1))), PromptLookup(1, 3)),
    "hybrid-hydra-suffix": lambda t: HybridDrafter(HeadDrafter(_random_hydra(t, 6), t, default_tree(4, (4, 2, 2, 1))), SuffixMatcher()),
    "hybrid-dflash-lookup": lambda t: HybridDrafter(HeadDrafter(_random_dflash(t, 12, block_size=5), t, ADAPTIVE), PromptLookup(1, 3)),
    # A random head is unsure of everything: with a cost it would draft nothing, so none here.
    "adaptive-eagle": lambda t: HeadDrafter(_random_eagle(t, 3), t, AdaptiveTreeSpec(depth=4, topk=3, budget=10)),
    "adaptive-noisy-lm": lambda t: StandaloneDrafter(_confident_noisy_copy(t.model), ADAPTIVE),
}


@pytest.mark.parametrize("kind", list(DRAFTERS))
def test_greedy_output_equals_hf_greedy(setup, kind):
    target, prompts, references = setup
    drafter = DRAFTERS[kind](target)
    accepted = drafted = 0
    for ids, reference in zip(prompts, references):
        out, stats = speculative_generate(target, drafter, ids, MAX_NEW, eos_token_id=EOS)
        assert out.tolist() == reference.tolist(), f"{kind}: prompt {ids.tolist()}"
        accepted += sum(stats.accept_lens)
        drafted += sum(stats.draft_depths)
    # Drafts are accepted and rejected: the tests exercise both paths of verification and rollback.
    assert 0 < accepted < drafted, (kind, accepted, drafted)
    if hasattr(drafter, "reliability"):
        assert drafter.reliability.accepted > 0  # lookup candidates were accepted, not only the head's


def _real(tree):
    n = int(tree.num_nodes[0])
    return tree.tokens[0, :n].tolist(), tree.parents[0, :n].tolist()


@pytest.mark.parametrize("kind", [k for k in DRAFTERS if k.startswith("hybrid")])
def test_a_hybrid_on_the_static_cache_drafts_on_the_device_what_the_host_drafts(setup, kind, monkeypatch):
    """On the static cache a hybrid's tree is built on the device (build_scored_tree_on_device:
    EAGLE's whole tree as one function, Hydra's and Clover's levels, Medusa's and DFlash's rows),
    where the dynamic cache builds it on the host a level at a time: the same trees step for step
    (their real nodes; the device's are padded to the budget), the same lookup bookkeeping and
    expected lengths, and HF's greedy output."""
    target, prompts, references = setup
    runs, expected = {}, {}
    monkeypatch.setattr(lookup_module, "EXPECTED_READS", 3)  # the device's expected lengths read 3 steps at a time
    for cache in ("dynamic", "static"):
        torch.manual_seed(0)  # the same head both times (some builders draw from the global generator)
        drafter = DRAFTERS[kind](target)
        drafter.head.cache_kind = cache
        proposed, propose = [], drafter.propose
        drafter.propose = lambda state: proposed.append(propose(state)) or proposed[-1]
        outputs = []
        for ids, reference in zip(prompts, references):
            out, stats = speculative_generate(target, drafter, ids, MAX_NEW, eos_token_id=EOS)
            assert out.tolist() == reference.tolist(), (kind, cache)
            outputs.append(stats.accept_lens)
        trees = [_real(t) for t in proposed]
        runs[cache] = (outputs, trees, (drafter.reliability.tested, drafter.reliability.accepted))
        assert len(drafter._unread) < 3
        expected[cache] = drafter.expected
    assert runs["static"] == runs["dynamic"]
    assert len(expected["static"]) == len(proposed) and expected["static"] == pytest.approx(expected["dynamic"], rel=1e-6)
    assert runs["static"][2][1] > 0  # lookup candidates were drafted and accepted
    assert any(len(tokens) > 1 for tokens, _ in runs["static"][1])


def test_a_hybrid_eagle_head_stays_in_step_whichever_branch_is_accepted(setup):
    """After every step, the EAGLE session's drafting state (its KV cache over decided positions,
    read with the target's real features) gives the root the same logits as a fresh session that
    reads the whole decided text at once, also after steps that accepted a lookup branch."""
    target, prompts, _ = setup
    head = _random_eagle(target, 4, num_layers=2)

    class Checked(HybridDrafter):
        def propose(self, state):
            tree = super().propose(state)
            if state.new_hidden is not None:
                root = Frontier([0], [state.root], [-1], [0])
                ours = self.head.session.expand(root)
                fresh = head.start_drafting(target.embed, target.lm_head)
                hidden, layers = TargetSession(target, head.required_layers()).prefill(state.tokens[:, :-1])
                fresh.extend(hidden, layers, state.tokens[:, 1:])
                torch.testing.assert_close(ours, fresh.expand(root), atol=1e-4, rtol=1e-4)
                self.checked += 1
            return tree

    drafter = Checked(HeadDrafter(head, target, DynamicTreeSpec(4, 3, 10)), SuffixMatcher())
    drafter.checked = 0
    for ids in prompts[1:3]:
        speculative_generate(target, drafter, ids, MAX_NEW, eos_token_id=EOS)
    assert drafter.checked > 5 and drafter.reliability.accepted > 0


def test_a_hybrid_refuses_a_drafter_that_is_not_a_head(setup):
    target, _, _ = setup
    with pytest.raises(Exception, match="cannot join"):
        HybridDrafter(StandaloneDrafter(target.model), SuffixMatcher())


def test_a_hybrid_tree_deeper_than_its_head_is_refused_saying_what_fits(setup):
    target, _, _ = setup
    head = HeadDrafter(_random_medusa(target, 2), target, default_tree(2, (2, 1)))
    with pytest.raises(Exception, match=r"the tree is 5 deep but the medusa head drafts 4 tokens: give --tree a depth of at most 4 \(in a hybrid the lookup drafts deeper"):
        HybridDrafter(head, SuffixMatcher(), AdaptiveTreeSpec(5, 3, 8))


# ---------------------------------------------------------------- sampling

V = 8
# Repeats, so the matchers have something to propose: "3 4" was followed by 5 and by 6.
PROMPT = torch.tensor([[3, 4, 5, 1, 3, 4, 6, 1, 3, 4]])
TEMPERATURE, TOP_P = 0.8, 0.9


def _pairs(build, n, seed):
    target_model = _peaky(0)
    target = FrozenTarget(target_model)
    drafter = build(target)
    gen = torch.Generator().manual_seed(seed)
    pairs, accepted, drafted = [], 0, 0
    for _ in range(n):
        out, stats = speculative_generate(target, drafter, PROMPT, 2, SamplingParams("sample", TEMPERATURE, top_p=TOP_P), generator=gen)
        pairs.append((int(out[0, -2]), int(out[0, -1])))
        accepted += sum(stats.accept_lens)
        drafted += sum(stats.draft_depths)
    return joint_p_value(pairs, target_model, PROMPT, TEMPERATURE, TOP_P), accepted, drafted


def _eagle_for_sampling(target):
    torch.manual_seed(3)
    eagle = EagleHead(EagleConfig(depth=2), target.dims)
    with torch.no_grad():
        for p in eagle.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    return eagle


SAMPLED = {
    "lookup": lambda t: LookupDrafter(PromptLookup(1, 2), DynamicTreeSpec(2, 2, 4)),
    "suffix": lambda t: LookupDrafter(SuffixMatcher(min_prob=0.0), DynamicTreeSpec(2, 2, 4)),
    "hybrid-eagle-suffix": lambda t: HybridDrafter(HeadDrafter(_eagle_for_sampling(t), t, AdaptiveTreeSpec(2, 2, 5)), SuffixMatcher(min_prob=0.0)),
    # The tree built on the device (the static cache), the verification inside the target's graph's function.
    "hybrid-eagle-suffix-static": lambda t: HybridDrafter(HeadDrafter(_eagle_for_sampling(t), t, AdaptiveTreeSpec(2, 2, 5), cache="static"), SuffixMatcher(min_prob=0.0)),
    "adaptive-lm": lambda t: StandaloneDrafter(_peaky(1), AdaptiveTreeSpec(2, 3, 5, cost=0.05)),
}


@pytest.mark.parametrize("kind", list(SAMPLED))
def test_sampled_tokens_follow_the_target(kind):
    p_value, accepted, drafted = _pairs(SAMPLED[kind], 500, seed=0)
    assert p_value > 1e-3
    assert 0 < accepted < drafted  # candidates are tested, accepted and rejected


def test_the_sampling_check_rejects_lookup_candidates_that_keep_their_mass(monkeypatch):
    """If a rejected candidate's mass stayed in p (no residual), the lookup's fixed candidates would
    be over-produced: the same check must see it."""
    monkeypatch.setattr(verify_module, "_residual", lambda p, q: p)
    p_value, _, _ = _pairs(SAMPLED["suffix"], 500, seed=0)
    assert p_value < 1e-6
