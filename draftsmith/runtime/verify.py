"""Reference verification of draft trees in torch: greedy, lossless speculative sampling, and
Medusa's typical acceptance (NOT lossless).

Pure functions of tensors. The fused kernel (runtime/kernels) must match ``verify_greedy`` exactly
and ``verify_sample`` given the same ``uniforms``; the decoding loop is lossless with either.
``verify_greedy_on_device`` and ``verify_sample_on_device`` are the same decisions with no value
read to the host, what a CUDA graph can hold where the kernel does not run (the CPU).
Tree conventions (node 0 = root, topological order, padding) are in ``draftsmith.runtime.tree``.

Shapes: B trees, N nodes per tree, V vocabulary, D = the deepest node's depth in the batch.

Sampled verification (``verify_sample``) is multi-candidate recursive rejection sampling WITHOUT
replacement. Its contract with the drafter: the children of a node are distinct tokens drawn one
after another without replacement from that node's ``draft_probs`` q, in index order (draw the
first child from q, the second from q with the first zeroed and renormalised, and so on; Gumbel
top-k gives exactly this). Walking down from the root, at the current node with target
distribution p and draft distribution q, each child x in index order is tested:

    accept  iff  u * q(x) < p(x)            (probability min(1, p(x) / q(x)); never where q(x) = 0)
    reject:      p <- max(p - q, 0) / sum(max(p - q, 0))
                 q <- q with q(x) = 0, renormalised

An accepted child becomes the current node (its own p and q are loaded). When every child is
rejected the bonus token is drawn from the residual p; at a node without children (a fully
accepted leaf) it is drawn from the target's p there. A chain is the case of one child per node.

A node may hold more children than q has tokens: a tree of fixed shape drafted on the device
draws as many children as the shape asks, and the draws past q's support are tokens of q(x) = 0,
made after q has run out of mass. Such a child is never accepted, and its rejection leaves p as it
is (q is all zero by then), so the walk goes on as if it were not in the tree.

Deterministic candidates (``DraftTree.deterministic``: the draft's top-k, EAGLE-2's dynamic trees)
are not draws from q. Each child x is then tested as a draw from the point mass at x, with the
same three rules: accept iff u < p(x) (probability p(x)); on rejection the residual
norm(max(p - onehot(x), 0)) is p with p(x) = 0, renormalised, and the next sibling is tested
against it; when every sibling is rejected the bonus comes from that residual. Every emitted
token then follows p, as for drawn children (EAGLE's rule for its top-k candidates).

Typical acceptance (``verify_typical``, Medusa) is a different contract: it accepts a drafted
token x when the target finds it plausible enough, p(x) > min(posterior_threshold,
posterior_alpha * exp(-H(p))), and the output does NOT follow the target's distribution. It is a
speed/quality trade-off the caller opts into, never the default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from draftsmith.runtime.tree import DraftTree, ancestor_mask
from draftsmith.sampling import logits_to_probs

__all__ = [
    "GREEDY", "SamplingParams", "VerifyResult", "logits_to_probs", "verify", "verify_greedy", "verify_sample", "verify_sample_on_device", "verify_typical",
]  # fmt: skip

MODES = ("greedy", "sample", "typical")
# Medusa's typical acceptance defaults (its medusa_generate): the threshold epsilon and alpha = sqrt(epsilon).
POSTERIOR_THRESHOLD = 0.09
POSTERIOR_ALPHA = 0.3


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen: the one object the decoding loop, the baseline, the verifiers, eval
    and the online trainer pass along.

    ``mode`` "greedy" ignores the rest; "sample" draws from ``logits_to_probs(logits, temperature,
    top_k, top_p)`` for the target and the drafter alike; "typical" (NOT lossless) drafts greedily
    and verifies with Medusa's typical acceptance at ``temperature`` (> 0) with
    ``posterior_threshold`` and ``posterior_alpha``; it has its own cut-off, so top-k / top-p are
    refused there. Invalid settings raise ValueError in one line."""

    mode: str = "greedy"
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    posterior_threshold: float = POSTERIOR_THRESHOLD
    posterior_alpha: float = POSTERIOR_ALPHA

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.mode == "typical":
            check_typical(self.temperature, self.top_k, self.top_p, self.posterior_threshold, self.posterior_alpha)

    @classmethod
    def choose(
        cls,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        verify: str = "exact",
        posterior_threshold: float = POSTERIOR_THRESHOLD,
        posterior_alpha: float = POSTERIOR_ALPHA,
    ) -> "SamplingParams":
        """The settings a user gives (the command line's): temperature 0 decodes greedily, above 0
        samples; ``verify`` "exact" (lossless) or "typical" (Medusa's, NOT lossless)."""
        if verify not in ("exact", "typical"):
            raise ValueError(f"verification must be 'exact' or 'typical', got {verify!r}")
        if verify == "typical":
            return cls("typical", temperature, top_k, top_p, posterior_threshold, posterior_alpha)
        if temperature == 0:
            return cls("greedy")
        return cls("sample", temperature, top_k, top_p)

    @property
    def greedy(self) -> bool:
        return self.mode == "greedy"

    @property
    def sampled(self) -> bool:
        """Whether drafters draw their children at random (mode "sample"); otherwise they take ranks."""
        return self.mode == "sample"

    @property
    def lossless(self) -> bool:
        """Whether the output follows the target's own decoding (everything but typical acceptance)."""
        return self.mode != "typical"

    def target_alone(self) -> "SamplingParams":
        """How the target decodes on its own under these settings (the baseline): typical
        acceptance has no meaning there, so it samples at the same temperature."""
        return SamplingParams("sample", self.temperature) if self.mode == "typical" else self

    def describe(self) -> str:
        if self.mode == "typical":
            return (
                f"typical acceptance (NOT lossless) at temperature {self.temperature}: "
                f"posterior_threshold={self.posterior_threshold}, posterior_alpha={self.posterior_alpha}"
            )
        if self.mode == "greedy":
            return "exact, greedy"
        return f"exact, lossless sampling at temperature {self.temperature}, top_k {self.top_k}, top_p {self.top_p}"


