"""What a distribution over tokens is once temperature, top-k and top-p have had their say: the one
processing that drafting, verification and data regeneration all sample from. A floor module:
it imports nothing of draftsmith, so data and the runtime can both stand on it."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["logits_to_probs"]


def logits_to_probs(logits: Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """logits [..., V] -> probs [..., V] in at least fp32; the one processing for draft and target.

    In order: divide by temperature (0 means one-hot at the argmax, first index on ties); top-k
    keeps the tokens whose scaled logit is >= the k-th largest (ties at the boundary are all kept;
    0 = off); top-p keeps, in descending probability order (stable sort), each token whose
    strictly-higher-ranked tokens hold less than ``top_p`` of the mass (so at least one token);
    then renormalise.
    """
    dtype = torch.promote_types(logits.dtype, torch.float32)
    x = logits.to(dtype)
    V = x.shape[-1]
    if temperature == 0:
        return torch.zeros_like(x).scatter_(-1, x.argmax(-1, keepdim=True), 1.0)
    x = x / temperature
    if 0 < top_k < V:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs
