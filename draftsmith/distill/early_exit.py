"""LayerSkip's training objective (Elhoushi et al., 2024): layer dropout and the early-exit loss.

Pure functions of tensors and step counters. Notation: the model has L decoder layers; layer l
(0-based) maps x_l to x_{l+1} = x_l + f_l(x_l). The *exit after layer l* reads x_{l+1} through the
model's own final norm and LM head; exit L-1 is the model's ordinary output. Arrays of length L are
indexed by l. (At decoding time "exit layer E" means the first E layers, i.e. l = E - 1.)

Layer dropout: layer l of sample b is skipped (x_{l+1} = x_l, no rescaling) with probability
p_l(t) = S(t) * D(l) * max_rate, where D rises from 0 at the first layer to 1 at the last
(exponentially, 2^(l/(L-1)) - 1, or linearly) and S is a curriculum over optimizer steps (constant
1 for fine-tuning, or rising from 0 as in pre-training from scratch).

Early-exit loss: sum over enabled exits of e~(t,l) * CE(exit l), with e(l) = e_scale * l(l+1)/2 for
l < L-1 and e(L-1) = (L-1) + e_scale * (L-2)(L-1)/2 (quadratic in depth; the last layer's weight
keeps the ordinary loss dominant), normalised over the enabled exits to sum to 1. A curriculum
C(t,l) enables exits: all of them, every R-th layer rotating by one layer per step, or gradually
from the last layer towards the first during the first half of training. The last exit is always on.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import Tensor

from draftsmith.distill.divergences import compute_dtype, tvd

__all__ = [
    "best_exit",
    "DROPOUT_CURRICULA",
    "DROPOUT_SCALES",
    "EXIT_CURRICULA",
    "dropout_curriculum",
    "early_exit_loss",
    "exit_agreement",
    "exit_cross_entropy",
    "exit_curriculum",
    "exit_loss_scales",
    "expected_chain_tokens",
    "layer_drop_mask",
    "layer_dropout_rates",
    "modeled_speedup",
]

DROPOUT_SCALES = ("exp", "linear")
DROPOUT_CURRICULA = ("constant", "exp", "linear")
EXIT_CURRICULA = ("all", "rotational", "gradual")


def layer_dropout_rates(num_layers: int, max_rate: float, scale: str = "exp") -> Tensor:
    """Per-layer drop probabilities [L] (float64): 0 for layer 0, `max_rate` for layer L-1.

    scale "exp": max_rate * (2^(l/(L-1)) - 1), the paper's choice; "linear": max_rate * l/(L-1).
    """
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    if not 0.0 <= max_rate < 1.0:
        raise ValueError(f"max_rate must be in [0, 1), got {max_rate}")
    depth = torch.arange(num_layers, dtype=torch.float64) / max(1, num_layers - 1)
    if scale == "exp":
        shape = torch.exp2(depth) - 1.0
    elif scale == "linear":
        shape = depth
    else:
        raise ValueError(f"unknown layer dropout scale {scale!r}; one of {', '.join(DROPOUT_SCALES)}")
    return max_rate * shape


def dropout_curriculum(step: int, total_steps: int, kind: str = "constant") -> float:
    """S(t) in [0, 1] at optimizer step `step` (0-based) of `total_steps`.

    "constant": 1 (continual pre-training, fine-tuning). "exp": 2^(t/(T-1)) - 1 and "linear":
    t/(T-1), both rising from 0 at the first step to 1 at the last (pre-training from scratch).
    """
    progress = min(1.0, max(0.0, step / max(1, total_steps - 1)))
    if kind == "constant":
        return 1.0
    if kind == "exp":
        return 2.0**progress - 1.0
    if kind == "linear":
        return progress
    raise ValueError(f"unknown layer dropout curriculum {kind!r}; one of {', '.join(DROPOUT_CURRICULA)}")


def layer_drop_mask(rates: Tensor, sample_ids: Sequence[int], step: int, seed: int = 0) -> Tensor:
    """Which layers each sample skips at this step: bool [B,L], True = skipped.

    rates: [L] drop probabilities; sample_ids: one integer per row naming the sample within the
    step (its place in the global batch), so the draw depends on (seed, step, sample) only: the
    same sample drops the same layers whether it runs in one process, on another rank or in another
    accumulation micro-batch, and a resumed run draws what the uninterrupted one drew.
    """
    rows = []
    for sample in sample_ids:
        mixed = (seed * 1_000_003 + step) * 2_147_483_629 + int(sample)
        gen = torch.Generator().manual_seed(mixed % (2**63 - 1))
        rows.append(torch.rand(rates.shape[0], generator=gen, dtype=torch.float64) < rates.cpu().double())
    if not rows:
        return torch.zeros(0, rates.shape[0], dtype=torch.bool)
    return torch.stack(rows)


def exit_curriculum(kind: str, num_layers: int, step: int, total_steps: int, rotation: int = 1) -> Tensor:
    """C(t,l): which exits carry a loss at optimizer step `step` (0-based) of `total_steps`: bool [L].

    "all": every exit. "rotational": every `rotation`-th exit, the pattern moving up one layer per
    step (exits R-1, 2R-1, ... at step 0), so each exit is on once every R steps. "gradual": exit l
    switches on at step (L-1-l) * T / (2L), from the last layer down; all are on after T/2.
    The last exit (the model's own output) is always on.
    """
    L = num_layers
    layers = torch.arange(L)
    if kind == "all":
        enabled = torch.ones(L, dtype=torch.bool)
    elif kind == "rotational":
        if rotation < 1:
            raise ValueError(f"rotation must be >= 1, got {rotation}")
        enabled = (layers - step) % rotation == rotation - 1
    elif kind == "gradual":
        enabled = step >= (L - 1 - layers).double() * total_steps / (2 * L)
    else:
        raise ValueError(f"unknown early-exit curriculum {kind!r}; one of {', '.join(EXIT_CURRICULA)}")
    enabled[L - 1] = True
    return enabled


def exit_loss_scales(num_layers: int, e_scale: float, enabled: Tensor) -> Tensor:
    """e~(t,l): the weight of each exit's loss, [L] float64, zero where `enabled` [L] is False and
    summing to 1 over the enabled exits (the last exit is expected among them)."""
    if not 0.0 <= e_scale <= 1.0:
        raise ValueError(f"e_scale must be in [0, 1], got {e_scale}")
    L = num_layers
    layers = torch.arange(L, dtype=torch.float64)
    raw = e_scale * layers * (layers + 1) / 2
    raw[L - 1] = (L - 1) + e_scale * (L - 2) * (L - 1) / 2 if L > 1 else 1.0
    weights = raw * enabled.to(torch.float64)
    total = weights.sum()
    if total <= 0:
        raise ValueError("no enabled exit has a positive loss scale (is the last exit enabled?)")
    return weights / total


def exit_cross_entropy(logits: Tensor, labels: Tensor) -> Tensor:
    """Cross-entropy of one exit per position, in at least fp32: logits [N,V], labels [N] -> [N]."""
    return torch.nn.functional.cross_entropy(logits.to(compute_dtype(logits)), labels, reduction="none")


def early_exit_loss(exit_logits: Sequence[Tensor], labels: Tensor, scales: Sequence[float] | Tensor) -> tuple[Tensor, Tensor]:
    """The early-exit loss: sum_i scales[i] * mean cross-entropy of exit i over the N trained positions.

    exit_logits: one [N,V] tensor per enabled exit (the same N positions, already masked);
    labels: [N]; scales: [n] weights, e.g. exit_loss_scales at the enabled exits. Returns (loss,
    per-exit mean cross-entropy [n], detached). With N = 0 the loss is 0 and stays in the graph.
    """
    if len(exit_logits) != len(scales):
        raise ValueError(f"{len(exit_logits)} exits but {len(scales)} scales")
    per_exit = []
    for logits in exit_logits:
        ce = exit_cross_entropy(logits, labels)
        per_exit.append(ce.mean() if ce.numel() else ce.sum())
    stacked = torch.stack(per_exit)
    weights = torch.as_tensor(scales, dtype=stacked.dtype, device=stacked.device)
    return (weights * stacked).sum(), stacked.detach()


def exit_agreement(exit_logits: Tensor, full_logits: Tensor) -> tuple[Tensor, Tensor]:
    """How well an exit would draft for the full model, per position: (top-1 agreement [N] bool,
    expected acceptance 1 - TVD [N], the probability that speculative sampling accepts a token drawn
    from the exit). exit_logits, full_logits: [N,V]."""
    agree = exit_logits.argmax(-1) == full_logits.argmax(-1)
    return agree, 1.0 - tvd(exit_logits, full_logits)


def expected_chain_tokens(acceptance: float, draft_length: int) -> float:
    """Tokens per verification step of a chain of `draft_length` drafts whose tokens are each
    accepted with probability `acceptance` (independently): (1 - a^(k+1)) / (1 - a)."""
    a, k = acceptance, draft_length
    return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


def modeled_speedup(acceptance: float, exit_layer: int, num_layers: int, draft_length: int) -> float:
    """Speedup of self-speculative decoding over plain decoding when a step costs one full forward
    for verification plus `draft_length` forwards of `exit_layer` of `num_layers` layers (memory-
    bound decoding, LM head ignored): expected_chain_tokens / (1 + k E / L). A ranking aid for
    choosing an exit from teacher-forced figures, not a measurement."""
    cost = 1.0 + draft_length * exit_layer / num_layers
    return expected_chain_tokens(acceptance, draft_length) / cost if math.isfinite(acceptance) else 0.0


def best_exit(exits: Sequence[int], acceptance: Sequence[float], num_layers: int, draft_length: int) -> int:
    """The exit layer among `exits` with the highest modeled_speedup, given each one's expected
    acceptance and the chain length it would draft."""
    scores = [modeled_speedup(a, e, num_layers, draft_length) for e, a in zip(exits, acceptance)]
    return exits[max(range(len(scores)), key=scores.__getitem__)]
