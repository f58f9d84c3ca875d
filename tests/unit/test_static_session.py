"""StaticSession: the target on a preallocated KV cache (what a GPU replays as CUDA graphs) computes
what TargetSession computes on transformers' DynamicCache, step for step, on the CPU."""

import inspect

import pytest
import torch

from draftsmith.runtime.drafters import DrafterError, StandaloneDrafter
from draftsmith.runtime.early_exit import EarlyExitDrafter
from draftsmith.runtime.generate import TargetSession, autoregressive_generate, open_session, speculative_generate
from draftsmith.runtime.static import StaticSession, static_session_supported
from draftsmith.runtime.tree import DraftTree, TreeSpec, ancestor_mask
from draftsmith.target import FrozenTarget
from draftsmith.testing import tiny_causal_lm

pytestmark = pytest.mark.usefixtures("one_thread")

# A static tree with several nodes that get children at every level: the accepted path's entries
# among them are not the first ones (a move when they are kept), and siblings must not see each other.
BUSHY = TreeSpec.from_choices([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0), (0, 0, 0, 0), (1, 0, 0, 0)])


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def target(request):
    return FrozenTarget(tiny_causal_lm(request.param, seed=0))


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_every_forward_and_rollback_matches_the_dynamic_cache(target):
    """prefill, a tree, keep a path, a second tree, keep, a plain step: the same logits, final
    hidden states and captured layers as TargetSession; the cache grows past its first capacity."""
    layers = [0, 2, -1]
    ref, static = TargetSession(target, layers), StaticSession(target, layers, capacity=12)
    prompt = torch.tensor([[5, 9, 14, 20, 7, 3, 11]])
    (h1, l1), (h2, l2) = ref.prefill(prompt), static.prefill(prompt)
    _close(h2, h1)
    assert sorted(l2) == sorted(l1) == [-1, 0, 2]
    for i in l1:
        _close(l2[i], l1[i])
    trees = [
        DraftTree.from_lists([11, 30, 31, 40, 41, 42], [-1, 0, 0, 1, 1, 2]),
        DraftTree.from_lists([40, 8, 9, 10], [-1, 0, 1, 1]),
    ]
    for tree, path in zip(trees, ([0, 1, 4], [0, 2])):
        (g1, f1, t1), (g2, f2, t2) = ref.forward_tree(tree), static.forward_tree(tree)
        _close(g2, g1)
        _close(f2, f1)
        for i in t1:
            _close(t2[i], t1[i])
        ref.keep(path)
        static.keep(path)
        assert static.length == ref.length
    assert static.cache.capacity > 12  # grew, keeping what it held
    _close(static.next_logits(torch.tensor([[12]])), ref.next_logits(torch.tensor([[12]])))


def test_plain_and_speculative_decoding_on_the_static_cache_equal_hf_greedy(target):
    prompts = [torch.tensor([[5, 9, 14, 20]]), torch.tensor([[7]]), torch.tensor([[3, 3, 3, 3, 3, 3, 3, 3, 40]])]
    other = StandaloneDrafter(tiny_causal_lm("llama", hidden_size=32, num_layers=1, seed=1), TreeSpec.chain(3))
    itself = StandaloneDrafter(target.model, TreeSpec.chain(3))  # everything accepted: 4 tokens a step
    for ids in prompts:
        want = target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=20, pad_token_id=0, eos_token_id=None)
        plain, _ = autoregressive_generate(target, ids, 20, cache="static")
        spec, _ = speculative_generate(target, other, ids, 20, cache="static")
        fast, stats = speculative_generate(target, itself, ids, 20, cache="static")
        assert plain.tolist() == spec.tolist() == fast.tolist() == want.tolist()
        assert set(stats.accept_lens[:-1]) == {3}


def test_one_session_per_target_reused_across_generations(target):
    first = StaticSession.for_target(target, [1], capacity=64)
    first.prefill(torch.tensor([[5, 6, 7]]))
    again = StaticSession.for_target(target, [1], capacity=32)
    assert again is first and again.length == 0 and again.cache.capacity == 64
    bigger = StaticSession.for_target(target, [1], capacity=200)
    assert bigger is first and bigger.cache.capacity == 200
    assert StaticSession.for_target(target, [2], capacity=8) is not first


