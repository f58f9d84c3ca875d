"""The fused Triton verification kernel against the torch reference, run by the Triton interpreter.

Greedy must match `verify_greedy` exactly (ties in the logits, duplicate siblings, padded trees,
split vocabularies, every logits dtype). Sampling must make the same decisions as `verify_sample`
given the same uniforms, and its first emitted token must follow the target distribution
(chi-square). Interpreted programs run one after another, so sizes stay tiny.
"""

import importlib
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from draftsmith.runtime.tree import DraftTree, TreeSpec  # noqa: E402
from draftsmith.runtime.verify import SamplingParams, logits_to_probs, verify, verify_greedy, verify_sample  # noqa: E402

KERNEL_MODULE = "draftsmith.runtime.kernels.verify_kernels"
FIELDS = ("accept_len", "best_node", "path", "accepted_tokens", "bonus")


@pytest.fixture(scope="module")
def kernels():
    """The package, with its kernel module imported in interpreter mode.

    tests/conftest.py switches the interpreter on before anything imports triton when there is no
    CUDA device; with one, the session runs triton compiled (tests/gpu) and these tests skip.
    """
    pkg = importlib.import_module("draftsmith.runtime.kernels")
    if os.environ.get("TRITON_INTERPRET") != "1" and torch.cuda.is_available():
        pytest.skip("triton runs compiled in this session; TRITON_INTERPRET=1 python -m pytest " + __file__)
    assert pkg.mode_conflict() is None, pkg.mode_conflict()
    assert importlib.import_module(KERNEL_MODULE).INTERPRETED
    return pkg


def assert_same(got, want, where=""):
    for name in FIELDS:
        g, w = getattr(got, name), getattr(want, name)
        assert g.dtype == w.dtype == torch.long, (name, g.dtype, w.dtype)
        assert g.shape == w.shape, f"{where}{name}: shape {tuple(g.shape)} != {tuple(w.shape)}"
        assert torch.equal(g, w), f"{where}{name}:\nkernel    {g.tolist()}\nreference {w.tolist()}"


def random_parents(gen, B, N, num_nodes):
    """parents/depths [B,N] following tree.py's padding convention (-1 / 0 past num_nodes)."""
    parents = torch.full((B, N), -1, dtype=torch.long)
    depths = torch.zeros(B, N, dtype=torch.long)
    for b in range(B):
        for i in range(1, int(num_nodes[b])):
            # Lean on recent nodes so trees get deep as well as wide.
            lo = max(0, i - 3) if torch.rand(1, generator=gen) < 0.6 else 0
            p = int(torch.randint(lo, i, (1,), generator=gen))
            parents[b, i] = p
            depths[b, i] = depths[b, p] + 1
    return parents, depths


def greedy_case(gen, B=3, N=8, V=48, dtype=torch.float32, full=False):
    """Random trees whose tokens often equal the target argmax (so paths get accepted), with
    integer-valued logits (ties everywhere) and tokens that sometimes pick a tied maximum that is
    not the first one (must be rejected: argmax takes the first)."""
    num_nodes = torch.full((B,), N) if full else torch.randint(1, N + 1, (B,), generator=gen)
    num_nodes[0] = N
    parents, depths = random_parents(gen, B, N, num_nodes)
    logits = torch.randint(0, 4, (B, N, V), generator=gen).to(dtype)
    pred = logits.argmax(-1)
    tokens = torch.zeros(B, N, dtype=torch.long)
    for b in range(B):
        for i in range(1, int(num_nodes[b])):
            p = int(parents[b, i])
            roll = float(torch.rand(1, generator=gen))
            if roll < 0.7:
                tokens[b, i] = pred[b, p]
            elif roll < 0.85:
                tied = (logits[b, p] == logits[b, p].max()).nonzero().flatten()
                tokens[b, i] = tied[-1]
            else:
                tokens[b, i] = int(torch.randint(0, V, (1,), generator=gen))
    tree = DraftTree(tokens, parents, depths, num_nodes.long())
    tree.validate()
    return tree, logits


