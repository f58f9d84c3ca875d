"""Distillation objectives: pure functions of tensors, no module state.

Two registries, because the objectives take two shapes of input:

- DIVERGENCES: `fn(draft_logits [B,T,V], target_logits [B,T,V], temperature, **params) -> [B,T]`,
  reduced by `masked_mean`. They need only the two distributions.
- SAMPLED_OBJECTIVES: `fn(draft_logits, target_logits, sampled_tokens [B,T], mask [B,T],
  temperature) -> scalar`. They also need one token per position sampled from the draft
  (`sample_draft_tokens`), and reduce over the batch themselves (TVD++ normalizes its reward with
  batch statistics, so its positions are not independent).

A recipe names either kind; `distillation_loss` dispatches on the name so a trainer has one call.
"""

from __future__ import annotations

from torch import Tensor

from draftsmith.distill.divergences import forward_kl, jsd, masked_mean, reverse_kl, tvd
from draftsmith.distill.tvdpp import sample_draft_tokens, tvdpp_loss

DIVERGENCES = {"fkl": forward_kl, "rkl": reverse_kl, "jsd": jsd, "tvd": tvd}

SAMPLED_OBJECTIVES = {"tvdpp": tvdpp_loss}


def distillation_loss(
    name: str,
    draft_logits: Tensor,
    target_logits: Tensor,
    mask: Tensor,
    temperature: float = 1.0,
    sampled_tokens: Tensor | None = None,
    **params,
) -> Tensor:
    """The scalar loss of objective `name` (a DIVERGENCES or SAMPLED_OBJECTIVES key).

    draft_logits, target_logits: [B, T, V]; mask: [B, T]; sampled_tokens: [B, T], required by
    the sampled objectives (drawn with `sample_draft_tokens` at the same temperature) and
    refused by the others. `params` go to the divergence (`beta=` for "jsd").
    """
    if name in DIVERGENCES:
        if sampled_tokens is not None:
            raise ValueError(f"divergence {name!r} uses the full distributions; it takes no sampled_tokens")
        return masked_mean(DIVERGENCES[name](draft_logits, target_logits, temperature, **params), mask)
    if name in SAMPLED_OBJECTIVES:
        if sampled_tokens is None:
            raise ValueError(f"objective {name!r} needs sampled_tokens drawn from the draft (sample_draft_tokens)")
        return SAMPLED_OBJECTIVES[name](draft_logits, target_logits, sampled_tokens, mask, temperature, **params)
    known = ", ".join([*DIVERGENCES, *SAMPLED_OBJECTIVES])
    raise KeyError(f"unknown distillation objective {name!r}; known: {known}")


__all__ = [
    "DIVERGENCES",
    "SAMPLED_OBJECTIVES",
    "distillation_loss",
    "forward_kl",
    "jsd",
    "masked_mean",
    "reverse_kl",
    "sample_draft_tokens",
    "tvd",
    "tvdpp_loss",
]
