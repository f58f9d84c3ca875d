"""Medusa heads: distinct blocks, identity start, depth labels, and no target weights inside."""

import torch

from draftsmith.heads import HEADS, MedusaConfig, MedusaHead
from draftsmith.heads.base import DraftHead, depth_labels
from draftsmith.target import FrozenTarget
from draftsmith.testing import tiny_causal_lm


def _target():
    return FrozenTarget(tiny_causal_lm("llama", vocab_size=40, hidden_size=32))


def test_registry_lists_medusa():
    assert HEADS["medusa"] is MedusaHead and MedusaHead.config_class is MedusaConfig


def test_blocks_are_distinct_tensors():
    target = _target()
    head = MedusaHead(MedusaConfig(num_heads=3, num_layers=2, lm_head="own"), target.dims)
    ptrs = [p.data_ptr() for p in head.parameters()]
    assert len(ptrs) == len(set(ptrs)) == 3 * 2 * 2 + 3
    # Training one block's weight must not move another's.
    head.blocks[0].layers[0].weight.data.fill_(1.0)
    assert head.blocks[1].layers[0].weight.abs().sum() == 0
    assert head.blocks[0].layers[1].weight.abs().sum() == 0


def test_fresh_head_predicts_like_the_target_lm_head():
    target = _target()
    ids = torch.randint(0, 40, (2, 7))
    feats = target.features(ids)
    for mode in ("own", "target"):
        head = MedusaHead(MedusaConfig(num_heads=2, lm_head=mode), target.dims)
        head.init_from_target(target)
        logits = head(feats)
        assert logits.shape == (2, 7, 2, 40)
        for k in range(2):
            torch.testing.assert_close(logits[:, :, k], feats.logits)


def test_no_target_weights_in_head_state():
    target = _target()
    head = MedusaHead(MedusaConfig(num_heads=2, lm_head="target"), target.dims)
    target_ptrs = {p.data_ptr() for p in target.model.parameters()}
    state = head.runtime_state_dict()
    assert not any(v.data_ptr() in target_ptrs for v in state.values())
    assert all(v.shape[-1] == 32 for v in state.values())  # no [V, D] LM head copy
    own = MedusaHead(MedusaConfig(num_heads=2, lm_head="own"), target.dims)
    own.init_from_target(target)
    assert not any(v.data_ptr() in target_ptrs for v in own.runtime_state_dict().values())


def test_depth_labels_by_hand():
    ids = torch.tensor([[10, 11, 12, 13, 14]])
    mask = torch.tensor([[0, 0, 1, 1, 1]])
    labels, valid = depth_labels(ids, mask, depth=2)
    # depth 1 at t predicts x_{t+2}; depth 2 predicts x_{t+3}
    assert labels[0, :, 0].tolist() == [12, 13, 14, 0, 0]
    assert valid[0, :, 0].tolist() == [True, True, True, False, False]
    assert labels[0, :, 1].tolist() == [13, 14, 0, 0, 0]
    assert valid[0, :, 1].tolist() == [True, True, False, False, False]
    seg = torch.tensor([[1, 1, 1, 2, 2]])
    _, valid = depth_labels(ids, mask, depth=2, segment_ids=seg)
    assert valid[0, :, 0].tolist() == [True, False, False, False, False]


def test_gathered_medusa_loss_equals_generic_loss():
    torch.manual_seed(0)
    target = _target()
    ids = torch.randint(0, 40, (3, 9))
    mask = (torch.rand(3, 9) > 0.4).long()
    feats = target.features(ids)
    for mode in ("own", "target"):
        head = MedusaHead(MedusaConfig(num_heads=3, lm_head=mode), target.dims)
        for p in head.parameters():
            torch.nn.init.normal_(p, std=0.2)
        fast, stats = head.loss(feats, mask)
        slow, ref = DraftHead.loss(head, feats, mask)
        torch.testing.assert_close(fast, slow)
        torch.testing.assert_close(stats["top1"], ref["top1"])
