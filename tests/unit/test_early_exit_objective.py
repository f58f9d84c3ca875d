"""LayerSkip's objective (distill/early_exit.py): layer-dropout rates and curricula against the
paper's formulas and worked numbers, the per-sample drop draw, early-exit loss scales and curricula,
the loss against a hand computation (and a float64 gradcheck), and the exit figures' identities."""

import math

import pytest
import torch

from draftsmith.distill.early_exit import (
    best_exit, dropout_curriculum, early_exit_loss, exit_agreement, exit_curriculum, exit_loss_scales,
    expected_chain_tokens, layer_drop_mask, layer_dropout_rates, modeled_speedup,
)


def test_dropout_rates_rise_from_zero_to_max_rate_exponentially_or_linearly():
    # The paper's example, L = 32 and p_max = 0.1: 0, 0.0196, 0.043, 0.071, 0.1 at l = 0, 8, 16, 24, 31.
    rates = layer_dropout_rates(32, 0.1, "exp")
    for layer, expected in [(0, 0.0), (8, 0.0196), (16, 0.043), (24, 0.071), (31, 0.1)]:
        assert rates[layer].item() == pytest.approx(expected, abs=5e-4)
    assert rates[16].item() == pytest.approx(0.1 * (2 ** (16 / 31) - 1))
    assert torch.all(rates[1:] > rates[:-1])
    linear = layer_dropout_rates(5, 0.2, "linear")
    assert linear.tolist() == pytest.approx([0.0, 0.05, 0.1, 0.15, 0.2])
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        layer_dropout_rates(4, 1.0)


def test_dropout_curriculum_is_constant_or_rises_from_zero_to_one():
    assert [dropout_curriculum(t, 11, "constant") for t in (0, 5, 10)] == [1.0, 1.0, 1.0]
    exp = [dropout_curriculum(t, 11, "exp") for t in range(11)]
    assert exp[0] == 0.0 and exp[-1] == pytest.approx(1.0) and exp[5] == pytest.approx(math.sqrt(2) - 1)
    assert all(b > a for a, b in zip(exp, exp[1:]))
    assert dropout_curriculum(5, 11, "linear") == pytest.approx(0.5)


def test_drop_mask_depends_on_seed_step_and_sample_only_and_follows_the_rates():
    rates = layer_dropout_rates(6, 0.6, "linear")
    whole = layer_drop_mask(rates, range(8), step=3, seed=1)
    # The same samples split over two "ranks" or micro-batches draw the same layers.
    assert torch.equal(torch.cat([layer_drop_mask(rates, range(4), 3, 1), layer_drop_mask(rates, range(4, 8), 3, 1)]), whole)
    assert not torch.equal(layer_drop_mask(rates, range(8), step=4, seed=1), whole)
    assert not whole[:, 0].any()  # layer 0 never drops
    many = layer_drop_mask(rates, range(4000), step=0, seed=0).double().mean(0)
    assert torch.allclose(many, rates, atol=0.03), (many, rates)


def test_rotational_curriculum_enables_every_rth_exit_once_every_r_steps_and_always_the_last():
    L, R = 32, 8
    assert exit_curriculum("rotational", L, 0, 100, R).nonzero().flatten().tolist() == [7, 15, 23, 31]
    counts = torch.stack([exit_curriculum("rotational", L, t, 100, R) for t in range(R)]).sum(0)
    assert counts[:-1].tolist() == [1] * (L - 1) and counts[-1] == R
    assert exit_curriculum("all", 5, 0, 10).all()


def test_gradual_curriculum_switches_exits_on_from_the_last_layer_down():
    L, T = 4, 80  # exit l switches on at step (L-1-l) * T / (2L) = (3 - l) * 10
    on = [exit_curriculum("gradual", L, t, T).tolist() for t in (0, 9, 10, 20, 30, 79)]
    assert on == [
        [False, False, False, True], [False, False, False, True], [False, False, True, True],
        [False, True, True, True], [True, True, True, True], [True, True, True, True],
    ]


def test_loss_scales_match_the_papers_formula_and_worked_example():
    # L = 32, e_scale = 0.2: e(31) = 31 + 0.2 * 30 * 31 / 2 = 124; with every exit on it weighs 124/1116.
    every = exit_loss_scales(32, 0.2, torch.ones(32, dtype=torch.bool))
    assert every[31].item() == pytest.approx(124 / 1116) and every.sum().item() == pytest.approx(1.0)
    assert every[0] == 0 and torch.all(every[1:-1] > 0) and torch.all(every[2:-1] > every[1:-2])
    rotational = exit_loss_scales(32, 0.2, exit_curriculum("rotational", 32, 0, 10, 8))
    # e(7), e(15), e(23) = 0.2 * (28, 120, 276); e(31) = 124; normalised over the four.
    kept = rotational[[7, 15, 23, 31]]
    assert kept.tolist() == pytest.approx([5.6 / 208.8, 24 / 208.8, 55.2 / 208.8, 124 / 208.8])
    assert rotational.sum().item() == pytest.approx(1.0)
    # e_scale 0: only the model's own output.
    assert exit_loss_scales(6, 0.0, torch.ones(6, dtype=torch.bool)).tolist() == [0, 0, 0, 0, 0, 1.0]


def test_early_exit_loss_is_the_weighted_mean_cross_entropy_and_passes_gradcheck():
    gen = torch.Generator().manual_seed(0)
    logits = [torch.randn(7, 11, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    labels = torch.randint(0, 11, (7,), generator=gen)
    scales = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    loss, per_exit = early_exit_loss(logits, labels, scales)
    by_hand = [(-torch.log_softmax(x, -1)[torch.arange(7), labels]).mean() for x in logits]
    assert per_exit.tolist() == pytest.approx([v.item() for v in by_hand])
    assert loss.item() == pytest.approx(sum(s * v.item() for s, v in zip(scales.tolist(), by_hand)))
    assert torch.autograd.gradcheck(lambda a, b, c: early_exit_loss([a, b, c], labels, scales)[0], tuple(logits))
    # bf16 logits are computed in fp32.
    low, _ = early_exit_loss([x.detach().bfloat16() for x in logits], labels, scales)
    assert low.dtype == torch.float32


def test_exit_agreement_is_top1_match_and_one_minus_tvd():
    gen = torch.Generator().manual_seed(1)
    draft, full = torch.randn(5, 9, generator=gen), torch.randn(5, 9, generator=gen)
    agree, accept = exit_agreement(draft, full)
    assert agree.tolist() == (draft.argmax(-1) == full.argmax(-1)).tolist()
    # The acceptance probability of one speculative-sampling step: sum_v min(p_v, q_v).
    p, q = torch.softmax(full, -1), torch.softmax(draft, -1)
    assert accept.tolist() == pytest.approx(torch.minimum(p, q).sum(-1).tolist(), abs=1e-6)
    assert exit_agreement(full, full)[1].tolist() == pytest.approx([1.0] * 5)


def test_modeled_speedup_and_the_exit_it_ranks_first():
    assert expected_chain_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_chain_tokens(1.0, 4) == 5
    assert modeled_speedup(0.5, 8, 32, 4) == pytest.approx(expected_chain_tokens(0.5, 4) / 2.0)
    # A deeper exit wins only when it agrees enough more to pay for the layers it drafts with.
    assert best_exit([1, 2, 3, 4, 5], [0.1, 0.6, 0.62, 0.64, 0.99], 6, 4) == 5
    assert best_exit([1, 2, 3, 4, 5], [0.1, 0.6, 0.62, 0.64, 0.9], 6, 4) == 2
    assert best_exit([3, 5], [0.75, 0.9], 6, 4) == 3 and best_exit([3, 5], [0.7, 0.9], 6, 4) == 5
