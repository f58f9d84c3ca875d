"""The static-cache session with CUDA graphs on a GPU (skipped without CUDA): the same forwards as
the DynamicCache reference, and decoding token-identical to transformers' greedy generate() on the
same device (fp32) for the drafter kinds, with the graphs really replayed.

    python -m pytest -q tests/gpu/test_static_gpu.py
"""

import copy

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

from draftsmith.heads.clover import CloverConfig, CloverHead  # noqa: E402
from draftsmith.heads.dflash import DFlashConfig, DFlashHead  # noqa: E402
from draftsmith.heads.eagle import EagleConfig, EagleHead  # noqa: E402
from draftsmith.heads.hydra import HydraConfig, HydraHead  # noqa: E402
from draftsmith.heads.medusa import MedusaConfig, MedusaHead  # noqa: E402
from draftsmith.runtime.drafters import HeadDrafter, StandaloneDrafter  # noqa: E402
from draftsmith.runtime.early_exit import EarlyExitDrafter  # noqa: E402
from draftsmith.runtime.generate import TargetSession, autoregressive_generate, speculative_generate  # noqa: E402
from draftsmith.runtime.lookup import HybridDrafter, SuffixMatcher  # noqa: E402
from draftsmith.runtime.static import StaticSession  # noqa: E402
from draftsmith.runtime.tree import DraftTree, DynamicTreeSpec, TreeSpec, default_tree  # noqa: E402
from draftsmith.target import FrozenTarget  # noqa: E402
from draftsmith.testing import graph_roles, tiny_causal_lm  # noqa: E402

CUDA = torch.device("cuda")


@pytest.fixture(scope="module")
def target():
    return FrozenTarget(tiny_causal_lm("llama", seed=0).to(CUDA))