def sample_case(gen, B=3, N=8, V=40, temperature=1.0, top_k=0, top_p=1.0, spread=0.7):
    """Random trees drafted the way verify.py's contract says: the children of a node are distinct
    tokens drawn without replacement from that node's processed draft distribution."""
    num_nodes = torch.randint(2, N + 1, (B,), generator=gen)
    num_nodes[0] = N
    parents, depths = random_parents(gen, B, N, num_nodes)
    logits = torch.randn(B, N, V, generator=gen) * 2.0
    draft_logits = logits + spread * torch.randn(B, N, V, generator=gen)
    # The drafter draws at temperature 1 when the target is verified greedily at T = 0.
    q = logits_to_probs(draft_logits, temperature or 1.0, top_k, top_p)
    tokens = torch.zeros(B, N, dtype=torch.long)
    for b in range(B):
        left = {}
        for i in range(1, int(num_nodes[b])):
            p = int(parents[b, i])
            w = left.setdefault(p, q[b, p].clone())
            if w.sum() <= 0:  # every live token used: a duplicate-free tree can't grow here
                w = torch.ones(V)
            tokens[b, i] = int(torch.multinomial(w, 1, generator=gen))
            w[tokens[b, i]] = 0.0
    tree = DraftTree(tokens, parents, depths, num_nodes.long(), q)
    tree.validate()
    return tree, logits


# --------------------------------------------------------------------------------------------
# Greedy: exact.
# --------------------------------------------------------------------------------------------


def test_greedy_matches_reference_on_random_trees(kernels):
    gen = torch.Generator().manual_seed(0)
    accepted = 0
    for trial in range(6):
        tree, logits = greedy_case(gen)
        want = verify_greedy(tree, logits)
        assert_same(kernels.fused_verify(tree, logits), want, f"trial {trial}: ")
        accepted += int(want.accept_len.sum())
    # The cases must actually exercise acceptance, not only the root.
    assert accepted >= 10


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_greedy_split_vocabulary_and_dtypes(kernels, monkeypatch, dtype):
    """Three V-splits (the partials combine across programs), strided logits, narrow dtypes."""
    vk = importlib.import_module(KERNEL_MODULE)
    monkeypatch.setattr(vk, "_num_splits", lambda *args: 3)
    gen = torch.Generator().manual_seed(1)
    tree, logits = greedy_case(gen, V=44, dtype=dtype)
    # A transposed copy viewed back: same values, non-contiguous strides on every axis.
    strided = logits.transpose(0, 2).contiguous().transpose(0, 2)
    assert not strided.is_contiguous()
    assert_same(kernels.fused_verify(tree, strided), verify_greedy(tree, logits))


def test_greedy_fp64_maxima_that_tie_in_fp32(kernels):
    """Two fp64 logits that round to the same fp32 value: the larger one (later index) is the argmax."""
    V = 20
    logits = torch.zeros(1, 3, V, dtype=torch.float64)
    logits[0, :, 3] = 1.0
    logits[0, :, 11] = 1.0 + 1e-12
    assert torch.float32 != logits.dtype and float(logits[0, 0, 3].float()) == float(logits[0, 0, 11].float())
    tree = DraftTree.from_lists([5, 11, 11], [-1, 0, 1])
    want = verify_greedy(tree, logits)
    assert int(want.accept_len[0]) == 2 and int(want.bonus[0]) == 11
    assert_same(kernels.fused_verify(tree, logits), want)