def check_typical(temperature: float, top_k: int, top_p: float, posterior_threshold: float, posterior_alpha: float) -> None:
    """ValueError, one line, for settings typical acceptance does not support."""
    if not temperature > 0:
        raise ValueError(f"typical acceptance needs a temperature > 0 (at 0 verification is greedy and exact), got {temperature}")
    if top_k or top_p < 1.0:
        raise ValueError(f"typical acceptance has its own cut-off and does not support top-k / top-p, got top_k={top_k}, top_p={top_p}")
    if not 0.0 < posterior_threshold <= 1.0 or posterior_alpha <= 0:
        raise ValueError(
            f"typical acceptance needs posterior_threshold in (0, 1] and posterior_alpha > 0, got {posterior_threshold}, {posterior_alpha}"
        )


GREEDY = SamplingParams()


@dataclass
class VerifyResult:
    """The outcome of verifying B trees.

    accept_len [B] long: accepted drafted tokens (the root excluded).
    best_node [B] long: the deepest accepted node (0 when nothing was accepted).
    path [B,D+1] long: node indices root..best_node, -1 past best_node. They are also the tree
        positions whose KV entries the cache keeps (cache slot prefix_len + path[b, d]).
    accepted_tokens [B,D] long: tokens of path[1..accept_len], -1 past accept_len.
    bonus [B] long: the target's token after the accepted path (next step's root).

    D is ``tree.depth_bound``: the deepest node, or for a tree grown on the device its spec's depth.
    verdict [3+(D+1)+D+2N] long or None: what a decoding step reads of tree 0, in one row
    (``runtime.verdict.verdict_row``), where the verification made it alongside (inside a CUDA graph).
    host_path: tree 0's accepted path, root first (accept_len + 1 nodes), as the decoding loop read
    it with the verdict, so a drafter's ``accept`` needs no read of its own; None where nobody has.
    """

    accept_len: Tensor
    best_node: Tensor
    path: Tensor
    accepted_tokens: Tensor
    bonus: Tensor
    verdict: Optional[Tensor] = None
    host_path: Optional[list[int]] = None



