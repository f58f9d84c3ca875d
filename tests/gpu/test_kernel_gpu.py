"""The fused verification kernel, compiled, on a CUDA device at real sizes (skipped without CUDA).

The same comparisons as tests/unit/test_kernel_verify.py (which runs the kernels in the Triton
interpreter on tiny inputs), at the sizes the runtime sees: trees of up to 200 nodes, vocabularies
of 32k-152k, bf16/fp16/fp32 logits, batches of 64, strided logits.

    python -m pytest -q tests/gpu/test_kernel_gpu.py
"""

import importlib
import os

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
pytest.importorskip("triton")

from draftsmith.runtime.tree import DraftTree  # noqa: E402
from draftsmith.runtime.verify import SamplingParams, logits_to_probs, verify_greedy, verify_sample  # noqa: E402

KERNEL_MODULE = "draftsmith.runtime.kernels.verify_kernels"
FIELDS = ("accept_len", "best_node", "path", "accepted_tokens", "bonus")
DEVICE = "cuda"


@pytest.fixture(scope="module")
def kernels():
    """The package, with its kernel module imported compiled.

    Triton fixes interpreted vs compiled when it is first imported; tests/conftest.py leaves the
    interpreter off when CUDA is present, so a session that has it on cannot compile these.
    """
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 in this session: the GPU tests need triton compiled")
    pkg = importlib.import_module("draftsmith.runtime.kernels")
    assert pkg.mode_conflict() is None, pkg.mode_conflict()
    assert not importlib.import_module(KERNEL_MODULE).INTERPRETED
    assert pkg.kernel_available(DEVICE)
    return pkg


def random_structure(gen, B, N, full=False):
    """parents, depths [B,N] and num_nodes [B] on the GPU; padding as tree.py defines it."""
    num_nodes = torch.full((B,), N) if full else torch.randint(1, N + 1, (B,), generator=gen)
    num_nodes[0] = N
    parents = torch.full((B, N), -1, dtype=torch.long)
    depths = torch.zeros(B, N, dtype=torch.long)
    for i in range(1, N):
        near = torch.randint(max(0, i - 3), i, (B,), generator=gen)
        anywhere = torch.randint(0, i, (B,), generator=gen)
        p = torch.where(torch.rand(B, generator=gen) < 0.6, near, anywhere)
        real = i < num_nodes
        parents[:, i] = torch.where(real, p, -1)
        depths[:, i] = torch.where(real, depths.gather(1, p[:, None]).squeeze(1) + 1, 0)
    return parents.to(DEVICE), depths.to(DEVICE), num_nodes.to(DEVICE)


def sibling_rank(parents):
    """rank [B,N]: how many earlier nodes share node i's parent (its draw order among siblings)."""
    B, N = parents.shape
    seen = torch.zeros(B, N + 1, dtype=torch.long, device=parents.device)
    rank = torch.zeros_like(parents)
    slot = torch.where(parents >= 0, parents, N)  # padding counts in a dummy slot
    for i in range(1, N):
        rank[:, i] = seen.gather(1, slot[:, i : i + 1]).squeeze(1)
        seen.scatter_add_(1, slot[:, i : i + 1], torch.ones_like(slot[:, i : i + 1]))
    return rank


def assert_same(got, want):
    for name in FIELDS:
        g, w = getattr(got, name), getattr(want, name)
        assert g.shape == w.shape and g.dtype == w.dtype, name
        bad = (g != w).reshape(g.shape[0], -1).any(-1).nonzero().flatten()
        assert bad.numel() == 0, f"{name} differs in trees {bad.tolist()[:10]}"


@pytest.mark.parametrize(
    "B, N, V, dtype",
    [
        (1, 8, 32000, torch.bfloat16),
        (16, 64, 152064, torch.bfloat16),
        (64, 26, 128256, torch.float16),
        (4, 64, 32000, torch.float32),
        (2, 200, 32000, torch.bfloat16),
    ],
)
def test_greedy_matches_reference(kernels, B, N, V, dtype):
    gen = torch.Generator().manual_seed(B * 1000 + N)
    parents, depths, num_nodes = random_structure(gen, B, N)
    # A target forward returns [B, T, V]; verification reads its last N positions (strided).
    logits = torch.randn(B, N + 3, V, device=DEVICE).to(dtype)[:, 3:]
    pred = logits.argmax(-1)
    drafted = torch.where(
        torch.rand(B, N, device=DEVICE) < 0.85,
        pred.gather(1, parents.clamp_min(0)),
        torch.randint(0, V, (B, N), device=DEVICE),
    )
    tokens = torch.where(parents >= 0, drafted, 0)
    tree = DraftTree(tokens, parents, depths, num_nodes)
    tree.validate()
    want = verify_greedy(tree, logits)
    got = kernels.fused_verify(tree, logits)
    assert_same(got, want)
    assert int(want.accept_len.max()) >= 2  # the cases reach past the root