def test_greedy_edge_trees(kernels):
    gen = torch.Generator().manual_seed(2)
    V = 16
    # Only roots (D = 0: path [B,1], accepted_tokens [B,0]).
    roots = DraftTree(
        torch.tensor([[7], [3]]), torch.full((2, 1), -1), torch.zeros(2, 1, dtype=torch.long), torch.ones(2, dtype=torch.long)
    )
    logits = torch.randn(2, 1, V, generator=gen)
    assert_same(kernels.fused_verify(roots, logits), verify_greedy(roots, logits))
    # A fully accepted chain, and a chain rejected at its first token.
    spec = TreeSpec.chain(5)
    logits = torch.randn(1, 6, V, generator=gen)
    good = logits.argmax(-1)[0]
    for first in (int(good[0]), (int(good[0]) + 1) % V):
        tokens = [0, first] + [int(t) for t in good[1:5]]
        tree = DraftTree.from_lists(tokens, list(spec.parents))
        want = verify_greedy(tree, logits)
        assert_same(kernels.fused_verify(tree, logits), want)
    assert int(want.accept_len[0]) == 0 and int(want.bonus[0]) == int(good[0])
    # Two accepted siblings with the same token: the lower index wins the tie.
    logits = torch.randn(1, 4, V, generator=gen)
    t = int(logits[0, 0].argmax())
    tree = DraftTree.from_lists([1, (t + 1) % V, t, t], [-1, 0, 0, 0])
    want = verify_greedy(tree, logits)
    assert int(want.best_node[0]) == 2
    assert_same(kernels.fused_verify(tree, logits), want)


def test_greedy_detects_a_wrong_answer(kernels):
    """The comparison itself can fail: a kernel result for different logits differs."""
    gen = torch.Generator().manual_seed(3)
    tree, logits = greedy_case(gen, full=True)
    got = kernels.fused_verify(tree, logits)
    other = logits.clone()
    other[..., 0] = 100.0  # every argmax becomes token 0
    with pytest.raises(AssertionError):
        assert_same(got, verify_greedy(tree, other))


# --------------------------------------------------------------------------------------------
# Sampling: same uniforms, same decisions; right distribution.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "temperature, top_k, top_p",
    [(1.0, 0, 1.0), (0.6, 0, 1.0), (1.3, 6, 1.0), (0.8, 0, 0.7), (1.0, 10, 0.9), (0.0, 0, 1.0)],
)
def test_sample_matches_reference_given_uniforms(kernels, temperature, top_k, top_p):
    gen = torch.Generator().manual_seed(10)
    rejected = 0
    for trial in range(2):
        tree, logits = sample_case(gen, temperature=temperature, top_k=top_k, top_p=top_p)
        u = torch.rand(tree.batch_size, tree.size + 1, generator=gen)
        want = verify_sample(tree, logits, temperature=temperature, top_k=top_k, top_p=top_p, uniforms=u)
        got = kernels.fused_verify(tree, logits, SamplingParams("sample", temperature, top_k, top_p), uniforms=u)
        assert_same(got, want, f"trial {trial}: ")
        has_kids = (tree.parents.unsqueeze(-1) == torch.arange(tree.size)).any(1)
        rejected += int((has_kids.gather(1, want.best_node[:, None]).squeeze(1)).sum())
    if temperature > 0:
        # Some walks ended by rejecting every child: the residual and its bonus draw were used.
        assert rejected >= 1


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.8)])
def test_fixed_candidates_match_reference_given_uniforms(kernels, temperature, top_p):
    """Deterministic trees (each node's children the draft's top candidates, no draft_probs): the
    kernel walks them with point masses exactly as verify_sample does, rejections included."""
    gen = torch.Generator().manual_seed(21)
    rejected = 0
    for trial in range(3):
        drawn, logits = sample_case(gen, temperature=temperature, top_p=top_p)
        # Same shape, but every node's children are its draft's best tokens in rank order.
        ranked = torch.argsort(drawn.draft_probs, dim=-1, descending=True, stable=True)
        tokens = drawn.tokens.clone()
        for b in range(drawn.batch_size):
            seen: dict[int, int] = {}
            for i in range(1, int(drawn.num_nodes[b])):
                p = int(drawn.parents[b, i])
                tokens[b, i] = ranked[b, p, seen.get(p, 0)]
                seen[p] = seen.get(p, 0) + 1
        tree = DraftTree(tokens, drawn.parents, drawn.depths, drawn.num_nodes, deterministic=True)
        tree.validate()
        u = torch.rand(tree.batch_size, tree.size + 1, generator=gen)
        want = verify_sample(tree, logits, temperature=temperature, top_p=top_p, uniforms=u)
        got = kernels.fused_verify(tree, logits, SamplingParams("sample", temperature, top_p=top_p), uniforms=u)
        assert_same(got, want, f"trial {trial}: ")
        has_kids = (tree.parents.unsqueeze(-1) == torch.arange(tree.size)).any(1)
        rejected += int((has_kids.gather(1, want.best_node[:, None]).squeeze(1)).sum())
    assert rejected >= 1


