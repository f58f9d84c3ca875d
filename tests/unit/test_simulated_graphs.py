"""Decoding through every graph a GPU captures, on the CPU: ``simulated_cuda_graphs`` makes the
static-cache sessions capture their forwards as traced replays with a CUDA graph's contract (host
reads refused, values frozen at capture, fixed output buffers). What tests/gpu/test_static_gpu.py
checks on CUDA, checked here on every CPU run: output token-identical to transformers' greedy
generate() for each drafter kind, every capture taken (none fell back to eager) and replayed, the
greedy verification inside the target's graph (the torch one here; the fused kernel on CUDA)."""

import copy

import pytest
import torch

from draftsmith.heads.clover import CloverConfig, CloverHead
from draftsmith.heads.dflash import DFlashConfig, DFlashHead
from draftsmith.heads.eagle import EagleConfig, EagleHead
from draftsmith.heads.eagle3 import Eagle3Config, Eagle3Head
from draftsmith.heads.hydra import HydraConfig, HydraHead
from draftsmith.heads.medusa import MedusaConfig, MedusaHead
from draftsmith.runtime.drafters import HeadDrafter, StandaloneDrafter
from draftsmith.runtime.early_exit import EarlyExitDrafter
from draftsmith.runtime.generate import autoregressive_generate, speculative_generate
from draftsmith.runtime.lookup import HybridDrafter, LookupDrafter, SuffixMatcher
from draftsmith.runtime.tree import DynamicTreeSpec, TreeSpec, default_tree
from draftsmith.target import FrozenTarget
from draftsmith.testing import TracedGraph, graph_roles, simulated_cuda_graphs, tiny_causal_lm

pytestmark = pytest.mark.usefixtures("one_thread")

KINDS = [
    "plain", "eagle-dynamic", "eagle3-dynamic", "eagle3-static", "medusa-tree", "dflash-chain", "hydra-dynamic", "clover-static", "noisy-tree",
    "noisy-dynamic", "self-chain", "early-exit", "suffix", "hybrid",
]  # fmt: skip


def _perturbed(module, scale, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale * p.std().clamp_min(1e-3).item())
    return module


def _drafter(kind, target, cache="static"):
    dims, L = target.dims, target.dims.num_layers
    torch.manual_seed(3)
    if kind == "eagle-dynamic":
        return HeadDrafter(EagleHead(EagleConfig(depth=4), dims).eval(), target, DynamicTreeSpec(depth=4, topk=3, budget=10), cache=cache)
    if kind.startswith("eagle3"):
        head = Eagle3Head(Eagle3Config(depth=4, train_depth=4, draft_vocab_size=64, aux_layer_ids=[1, 2, 3]), dims)
        head.init_from_target(target)
        spec = DynamicTreeSpec(depth=4, topk=3, budget=10) if kind.endswith("dynamic") else default_tree(4, (3, 2, 2, 1))
        return HeadDrafter(head.eval(), target, spec, cache=cache)
    if kind == "medusa-tree":
        return HeadDrafter(_perturbed(MedusaHead(MedusaConfig(num_heads=4, num_layers=1), dims), 0.1, 4).eval(), target, default_tree(4, (4, 2, 2, 1)), cache=cache)
    if kind == "dflash-chain":
        head = DFlashHead(DFlashConfig(aux_layer_ids=[1, L], num_layers=1, block_size=5), dims)
        head.init_from_target(target)
        return HeadDrafter(_perturbed(head, 0.05, 5).eval(), target, TreeSpec.chain(4), cache=cache)
    if kind in ("noisy-tree", "noisy-dynamic"):
        spec = default_tree(4, (3, 2, 2, 1)) if kind == "noisy-tree" else DynamicTreeSpec(depth=4, topk=3, budget=10)
        return StandaloneDrafter(_perturbed(copy.deepcopy(target.model), 0.15, 1), spec, cache=cache)
    if kind == "suffix":  # trees of every size and depth, step to step
        return LookupDrafter(SuffixMatcher())
    if kind == "hybrid":
        return HybridDrafter(_drafter("eagle3-dynamic", target, cache), SuffixMatcher())
    if kind == "hybrid-hydra":
        return HybridDrafter(_drafter("hydra-dynamic", target, cache), SuffixMatcher())
    if kind in ("hydra-dynamic", "clover-static"):  # Hydra++ with an EAGLE-2 tree, Clover-2 with a static one
        head = HydraHead(HydraConfig(num_heads=4, num_layers=2), dims) if kind.startswith("hydra") else CloverHead(CloverConfig(depth=4), dims)
        head.init_from_target(target)
        spec = DynamicTreeSpec(depth=4, topk=3, budget=10) if kind.endswith("dynamic") else default_tree(4, (3, 2, 2, 1))
        return HeadDrafter(_perturbed(head, 0.005, 6).eval(), target, spec, cache=cache)
    if kind == "early-exit":  # drafts on the target's own session (cache= is the target's)
        return EarlyExitDrafter(target, exit_layer=1, tree=TreeSpec.chain(3))
    assert kind == "self-chain"
    return StandaloneDrafter(target.model, TreeSpec.chain(4), cache=cache)