def test_which_session_a_generation_opens(target):
    assert type(open_session(target, [], "auto", 64)) is TargetSession  # the CPU: the reference cache
    assert type(open_session(target, [], "static", 64)) is StaticSession
    with pytest.raises(ValueError, match="cache must be one of auto, dynamic, static, got 'paged'"):
        speculative_generate(target, StandaloneDrafter(target.model), torch.tensor([[5, 6]]), 4, cache="paged")
    with pytest.raises(ValueError, match="CUDA graphs need the target on a CUDA device"):
        StaticSession(target, graphs=True)
    with pytest.raises(DrafterError, match="forward_tree"):
        StaticSession(target).keep([0])
    from draftsmith.runtime.load import load_drafter

    with pytest.raises(DrafterError, match="--cache: cache must be one of auto, dynamic, static, got 'paged'"):
        load_drafter("lookup", cache="paged")  # refused before a model loads
    assert static_session_supported(target)


@pytest.mark.parametrize("mode", ["greedy", "sample"])
def test_an_early_exit_drafter_on_the_static_cache_drafts_what_it_drafts_on_the_dynamic_one(target, mode):
    """A self-drafter runs slices of the target's layers on the target's own session: on the static
    cache (what CUDA replays as two graphs a step, greedy) its chains, step for step, its acceptance
    and its output are the dynamic cache's, and greedy output is the target's own greedy output.
    Each exit layer, sampled too (the same draws from the same generator)."""
    from draftsmith.runtime.verify import SamplingParams

    ids = torch.tensor([[5, 9, 14, 20, 7, 3]])
    sampling = SamplingParams(mode="sample", temperature=0.9, top_k=30) if mode == "sample" else SamplingParams()
    want = target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24, pad_token_id=0, eos_token_id=None)
    for exit_layer in range(1, len(target.layers)):
        runs = {}
        for cache in ("dynamic", "static"):
            drafter = EarlyExitDrafter(target, exit_layer=exit_layer, tree=TreeSpec.chain(3))
            proposed, propose = [], drafter.propose
            drafter.propose = lambda state: proposed.append(propose(state)) or proposed[-1]
            out, stats = speculative_generate(target, drafter, ids, 24, sampling=sampling, generator=torch.Generator().manual_seed(2), cache=cache)
            runs[cache] = (out.tolist(), stats.accept_lens, [t.tokens.tolist() for t in proposed])
        assert runs["static"] == runs["dynamic"], exit_layer
        assert mode == "sample" or runs["static"][0] == want.tolist()
        assert 0 < sum(runs["static"][1]) and min(runs["static"][1]) < 3  # partial acceptance: rollbacks happened


def test_ancestor_mask_is_the_walk_to_the_root():
    def walk(parents):
        B, N = parents.shape
        anc = torch.zeros(B, N, N, dtype=torch.bool)
        for b in range(B):
            for i in range(N):
                j = i
                while j >= 0:
                    anc[b, i, j] = True
                    j = int(parents[b, j])
        return anc

    gen = torch.Generator().manual_seed(0)
    for n in (1, 2, 3, 8, 26, 65):
        parents = torch.full((3, n), -1)
        for b in range(3):
            for i in range(1, n):
                if b < 2 or i % 5:  # the third tree has padding nodes (parent -1) among real ones
                    parents[b, i] = int(torch.randint(0, i, (1,), generator=gen)) if b else i - 1  # the first one a chain
        assert torch.equal(ancestor_mask(parents), walk(parents)), n


