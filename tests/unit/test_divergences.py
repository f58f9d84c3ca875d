"""Divergences: closed forms, identities, limits, gradients, masking."""

import math

import pytest
import torch
from torch.distributions import Categorical, kl_divergence

from draftsmith.distill import DIVERGENCES, distillation_loss, forward_kl, jsd, masked_mean, reverse_kl, tvd

# (name, extra params): every divergence, jsd at an asymmetric beta as well.
CASES = [("fkl", {}), ("rkl", {}), ("jsd", {}), ("jsd", {"beta": 0.2}), ("tvd", {})]


def _logits(*shape, seed=0, scale=2.0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype) * scale


def test_registry_is_the_four_divergences():
    assert DIVERGENCES == {"fkl": forward_kl, "rkl": reverse_kl, "jsd": jsd, "tvd": tvd}


@pytest.mark.parametrize("name,params", CASES)
def test_gradcheck_float64(name, params):
    fn = DIVERGENCES[name]
    draft = _logits(2, 3, 5, seed=1).requires_grad_()
    target = _logits(2, 3, 5, seed=2).requires_grad_()
    assert torch.autograd.gradcheck(lambda d, t: fn(d, t, 0.7, **params), (draft, target))


@pytest.mark.parametrize("name,params", CASES)
def test_shape_and_zero_on_equal_inputs(name, params):
    fn = DIVERGENCES[name]
    logits = _logits(2, 4, 7, seed=3)
    out = fn(logits, logits.clone(), **params)
    assert out.shape == (2, 4)
    torch.testing.assert_close(out, torch.zeros(2, 4, dtype=torch.float64), atol=1e-12, rtol=0)
    # ...and strictly positive on different inputs, so the zero above is not a constant.
    assert (fn(logits, _logits(2, 4, 7, seed=4), **params) > 1e-6).all()


def test_forward_kl_is_kl_target_to_draft():
    draft, target = _logits(3, 5, 11, seed=5), _logits(3, 5, 11, seed=6)
    expected = kl_divergence(Categorical(logits=target), Categorical(logits=draft))
    torch.testing.assert_close(forward_kl(draft, target), expected)
    torch.testing.assert_close(reverse_kl(draft, target), kl_divergence(Categorical(logits=draft), Categorical(logits=target)))
    # The two directions really differ on these inputs: argument order matters.
    assert (forward_kl(draft, target) - reverse_kl(draft, target)).abs().max() > 1e-3


def test_small_case_by_hand():
    q = torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64)  # draft
    p = torch.tensor([0.25, 0.25, 0.5], dtype=torch.float64)  # target
    d, t = q.log(), p.log()
    ln2 = math.log(2.0)
    # KL(p||q) = .25 ln(.5) + 0 + .5 ln(2) = .25 ln 2; KL(q||p) = .5 ln 2 + 0 + .25 ln(.5) = .25 ln 2.
    assert forward_kl(d, t).item() == pytest.approx(0.25 * ln2, rel=1e-12)
    assert reverse_kl(d, t).item() == pytest.approx(0.25 * ln2, rel=1e-12)
    assert tvd(d, t).item() == pytest.approx(0.25, rel=1e-12)
    # m = [.375, .25, .375]: JSD(.5) = .5 * (.25 ln(2/3) + .5 ln(4/3)) + .5 * (.5 ln(4/3) + .25 ln(2/3)).
    expected = 0.25 * math.log(2 / 3) + 0.5 * math.log(4 / 3)
    assert jsd(d, t).item() == pytest.approx(expected, rel=1e-12)


def test_jsd_limits_recover_the_two_kls():
    draft, target = _logits(2, 3, 9, seed=7), _logits(2, 3, 9, seed=8)
    eps = 1e-6
    torch.testing.assert_close(jsd(draft, target, beta=eps) / eps, forward_kl(draft, target), rtol=1e-4, atol=0)
    torch.testing.assert_close(jsd(draft, target, beta=1 - eps) / eps, reverse_kl(draft, target), rtol=1e-4, atol=0)
    # Not the other way round: the limits really pick out one direction each.
    assert not torch.allclose(jsd(draft, target, beta=eps) / eps, reverse_kl(draft, target), rtol=1e-2)


def test_jsd_mirror_symmetry_and_bound():
    a, b = _logits(4, 6, seed=9, scale=5.0), _logits(4, 6, seed=10, scale=5.0)
    torch.testing.assert_close(jsd(a, b, beta=0.3), jsd(b, a, beta=0.7))
    # Disjoint supports reach the log 2 bound of the symmetric JSD.
    far = torch.tensor([[0.0, -1e4], [-1e4, 0.0]], dtype=torch.float64)
    assert jsd(far[0], far[1]).item() == pytest.approx(math.log(2.0), rel=1e-9)
    assert (jsd(a, b) <= math.log(2.0)).all()
    with pytest.raises(ValueError):
        jsd(a, b, beta=0.0)


def test_tvd_is_one_minus_overlap():
    draft, target = _logits(3, 4, 13, seed=11), _logits(3, 4, 13, seed=12)
    q, p = draft.softmax(-1), target.softmax(-1)
    torch.testing.assert_close(tvd(draft, target), 1 - torch.minimum(p, q).sum(-1))