@pytest.mark.parametrize("kind", KINDS)
def test_decoding_through_the_captured_graphs_equals_hf_greedy(kind, capsys):
    prompts = [torch.tensor([[5, 9, 14, 20]]), torch.tensor([[7, 7, 30, 31, 32, 33, 34, 35, 36]])]
    with simulated_cuda_graphs() as graphs, torch.no_grad():
        target = FrozenTarget(tiny_causal_lm("llama", seed=0))  # made inside: its sessions capture
        drafter = None if kind == "plain" else _drafter(kind, target)
        for ids in prompts:
            want = target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=20, pad_token_id=0, eos_token_id=None)
            if drafter is None:
                got, stats = autoregressive_generate(target, ids, 20, cache="static")
            else:
                got, stats = speculative_generate(target, drafter, ids, 20, cache="static")
            assert got.tolist() == want.tolist(), kind
    assert "capture failed" not in capsys.readouterr().err  # no capture fell back to eager
    assert graphs.captured and all(graph.replays for graph in graphs.captured)
    session = target._static_sessions[(() if drafter is None else tuple(drafter.required_layers()), target.device, target.dtype)]
    assert session.graphs and session.graphs.captured and all(g is not None for g in session.graphs.captured.values())
    # One graph per tree size: a plain step's one-node forward, or a tree's forward with its greedy
    # verification inside; an early exit's whole chain, then its verify forward from the exit.
    want = {"tree"} if drafter is None else {"early-exit draft", "early-exit verify"} if kind == "early-exit" else {"tree-verify"}
    assert {key[0] for key in session.graphs.captured} == want
    if kind == "early-exit":  # its greedy verification inside the verify forward's graph
        assert any(key[-1] == "verified" for key in session.graphs.captured)
    if kind == "suffix":  # trees of several sizes: one graph each, whatever depth a tree reached
        assert len(session.graphs.captured) > 1
    if kind in ("hydra-dynamic", "eagle-dynamic", "eagle3-dynamic", "eagle3-static", "clover-static", "hybrid", "dflash-chain", "medusa-tree"):
        # A step's read of its accepted positions (EAGLE's extend, Hydra++'s prefix layer, Clover's
        # block, DFlash's context and block, Medusa's heads) and the tree drafted after it are one
        # graph. Only a prompt's read (the first, at position 0) runs alone, and the tree after it.
        session = drafter.head.session if kind == "hybrid" else drafter.session
        compiled = session.graphs.captured
        assert session.graphs and compiled and all(isinstance(g, TracedGraph) for g in compiled.values()), list(compiled)
        roles = graph_roles(compiled)
        trees = [name[-1] for name in roles["read+tree"]] + roles["tree"]
        assert roles["read+tree"] and not roles["other"], roles
        # Reads alone: the prompts' (their length but the root), never a step's.
        assert {name[1] for name in roles["read"] if name != "heads"} <= {ids.shape[1] - 1 for ids in prompts} and len(roles["tree"]) <= 1, roles
        # And no prompt's read in a tree's graph: the 9-token prompt's (8 positions) would capture a
        # whole tree of its own, where a step reads at most its tree's depth + 1 (5 here).
        assert all(name[1] <= 5 for name in roles["read+tree"] if name[0] != "heads"), roles
        whole = "static" if kind.endswith(("static", "tree", "chain")) else "dynamic"
        assert all(name[0] == whole for name in trees), trees
        if kind == "hybrid":  # its levels and the lookup's candidates merged in the same graph
            assert all(name[-1][0] == "hybrid" for name in trees), trees
        if kind == "medusa-tree":  # the heads take no count: one graph for every step
            assert list(compiled) == [("heads", ("static", drafter.tree, ()))]
    if isinstance(drafter, StandaloneDrafter):  # the draft model's own forwards
        assert drafter.static is not None and drafter.static.graphs and drafter.static.graphs.captured
        # A step's read and its whole tree are one graph; the 9-token prompt (the second: its larger
        # cache took new graphs) is read eagerly, then its tree replays a graph of its own.
        names = [name for name in drafter.static.graphs.captured if isinstance(name, tuple)]
        if kind == "noisy-dynamic":  # an EAGLE-2 tree: the same, named by its depth, top-k and budget
            counts = {name[-1] for name in names if name[0] == "draft-dynamic"}
            assert counts & {1, 2} and "tree" in counts, counts
        else:
            assert {name[2] for name in names if name[0] == "draft"} & {1, 2} and ("draft-tree", drafter.tree, ()) in names  # () greedy
        assert all(isinstance(name, tuple) for name in drafter.static.graphs.captured), "a level forward replayed on its own"


