"""TVD++: a hand-computed case, and exact expectations of the estimator by enumeration."""

import itertools
import math

import pytest
import torch

from draftsmith.distill import SAMPLED_OBJECTIVES, distillation_loss, masked_mean, tvd
from draftsmith.distill.tvdpp import normalized_advantage, sample_draft_tokens, tvd_reward, tvdpp_loss


def _logits(*shape, seed, scale=1.5):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64) * scale


def test_registered_as_a_sampled_objective():
    assert SAMPLED_OBJECTIVES == {"tvdpp": tvdpp_loss}


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_hand_computed_case(temperature):
    # Three positions, V = 3; the last position is padding. Logits are T * log(probs), so the
    # tempered distributions are exactly these numbers whatever the temperature.
    q = torch.tensor([[0.5, 0.25, 0.25], [0.5, 0.25, 0.25], [0.2, 0.3, 0.5]], dtype=torch.float64)
    p = torch.tensor([[0.25, 0.25, 0.5], [0.25, 0.25, 0.5], [0.6, 0.2, 0.2]], dtype=torch.float64)
    draft = (temperature * q.log()).unsqueeze(0).requires_grad_()
    target = (temperature * p.log()).unsqueeze(0).requires_grad_()
    tokens = torch.tensor([[2, 0, 1]])
    mask = torch.tensor([[True, True, False]])

    # Rewards 1{p(x) > q(x)}: position 0 drew x=2 (.5 > .25) -> 1; position 1 drew x=0 (.25 < .5) -> 0.
    reward = tvd_reward(draft, target, tokens, temperature)
    assert reward[0, :2].tolist() == [1.0, 0.0]
    # Over the two valid tokens: mean .5, population std .5 -> advantages +1 and -1.
    adv = normalized_advantage(reward, mask)
    assert adv.tolist() == [[1.0, -1.0, 0.0]]

    # loss = -(1/2) * (A0 log q0(2) + A1 log q1(0)) = -(1/2) * (log .25 - log .5) = (1/2) log 2.
    loss = tvdpp_loss(draft, target, tokens, mask, temperature)
    assert loss.item() == pytest.approx(0.5 * math.log(2.0), rel=1e-12)

    # d loss / d z_ik = -(1/N) * A_i * (1{k = x_i} - q_i(k)) / T:
    #   position 0: -(1/2) * (+1) * ([0, 0, 1] - [.5, .25, .25]) = [.25, .125, -.375]
    #   position 1: -(1/2) * (-1) * ([1, 0, 0] - [.5, .25, .25]) = [.25, -.125, -.125]
    #   position 2: masked -> 0
    loss.backward()
    expected = torch.tensor([[[0.25, 0.125, -0.375], [0.25, -0.125, -0.125], [0.0, 0.0, 0.0]]], dtype=torch.float64)
    torch.testing.assert_close(draft.grad, expected / temperature, rtol=1e-12, atol=1e-15)
    # The reward is a constant: nothing flows into the target.
    assert target.grad is None or (target.grad == 0).all()
    # A descent step moves the draft toward the target at both valid positions.
    stepped = draft.detach() - 0.5 * draft.grad
    before = tvd(draft.detach(), target.detach(), temperature)[0, :2]
    after = tvd(stepped, target.detach(), temperature)[0, :2]
    assert (after < before).all()


def _exact_expected_grad(loss_fn, draft, target, mask):
    """E over x_i ~ q_i (independent per valid position) of d loss_fn(x) / d draft, by enumeration.

    draft, target: [1, N, V]; mask: [1, N]. Masked positions keep token 0 (they must not matter)."""
    q = draft.softmax(-1)
    valid = mask[0].nonzero().flatten()
    total = torch.zeros_like(draft)
    for combo in itertools.product(range(draft.shape[2]), repeat=len(valid)):
        tokens = torch.zeros(1, draft.shape[1], dtype=torch.long)
        tokens[0, valid] = torch.tensor(combo)
        weight = q[0, valid, tokens[0, valid]].prod()
        d = draft.clone().requires_grad_()
        loss_fn(d, target, tokens, mask).backward()
        total += weight * d.grad
    return total


def _true_grad(draft, target, mask):
    d = draft.clone().requires_grad_()
    masked_mean(tvd(d, target), mask).backward()
    return d.grad


