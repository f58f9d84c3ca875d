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


def test_label_weights_shift_as_the_labels_do_and_weight_the_mean():
    """depth_label_weights puts token j's weight where depth_labels puts token j as a label; a
    weight of 0 removes a position from its depth's mean, equal weights change nothing."""
    from draftsmith.heads.base import depth_label_weights, depth_loss

    ids = torch.tensor([[10, 11, 12, 13, 14, 15]])
    weights = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.5, 0.6]])
    labels, valid = depth_labels(ids, None, depth=2)
    shifted = depth_label_weights(weights, 2)
    # Wherever a label is valid its weight is that of the same token: token id - 10 indexes weights.
    assert torch.equal(shifted[valid], weights[0, labels[valid] - 10])
    assert shifted[~valid].eq(0).all()

    torch.manual_seed(0)
    logits = torch.randn(1, 6, 2, 20)
    at = lambda k, rows: logits[..., k - 1, :][rows]  # noqa: E731
    plain, _ = depth_loss(labels, valid, torch.ones(2), at)
    ones, _ = depth_loss(labels, valid, torch.ones(2), at, label_weights=torch.ones(1, 6, 2))
    torch.testing.assert_close(ones, plain)
    # Token 13 weighted 0: the positions labelled 13 drop out; the rest average as before.
    drop = torch.ones(1, 6)
    drop[0, 3] = 0.0
    weighted, _ = depth_loss(labels, valid, torch.ones(2), at, label_weights=depth_label_weights(drop, 2))
    kept = valid & (labels != 13)
    without, _ = depth_loss(labels, kept, torch.ones(2), at)
    torch.testing.assert_close(weighted, without)
    assert not torch.isclose(weighted, plain)


def test_eagle3_takes_token_weights_and_refuses_bad_lookup_keys():
    import pytest

    from draftsmith.heads.eagle3 import Eagle3Config, Eagle3Head

    target = FrozenTarget(tiny_causal_lm("llama", seed=0))
    head = Eagle3Head(Eagle3Config(depth=2, train_depth=2, draft_vocab_size=64, aux_layer_ids=[1, 2, 3]), target.dims)
    head.init_from_target(target)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    features = target.features(ids, torch.ones_like(ids), layers=head.required_layers())
    mask = torch.ones_like(ids)
    plain, _ = head.loss(features, mask)
    same, _ = head.loss(features, mask, token_weights=torch.ones(2, 12))
    torch.testing.assert_close(same, plain)
    half = torch.ones(2, 12)
    half[:, ::2] = 0.25
    assert not torch.isclose(head.loss(features, mask, token_weights=half)[0], plain)
    with pytest.raises(ValueError, match="head.lookup_hit_weight"):
        Eagle3Config(lookup_hit_weight=1.5).check()
    with pytest.raises(ValueError, match="head.lookup_matcher"):
        Eagle3Config(lookup_matcher="ngram").check()