def _result(tree: DraftTree, best: Tensor, bonus: Tensor, anc: Optional[Tensor] = None) -> VerifyResult:
    """Assemble a VerifyResult from the best node [B] and bonus [B]."""
    return result_on_device(tree.tokens, tree.parents, tree.depths, tree.depth_bound, best, bonus, anc)


def result_on_device(tokens: Tensor, parents: Tensor, depths: Tensor, depth_bound: int, best: Tensor, bonus: Tensor, anc: Optional[Tensor] = None) -> VerifyResult:
    """``_result`` from the tree's tensors, every shape fixed by [B,N] and ``depth_bound`` and no
    value read to the host: the path's node at depth d is the one ancestor-or-self of ``best`` at
    that depth (what a CUDA graph can hold)."""
    B, N = tokens.shape
    rows = torch.arange(B, device=best.device)
    if anc is None:
        anc = ancestor_mask(parents)
    on_path = anc[rows, best]  # [B,N]
    levels = torch.arange(depth_bound + 1, device=best.device).view(1, -1, 1)
    at = on_path.unsqueeze(1) & (depths.unsqueeze(1) == levels)  # [B,D+1,N]: at most one node each
    path = torch.where(at.any(-1), at.int().argmax(-1), torch.full_like(at[..., 0], -1, dtype=torch.long))
    steps = path[:, 1:]
    accepted_tokens = torch.where(steps >= 0, tokens.gather(1, steps.clamp_min(0)), torch.full_like(steps, -1))
    return VerifyResult(accept_len=depths.gather(1, best.unsqueeze(1)).squeeze(1), best_node=best, path=path, accepted_tokens=accepted_tokens, bonus=bonus)


def verify_greedy(tree: DraftTree, target_logits: Tensor) -> VerifyResult:
    """Greedy verification. target_logits [B,N,V].

    Node i >= 1 is accepted iff tokens[i] == argmax(target_logits[parents[i]]) and its parent is
    accepted (argmax: first index on ties). best = the deepest accepted node, the lowest index on
    ties; bonus = argmax(target_logits[best]).
    """
    tree.validate()
    B, N = tree.tokens.shape
    if target_logits.shape[:2] != (B, N):
        raise ValueError(f"target_logits has shape {tuple(target_logits.shape)}; the trees need [{B},{N},V]")
    return verify_greedy_on_device(tree.tokens, tree.parents, tree.depths, tree.depth_bound, target_logits)


def verify_greedy_on_device(tokens: Tensor, parents: Tensor, depths: Tensor, depth_bound: int, target_logits: Tensor) -> VerifyResult:
    """``verify_greedy`` on a tree's tensors without its checks: no value read to the host, so a
    CUDA graph can hold it (StaticSession verifies inside the graph of its tree forward)."""
    B, N = tokens.shape
    pred = target_logits.argmax(-1)  # [B,N]
    match = (tokens == pred.gather(1, parents.clamp_min(0))) & (parents >= 0)
    match[:, 0] = True  # the root is decided already
    anc = ancestor_mask(parents)
    # Accepted iff every ancestor-or-self matches: one reduction instead of a walk down the tree.
    accepted = ~(anc & ~match.unsqueeze(1)).any(-1)
    index = torch.arange(N, device=parents.device)
    score = torch.where(accepted, depths * (N + 1) + (N - index), torch.full_like(depths, -1))
    best = score.argmax(-1)
    bonus = pred.gather(1, best.unsqueeze(1)).squeeze(1)
    return result_on_device(tokens, parents, depths, depth_bound, best, bonus, anc)


# The three rules of the rejection walk, as functions so that a test can swap in a broken rule and
# watch the distribution test fail.


def _accepts(u: Tensor, p_x: Tensor, q_x: Tensor) -> Tensor:
    """Accept with probability min(1, p(x)/q(x)), multiplied out so that nothing divides. A child of
    q(x) = 0 is never accepted: it was not drawn from q (a tree drafted on the device keeps the
    children a draw past q's support would have left out), and its rejection changes nothing, since
    q is then all zero: as if it were not there."""
    return (u * q_x < p_x) & (q_x > 0)