@pytest.mark.parametrize(
    "kind", ["eagle3-dynamic", "eagle3-static", "dflash-chain", "hydra-dynamic", "clover-static", "noisy-tree", "noisy-dynamic", "self-chain", "early-exit", "hybrid", "hybrid-hydra"]
)  # fmt: skip
def test_a_graphed_drafter_drafts_what_the_eager_one_drafts(kind):
    """Output identity cannot see a drafter (verification keeps any draft lossless): the trees a
    head or a draft model drafts through its replayed graphs are the trees it drafts on growing
    caches, step for step, with the acceptance they got. A hybrid's tree grows on the host on
    growing caches and on the device through the graphs (padded there: its real nodes compared)."""
    ids = torch.tensor([[5, 9, 14, 20, 5, 9, 14, 20, 5]]) if kind.startswith("hybrid") else torch.tensor([[5, 9, 14, 20, 7, 3]])
    runs = {}
    for cache in ("dynamic", "static"):
        with simulated_cuda_graphs(), torch.no_grad():
            target = FrozenTarget(tiny_causal_lm("llama", seed=0))
            drafter = _drafter(kind, target, cache)
            proposed, propose = [], drafter.propose
            drafter.propose = lambda state: proposed.append(propose(state)) or proposed[-1]
            out, stats = speculative_generate(target, drafter, ids, 24, cache=cache)
        n = [int(t.num_nodes[0]) for t in proposed] if kind.startswith("hybrid") else [t.tokens.shape[1] for t in proposed]
        runs[cache] = (out.tolist(), stats.accept_lens, [(t.tokens[:, :k].tolist(), t.parents[:, :k].tolist()) for t, k in zip(proposed, n)])
        if kind.startswith("hybrid"):
            runs[cache] += ((drafter.reliability.tested, drafter.reliability.accepted),)
            # The head's read of a step runs in its tree's graph: ("extend", count, layers, the tree's name).
            roles = graph_roles(drafter.head.session.graphs.captured)
            trees = [name[-1] for name in roles["read+tree"]] + roles["tree"]
            merged = [name for name in trees if name[0] == "dynamic" and name[-1][0] == "hybrid"]
            assert bool(merged) == (cache == "static")  # through the graphs, the merged tree is one
    assert runs["static"] == runs["dynamic"]
    if kind.startswith(("eagle", "hydra", "clover", "noisy", "hybrid")) or kind == "early-exit":  # something was accepted: the caches were rolled back and kept
        assert 0 < sum(runs["static"][1])
    if kind.startswith("hybrid"):  # the lookup's candidates were in the trees, and some were accepted
        assert runs["static"][3][1] > 0


