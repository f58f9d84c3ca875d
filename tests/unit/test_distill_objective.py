"""The distill trainer's objective dispatch and position alignment, on random tensors."""

import pytest
import torch

from draftsmith.distill import DIVERGENCES, masked_mean
from draftsmith.recipe import DistillConfig, Recipe
from draftsmith.trainers.distill import common_vocab, distill_objective, predicted_mask


def recipe_with(divergence: str, **distill) -> Recipe:
    recipe = Recipe(output_dir="unused", trainer="distill", distill=DistillConfig())
    recipe.distill.divergence = divergence
    for key, value in distill.items():
        setattr(recipe.distill, key, value)
    return recipe


@pytest.mark.parametrize("name", ["fkl", "rkl", "jsd", "tvd"])
def test_objective_is_the_masked_mean_of_the_named_divergence(name):
    torch.manual_seed(0)
    q, p = torch.randn(2, 5, 11), torch.randn(2, 5, 11)
    mask = torch.tensor([[1, 1, 0, 1, 0], [0, 1, 1, 1, 1]])
    params = {"beta": 0.3} if name == "jsd" else {}
    got = distill_objective(recipe_with(name, beta=0.3, temperature=2.0), q, p, mask)
    want = masked_mean(DIVERGENCES[name](q, p, 2.0, **params), mask)
    assert torch.allclose(got, want)


def test_tvdpp_gradient_points_down_the_tvd():
    # Averaged over many draws, the TVD++ step decreases the TVD (its expected gradient is
    # a positive multiple of dTVD per position).
    torch.manual_seed(0)
    p = torch.randn(1, 64, 7)
    q = torch.randn(1, 64, 7, requires_grad=True)
    mask = torch.ones(1, 64)
    grad = torch.zeros_like(q)
    for _ in range(200):
        (g,) = torch.autograd.grad(distill_objective(recipe_with("tvdpp"), q, p, mask), q)
        grad += g
    tvd = DIVERGENCES["tvd"]
    before = masked_mean(tvd(q, p), mask)
    # The loss is a mean over 64 positions, so each position's gradient carries a 1/64 factor.
    after = masked_mean(tvd(q - 30.0 * grad / 200, p), mask)
    assert after < before - 0.02, (before, after)


def test_predicted_mask_shifts_and_stops_at_example_boundaries():
    loss_mask = torch.tensor([[0, 0, 1, 1, 0, 1, 1]])
    segments = torch.tensor([[1, 1, 1, 1, 2, 2, 2]])
    # logits at t predict token t+1: trained when token t+1 is an answer token of the same example
    assert predicted_mask(loss_mask).tolist() == [[False, True, True, False, True, True]]
    assert predicted_mask(loss_mask, segments).tolist() == [[False, True, True, False, True, True]]
    loss_mask = torch.tensor([[0, 1, 1, 1]])
    segments = torch.tensor([[1, 1, 2, 2]])
    assert predicted_mask(loss_mask, segments).tolist() == [[True, False, True]]


def test_common_vocab_cuts_padded_rows():
    a, b = torch.randn(1, 2, 10), torch.randn(1, 2, 12)
    x, y = common_vocab(a, b)
    assert x.shape == y.shape == (1, 2, 10) and torch.equal(y, b[..., :10])
