"""Token-level divergences between a draft and a target next-token distribution.

Every divergence has the same shape of call:

    fn(draft_logits [..., V], target_logits [..., V], temperature=1.0, **params) -> loss [...]

usually `[B, T, V] -> [B, T]` (a head's `[B, T, K, V]` works the same way). The draft comes first,
always. Both logit tensors are divided by the same `temperature` before the softmax; no `T**2`
factor is applied (a trainer that wants Hinton-style scaling multiplies the loss itself).

Notation: `q = softmax(draft_logits / T)` is the draft, `p = softmax(target_logits / T)` the target.

Masking and reduction happen in exactly one place, `masked_mean`; the divergences return one value
per position and never reduce over positions.

Masked vocabulary (`-inf` logits, or `finfo.min` as Hugging Face writes them) is a zero-probability
token. A token that one side masks and the other does not has infinite KL in one direction; it is
computed as a very large finite number (about 1.7e38 times the probability on it) so that the value
still says "huge" while gradients elsewhere stay finite. Mask the same vocabulary on both sides.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["forward_kl", "reverse_kl", "jsd", "tvd", "masked_mean", "log_probs", "compute_dtype"]


def compute_dtype(*tensors: Tensor) -> torch.dtype:
    """The dtype losses are computed in: at least fp32, wider if any input is (float64 stays float64)."""
    # promote_types, not .float(): a float64 gradcheck must see the float64 function.
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def log_probs(logits: Tensor, temperature: float, dtype: torch.dtype) -> Tensor:
    """`log_softmax(logits / temperature)` in `dtype`, with masked (`-inf`) entries kept finite.

    logits: [..., V]. Returns [..., V]. A masked entry comes back as a log-probability near
    `finfo(dtype).min / 2`: its probability is exactly 0, and `0 * log 0` terms evaluate to 0
    instead of NaN in the value and in the gradient. Half of `finfo.min` leaves room for the
    `log_softmax` shift and for differences of two log-probabilities without overflowing.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    scaled = logits.to(dtype) / temperature
    # clamp's gradient is 0 on clamped entries, which is right for a token that cannot be drawn.
    scaled = scaled.clamp(min=torch.finfo(dtype).min / 2)
    return torch.log_softmax(scaled, dim=-1)


def _pair(draft_logits: Tensor, target_logits: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    if draft_logits.shape != target_logits.shape:
        raise ValueError(
            f"draft and target logits must have the same shape, got {tuple(draft_logits.shape)} "
            f"and {tuple(target_logits.shape)}"
        )
    dtype = compute_dtype(draft_logits, target_logits)
    return log_probs(draft_logits, temperature, dtype), log_probs(target_logits, temperature, dtype)


def forward_kl(draft_logits: Tensor, target_logits: Tensor, temperature: float = 1.0) -> Tensor:
    """KL(target || draft) = sum_x p(x) (log p(x) - log q(x)), per position.

    draft_logits, target_logits: [..., V]. Returns [...]. Mass-covering: the draft pays for every
    token the target likes and it misses. Equals
    `torch.distributions.kl_divergence(Categorical(logits=target), Categorical(logits=draft))`.
    """
    log_q, log_p = _pair(draft_logits, target_logits, temperature)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def reverse_kl(draft_logits: Tensor, target_logits: Tensor, temperature: float = 1.0) -> Tensor:
    """KL(draft || target) = sum_x q(x) (log q(x) - log p(x)), per position.

    draft_logits, target_logits: [..., V]. Returns [...]. Mode-seeking: the draft pays for mass it
    puts where the target has little.
    """
    log_q, log_p = _pair(draft_logits, target_logits, temperature)
    return (log_q.exp() * (log_q - log_p)).sum(-1)


def jsd(
    draft_logits: Tensor, target_logits: Tensor, temperature: float = 1.0, beta: float = 0.5
) -> Tensor:
    """Generalized Jensen-Shannon divergence (DistillSpec / GKD), per position.

        m = beta * p + (1 - beta) * q
        JSD(beta) = beta * KL(p || m) + (1 - beta) * KL(q || m)

    draft_logits, target_logits: [..., V]. Returns [...]. `beta` in (0, 1); 0.5 is the symmetric
    JSD, bounded by log 2. Limits, both with the mixture collapsing onto one side:

        JSD(beta) / beta       -> KL(p || q) = forward_kl   as beta -> 0   (m -> q)
        JSD(beta) / (1 - beta) -> KL(q || p) = reverse_kl   as beta -> 1   (m -> p)

    (the other term vanishes as O(beta^2), resp. O((1 - beta)^2)). Swapping the arguments mirrors
    beta: `jsd(a, b, beta=beta) == jsd(b, a, beta=1 - beta)`.
    """
    if not 0.0 < beta < 1.0:
        raise ValueError(f"jsd needs 0 < beta < 1, got {beta} (use forward_kl / reverse_kl for the limits)")
    log_q, log_p = _pair(draft_logits, target_logits, temperature)
    # log m in log space: the mixture of two tiny probabilities must not underflow to log 0.
    log_m = torch.logaddexp(log_p + math.log(beta), log_q + math.log1p(-beta))
    kl_p_m = (log_p.exp() * (log_p - log_m)).sum(-1)
    kl_q_m = (log_q.exp() * (log_q - log_m)).sum(-1)
    return beta * kl_p_m + (1.0 - beta) * kl_q_m


def tvd(draft_logits: Tensor, target_logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Total variation distance 0.5 * sum_x |p(x) - q(x)|, per position.

    draft_logits, target_logits: [..., V]. Returns [...] in [0, 1]. Equals 1 - sum_x min(p, q),
    and sum_x min(p, q) is the probability that standard speculative sampling accepts one drafted
    token: minimizing TVD maximizes one-token acceptance directly.
    """
    log_q, log_p = _pair(draft_logits, target_logits, temperature)
    return 0.5 * (log_p.exp() - log_q.exp()).abs().sum(-1)


def masked_mean(loss: Tensor, mask: Tensor) -> Tensor:
    """Mean of `loss` over the positions where `mask` is true: the one place losses are reduced.

    loss: [B, T] (any shape); mask: same shape, bool or 0/1. Returns a scalar. Masked positions
    contribute nothing to the value or the gradient, even when they hold inf or NaN (padding rows
    of all `-inf` logits, say). With no position selected the result is 0, still attached to the
    graph, so an empty micro-batch does not poison gradient accumulation.
    """
    if loss.shape != mask.shape:
        raise ValueError(f"loss and mask must have the same shape, got {tuple(loss.shape)} and {tuple(mask.shape)}")
    keep = mask != 0
    # where, not multiply: 0 * inf is NaN, and where sends a zero gradient to the dropped side.
    total = torch.where(keep, loss, torch.zeros((), dtype=loss.dtype, device=loss.device)).sum()
    return total / keep.sum().clamp(min=1).to(loss.dtype)