def test_a_draft_model_on_the_static_cache_drafts_what_it_drafts_on_the_dynamic_one(target):
    """Output identity cannot see a drafter's cache (verification keeps any draft lossless): the
    trees must be the same, step for step, with rollbacks of non-contiguous paths."""
    import copy

    from draftsmith.runtime.tree import DynamicTreeSpec, default_tree

    noisy = copy.deepcopy(target.model)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in noisy.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.15 * p.std().clamp_min(1e-3))
    ids = torch.tensor([[5, 9, 14, 20, 7, 3]])
    for tree in (default_tree(4, (3, 2, 2, 1)), BUSHY, DynamicTreeSpec(depth=4, topk=3, budget=10)):
        runs, kept = {}, {}
        for cache in ("dynamic", "static"):
            drafter = StandaloneDrafter(noisy, tree, cache=cache)
            proposed, entries = [], []
            propose, accept = drafter.propose, drafter.accept
            drafter.propose = lambda state: proposed.append(propose(state)) or proposed[-1]

            def accepted(result, drafter=drafter, accept=accept, entries=entries):
                # The draft's kept keys (their rotary positions in them) after each step, every layer.
                accept(result)
                n = drafter.cached_len
                keys = drafter.static.cache.keys[:, 0, :, :n] if drafter.static is not None else torch.stack([layer.keys[0, :, :n] for layer in drafter.cache.layers])
                entries.append(keys.clone())

            drafter.accept = accepted
            out, stats = speculative_generate(target, drafter, ids, 30, cache=cache)
            runs[cache] = (out.tolist(), stats.accept_lens, [(t.tokens.tolist(), t.parents.tolist()) for t in proposed])
            kept[cache] = entries
        assert runs["static"] == runs["dynamic"]
        for want, got in zip(kept["dynamic"], kept["static"]):
            # An EAGLE-2 tree on the static cache drops the deepest accepted node's entry (it knows
            # on the host only how many nodes were accepted, not whether that one was forwarded)
            # and reads its token again next step; everything else it keeps as the dynamic cache does.
            dropped = want.shape[2] - got.shape[2]
            assert dropped == 0 or (dropped == 1 and isinstance(tree, DynamicTreeSpec)), (got.shape, want.shape)
            _close(got, want[:, :, : got.shape[2]])
        assert 0 < sum(runs["static"][1]) < sum(len(t[0][0]) - 1 for t in runs["static"][2])  # partial acceptance: rollbacks happened


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "dflash"])
def test_a_head_on_preallocated_caches_drafts_what_it_drafts_on_growing_ones(target, kind):
    """EAGLE's and EAGLE-3's own caches, DFlash's context, in buffers read whole under a mask (what
    a GPU replays as graphs): the same trees step for step, dynamic and static trees, the buffers
    grown mid-generation. EAGLE's dynamic trees grow on the device there, on the host here."""
    from draftsmith.heads.dflash import DFlashConfig, DFlashHead
    from draftsmith.heads.eagle import EagleConfig, EagleHead
    from draftsmith.heads.eagle3 import Eagle3Config, Eagle3Head
    from draftsmith.runtime.drafters import HeadDrafter
    from draftsmith.runtime.tree import DynamicTreeSpec, default_tree

    torch.manual_seed(3)
    if kind == "eagle":
        head = EagleHead(EagleConfig(depth=4), target.dims)
    elif kind == "eagle3":
        head = Eagle3Head(Eagle3Config(depth=4, train_depth=4, draft_vocab_size=64, aux_layer_ids=[1, 2, 3]), target.dims)
        head.init_from_target(target)
    else:
        head = DFlashHead(DFlashConfig(aux_layer_ids=[1, 3], num_layers=1, block_size=5), target.dims)
        head.init_from_target(target)
        with torch.no_grad():
            for p in head.parameters():
                p.add_(torch.randn_like(p) * 0.05)
    head.eval()
    ids = torch.tensor([[5, 9, 14, 20, 7, 3]])

    def no_host_expand(frontier):
        raise AssertionError("a tree level was expanded on the host")

    for tree in (default_tree(4, (3, 2, 2, 1)), DynamicTreeSpec(depth=4, topk=3, budget=10)):
        runs = {}
        for cache in ("dynamic", "static"):
            drafter = HeadDrafter(head, target, tree, cache=cache)
            proposed, sessions = [], []
            propose = drafter.propose

            def recording(state, propose=propose, proposed=proposed, sessions=sessions, drafter=drafter):
                if cache == "static" and drafter.session.capacity and not sessions:
                    drafter.session._grow(drafter.session.decided + 12 if drafter.session.decided else 12)  # small: it must grow
                sessions.append(drafter.session.capacity)
                if cache == "static" and kind != "dflash":
                    drafter.session.expand = no_host_expand  # EAGLE's trees, static and dynamic, grow on the device
                proposed.append(propose(state))
                return proposed[-1]

            drafter.propose = recording
            out, stats = speculative_generate(target, drafter, ids, 30, cache=cache)
            runs[cache] = (out.tolist(), stats.accept_lens, [(t.tokens.tolist(), t.parents.tolist()) for t in proposed])
            if cache == "static":
                assert sessions[0] == 12 and drafter.session.capacity > 12  # grew, keeping its entries
            else:
                assert drafter.session.capacity == 0
        assert runs["static"] == runs["dynamic"]