def _residual(p: Tensor, q: Tensor) -> Tensor:
    """norm(max(p - q, 0)) per row [B,V]. A row whose residual is all zero keeps p (a rejection
    there has probability zero; rounding alone could get there)."""
    r = (p - q).clamp_min(0)
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 0, r / torch.where(total > 0, total, torch.ones_like(total)), p)


def _without(q: Tensor, x: Tensor) -> Tensor:
    """q [B,V] with token x [B] removed and renormalised: the next sibling's draw without replacement."""
    r = q.scatter(-1, x.unsqueeze(-1), 0.0)
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 0, r / torch.where(total > 0, total, torch.ones_like(total)), r)


def _inverse_cdf(p: Tensor, u: Tensor) -> Tensor:
    """Draw from p [B,V] (unnormalised is fine) with uniforms u [B]: the first token whose
    cumulative mass exceeds u * total. Tokens of mass zero are never drawn."""
    cdf = torch.cumsum(p, dim=-1)
    token = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1).contiguous(), right=True).squeeze(-1)
    # Rounding can push u * total past the last step of the cdf: fall back to the last live token.
    V = p.shape[-1]
    last_live = (V - 1) - (p.flip(-1) > 0).to(torch.int8).argmax(-1)
    return torch.minimum(token, last_live)


def verify_sample(
    tree: DraftTree,
    target_logits: Tensor,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: Optional[torch.Generator] = None,
    uniforms: Optional[Tensor] = None,
) -> VerifyResult:
    """Lossless sampled verification (rules in the module docstring). target_logits [B,N,V].

    tree.draft_probs [B,N,V] is required unless every tree is root-only or the tree is
    ``deterministic``: q at each node, processed like the target's p (``logits_to_probs`` with the
    same temperature / top_k / top_p). A deterministic tree's children are tested as point masses.

    uniforms [B,N+1] in [0,1), or None to draw them from ``generator``: column i (1 <= i < N) is
    the acceptance test of node i (used only if node i is tested; column 0 is unused, the root is
    never tested) and column N is the bonus draw, by inverse CDF over the final p.
    """
    tree.validate()
    B, N = tree.tokens.shape
    if target_logits.shape[:2] != (B, N):
        raise ValueError(f"target_logits has shape {tuple(target_logits.shape)}; the trees need [{B},{N},V]")
    P = logits_to_probs(target_logits, temperature, top_k, top_p)
    if tree.draft_probs is None or tree.deterministic:
        if not tree.deterministic and bool((tree.num_nodes > 1).any()):
            raise ValueError("sampled verification needs tree.draft_probs (the drafter's processed distributions)")
        Q = torch.zeros_like(P)  # root-only trees test nothing
    elif tree.draft_probs.shape != P.shape:
        raise ValueError(f"draft_probs has shape {tuple(tree.draft_probs.shape)}, target probs {tuple(P.shape)}")
    else:
        Q = tree.draft_probs
    dtype = torch.promote_types(P.dtype, Q.dtype)
    P, Q = P.to(dtype), Q.to(dtype)
    device = P.device
    if uniforms is None:
        uniforms = torch.rand(B, N + 1, generator=generator, device=device, dtype=dtype)
    elif uniforms.shape != (B, N + 1):
        raise ValueError(f"uniforms must have shape [{B},{N + 1}], got {tuple(uniforms.shape)}")
    uniforms = uniforms.to(device=device, dtype=dtype)

    kids = tree.children_table()  # [B,N,C]
    rows = torch.arange(B, device=device)
    cur = torch.zeros(B, dtype=torch.long, device=device)
    p, q = P[:, 0].clone(), Q[:, 0].clone()
    done = torch.zeros(B, dtype=torch.bool, device=device)
    # Each pass moves every live row one level down or finishes it, so depth + 1 passes suffice.
    for _ in range(tree.depth_bound + 1):
        if bool(done.all()):
            break
        moved = torch.zeros(B, dtype=torch.bool, device=device)
        nxt = cur.clone()
        for j in range(kids.shape[-1]):
            child = kids[rows, cur, j]
            test = ~done & ~moved & (child >= 0)
            if not bool(test.any()):
                continue
            c = child.clamp_min(0)
            x = tree.tokens[rows, c]
            if tree.deterministic:
                # A fixed candidate is a draw from the point mass at x.
                q = torch.zeros_like(p).scatter_(1, x.unsqueeze(1), 1.0)
            p_x = p.gather(1, x.unsqueeze(1)).squeeze(1)
            q_x = q.gather(1, x.unsqueeze(1)).squeeze(1)
            acc = test & _accepts(uniforms[rows, c], p_x, q_x)
            rej = (test & ~acc).unsqueeze(1)
            p = torch.where(rej, _residual(p, q), p)
            q = torch.where(rej, _without(q, x), q)
            moved |= acc
            nxt = torch.where(acc, child, nxt)
        cur = torch.where(moved, nxt, cur)
        p = torch.where(moved.unsqueeze(1), P[rows, cur], p)
        q = torch.where(moved.unsqueeze(1), Q[rows, cur], q)
        done |= ~moved
    bonus = _inverse_cdf(p, uniforms[:, N])
    return _result(tree, cur, bonus)