def test_a_host_read_in_a_captured_function_falls_back_to_eager(capsys):
    """A function that reads a value to the host cannot be captured: the simulation refuses it as
    CUDA does, and the caller is told once and runs eagerly."""
    from draftsmith.graphs import capture_or_none

    def reads(x):
        return x * int(x.sum())

    with simulated_cuda_graphs() as graphs:
        assert capture_or_none(reads, [torch.ones(3)], "a reading function") is None
        assert capture_or_none(lambda x: x * 2, [torch.ones(3)], "a pure function") is not None
    assert len(graphs.captured) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "note: a reading function: CUDA graph capture failed" in err


def test_a_sessions_graphs_replay_by_name_and_stop_for_good_after_a_failed_capture(capsys):
    """``Graphs``, what every session captures with: a name is captured once and replayed after;
    once a capture fails the session runs everything eagerly, the graphs it holds included."""
    from draftsmith.graphs import Graphs

    calls = []

    def double(x):
        calls.append(1)
        return x * 2

    with simulated_cuda_graphs():
        graphs = Graphs(True)
        first, replayed = graphs.run("double", double, [torch.ones(3)], "doubling")
        traced = len(calls)
        again, replayed_again = graphs.run("double", double, [torch.full((3,), 5.0)], "doubling")
        assert replayed and replayed_again and len(calls) == traced  # the second call replays: fn not run
        assert again.tolist() == [10.0, 10.0, 10.0] and again is first  # the graph's own buffer, overwritten
        out, replayed = graphs.run("reads", lambda x: x * int(x.sum()), [torch.ones(3)], "a reading function")
        assert not replayed and out.tolist() == [3.0, 3.0, 3.0] and not graphs
        out, replayed = graphs.run("double", double, [torch.ones(3)], "doubling")
        assert not replayed and len(calls) == traced + 1  # eager from then on
    assert capsys.readouterr().err.count("capture failed") == 1
    assert not Graphs(False).run("double", double, [torch.ones(3)], "doubling")[1]  # off: eager, nothing captured


def test_a_traced_graph_freezes_what_it_read_at_capture_and_reuses_its_outputs():
    """The contract the simulation keeps: a Python value taken at capture stays (as in a CUDA
    graph), the inputs are copied into its buffers, and every replay returns the same output
    tensors, overwritten."""
    state = {"scale": 2.0}
    graph = TracedGraph(lambda x: (x * state["scale"], x + 1), [torch.ones(2)])
    state["scale"] = 5.0
    first = graph(torch.tensor([1.0, 2.0]))
    assert first[0].tolist() == [2.0, 4.0]  # frozen at 2.0
    kept = first[0]
    second = graph(torch.tensor([3.0, 4.0]))
    assert second[0] is kept and kept.tolist() == [6.0, 8.0] and second[1].tolist() == [4.0, 5.0]


# The static trees of the kinds above, sampled: on the static cache their drafting runs on the device
# (runtime.sampling.DeviceDraws), through the graphs; on the dynamic cache it runs on the host.
SAMPLED = ["eagle3-static", "medusa-tree", "dflash-chain", "hydra-static", "clover-static", "noisy-tree", "noisy-dynamic", "self-chain", "early-exit"]