NOISE = 0.005


def _path_head(kind, target):
    """Hydra (Hydra++: its prefix layer, or without it) or Clover (Clover-2, or Clover-1's order)
    on ``target``, initialised from it."""
    from draftsmith.heads.clover import CloverConfig, CloverHead
    from draftsmith.heads.hydra import HydraConfig, HydraHead

    torch.manual_seed(3)
    if kind.startswith("hydra"):
        head = HydraHead(HydraConfig(num_heads=4, num_layers=2, prefix_attention=kind == "hydra++"), target.dims)
    else:
        clover1 = dict(num_layers=1, token_first=False, output="residual", teacher=False, regression_weight=0.0) if kind == "clover-1" else {}
        head = CloverHead(CloverConfig(depth=4, **clover1), target.dims)
    head.init_from_target(target)
    with torch.no_grad():  # as initialised, a head's children barely depend on the path: ties everywhere, broken by rounding
        for p in head.parameters():
            p.add_(torch.randn_like(p) * NOISE)
    return head.eval()


@pytest.mark.parametrize("kind", ["hydra", "hydra++", "clover-1", "clover-2"])
def test_a_path_conditioned_head_grows_its_trees_on_the_device(target, kind):
    """Hydra's and Clover's sessions on the static cache (LevelSession: each tree level's node
    states from the level before, on the device, the whole tree one CUDA graph a step on a GPU;
    Hydra++'s prefix layer and Clover's augmenting block on preallocated caches, grown
    mid-generation): the same trees step for step as the host's level-by-level growth on growing
    caches, static and EAGLE-2 trees, and no level expanded on the host."""
    from draftsmith.runtime.drafters import HeadDrafter
    from draftsmith.runtime.tree import DynamicTreeSpec, default_tree

    head = _path_head(kind, target)
    ids = torch.tensor([[5, 9, 14, 20, 7, 3]])

    def no_host_expand(frontier):
        raise AssertionError("a tree level was expanded on the host")

    accepted = []
    for tree in (default_tree(4, (3, 2, 2, 1)), BUSHY, DynamicTreeSpec(depth=4, topk=3, budget=10)):
        runs = {}
        for cache in ("dynamic", "static"):
            drafter = HeadDrafter(head, target, tree, cache=cache)
            proposed, propose = [], drafter.propose

            def recording(state, propose=propose, proposed=proposed, drafter=drafter, cache=cache):
                if cache == "static" and not proposed:
                    drafter.session.expand = no_host_expand
                    drafter.session._grow(12)  # small: the prefix layer's or the block's caches must grow mid-generation
                proposed.append(propose(state))
                return proposed[-1]

            drafter.propose = recording
            out, stats = speculative_generate(target, drafter, ids, 60, cache=cache)
            runs[cache] = (out.tolist(), stats.accept_lens, [(t.tokens.tolist(), t.parents.tolist()) for t in proposed])
            assert (drafter.session.capacity > 12) == (cache == "static")
        assert runs["static"] == runs["dynamic"], tree
        accepted.append(sum(runs["static"][1]))
    # On the Llama target every kind accepts: multi-position reads and rollbacks happen (on the
    # Qwen2 one Hydra++'s perturbed prefix layer accepts nothing).
    assert target.model.config.model_type != "llama" or min(accepted) > 0, accepted