def verify_sample_on_device(
    tokens: Tensor, parents: Tensor, depths: Tensor, num_nodes: Tensor, probs: Tensor, draft_probs: Optional[Tensor], uniforms: Tensor, depth_bound: int
) -> VerifyResult:
    """``verify_sample`` on a tree's tensors with no value read to the host, so that a CUDA graph
    can hold it (StaticSession verifies inside the graph of its tree forward; on CUDA the fused
    kernel runs there instead). probs [B,N,V]: the target's processed distributions;
    draft_probs [B,N,V], or None for fixed candidates (a ``deterministic`` tree); uniforms
    [B,N+1] as ``verify_sample`` takes them. The same tests in the same order with the same rules:
    each pass tests the next untried child of the current node (the lowest index above the last
    one tried), so N passes are always enough. Equals ``verify_sample`` given the same uniforms."""
    B, N = tokens.shape
    device = tokens.device
    index = torch.arange(N, device=device)
    live = index.unsqueeze(0) < num_nodes.unsqueeze(1)
    rows = torch.arange(B, device=device)
    Q = torch.zeros_like(probs) if draft_probs is None else draft_probs
    dtype = torch.promote_types(probs.dtype, Q.dtype)
    P, Q, uniforms = probs.to(dtype), Q.to(dtype), uniforms.to(dtype)
    cur = torch.zeros(B, dtype=torch.long, device=device)
    last = torch.zeros(B, dtype=torch.long, device=device)  # children tried have index <= last
    p, q = P[:, 0].clone(), Q[:, 0].clone()
    for _ in range(N - 1):  # a pass tests one child (N - 1 of them at most) or finds none left
        untried = live & (parents == cur.unsqueeze(1)) & (index.unsqueeze(0) > last.unsqueeze(1))
        child = torch.where(untried, index.unsqueeze(0), N).amin(-1)
        test = child < N
        c = child.clamp(max=N - 1)
        x = tokens[rows, c]
        if draft_probs is None:  # a fixed candidate is a draw from the point mass at x
            q = torch.zeros_like(p).scatter_(1, x.unsqueeze(1), 1.0)
        p_x, q_x = p.gather(1, x.unsqueeze(1)).squeeze(1), q.gather(1, x.unsqueeze(1)).squeeze(1)
        acc = test & _accepts(uniforms[rows, c], p_x, q_x)
        rej = (test & ~acc).unsqueeze(1)
        p = torch.where(rej, _residual(p, q), p)
        q = torch.where(rej, _without(q, x), q)
        last = torch.where(test, c, last)
        cur = torch.where(acc, c, cur)
        p = torch.where(acc.unsqueeze(1), P[rows, c], p)
        q = torch.where(acc.unsqueeze(1), Q[rows, c], q)
    bonus = _inverse_cdf(p, uniforms[:, N])
    return result_on_device(tokens, parents, depths, depth_bound, cur, bonus)