def _perturbed(module, scale, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_((torch.randn(p.shape, generator=gen) * scale * p.std().clamp_min(1e-3).item()).to(p.device))
    return module


def _drafters(target):
    dims, L = target.dims, target.dims.num_layers
    torch.manual_seed(3)
    eagle = EagleHead(EagleConfig(depth=4), dims).to(CUDA).eval()
    medusa = _perturbed(MedusaHead(MedusaConfig(num_heads=4, num_layers=1), dims).to(CUDA), 0.1, 4).eval()
    dflash = DFlashHead(DFlashConfig(aux_layer_ids=[1, L], num_layers=1, block_size=5), dims)
    dflash.init_from_target(target)
    dflash = _perturbed(dflash.to(CUDA), 0.05, 5).eval()
    noisy = _perturbed(copy.deepcopy(target.model), 0.15, 1)
    hydra = HydraHead(HydraConfig(num_heads=4, num_layers=2), dims)  # Hydra++: the prefix layer
    hydra.init_from_target(target)
    clover = CloverHead(CloverConfig(depth=4), dims)  # Clover-2
    clover.init_from_target(target)
    return {
        "eagle-dynamic": HeadDrafter(eagle, target, DynamicTreeSpec(depth=4, topk=3, budget=10)),
        "medusa-tree": HeadDrafter(medusa, target, default_tree(4, (4, 2, 2, 1))),
        "dflash-chain": HeadDrafter(dflash, target, TreeSpec.chain(4)),
        "noisy-tree": StandaloneDrafter(noisy, default_tree(4, (3, 2, 2, 1))),
        "noisy-dynamic": StandaloneDrafter(noisy, DynamicTreeSpec(depth=4, topk=3, budget=10)),
        "self-chain": StandaloneDrafter(target.model, TreeSpec.chain(4)),
        "early-exit": EarlyExitDrafter(target, exit_layer=1, tree=TreeSpec.chain(3)),
        "hydra-dynamic": HeadDrafter(_perturbed(hydra.to(CUDA), 0.005, 6).eval(), target, DynamicTreeSpec(depth=4, topk=3, budget=10)),
        "clover-tree": HeadDrafter(_perturbed(clover.to(CUDA), 0.005, 6).eval(), target, default_tree(4, (3, 2, 2, 1))),
        # Lookup merged with a head: the merged tree built on the device, EAGLE's as one graph a step.
        "hybrid-eagle": HybridDrafter(HeadDrafter(eagle, target, DynamicTreeSpec(depth=4, topk=3, budget=10)), SuffixMatcher()),
        "hybrid-medusa": HybridDrafter(HeadDrafter(medusa, target, default_tree(4, (4, 2, 2, 1))), SuffixMatcher()),
    }


def test_graphed_forwards_match_the_dynamic_cache(target):
    layers = [0, -1]
    ref, static = TargetSession(target, layers), StaticSession(target, layers, capacity=16)
    assert static.graphs
    prompt = torch.tensor([[5, 9, 14, 20, 7, 3, 11]], device=CUDA)
    (h1, _), (h2, _) = ref.prefill(prompt), static.prefill(prompt)
    torch.testing.assert_close(h2, h1, rtol=1e-4, atol=1e-4)
    trees = [DraftTree.from_lists([11, 30, 31, 40, 41, 42], [-1, 0, 0, 1, 1, 2], device=CUDA), DraftTree.from_lists([40, 8, 9, 10], [-1, 0, 1, 1], device=CUDA)]
    for _ in range(3):  # the same sizes again: replays, and the cache grows past 16 slots (graphs recaptured)
        for tree, path in zip(trees, ([0, 1, 4], [0, 2])):
            (g1, f1, t1), (g2, f2, t2) = ref.forward_tree(tree), static.forward_tree(tree)
            torch.testing.assert_close(g2, g1, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(f2, f1, rtol=1e-4, atol=1e-4)
            for i in t1:
                torch.testing.assert_close(t2[i], t1[i], rtol=1e-4, atol=1e-4)
            ref.keep(path)
            static.keep(path)
    assert static.cache.capacity > 16 and sorted(static.graphs.captured) == [("tree", 4), ("tree", 6)] and static.graphs


@pytest.mark.parametrize(
    "kind",
    # (the early exit after every kind that shares its session: its graphs join the target's)
    ["eagle-dynamic", "medusa-tree", "dflash-chain", "hydra-dynamic", "clover-tree", "noisy-tree", "noisy-dynamic", "self-chain", "hybrid-eagle", "hybrid-medusa", "early-exit", "plain"],
)  # fmt: skip
def test_graphed_decoding_equals_hf_greedy(target, kind):
    prompts = [torch.tensor([[5, 9, 14, 20]], device=CUDA), torch.tensor([[7, 7, 30, 31, 32, 33, 34, 35, 36]], device=CUDA)]
    drafter = None if kind == "plain" else _drafters(target)[kind]
    for ids in prompts:
        want = target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24, pad_token_id=0, eos_token_id=None)
        if drafter is None:
            got, _ = autoregressive_generate(target, ids, 24)
        else:
            got, _ = speculative_generate(target, drafter, ids, 24)
        assert got.tolist() == want.tolist(), kind
    layers = () if drafter is None else tuple(drafter.required_layers())
    session = target._static_sessions[(layers, target.device, target.dtype)]
    assert session.graphs and session.graphs.captured, "auto did not take the graphed static cache on CUDA"
    if kind == "early-exit":  # the chain as one graph, the verify forward from the exit (verification inside) as another
        # (the session is the one the draft models' generations used before: their graphs are there too)
        assert {"early-exit draft", "early-exit verify"} <= {key[0] for key in session.graphs.captured}
        assert all(g is not None for g in session.graphs.captured.values()) and any(key[-1] == "verified" for key in session.graphs.captured)
    elif drafter is not None:  # the fused greedy verification replays inside the tree forward's graph
        assert {key[0] for key in session.graphs.captured} == {"tree-verify"} and all(g is not None for g in session.graphs.captured.values())
    if isinstance(drafter, StandaloneDrafter):  # the draft model's own forwards are graphed too
        assert drafter.static is not None and drafter.static.graphs and drafter.static.graphs.captured
        # A step's read and whole tree as one graph (StaticSession.draft_tree), captured, not eager.
        steps = [g for name, g in drafter.static.graphs.captured.items() if isinstance(name, tuple) and name[0] in ("draft", "draft-dynamic")]
        assert steps and all(graph is not None for graph in steps)
    if kind == "eagle-dynamic":  # and an EAGLE head's tree levels
        assert drafter.session.capacity and drafter.session.graphs and drafter.session.graphs.captured
    if kind in ("medusa-tree", "hydra-dynamic", "clover-tree", "dflash-chain", "hybrid-eagle", "hybrid-medusa"):
        # A head's read of a step's accepted positions (Medusa's heads, Hydra++'s prefix layer,
        # Clover's block, DFlash's context and block, EAGLE's extend) and the tree drafted after it
        # replay as one graph, captured (not eager after a failed capture). Only a prompt's read
        # (the first, at position 0) runs alone, and the tree after it.
        session = drafter.head.session if kind.startswith("hybrid") else drafter.session
        captured = session.graphs.captured
        assert session.graphs and captured and all(g is not None for g in captured.values()), list(captured)
        roles = graph_roles(captured)
        trees = [name[-1] for name in roles["read+tree"]] + roles["tree"]
        assert roles["read+tree"] and not roles["other"] and len(roles["tree"]) <= 1, roles
        assert {name[1] for name in roles["read"] if name != "heads"} <= {ids.shape[1] - 1 for ids in prompts}, roles  # the prompts' reads, never a step's
        whole = "dynamic" if kind in ("hydra-dynamic", "hybrid-eagle", "hybrid-medusa") else "static"
        assert all(name[0] == whole for name in trees), trees
        if kind.startswith("hybrid"):  # the head's levels and the lookup's candidates merged in the same graph
            assert all(name[-1][0] == "hybrid" for name in trees), trees
    if kind.startswith("hybrid"):  # the lookup's candidates were drafted (and so checked by the output)
        assert drafter.reliability.tested > 0


def test_a_graphed_eagle_head_drafts_what_the_eager_one_drafts(target):
    """Output identity cannot see a drafter (verification keeps any draft lossless): the trees of
    the graphed EAGLE session are the eager growing caches' trees, step for step (fp32)."""
    runs = {}
    for cache in ("dynamic", "static"):
        drafter = _drafters(target)["eagle-dynamic"]
        drafter = HeadDrafter(drafter.head, target, drafter.tree, cache=cache)
        proposed, propose = [], drafter.propose
        drafter.propose = lambda state: proposed.append(propose(state)) or proposed[-1]
        out, stats = speculative_generate(target, drafter, torch.tensor([[5, 9, 14, 20, 7, 3]], device=CUDA), 30, cache=cache)
        runs[cache] = (out.tolist(), stats.accept_lens, [t.tokens.tolist() for t in proposed])
        if cache == "static":  # each step's read and whole tree were captured as one graph, not run eagerly after a failed capture
            captured = drafter.session.graphs.captured
            roles = graph_roles(captured)
            assert roles["read+tree"] and all(name[-1][0] == "dynamic" for name in roles["read+tree"]), roles
            assert all(graph is not None for graph in captured.values())
    assert runs["static"] == runs["dynamic"]


@pytest.mark.parametrize("kind", ["medusa-tree", "dflash-chain", "clover-tree", "noisy-tree", "early-exit"])
def test_graphed_sampled_drafting_at_top_k_1_equals_hf_greedy(target, kind):
    """Sampled drafting of a static tree on CUDA: every draw on the device (inside the drafter's
    graph where it has one, the uniforms an input), the fused sampled verification inside the
    target's graph. At top-k 1 the
    target's distribution is one token, so the output is its greedy output, though the trees hold
    children past the draft's one-token support."""
    from draftsmith.runtime.verify import SamplingParams

    drafter = _drafters(target)[kind]
    sampling = SamplingParams(mode="sample", temperature=1.0, top_k=1)
    for ids in (torch.tensor([[5, 9, 14, 20]], device=CUDA), torch.tensor([[7, 7, 30, 31, 32, 33, 34, 35, 36]], device=CUDA)):
        want = target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24, pad_token_id=0, eos_token_id=None)
        got, _ = speculative_generate(target, drafter, ids, 24, sampling=sampling, generator=torch.Generator(device=CUDA).manual_seed(0))
        assert got.tolist() == want.tolist(), kind
    # The sampled verification ran in the target's graph (the fused kernel inside it; an early
    # exit's inside its verify forward's).
    session = target._static_sessions[(tuple(drafter.required_layers()), target.device, target.dtype)]
    verified = [name for name in session.graphs.captured if name[0] in ("tree-verify", "early-exit verify") and name[-4:-1] == (1.0, 1, 1.0)]
    assert verified and all(session.graphs.captured[name] is not None for name in verified), list(session.graphs.captured)
    # The sampled drafting was captured (its graph named by the sampling settings), not run eagerly.
    graphs = {"noisy-tree": lambda: drafter.static.graphs, "clover-tree": lambda: drafter.session.graphs}.get(kind)
    if kind == "early-exit":
        graphs = lambda: target._static_sessions[((), target.device, target.dtype)].graphs  # noqa: E731
    if graphs is not None:
        captured = graphs().captured
        # A head's tree graph also holds the step's read (graph_roles: "read+tree"), named after the tree.
        roles = graph_roles(captured)
        trees = [(name[-1], captured[name]) for name in roles["read+tree"]] + [(name, captured[name]) for name in roles["tree"]]
        trees += [(name, g) for name, g in captured.items() if isinstance(name, tuple) and name not in roles["read+tree"] + roles["tree"]]
        sampled = [g for name, g in trees if name[-1] == (1.0, 1, 1.0)]
        assert sampled and all(g is not None for g in sampled), list(captured)