@pytest.mark.parametrize("kind", ["eagle", "dflash"])
def test_a_preallocated_head_session_starts_over_in_its_own_buffers(target, kind):
    """The next generation reuses the session (its buffers, and on CUDA its graphs) and drafts what
    a fresh session on growing caches drafts: nothing of the last prompt shows through."""
    from draftsmith.heads.dflash import DFlashConfig, DFlashHead
    from draftsmith.heads.eagle import EagleConfig, EagleHead
    from draftsmith.runtime.drafters import HeadDrafter
    from draftsmith.runtime.tree import DynamicTreeSpec, TreeSpec

    torch.manual_seed(4)
    if kind == "eagle":
        head, tree = EagleHead(EagleConfig(depth=4), target.dims).eval(), DynamicTreeSpec(depth=4, topk=3, budget=10)
    else:
        head, tree = DFlashHead(DFlashConfig(aux_layer_ids=[1, 3], num_layers=1, block_size=5), target.dims), TreeSpec.chain(4)
        head.init_from_target(target)
        head.eval()
    reused = HeadDrafter(head, target, tree, cache="static")
    session = reused.session
    long_prompt, short_prompt = torch.tensor([[5, 9, 14, 20, 7, 3, 11, 40, 41, 42]]), torch.tensor([[8, 6, 30]])
    speculative_generate(target, reused, long_prompt, 16, cache="static")
    fresh = HeadDrafter(head, target, tree, cache="dynamic")
    trees = {}
    for name, drafter in (("reused", reused), ("fresh", fresh)):
        trees[name], propose = [], drafter.propose
        drafter.propose = lambda state, propose=propose, seen=trees[name]: seen.append(propose(state)) or seen[-1]
        out, stats = speculative_generate(target, drafter, short_prompt, 16, cache="static" if drafter is reused else "dynamic")
        trees[name] = (out.tolist(), stats.draft_forwards, [t.tokens.tolist() for t in trees[name]])
    assert reused.session is session and session.capacity
    assert trees["reused"] == trees["fresh"]