def test_plain_reinforce_with_the_tvd_reward_is_the_exact_tvd_gradient():
    """dTVD = -E_{x~q}[1{p(x) > q(x)} dlog q(x)]: checks the reward and the sign."""
    draft, target = _logits(1, 3, 4, seed=1), _logits(1, 3, 4, seed=2)
    mask = torch.ones(1, 3, dtype=torch.bool)

    def reinforce(d, t, tokens, m):
        log_q = d.log_softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        return -masked_mean(tvd_reward(d, t, tokens) * log_q, m)

    torch.testing.assert_close(_exact_expected_grad(reinforce, draft, target, mask), _true_grad(draft, target, mask))


def test_tvdpp_with_two_tokens_is_exactly_the_tvd_gradient_in_expectation():
    draft, target = _logits(1, 2, 4, seed=3), _logits(1, 2, 4, seed=4)
    mask = torch.ones(1, 2, dtype=torch.bool)
    expected = _exact_expected_grad(tvdpp_loss, draft, target, mask)
    true = _true_grad(draft, target, mask)
    assert true.abs().max() > 1e-3
    torch.testing.assert_close(expected, true)


@pytest.mark.parametrize("seed", [5, 6])
def test_tvdpp_expected_gradient_is_parallel_to_tvd_gradient_at_every_position(seed):
    # Four valid tokens plus one masked position that must neither move nor count in the stats.
    draft, target = _logits(1, 5, 3, seed=seed), _logits(1, 5, 3, seed=seed + 50)
    mask = torch.tensor([[True, True, False, True, True]])
    expected = _exact_expected_grad(tvdpp_loss, draft, target, mask)
    true = _true_grad(draft, target, mask)
    assert (expected[0, 2] == 0).all()
    for i in (0, 1, 3, 4):
        e, t = expected[0, i], true[0, i]
        scale = (e @ t) / (t @ t)
        assert scale > 0.1  # same direction, not the opposite one
        torch.testing.assert_close(e, scale * t, rtol=0, atol=1e-12)


def test_masked_positions_do_not_change_the_loss():
    draft, target = _logits(2, 4, 5, seed=7), _logits(2, 4, 5, seed=8)
    mask = torch.tensor([[True, True, True, False], [True, False, True, True]])
    tokens = sample_draft_tokens(draft, generator=torch.Generator().manual_seed(0))
    loss = tvdpp_loss(draft, target, tokens, mask)
    d2, t2, x2 = draft.clone(), target.clone(), tokens.clone()
    d2[~mask] = _logits(2, 5, seed=9)
    t2[~mask] = float("-inf")
    x2[~mask] = (x2[~mask] + 1) % 5
    assert tvdpp_loss(d2, t2, x2, mask).item() == loss.item()
    assert tvdpp_loss(draft, target, tokens, torch.ones_like(mask)).item() != loss.item()


def test_matched_draft_gets_no_update():
    logits = _logits(2, 3, 6, seed=10).requires_grad_()
    tokens = sample_draft_tokens(logits)
    loss = tvdpp_loss(logits, logits.detach().clone(), tokens, torch.ones(2, 3))
    loss.backward()
    assert loss.item() == 0.0 and (logits.grad == 0).all()


def test_gradcheck_float64():
    draft = _logits(2, 3, 5, seed=11).requires_grad_()
    target = _logits(2, 3, 5, seed=12)
    tokens = sample_draft_tokens(draft, 0.8, generator=torch.Generator().manual_seed(1))
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    assert torch.autograd.gradcheck(lambda d: tvdpp_loss(d, target, tokens, mask, 0.8), (draft,))


def test_sampler_draws_from_the_tempered_draft():
    logits = torch.tensor([[[2.0, 0.0, -1.0, float("-inf")]]])
    temp = 1.7
    g = torch.Generator().manual_seed(0)
    n = 20_000
    draws = torch.cat([sample_draft_tokens(logits.expand(n, 1, 4), temp, generator=g)]).flatten()
    freq = torch.bincount(draws, minlength=4).double() / n
    probs = (logits[0, 0] / temp).softmax(-1).double()
    assert freq[3] == 0
    assert ((freq - probs).abs() < 5 * (probs * (1 - probs) / n).sqrt() + 1e-12).all()


def test_selected_by_name():
    draft, target = _logits(1, 3, 4, seed=13), _logits(1, 3, 4, seed=14)
    tokens = torch.tensor([[0, 3, 1]])
    mask = torch.ones(1, 3)
    torch.testing.assert_close(
        distillation_loss("tvdpp", draft, target, mask, 1.2, sampled_tokens=tokens),
        tvdpp_loss(draft, target, tokens, mask, 1.2),
    )