def sample_tree(gen, B, N, V, temperature, top_k, top_p, full=False):
    """Trees whose siblings are drawn without replacement from the processed draft distribution
    (Gumbel top-k: the r-th child takes the r-th key)."""
    parents, depths, num_nodes = random_structure(gen, B, N, full)
    logits = 3.0 * torch.randn(B, N, V, device=DEVICE)
    q = logits_to_probs(logits + 0.8 * torch.randn(B, N, V, device=DEVICE), temperature or 1.0, top_k, top_p)
    rank = sibling_rank(parents)
    keys = torch.log(q) - torch.log(-torch.log(torch.rand(B, N, V, device=DEVICE).clamp_min(1e-20)))
    draws = keys.topk(int(rank.max()) + 1, dim=-1).indices  # [B,N,C]
    tokens = draws[torch.arange(B, device=DEVICE)[:, None], parents.clamp_min(0), rank]
    tokens = torch.where(parents >= 0, tokens, 0)
    tree = DraftTree(tokens, parents, depths, num_nodes, q)
    tree.validate()
    return tree, logits


@pytest.mark.parametrize(
    "temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 50, 1.0), (1.0, 0, 0.9), (0.0, 0, 1.0)]
)
def test_sample_matches_reference_given_uniforms(kernels, temperature, top_k, top_p):
    gen = torch.Generator().manual_seed(7)
    B, N, V = 32, 48, 152064
    tree, logits = sample_tree(gen, B, N, V, temperature, top_k, top_p)
    u = torch.rand(B, N + 1, device=DEVICE)
    want = verify_sample(tree, logits, temperature=temperature, top_k=top_k, top_p=top_p, uniforms=u)
    got = kernels.fused_verify(tree, logits, SamplingParams("sample", temperature, top_k, top_p), uniforms=u)
    # Float rounding differs (exp, sums over 152k terms in another order), so a uniform that
    # lands within ~1e-6 of an acceptance or CDF boundary may go the other way: allow one tree.
    same = torch.ones(B, dtype=torch.bool, device=DEVICE)
    for name in FIELDS:
        g, w = getattr(got, name), getattr(want, name)
        assert g.shape == w.shape
        same &= (g == w).reshape(B, -1).all(-1)
    assert int((~same).sum()) <= 1, (~same).nonzero().flatten().tolist()


def test_sample_first_token_follows_the_target(kernels):
    """Chi-square over 50,000 draws on a 32k vocabulary: the first emitted token is distributed as
    the target's p at the root (the 40 likeliest tokens one by one, the rest pooled)."""
    stats = pytest.importorskip("scipy.stats")
    torch.manual_seed(8)
    B, N, V = 50_000, 4, 32000
    base = torch.randn(N, V, device=DEVICE)
    base[0] *= 2.5
    logits = base.expand(B, N, V)  # stride 0 on the batch: one row shared by every tree
    q_rows = logits_to_probs(base + 1.5 * torch.randn(N, V, device=DEVICE))
    draft = q_rows.expand(B, N, V)
    keys = torch.log(q_rows[0]) - torch.log(-torch.log(torch.rand(B, V, device=DEVICE).clamp_min(1e-20)))
    tokens = torch.zeros(B, N, dtype=torch.long, device=DEVICE)
    tokens[:, 1:] = keys.topk(N - 1, dim=-1).indices  # three siblings, without replacement
    parents = torch.tensor([[-1, 0, 0, 0]], device=DEVICE).expand(B, N)
    depths = torch.tensor([[0, 1, 1, 1]], device=DEVICE).expand(B, N)
    tree = DraftTree(tokens, parents, depths, torch.full((B,), N, device=DEVICE), draft)
    got = kernels.fused_verify(tree, logits, SamplingParams("sample"), generator=torch.Generator(DEVICE).manual_seed(9))
    first = torch.where(got.accept_len >= 1, got.accepted_tokens[:, 0], got.bonus)
    p = torch.softmax(base[0].double(), -1)
    top = p.topk(40).indices
    expected = torch.cat([p[top], (1 - p[top].sum()).view(1)]) * B
    hits = (first[:, None] == top[None, :]).double()
    counts = torch.cat([hits.sum(0), (B - hits.sum()).view(1)])
    assert stats.chisquare(counts.cpu().numpy(), expected.cpu().numpy()).pvalue > 1e-4
    drafted = (tokens[:, 1:2] == top[None, :]).double().sum(0)
    drafted = torch.cat([drafted, (B - drafted.sum()).view(1)])
    assert stats.chisquare(drafted.cpu().numpy(), expected.cpu().numpy()).pvalue < 1e-6