@pytest.mark.parametrize("seed", [13, 14, 15])
def test_one_minus_tvd_is_speculative_acceptance_probability(seed):
    """Simulate standard speculative sampling of one token: x ~ q, accept with min(1, p(x)/q(x))."""
    draft, target = _logits(6, seed=seed, scale=1.5), _logits(6, seed=seed + 100, scale=1.5)
    q, p = draft.softmax(-1), target.softmax(-1)
    n = 200_000
    g = torch.Generator().manual_seed(seed)
    x = torch.multinomial(q, n, replacement=True, generator=g)
    u = torch.rand(n, generator=g, dtype=torch.float64)
    accepted = (u < (p[x] / q[x]).clamp(max=1.0)).double().mean().item()
    alpha = 1 - tvd(draft, target).item()
    # Five binomial standard deviations: a false failure has probability below 1e-6.
    bound = 5 * math.sqrt(alpha * (1 - alpha) / n)
    assert abs(accepted - alpha) < bound, (accepted, alpha, bound)
    # The bound is tight enough to tell 1 - TVD from nearby wrong answers (half the TVD).
    assert abs(accepted - (1 - tvd(draft, target).item() / 2)) > bound


@pytest.mark.parametrize("name,params", CASES)
def test_temperature_divides_both_logits(name, params):
    fn = DIVERGENCES[name]
    draft, target = _logits(2, 3, 8, seed=16), _logits(2, 3, 8, seed=17)
    temp = 2.5
    torch.testing.assert_close(fn(draft, target, temp, **params), fn(draft / temp, target / temp, 1.0, **params))
    # Scaling only one side gives something else.
    assert not torch.allclose(fn(draft, target, temp, **params), fn(draft / temp, target, 1.0, **params))
    assert not torch.allclose(fn(draft, target, temp, **params), fn(draft, target / temp, 1.0, **params))
    with pytest.raises(ValueError):
        fn(draft, target, 0.0, **params)


@pytest.mark.parametrize("name,params", CASES)
def test_masked_vocabulary_is_finite_and_equals_the_reduced_vocabulary(name, params):
    fn = DIVERGENCES[name]
    draft = _logits(2, 3, 6, seed=18).requires_grad_()
    target = _logits(2, 3, 6, seed=19).requires_grad_()
    banned = torch.tensor([False, True, False, False, True, False])
    d = draft.masked_fill(banned, float("-inf"))
    t = target.masked_fill(banned, torch.finfo(torch.float64).min)  # HF writes finfo.min, not -inf
    out = fn(d, t, **params)
    assert torch.isfinite(out).all()
    out.sum().backward()
    assert torch.isfinite(draft.grad).all() and torch.isfinite(target.grad).all()
    assert (draft.grad[..., banned] == 0).all()
    torch.testing.assert_close(out, fn(draft[..., ~banned], target[..., ~banned], **params))


def test_fully_masked_rows_do_not_poison_the_batch():
    draft = _logits(2, 3, 5, seed=20).requires_grad_()
    target = _logits(2, 3, 5, seed=21)
    pad = torch.tensor([[False, False, True], [False, True, True]])
    d = draft.masked_fill(pad.unsqueeze(-1), float("-inf"))
    t = target.masked_fill(pad.unsqueeze(-1), float("-inf"))
    loss = masked_mean(forward_kl(d, t), ~pad)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(draft.grad).all()
    assert (draft.grad[pad] == 0).all()
    torch.testing.assert_close(loss, forward_kl(draft, target)[~pad].mean())


def test_masked_mean_ignores_masked_positions():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [0, 1, 0]])
    out = masked_mean(loss, mask)
    assert out.item() == pytest.approx((1 + 2 + 5) / 3)
    out.backward()
    torch.testing.assert_close(loss.grad, mask.double() / 3)
    # Whatever sits at the masked positions (even inf and NaN) changes nothing.
    other = loss.detach().clone()
    other[mask == 0] = torch.tensor([float("inf"), float("nan"), -1e30], dtype=torch.float64)
    assert masked_mean(other, mask.bool()).item() == out.item()
    # The mask is not ignored altogether: unmasking a position changes the mean.
    assert masked_mean(loss, torch.ones_like(mask)).item() != out.item()
    empty = masked_mean(loss, torch.zeros_like(mask))
    assert empty.item() == 0.0 and empty.requires_grad


def test_distillation_loss_dispatches_by_name():
    draft, target = _logits(2, 3, 5, seed=22), _logits(2, 3, 5, seed=23)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    for name, params in CASES:
        expected = masked_mean(DIVERGENCES[name](draft, target, 1.3, **params), mask)
        torch.testing.assert_close(distillation_loss(name, draft, target, mask, 1.3, **params), expected)
    with pytest.raises(KeyError, match="tvdpp"):
        distillation_loss("kl", draft, target, mask)
    with pytest.raises(ValueError, match="sampled_tokens"):
        distillation_loss("tvdpp", draft, target, mask)
    with pytest.raises(ValueError, match="sampled_tokens"):
        distillation_loss("fkl", draft, target, mask, sampled_tokens=torch.zeros(2, 3, dtype=torch.long))


def test_low_precision_inputs_compute_in_fp32():
    draft, target = _logits(2, 3, 5, seed=24, dtype=torch.float32), _logits(2, 3, 5, seed=25, dtype=torch.float32)
    out = forward_kl(draft.bfloat16(), target.bfloat16())
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, forward_kl(draft.bfloat16().float(), target.bfloat16().float()))