def test_typical_acceptance_runs_the_reference(kernels):
    from draftsmith.runtime.verify import verify_typical

    gen = torch.Generator().manual_seed(22)
    tree, logits = greedy_case(gen)
    want = verify_typical(tree, logits, 0.8, 0.09, 0.3)
    assert_same(kernels.fused_verify(tree, logits, SamplingParams("typical", 0.8)), want)


def test_sample_residual_edge_cases(kernels):
    """Rejection chains that reach verify.py's guards: a drafted token of probability zero under
    both p and q (its residual is all zero, so p stays), and q running out of mass."""
    V = 6
    p_logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1, 0.0, 0.0]).clamp_min(1e-30))
    p_logits[4:] = float("-inf")
    logits = p_logits.expand(3, 4, V).clone()
    # Tree 0: root's children 4 (p = q = 0: rejected, residual all zero), then 1.
    q0 = torch.softmax(p_logits, -1)
    # Tree 1: q one-hot on token 3 (rejected unless u < 0.1), then siblings see an all-zero q.
    q1 = torch.zeros(V)
    q1[3] = 1.0
    # Tree 2: q = p, everything accepted down a chain.
    draft = torch.stack([q0, q1, q0]).unsqueeze(1).expand(3, 4, V).clone()
    tokens = torch.tensor([[0, 4, 1, 2], [0, 3, 0, 2], [0, 0, 1, 2]])
    parents = torch.tensor([[-1, 0, 0, 0], [-1, 0, 0, 0], [-1, 0, 1, 2]])
    depths = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 1], [0, 1, 2, 3]])
    tree = DraftTree(tokens, parents, depths, torch.full((3,), 4), draft)
    tree.validate()
    gen = torch.Generator().manual_seed(11)
    for _ in range(3):
        u = torch.rand(3, 5, generator=gen)
        u[1, 1] = 0.5  # tree 1 rejects token 3
        want = verify_sample(tree, logits, uniforms=u)
        assert_same(kernels.fused_verify(tree, logits, SamplingParams("sample"), uniforms=u), want)
    assert int(want.best_node[1]) != 1


def test_a_float64_draft_below_fp32s_range_takes_the_reference(kernels):
    """The kernel carries q in fp32: a float64 q(x) = 1e-50 would read as 0 there and the child
    would never be accepted, where the reference renormalises q after its sibling's rejection and
    accepts it with probability p(x). float64 drafts take the reference: the same decisions."""
    V = 4
    draft = torch.zeros(3, V, dtype=torch.float64)
    draft[0] = torch.tensor([1.0, 1e-50, 0.0, 0.0], dtype=torch.float64)
    tree = DraftTree.from_lists([2, 0, 1], [-1, 0, 0], draft_probs=draft)
    logits = torch.zeros(1, 3, V, dtype=torch.float64)
    logits[0, 0, 0] = -30.0  # p(0) ~ 0: the first child is rejected, the second tested with q = 1
    gen, accepted = torch.Generator().manual_seed(0), 0
    for _ in range(60):
        u = torch.rand(1, 4, generator=gen, dtype=torch.float64)
        want = verify_sample(tree, logits, 1.0, uniforms=u)
        assert_same(kernels.fused_verify(tree, logits, SamplingParams("sample"), uniforms=u), want)
        accepted += int(want.best_node[0] == 2)
    assert 5 < accepted < 40  # p(1) = 1/3