# Several nodes with children at each level: each draws from its own row of uniforms.
BRANCHY = TreeSpec.from_choices([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (2, 0), (0, 0, 0), (1, 0, 0), (0, 0, 0, 0)])


def _sampled_drafter(kind, target, cache):
    """The drafter of ``kind``, its static tree BRANCHY where it drafts a tree."""
    if kind == "hydra-static":
        head = HydraHead(HydraConfig(num_heads=4, num_layers=2), target.dims)
        head.init_from_target(target)
        drafter = HeadDrafter(_perturbed(head, 0.005, 6).eval(), target, BRANCHY, cache=cache)
    else:
        drafter = _drafter(kind, target, cache)
    if isinstance(drafter.tree, TreeSpec) and drafter.tree.num_nodes > drafter.tree.max_depth + 1:
        drafter.tree = BRANCHY
    return drafter


def _no_host_growth(monkeypatch):
    """Growing a tree on the host (grow_static_tree, a draw a node; build_dynamic_tree, a read a
    level) raises from here on."""
    import draftsmith.runtime.drafters as drafters
    import draftsmith.runtime.early_exit as early_exit

    def refused(*args, **kwargs):
        raise AssertionError("a sampled tree grew on the host")

    for module, name in ((drafters, "grow_static_tree"), (early_exit, "grow_static_tree"), (drafters, "build_dynamic_tree")):
        monkeypatch.setattr(module, name, refused)


@pytest.mark.parametrize("kind", SAMPLED)
def test_a_sampled_tree_drawn_through_the_graphs_is_the_hosts(kind, monkeypatch, capsys):
    """Sampled drafting of a static tree on the static cache (every draw on the device, the whole
    tree in the drafter's graph, its uniforms an input) draws, step for step, the tree the host
    draws on the dynamic cache from the same generator: the same tokens, the same draft
    distributions; and the sampled verification inside the target's graph decides what the
    reference decides after it: the same output and acceptance."""
    from draftsmith.runtime.verify import SamplingParams

    ids = torch.tensor([[5, 9, 14, 20, 7, 3]])
    sampling = SamplingParams(mode="sample", temperature=0.9, top_k=30)
    runs, probs = {}, {}
    for cache in ("dynamic", "static"):
        with simulated_cuda_graphs() as graphs, torch.no_grad(), monkeypatch.context() as patch:
            target = FrozenTarget(tiny_causal_lm("llama", seed=0))
            drafter = _sampled_drafter(kind, target, cache)
            if cache == "static":
                _no_host_growth(patch)
            proposed, propose = [], drafter.propose
            drafter.propose = lambda state: proposed.append(propose(state)) or proposed[-1]
            out, stats = speculative_generate(target, drafter, ids, 24, sampling=sampling, generator=torch.Generator().manual_seed(3), cache=cache)
            if cache == "static":
                assert graphs.captured and all(graph.replays for graph in graphs.captured)
                # The sampled verification ran inside the target's graph (an early exit's: inside its verify forward's).
                session = target._static_sessions[(tuple(drafter.required_layers()), target.device, target.dtype)]
                verified = [key for key in session.graphs.captured if key[0] in ("tree-verify", "early-exit verify")]
                drafted = None if kind == "noisy-dynamic" else torch.float32  # an EAGLE-2 tree's candidates: no draft distributions
                assert verified and all(key[-4:] == (0.9, 30, 1.0, drafted) for key in verified), verified
        runs[cache] = (out.tolist(), stats.accept_lens, [(t.tokens.tolist(), t.parents.tolist()) for t in proposed])
        probs[cache] = [t.draft_probs for t in proposed]
    assert "capture failed" not in capsys.readouterr().err
    assert runs["static"] == runs["dynamic"]
    for want, got in zip(probs["dynamic"], probs["static"]):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert 0 < sum(runs["static"][1])  # something was accepted: the caches were rolled back and kept


