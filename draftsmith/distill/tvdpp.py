"""TVD++: total variation distance trained as a policy gradient on tokens the draft samples.

Goel et al. 2024, "Direct Alignment of Draft Model for Speculative Decoding with Chat-Fine-Tuned
LLMs" (arXiv 2403.00858), section on the TVD++ loss. At one position, with draft
`q = softmax(draft_logits / T)` and target `p = softmax(target_logits / T)`:

    TVD(p, q) = 0.5 * sum_x |p(x) - q(x)|
    dTVD/dtheta = 0.5 * sum_x sign(q(x) - p(x)) dq(x)/dtheta
                = -sum_x 1{p(x) > q(x)} dq(x)/dtheta          (sum_x dq(x) = 0; ties have measure 0)
                = -E_{x ~ q}[ r(x) * dlog q(x)/dtheta ],   r(x) = 1{p(x) > q(x)}

so descending TVD is REINFORCE on the draft's own samples with the reward "the target wants this
token more than the draft does". TVD++ applies the policy-gradient variance reduction to that
reward: over the batch's N valid sampled tokens x_i,

    A_i = (r_i - mean(r)) / std(r)           (population std; A = 0 where all rewards are equal)
    loss = -(1/N) * sum_i A_i * log q_i(x_i) (A_i treated as a constant)

Subtracting the mean is a baseline; dividing by the std rescales the step. Because r is 0/1,
E[A_i | x_i] is affine in r_i with a positive slope c_i, so the exact expectation of the
estimator at position i is c_i * dTVD_i/dtheta: the right direction at every position. c_i depends
on the other positions' statistics; for N = 2, c_i = 1 and the expected step is exactly the
gradient of the mean TVD (the tests enumerate both facts).

How it differs from the divergences in DIVERGENCES: it needs `sampled_tokens` drawn from the draft
at the same temperature (see `sample_draft_tokens`), its per-token terms are coupled through the
batch statistics so it returns the reduced scalar itself (with `masked_mean` inside), and its value
is a surrogate whose gradient is the estimator, not a distance. Select it by name through
`draftsmith.distill.distillation_loss("tvdpp", ...)`, like any divergence.
"""

from __future__ import annotations

import torch
from torch import Tensor

from draftsmith.distill.divergences import compute_dtype, log_probs, masked_mean

__all__ = ["tvd_reward", "normalized_advantage", "sample_draft_tokens", "tvdpp_loss"]


def sample_draft_tokens(
    draft_logits: Tensor, temperature: float = 1.0, generator: torch.Generator | None = None
) -> Tensor:
    """One token per position from the draft's own distribution softmax(draft_logits / T).

    draft_logits: [B, T, V]. Returns [B, T] int64, detached. Draws must come from the same
    temperature that `tvdpp_loss` uses, or the estimator is off-policy and biased.
    """
    probs = log_probs(draft_logits.detach(), temperature, compute_dtype(draft_logits)).exp()
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def tvd_reward(
    draft_logits: Tensor, target_logits: Tensor, sampled_tokens: Tensor, temperature: float = 1.0
) -> Tensor:
    """r = 1{p(x) > q(x)} at each sampled token x: 1 where the draft under-covers the target.

    draft_logits, target_logits: [B, T, V]; sampled_tokens: [B, T] int. Returns [B, T] in the
    compute dtype, 0/1, detached (a reward carries no gradient).
    """
    dtype = compute_dtype(draft_logits, target_logits)
    index = sampled_tokens.unsqueeze(-1)
    log_q = log_probs(draft_logits.detach(), temperature, dtype).gather(-1, index).squeeze(-1)
    log_p = log_probs(target_logits.detach(), temperature, dtype).gather(-1, index).squeeze(-1)
    return (log_p > log_q).to(dtype)


def normalized_advantage(reward: Tensor, mask: Tensor) -> Tensor:
    """(r - mean(r)) / std(r) over the positions where `mask` is true; 0 elsewhere.

    reward, mask: [B, T]. Returns [B, T], detached. The statistics cover the whole batch's valid
    tokens (one baseline per batch, as TVD++ does). Population std; where it is 0 (all rewards
    equal, e.g. a draft that already matches its target) the advantage is 0 and so is the update.
    """
    keep = mask != 0
    reward = reward.detach()
    mean = masked_mean(reward, keep)
    centered = torch.where(keep, reward - mean, torch.zeros_like(reward))
    std = masked_mean(centered.square(), keep).sqrt()
    return torch.where(std > 0, centered / std.clamp(min=torch.finfo(reward.dtype).tiny), torch.zeros_like(reward))


def tvdpp_loss(
    draft_logits: Tensor,
    target_logits: Tensor,
    sampled_tokens: Tensor,
    mask: Tensor,
    temperature: float = 1.0,
) -> Tensor:
    """TVD++ surrogate: -mean over valid positions of A * log q(x), x sampled from the draft.

    draft_logits, target_logits: [B, T, V]; sampled_tokens: [B, T] int, drawn from
    softmax(draft_logits / temperature) (`sample_draft_tokens`); mask: [B, T] bool or 0/1.
    Returns a scalar whose gradient with respect to the draft logits is the TVD++ estimate of
    dTVD; no gradient reaches the target. `A = normalized_advantage(tvd_reward(...), mask)`.
    """
    if sampled_tokens.shape != draft_logits.shape[:-1]:
        raise ValueError(
            f"sampled_tokens must be {tuple(draft_logits.shape[:-1])} (one token per position), "
            f"got {tuple(sampled_tokens.shape)}"
        )
    advantage = normalized_advantage(tvd_reward(draft_logits, target_logits, sampled_tokens, temperature), mask)
    dtype = compute_dtype(draft_logits, target_logits)
    log_q = log_probs(draft_logits, temperature, dtype).gather(-1, sampled_tokens.unsqueeze(-1)).squeeze(-1)
    return -masked_mean(advantage * log_q, mask)