def test_a_forward_that_cannot_be_captured_is_one_note_and_none(monkeypatch, capsys):
    """capture_or_none: the callers then run the forward eagerly (their graphs flag goes off)."""
    from draftsmith import graphs

    def refuse(*args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing\nCUDA details")

    monkeypatch.setattr(graphs, "CapturedForward", refuse)
    assert graphs.capture_or_none(lambda x: x, [torch.ones(1)], "the target's forward") is None
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "note: the target's forward: CUDA graph capture failed (RuntimeError: operation not permitted" in err


@pytest.mark.parametrize("kind,shape", [("eagle", "dynamic"), ("eagle3", "dynamic"), ("eagle3", "static")])
def test_a_tree_grown_on_the_device_stays_there(kind, shape):
    """The static-cache path an EAGLE head takes on CUDA (its dynamic or static tree grown on the
    device, the step's one read its verdict) under SimulatedDevice: no operation mixes a host
    tensor with a device one, and the output is the dynamic cache's."""
    from draftsmith.heads.eagle import EagleConfig, EagleHead
    from draftsmith.heads.eagle3 import Eagle3Config, Eagle3Head
    from draftsmith.runtime.drafters import HeadDrafter
    from draftsmith.runtime.tree import DynamicTreeSpec, default_tree
    from draftsmith.testing import SimulatedDevice

    spec = DynamicTreeSpec(depth=4, topk=3, budget=10) if shape == "dynamic" else default_tree(4, (3, 2, 2, 1))

    device, outputs = torch.device("cpu"), {}
    for cache in ("dynamic", "static"):
        with SimulatedDevice() as guard:
            torch.manual_seed(5)
            target = FrozenTarget(tiny_causal_lm("llama", seed=0).to(device))
            if kind == "eagle":
                head = EagleHead(EagleConfig(depth=4), target.dims)
            else:
                head = Eagle3Head(Eagle3Config(depth=4, train_depth=4, draft_vocab_size=64, aux_layer_ids=[1, 2, 3]), target.dims)
                head.init_from_target(target)
            drafter = HeadDrafter(head.to(device).eval(), target, spec, cache=cache)
            before = len(guard.reads)
            out, stats = speculative_generate(target, drafter, torch.tensor([[5, 9, 14, 20, 7, 3]]), 24, cache=cache)
        assert guard.checked > 200
        outputs[cache] = (out.tolist(), stats.accept_lens)
        if cache == "static":
            # What the CUDA path reads: the torch reference verification (verify.py, and the tree
            # checks it starts with) is the CPU's; on CUDA the fused kernel, which reads nothing, runs.
            lines, first = inspect.getsourcelines(DraftTree.validate)
            checks = {f"tree.py:{n}" for n in range(first, first + len(lines))}
            reads = [r for r in guard.reads[before:] if not r.split(" at ")[1].startswith("verify.py") and r.split(" at ")[1] not in checks]
            steps = len(stats.accept_lens)
            assert len(reads) <= steps + 2, (steps, reads)  # the prompt, the verdict once a step, and the end
            assert sum("generate.py" in r and r.startswith("tolist") for r in reads) == steps + 1
    assert outputs["static"] == outputs["dynamic"]


@pytest.mark.parametrize("shape", ["static", "dynamic"])
def test_a_draft_models_greedy_step_stays_on_the_device(shape):
    """A draft model on the static cache drafting greedily a static tree (StaticSession.draft_tree)
    or an EAGLE-2 tree (draft_dynamic_tree), what CUDA replays as one graph a step, under
    SimulatedDevice: no operation mixes a host tensor with a device one, the drafter reads nothing
    of its own (the accepted path, or its length, comes with the step's verdict), its trees are the
    dynamic cache's, and so is the output."""
    from draftsmith.runtime.tree import DynamicTreeSpec
    from draftsmith.testing import SimulatedDevice

    spec = BUSHY if shape == "static" else DynamicTreeSpec(depth=4, topk=3, budget=10)

    device, runs = torch.device("cpu"), {}
    for cache in ("dynamic", "static"):
        with SimulatedDevice() as guard:
            target = FrozenTarget(tiny_causal_lm("llama", seed=0).to(device))
            draft = tiny_causal_lm("llama", seed=0).to(device)
            gen = torch.Generator().manual_seed(1)
            with torch.no_grad():
                for p in draft.parameters():  # a draft close to the target: partial acceptance, non-contiguous paths kept
                    p.add_(torch.randn(p.shape, generator=gen).to(device) * 0.15 * p.std().clamp_min(1e-3))
            drafter = StandaloneDrafter(draft, spec, cache=cache)
            proposed, propose = [], drafter.propose
            drafter.propose = lambda state: proposed.append(propose(state)) or proposed[-1]
            if cache == "static":
                kept, pack = [], drafter.static.pack  # the entries moved into place
                drafter.static.pack = lambda start, sources: kept.append(sources - start) or pack(start, sources)
                cached, accept = [], drafter.accept  # the cache after each accept, read once the run is over

                def accept_and_keep(result, accept=accept):
                    accept(result)
                    cached.append(drafter.static.cache.keys[:, 0, :, : drafter.cached_len].clone())

                drafter.accept = accept_and_keep
            before = len(guard.reads)
            out, stats = speculative_generate(target, drafter, torch.tensor([[5, 9, 14, 20, 7, 3]]).to(device), 30, cache=cache)
            reads = guard.reads[before:]
        runs[cache] = (out.tolist(), stats.accept_lens, [(t.tokens.tolist(), t.parents.tolist()) for t in proposed])
        if cache == "static":
            assert guard.checked > 200
            assert not [r for r in reads if "drafters.py" in r], reads
            assert not [r for r in reads if "static.py" in r], reads
            assert any(rows.tolist() != list(range(len(rows))) for rows in kept), kept  # accepted entries moved into place
            for keys in cached:  # what each accept kept is the decided tokens' own entries, and no other
                with torch.no_grad():
                    want = draft(out[:, : keys.shape[2]], use_cache=True).past_key_values
                torch.testing.assert_close(keys, torch.stack([layer.keys[0] for layer in want.layers]), rtol=1e-4, atol=1e-5)
    assert runs["static"] == runs["dynamic"]
    assert 0 < sum(runs["static"][1]) < sum(len(t[0][0]) - 1 for t in runs["static"][2])


def test_an_early_exit_chain_of_nothing_is_a_plain_step_on_either_cache(target):
    """A chain of 0 drafts nothing: each step verifies the root alone, on the static cache as on the
    dynamic one (the drafted layer outputs are then an empty [1,0,D])."""
    ids = torch.tensor([[5, 9, 14, 20]])
    want = target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=6, pad_token_id=0, eos_token_id=None)
    for cache in ("dynamic", "static"):
        out, stats = speculative_generate(target, EarlyExitDrafter(target, 1, TreeSpec.chain(0)), ids, 6, cache=cache)
        assert out.tolist() == want.tolist() and stats.accept_lens == [0] * 6, cache