def test_sample_generator_draws_the_same_uniforms(kernels):
    """Without uniforms both draw [B,N+1] from the generator: same seed, same result."""
    gen = torch.Generator().manual_seed(12)
    tree, logits = sample_case(gen)
    want = verify(tree, logits, SamplingParams("sample", 0.9), generator=torch.Generator().manual_seed(5))
    got = kernels.fused_verify(tree, logits, SamplingParams("sample", 0.9), generator=torch.Generator().manual_seed(5))
    assert_same(got, want)


def test_sample_first_token_follows_the_target(kernels):
    """Chi-square: the first token a step emits (the first accepted draft token, or the bonus when
    the root's children are all rejected) is distributed as the target's p at the root, although
    the drafts come from a very different q. The same test rejects the draft tokens themselves."""
    stats = pytest.importorskip("scipy.stats")
    gen = torch.Generator().manual_seed(13)
    V, B = 5, 160
    p_root = torch.tensor([2.0, 1.2, 0.6, 0.0, -0.5])
    q_root = torch.tensor([-0.5, 0.0, 0.6, 1.2, 2.0])
    # Root with two children (drawn without replacement from q), each a leaf.
    logits = torch.randn(1, 3, V, generator=gen).expand(B, 3, V).clone()
    logits[:, 0] = p_root
    draft = logits_to_probs(torch.randn(1, 3, V, generator=gen)).expand(B, 3, V).clone()
    draft[:, 0] = torch.softmax(q_root, -1)
    tokens = torch.zeros(B, 3, dtype=torch.long)
    tokens[:, 1:] = torch.multinomial(draft[:, 0], 2, replacement=False, generator=gen)
    tree = DraftTree(
        tokens, torch.tensor([[-1, 0, 0]]).expand(B, 3), torch.tensor([[0, 1, 1]]).expand(B, 3), torch.full((B,), 3), draft
    )
    tree.validate()
    got = kernels.fused_verify(tree, logits, SamplingParams("sample"), generator=gen)
    first = torch.where(got.accept_len >= 1, got.accepted_tokens[:, 0], got.bonus)
    expected = (torch.softmax(p_root.double(), -1) * B).numpy()
    counts = torch.bincount(first, minlength=V).double().numpy()
    assert stats.chisquare(counts, expected).pvalue > 1e-3, counts
    drafted = torch.bincount(tokens[:, 1], minlength=V).double().numpy()
    assert stats.chisquare(drafted, expected).pvalue < 1e-6, drafted


# --------------------------------------------------------------------------------------------
# In the decoding loop.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["greedy", "sample"])
def test_speculative_generate_with_the_kernel(kernels, mode):
    """speculative_generate with verify_fn=fused_verify emits exactly what it emits with the
    reference: greedy by construction, sampling because both draw the same uniforms from the
    generator. A distinct random draft model keeps acceptance partial, so rejections happen."""
    from draftsmith.runtime.drafters import StandaloneDrafter
    from draftsmith.runtime.generate import speculative_generate
    from draftsmith.target import FrozenTarget
    from draftsmith.testing import tiny_causal_lm

    V = 40
    target = FrozenTarget(tiny_causal_lm("llama", vocab_size=V, hidden_size=32, num_layers=2, seed=0))
    draft = tiny_causal_lm("llama", vocab_size=V, hidden_size=32, num_layers=1, seed=1)
    prompt = torch.tensor([[5, 9, 14, 3, 22, 7]])
    outs = []
    for verify_fn in (verify, kernels.fused_verify):
        out, stats = speculative_generate(
            target, StandaloneDrafter(draft, TreeSpec.from_choices([(0,), (1,), (0, 0)])), prompt, 8,
            SamplingParams(mode, 1.0), generator=torch.Generator().manual_seed(4), verify_fn=verify_fn,
        )  # fmt: skip
        outs.append((out.tolist(), stats.accept_lens))
    assert outs[0] == outs[1]
    assert len(outs[0][0][0]) == prompt.shape[1] + 8