@pytest.mark.parametrize("kind", SAMPLED)
def test_children_past_the_draft_support_decode_as_the_target(kind, monkeypatch):
    """Top-k 1 sampling keeps one token of each distribution: every node of the tree with more
    than one child holds children past the draft's support (kept in place on the device, tokens of
    q = 0). The target's own distribution is one token too, so the output is its greedy output."""
    from draftsmith.runtime.verify import SamplingParams

    ids = torch.tensor([[5, 9, 14, 20, 7, 3]])
    with simulated_cuda_graphs(), torch.no_grad(), monkeypatch.context() as patch:
        target = FrozenTarget(tiny_causal_lm("llama", seed=0))
        want = target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=20, pad_token_id=0, eos_token_id=None)
        drafter = _sampled_drafter(kind, target, "static")
        _no_host_growth(patch)
        proposed, propose = [], drafter.propose
        drafter.propose = lambda state: proposed.append(propose(state)) or proposed[-1]
        sampling = SamplingParams(mode="sample", temperature=1.0, top_k=1)
        out, stats = speculative_generate(target, drafter, ids, 20, sampling=sampling, generator=torch.Generator().manual_seed(4), cache="static")
    assert out.tolist() == want.tolist()
    spec = drafter.tree
    if not isinstance(spec, TreeSpec):
        return  # an EAGLE-2 tree ranks its candidates: nothing is drawn
    assert all(t.size == spec.num_nodes for t in proposed)  # the fixed shape, past-support children included
    if any(len(spec.children(n)) > 1 for n in range(spec.num_nodes)):
        past = [(t.draft_probs[0, spec.parents[n], t.tokens[0, n]] == 0).item() for t in proposed for n in range(1, spec.num_nodes)]
        assert any(past)


@pytest.mark.parametrize("kind", ["eagle3-dynamic", "hydra-dynamic", "clover-static", "medusa-tree", "dflash-chain"])
def test_a_read_no_whole_tree_takes_runs_in_a_graph_of_its_own(kind):
    """On graphs a head session's read of the accepted positions (EAGLE's extend, Hydra++'s prefix
    layer, Clover's block, DFlash's context and block, Medusa's heads) waits for the step's tree,
    whose graph runs it. A tree grown otherwise (an adaptive one, node by node on the host) reads
    the read's result first: the read then replays alone, and the output is still the target's
    greedy one, equal to the run on growing caches."""
    from draftsmith.runtime.tree import AdaptiveTreeSpec

    ids = torch.tensor([[5, 9, 14, 20, 7, 3]])
    runs = {}
    for cache in ("dynamic", "static"):
        with simulated_cuda_graphs(), torch.no_grad():
            target = FrozenTarget(tiny_causal_lm("llama", seed=0))
            head = _drafter(kind, target, cache).head
            drafter = HeadDrafter(head, target, AdaptiveTreeSpec(depth=4, topk=3, budget=10), cache=cache)
            out, stats = speculative_generate(target, drafter, ids, 20, cache=cache)
            want = target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=20, pad_token_id=0, eos_token_id=None)
        assert out.tolist() == want.tolist(), cache
        runs[cache] = (out.tolist(), stats.accept_lens)
        if cache == "static":
            # The read alone (a graph per accepted count; Medusa's heads one); EAGLE's host nodes
            # replay graphs per frontier size. None holds a tree.
            captured = drafter.session.graphs.captured
            roles = graph_roles(captured)
            # Still on graphs, every read captured (none fell back to eager), none holding a tree.
            assert drafter.session.graphs and roles["read"] and all(captured[name] is not None for name in roles["read"]), roles
            assert not roles["read+tree"] and not roles["tree"], roles
    if kind != "dflash-chain":  # (the untrained DFlash block accepts nothing: every read is the bonus alone)
        assert 0 < sum(runs["static"][1]), "nothing accepted: no step read more than the bonus"
    assert runs["static"] == runs["dynamic"]