def test_an_early_exit_step_on_the_static_cache_reads_only_its_verdict():
    """The early-exit path CUDA takes (greedy chain and verify forward on the static cache) under
    SimulatedDevice: no operation mixes host and device tensors, and the step's one host read is
    the loop's verdict (the torch reference verification's own reads aside: the fused kernel
    makes none)."""
    from draftsmith.testing import SimulatedDevice

    with SimulatedDevice() as guard:
        target = FrozenTarget(tiny_causal_lm("llama", seed=0).to(torch.device("cpu")))
        drafter = EarlyExitDrafter(target, exit_layer=2, tree=TreeSpec.chain(3))
        ids = torch.tensor([[5, 9, 14, 20, 7, 3]]).to(torch.device("cpu"))
        before = len(guard.reads)
        out, stats = speculative_generate(target, drafter, ids, 24, cache="static")
    lines, first = inspect.getsourcelines(DraftTree.validate)
    checks = {f"tree.py:{n}" for n in range(first, first + len(lines))}
    reads = [r for r in guard.reads[before:] if not r.split(" at ")[1].startswith("verify.py") and r.split(" at ")[1] not in checks]
    steps = len(stats.accept_lens)
    assert guard.checked > 200 and steps > 3
    assert not [r for r in reads if "early_exit.py" in r or "static.py" in r]
    assert sum("generate.py" in r and r.startswith("tolist") for r in reads) == steps + 1 and len(reads) <= steps + 2, reads  # the prompt, then the verdicts


def _line_of(function, text: str) -> int:
    """The line number of the first line of ``function``'s source holding ``text``."""
    lines, first = inspect.getsourcelines(function)
    return first + next(i for i, line in enumerate(lines) if text in line)


@pytest.mark.parametrize("mode", ["greedy", "sample"])
def test_the_whole_tree_in_one_function_is_the_level_by_level_tree(monkeypatch, mode):
    """EAGLE's dynamic_tree (what CUDA captures as one graph a step) grows, every step of a
    generation, exactly the tree build_dynamic_tree_on_device grows through expand_level from the
    same state: tokens, parents, depths and node count, greedy and sampled; the whole tree's top-k
    reading the head's draft vocabulary alone (``columns``), the reference's the whole rows."""
    from draftsmith.heads.eagle import EagleSession
    from draftsmith.heads.eagle3 import Eagle3Config, Eagle3Head
    from draftsmith.runtime.drafters import HeadDrafter
    from draftsmith.runtime.tree import DynamicTreeSpec, build_dynamic_tree_on_device
    from draftsmith.runtime.verify import SamplingParams

    original, compared = EagleSession.dynamic_tree, []

    def checked(self, spec, root, logp, key, deterministic, build):
        assert build.func is build_dynamic_tree_on_device and torch.equal(build.keywords["columns"], self.head.draft_ids)
        length = self.length
        reference, _ = build_dynamic_tree_on_device(lambda f: logp(self.expand_level(f)), root, spec.depth, spec.topk, spec.budget, self.outputs[0].device, deterministic)
        self.length = length  # expand_level moved it; the whole tree writes the same slots again
        parts = original(self, spec, root, logp, key, deterministic, build)
        for name, got in zip(("tokens", "parents", "depths", "num_nodes"), parts):
            assert torch.equal(got, getattr(reference, name)), name
        compared.append(int(parts[3]))
        return parts

    monkeypatch.setattr(EagleSession, "dynamic_tree", checked)
    torch.manual_seed(5)
    target = FrozenTarget(tiny_causal_lm("llama", seed=0))
    head = Eagle3Head(Eagle3Config(depth=5, train_depth=5, draft_vocab_size=64, aux_layer_ids=[1, 2, 3]), target.dims)
    head.init_from_target(target)
    drafter = HeadDrafter(head.eval(), target, DynamicTreeSpec(depth=5, topk=3, budget=12), cache="static")
    sampling = SamplingParams(mode="sample", temperature=0.8, top_k=20) if mode == "sample" else SamplingParams()
    generator = torch.Generator().manual_seed(1)
    speculative_generate(target, drafter, torch.tensor([[5, 9, 14, 20, 7, 3]]), 20, cache="static", sampling=sampling, generator=generator)
    assert len(compared) >= 5 and max(compared) > 1