def test_a_workspace_allocates_once_per_shape_and_changes_nothing(kernels):
    """Calls after the largest shape allocate no buffer and still give the reference's results
    (trees of other depths and sizes in between); a larger tree grows the buffers; sampling shares
    the workspace too."""
    gen = torch.Generator().manual_seed(12)
    space = kernels.VerifyWorkspace()
    deep = DraftTree.from_lists([5] + [3] * 7, [-1, 0, 1, 2, 3, 4, 5, 6])  # a chain: the deepest tree of 8 nodes
    logits = torch.randint(0, 4, (1, 8, 48), generator=gen).float()
    assert_same(kernels.fused_verify(deep, logits, workspace=space), verify_greedy(deep, logits))
    first = space.allocations
    assert first == 7  # two partials and five outputs
    cases = [greedy_case(gen, B=1) for _ in range(4)]
    assert len({int(t.depths.max()) for t, _ in cases}) > 1  # the path's length changes from call to call
    for trial, (tree, logits) in enumerate(cases):
        got = kernels.fused_verify(tree, logits, workspace=space)
        assert_same(got, verify_greedy(tree, logits), f"trial {trial}: ")
        assert space.allocations == first
        if trial == 0:
            path = got.path
    assert got.path.data_ptr() == path.data_ptr()  # the same buffer, refilled
    tree, logits = greedy_case(gen, B=2, N=12, full=True)
    assert_same(kernels.fused_verify(tree, logits, workspace=space), verify_greedy(tree, logits))
    assert space.allocations > first
    tree, logits = sample_case(gen)
    u = torch.rand(tree.batch_size, tree.size + 1, generator=gen)
    sampling = SamplingParams("sample", 0.9)
    for _ in range(2):
        assert_same(kernels.fused_verify(tree, logits, sampling, uniforms=u, workspace=space), verify_sample(tree, logits, temperature=0.9, uniforms=u))
    made = space.allocations
    kernels.fused_verify(tree, logits, sampling, uniforms=u, workspace=space)
    assert space.allocations == made


def test_speculative_generate_keeps_one_workspace(kernels, monkeypatch):
    """The decoding loop verifies every step with one workspace: buffers are made at the first step
    of each tree shape only (a chain drafter proposes one shape)."""
    from draftsmith.runtime.drafters import StandaloneDrafter
    from draftsmith.runtime.generate import speculative_generate
    from draftsmith.target import FrozenTarget
    from draftsmith.testing import tiny_causal_lm

    spaces = []
    original = kernels.VerifyWorkspace

    class Recorded(original):
        def __init__(self):
            super().__init__()
            spaces.append(self)

    monkeypatch.setattr(kernels, "VerifyWorkspace", Recorded)
    V = 40
    target = FrozenTarget(tiny_causal_lm("llama", vocab_size=V, hidden_size=32, num_layers=2, seed=0))
    draft = tiny_causal_lm("llama", vocab_size=V, hidden_size=32, num_layers=1, seed=1)
    prompt = torch.tensor([[5, 9, 14, 3, 22, 7]])
    want, _ = speculative_generate(target, StandaloneDrafter(draft, TreeSpec.chain(3)), prompt, 12, verify_fn=verify)
    got, stats = speculative_generate(target, StandaloneDrafter(draft, TreeSpec.chain(3)), prompt, 12, verify_fn=kernels.fused_verify)
    assert got.tolist() == want.tolist()
    assert len(spaces) == 1 and len(stats.accept_lens) >= 3
    # Seven buffers at the first step (a chain of 3 is the largest tree), none after.
    assert spaces[0].allocations == 7


# --------------------------------------------------------------------------------------------
# API.
# --------------------------------------------------------------------------------------------


def test_kernel_available(kernels):
    assert kernels.kernel_available("cpu")
    assert not kernels.kernel_available("meta")


