"""Hydra heads: a fresh head is Medusa's (the target's own next-token logits) and the Hydra++
teacher loss is the soft cross-entropy against the target's distribution. That the training
forward computes what the runtime drafts is the head contract's (test_head_contract.py)."""

import pytest
import torch

from draftsmith.heads import HEADS
from draftsmith.heads.hydra import HydraConfig, HydraHead
from draftsmith.runtime.drafters import DrafterError, HeadDrafter
from draftsmith.runtime.tree import TreeSpec
from draftsmith.target import FrozenTarget
from draftsmith.testing import tiny_causal_lm


@pytest.fixture(scope="module")
def target():
    return FrozenTarget(tiny_causal_lm("llama", vocab_size=40, hidden_size=32, num_layers=2, seed=0))


def random_head(target, **cfg) -> HydraHead:
    torch.manual_seed(2)
    head = HydraHead(HydraConfig(**cfg), target.dims)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return head.eval()


def test_registered_and_a_fresh_head_is_the_targets_next_token(target):
    assert HEADS["hydra"] is HydraHead
    head = HydraHead(HydraConfig(num_heads=3, num_layers=2), target.dims)
    ids = torch.randint(3, 40, (2, 8), generator=torch.Generator().manual_seed(1))
    feats = target.features(ids)
    with torch.no_grad():
        logits = head(feats)
    for k in range(3):
        assert torch.allclose(logits[:, :, k], feats.logits, atol=1e-5)


def test_teacher_loss_is_the_soft_cross_entropy_against_the_target(target):
    head = random_head(target, num_heads=2, teacher=True).train()
    ids = torch.randint(3, 40, (2, 10), generator=torch.Generator().manual_seed(4))
    feats = target.features(ids)
    mask = torch.ones_like(ids)
    loss, stats = head.loss(feats, mask)
    with torch.no_grad():
        logits = head(feats)  # [B,T,K,V]
        expected = []
        for k in (1, 2):
            draft = torch.log_softmax(logits[:, : 10 - 1 - k, k - 1], dim=-1)
            teacher = torch.softmax(feats.logits[:, k : 10 - 1], dim=-1)
            expected.append(-(teacher * draft).sum(-1).mean())
    assert torch.allclose(stats["ce"], torch.stack(expected), atol=1e-5)
    weights = torch.tensor([1.0, 0.8])
    assert torch.allclose(loss, (weights * torch.stack(expected)).sum() / weights.sum(), atol=1e-5)


def test_too_deep_a_tree_is_refused(target):
    with pytest.raises(DrafterError, match="the hydra head drafts 2 tokens"):
        HeadDrafter(random_head(target, num_heads=2), target, TreeSpec.chain(3))