def test_tree_visibility_is_the_prefix_and_the_ancestors_and_holds_no_host_value():
    """The verify forward's mask made on the device from (parents, base): the same as the prefix
    columns beside ancestor_mask; traced once (make_fx, which bakes any value read to the host the
    way a CUDA graph capture would) and replayed at another base and tree, it still agrees."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from draftsmith.runtime.static import tree_visibility
    from draftsmith.runtime.tree import ancestor_mask

    columns = torch.arange(16)

    def expected(parents, base):
        n = len(parents)
        anc = ancestor_mask(torch.tensor([parents]))[0]
        want = torch.zeros(n, 16, dtype=torch.bool)
        want[:, :base] = True
        want[:, base : base + n] = anc
        return want

    first, second = [-1, 0, 0, 1, 1, 2], [-1, 0, 1, 1, -1, -1]  # the second with padding nodes
    traced = make_fx(tree_visibility)(columns, torch.tensor(first), torch.tensor([3]))
    for parents, base in [(first, 3), (second, 9), (first, 0), (second, 10)]:
        got_eager = tree_visibility(columns, torch.tensor(parents), torch.tensor([base]))
        got_replayed = traced(columns, torch.tensor(parents), torch.tensor([base]))
        assert torch.equal(got_eager, expected(parents, base)) and torch.equal(got_replayed, got_eager)


def test_a_sampled_verification_in_the_graph_checks_the_tree_as_the_reference_does():
    """Inside the target's graph the sampled verification has no reference to raise for it: a drawn
    tree without its draft distributions, or with distributions of the wrong vocabulary, gets the
    reference's error before any capture (where a wrong shape would switch the session's graphs
    off for good), and the session keeps its graphs."""
    from draftsmith.runtime.verify import SamplingParams
    from draftsmith.testing import simulated_cuda_graphs

    sampling = SamplingParams(mode="sample", temperature=1.0)
    with simulated_cuda_graphs(), torch.no_grad():
        target = FrozenTarget(tiny_causal_lm("llama", seed=0))
        session = StaticSession.for_target(target, capacity=32)
        session.prefill(torch.tensor([[5, 9, 14]]))
        V = target.dims.vocab_size
        for draft_probs, words in ((None, "needs tree.draft_probs"), (torch.full((3, V + 1), 1.0 / (V + 1)), "draft_probs has shape")):
            tree = DraftTree.from_lists([7, 8, 9], [-1, 0, 0], draft_probs=draft_probs)
            with pytest.raises(ValueError, match=words):
                session.forward_tree_verified(tree, sampling, torch.Generator().manual_seed(0))
        assert session.graphs and not session.graphs.captured
        tree = DraftTree.from_lists([7, 8, 9], [-1, 0, 0], draft_probs=torch.full((3, V), 1.0 / V))
        session.forward_tree_verified(tree, sampling, torch.Generator().manual_seed(0))
        assert session.graphs and [key[:2] for key in session.graphs.captured] == [("tree-verify", 3)]