def test_errors_match_the_reference(kernels):
    gen = torch.Generator().manual_seed(14)
    tree, logits = sample_case(gen)
    with pytest.raises(ValueError, match="mode"):
        kernels.fused_verify(tree, logits, SamplingParams("beam"))
    with pytest.raises(ValueError, match="uniforms"):
        kernels.fused_verify(tree, logits, SamplingParams("sample"), uniforms=torch.rand(3, 3))
    with pytest.raises(ValueError, match="target_logits"):
        kernels.fused_verify(tree, logits[:, :2])
    bare = DraftTree(tree.tokens, tree.parents, tree.depths, tree.num_nodes)
    with pytest.raises(ValueError, match="draft_probs"):
        kernels.fused_verify(bare, logits, SamplingParams("sample"))
    with pytest.raises(RuntimeError, match="cannot run"):
        kernels.fused_verify(tree, logits.to("meta"))


def test_package_imports_without_triton():
    """`import draftsmith.runtime.kernels` needs no triton; it only reports the kernel unavailable."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "from draftsmith.runtime.kernels import kernel_available\n"
        "print(kernel_available('cpu'), kernel_available('cuda'))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]


def test_interpreter_switched_on_after_triton_was_imported():
    """The CI failure this guards against: triton imported compiled (torch and transformers import
    it) and TRITON_INTERPRET=1 set afterwards. The kernels must then report themselves unavailable
    and say why, not die inside the first launch."""
    code = (
        "import os, torch, triton.language\n"
        "os.environ['TRITON_INTERPRET'] = '1'\n"
        "from draftsmith.runtime.kernels import fused_verify, kernel_available, mode_conflict\n"
        "from draftsmith.runtime.tree import DraftTree\n"
        "assert not kernel_available('cpu')\n"
        "print(mode_conflict())\n"
        "tree = DraftTree(torch.zeros(1, 1, dtype=torch.long), torch.full((1, 1), -1), torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long))\n"
        "try:\n"
        "    fused_verify(tree, torch.zeros(1, 1, 8))\n"
        "except RuntimeError as e:\n"
        "    print(e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 2, out.stdout
    assert "TRITON_INTERPRET=unset" in lines[0] and "before anything imports triton" in lines[0]
    assert lines[1].startswith("the fused verification kernel cannot run on cpu: triton was imported"), lines[1]


def test_a_graphed_workspace_captures_a_repeated_call_once_and_replays_it(monkeypatch, capsys):
    """VerifyWorkspace.graphed's policy, with the CUDA capture stood in for (the capture itself is
    tests/gpu's): a call seen once runs as is, seen twice is captured and replayed, then replayed;
    a capture that fails is said once and that call runs as is from then on; callers that never
    repeat a call keep a bounded number of entries."""
    import draftsmith.runtime.kernels as kernels

    class FakeGraph:
        def __init__(self, launch):
            self.launch = launch

        def replay(self):
            self.outputs[0].append("replayed")

    class FakeCaptured:
        def __init__(self, launch, device):
            if launch() == "refuse":
                raise RuntimeError("operation not permitted when stream is capturing")
            self.graph = FakeGraph(launch)
            self.outputs = self.graph.outputs = (["captured"],)

    monkeypatch.setattr(kernels, "_Captured", FakeCaptured)
    space = kernels.VerifyWorkspace(graphs=True)
    launches = []

    def launch():
        launches.append(1)
        return "eager"

    assert space.graphed(("a",), launch, None) == "eager" and len(launches) == 1  # first sighting
    out = space.graphed(("a",), launch, None)  # second: captured (its warm-up launch), then replayed
    assert out == (["captured", "replayed"],) and len(launches) == 2 and space.captures == 1 and space.replays == 1
    assert space.graphed(("a",), launch, None) is out and len(launches) == 2 and space.replays == 2
    assert space.graphed(("b",), lambda: "refuse", None) == "refuse"
    assert space.graphed(("b",), lambda: "refuse", None) == "refuse"  # capture failed: as is
    assert space.graphed(("b",), lambda: "refuse", None) == "refuse" and space.captures == 1
    assert capsys.readouterr().err.count("CUDA graph capture failed") == 1
    for i in range(40):
        space.graphed(("fresh", i), launch, None)
    assert len(space._graphs) <= kernels._GRAPHS_KEPT