def typical_accepts(target_logits: Tensor, tokens: Tensor, temperature: float, posterior_threshold: float, posterior_alpha: float) -> Tensor:
    """Medusa's typical acceptance test: accepted [...] bool for token ids [...] under target
    logits [..., V]: p(x) > min(posterior_threshold, posterior_alpha * exp(-H(p))), with
    p = softmax(logits / temperature) and H its entropy (in at least fp32). NOT lossless."""
    dtype = torch.promote_types(target_logits.dtype, torch.float32)
    log_p = torch.log_softmax(target_logits.to(dtype) / temperature, dim=-1)
    p = log_p.exp()
    entropy = -(p * log_p).nan_to_num(0.0).sum(-1)  # 0 * log 0 = 0
    threshold = torch.clamp(posterior_alpha * torch.exp(-entropy), max=posterior_threshold)
    return p.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) > threshold


def verify_typical(
    tree: DraftTree,
    target_logits: Tensor,
    temperature: float,
    posterior_threshold: float = POSTERIOR_THRESHOLD,
    posterior_alpha: float = POSTERIOR_ALPHA,
) -> VerifyResult:
    """Medusa's typical acceptance over a tree (NOT lossless). target_logits [B,N,V].

    Node i >= 1 is accepted iff ``typical_accepts`` holds for its token under the target's logits
    at its parent, and its parent is accepted. best = the deepest accepted node; among equally deep
    ones the most likely path (largest sum of log p of its tokens, Medusa's tie-break), then the
    lowest index. bonus = the target's argmax at best (Medusa's default "fast" mode).
    """
    check_typical(temperature, 0, 1.0, posterior_threshold, posterior_alpha)
    tree.validate()
    B, N = tree.tokens.shape
    if target_logits.shape[:2] != (B, N):
        raise ValueError(f"target_logits has shape {tuple(target_logits.shape)}; the trees need [{B},{N},V]")
    parents = tree.parents
    at_parent = target_logits.gather(1, parents.clamp_min(0).unsqueeze(-1).expand(-1, -1, target_logits.shape[-1]))
    ok = typical_accepts(at_parent, tree.tokens, temperature, posterior_threshold, posterior_alpha) & (parents >= 0)
    ok[:, 0] = True  # the root is decided already
    dtype = torch.promote_types(target_logits.dtype, torch.float32)
    log_p = torch.log_softmax(at_parent.to(dtype) / temperature, dim=-1).gather(-1, tree.tokens.unsqueeze(-1)).squeeze(-1)
    log_p = torch.where(parents >= 0, log_p, torch.zeros_like(log_p))
    anc = ancestor_mask(parents)
    accepted = ~(anc & ~ok.unsqueeze(1)).any(-1)
    path_log_p = (anc.to(dtype) * log_p.unsqueeze(1)).sum(-1)  # [B,N]: sum over ancestors-or-self
    index = torch.arange(N, device=parents.device)
    deepest = torch.where(accepted, tree.depths, torch.full_like(tree.depths, -1)).amax(-1, keepdim=True)
    candidates = accepted & (tree.depths == deepest)
    score = torch.where(candidates, path_log_p, torch.full_like(path_log_p, float("-inf")))
    best_score = score.amax(-1, keepdim=True)
    best = torch.where(candidates & (score == best_score), index, torch.full_like(index, N)).amin(-1)
    bonus = target_logits.argmax(-1).gather(1, best.unsqueeze(1)).squeeze(1)
    return _result(tree, best, bonus, anc)


def verify(
    tree: DraftTree,
    target_logits: Tensor,
    sampling: Optional[SamplingParams] = None,
    generator: Optional[torch.Generator] = None,
    uniforms: Optional[Tensor] = None,
) -> VerifyResult:
    """Verify B trees as ``sampling`` says (default greedy): verify_greedy, verify_sample (with
    `generator` or `uniforms`) or verify_typical (NOT lossless). target_logits [B,N,V]."""
    sampling = sampling or GREEDY
    if sampling.greedy:
        return verify_greedy(tree, target_logits)
    if sampling.sampled:
        return verify_sample(tree, target_logits, sampling.temperature, sampling.top_k, sampling.top_p, generator, uniforms)
    return verify_typical(tree, target_logits, sampling.temperature, sampling.posterior_threshold, sampling.posterior_alpha)
