"""What a distribution over tokens is once temperature, top-k and top-p have had their say: the one
processing that drafting, verification and data regeneration all sample from, and the draws
without replacement a drafter makes from it on the device. A floor module: it imports nothing of
draftsmith, so data, the heads and the runtime can all stand on it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from torch import Tensor

__all__ = ["DeviceDraws", "draws_inputs", "draws_key", "gumbel", "logits_to_probs", "with_uniforms"]


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


def gumbel(u: Tensor) -> Tensor:
    """Gumbel noise from uniforms u in [0,1): log q + gumbel(u), top-k, draws k tokens without
    replacement from q, in draw order."""
    return -torch.log(-torch.log(u.clamp_min(1e-300)))


@dataclass(frozen=True)
class DeviceDraws:
    """Sampled drafting of a static tree on the device (``runtime.drafters.static_tree_on_device``
    and ``grow_static_tree_on_device``): how tokens are processed (``sampling``, a
    ``runtime.verify.SamplingParams``) and the uniforms of a step's draws, one row [V] float64 per
    node that gets children, in spec order, drawn before the drafting (``draw``), so that a CUDA
    graph replaying the drafting takes them as an input.

    A node's children are its Gumbel top-k over the processed distribution q, the m-th child the
    m-th draw without replacement: ``runtime.drafters.sample_without_replacement``'s draws from the
    same uniforms, which ``grow_static_tree`` draws one node at a time in the same order (on the
    CPU one call gives the numbers the per-node calls give, so the two draw the same trees there;
    CUDA's generator splits its numbers differently, both are draws from q all the same). Where q
    keeps fewer tokens than the node has children, the children past its support keep their place
    in the tree's fixed shape and hold a token of q(x) = 0, which verification never accepts and
    whose rejection changes nothing (runtime/verify.py); grow_static_tree leaves them out."""

    sampling: Any
    uniforms: Tensor  # [F,V] float64

    @classmethod
    def draw(cls, spec: Any, sampling: Any, vocab: int, generator: Optional[torch.Generator], device) -> Optional["DeviceDraws"]:
        """The draws of one step of the TreeSpec ``spec`` (None unless ``sampling`` samples): one
        ``torch.rand``."""
        if not sampling.sampled:
            return None
        rows = sum(1 for count in spec.child_counts if count)
        return cls(sampling, torch.rand(rows, vocab, generator=generator, device=device, dtype=torch.float64))

    @property
    def key(self) -> tuple:
        """The settings a graph drafting from these draws bakes in."""
        s = self.sampling
        return (s.temperature, s.top_k, s.top_p)

    def probs(self, logits: Tensor) -> Tensor:
        """The processed distributions q [...,V] of logits [...,V]."""
        s = self.sampling
        return logits_to_probs(logits, s.temperature, s.top_k, s.top_p)

    def children(self, q: Tensor, widest: int, rows: Optional[Tensor] = None) -> Tensor:
        """The first ``widest`` draws [F,widest], in draw order, of nodes of distributions q [F,V]
        whose uniforms are rows ``rows`` [F] (None: all of them, in order)."""
        u = self.uniforms if rows is None else self.uniforms[rows]
        return torch.topk(q.double().log() + gumbel(u), widest, dim=-1).indices


def draws_key(draws: Optional[DeviceDraws]) -> tuple:
    """What a graph drafting from ``draws`` (None: greedy) bakes in besides its inputs."""
    return () if draws is None else draws.key


def draws_inputs(draws: Optional[DeviceDraws]) -> tuple[Tensor, ...]:
    """The graph inputs ``draws`` adds: its uniforms (nothing when greedy)."""
    return () if draws is None else (draws.uniforms,)


def with_uniforms(draws: Optional[DeviceDraws], inputs: Sequence[Tensor]) -> Optional[DeviceDraws]:
    """``draws`` on the uniforms a graph function received (``draws_inputs``' place in its inputs)."""
    return draws if draws is None else dataclasses.replace(draws, uniforms=inputs[0])