def test_a_workspace_is_refilled_on_the_gpu_and_changes_nothing(kernels):
    """tests/unit's workspace test at real sizes, compiled: once every shape has been verified (the
    buffers only grow), verifying the same shapes again allocates no buffer, hands out views of the
    same memory and still matches the reference."""
    gen = torch.Generator().manual_seed(21)
    space = kernels.VerifyWorkspace()
    cases = []
    for B, N in [(8, 64), (4, 20), (1, 8), (8, 33)]:
        parents, depths, num_nodes = random_structure(gen, B, N)
        logits = torch.randn(B, N, 32000, device=DEVICE).to(torch.bfloat16)
        drafted = torch.where(torch.rand(B, N, device=DEVICE) < 0.85, logits.argmax(-1).gather(1, parents.clamp_min(0)), 0)
        tree = DraftTree(torch.where(parents >= 0, drafted, 0), parents, depths, num_nodes)
        tree.validate()
        cases.append((tree, logits))
    for tree, logits in cases:
        assert_same(kernels.fused_verify(tree, logits, workspace=space), verify_greedy(tree, logits))
    made = space.allocations
    assert made > 0
    pointers = set()
    for tree, logits in cases:
        got = kernels.fused_verify(tree, logits, workspace=space)
        assert_same(got, verify_greedy(tree, logits))
        assert space.allocations == made, tree.tokens.shape
        pointers.add(got.accept_len.data_ptr())
    assert len(pointers) == 1  # one buffer, refilled every call


def test_a_graphed_workspace_replays_calls_on_the_same_tensors(kernels):
    """VerifyWorkspace(graphs=True): a call repeated on the same tensors (static buffers, their
    contents changed in place) is captured at its second sighting and replayed after, and every
    result, greedy and sampled, equals the reference's; other tensors run as usual."""
    gen = torch.Generator().manual_seed(5)
    space = kernels.VerifyWorkspace(graphs=True)
    B, N, V = 1, 8, 32000
    parents, depths, num_nodes = random_structure(gen, B, N, full=True)
    tokens = torch.zeros(B, N, dtype=torch.long, device=DEVICE)
    logits = torch.empty(B, N, V, device=DEVICE, dtype=torch.bfloat16)
    tree = DraftTree(tokens, parents, depths, num_nodes)
    for step in range(5):  # the buffers refilled in place, as a decoding loop on static buffers does
        logits.copy_(torch.randn(B, N, V, device=DEVICE))
        drafted = torch.where(torch.rand(B, N, device=DEVICE) < 0.8, logits.argmax(-1).gather(1, parents.clamp_min(0)), 7)
        tokens.copy_(torch.where(parents >= 0, drafted, 0))
        assert_same(kernels.fused_verify(tree, logits, workspace=space), verify_greedy(tree, logits))
    assert space.captures == 1 and space.replays == 4
    # Sampled: the replay against the same kernel launched as is, on the same uniforms (identical).
    sampled, sample_logits = sample_tree(gen, 2, 12, 32000, 1.0, 0, 1.0)
    uniforms = torch.empty(2, 13, device=DEVICE)
    for step in range(3):
        uniforms.uniform_()
        got = kernels.fused_verify(sampled, sample_logits, SamplingParams("sample"), uniforms=uniforms, workspace=space)
        assert_same(got, kernels.fused_verify(sampled, sample_logits, SamplingParams("sample"), uniforms=uniforms.clone()))
    assert space.captures == 2 and space.replays == 5
