"""EAGLE heads: the drafter's cache keeps decided positions only; the loss trains only the head;
bad configurations fail in one line. That the training forward (teacher-forced tokens,
training-time-test attention) computes what the runtime drafts is the head contract's
(test_head_contract.py)."""

import pytest
import torch

from draftsmith.heads import HEADS
from draftsmith.heads.base import TargetFeatures
from draftsmith.heads.eagle import EagleConfig, EagleHead
from draftsmith.runtime.drafters import DrafterError, DraftState, HeadDrafter
from draftsmith.runtime.tree import DynamicTreeSpec, TreeSpec
from draftsmith.target import FrozenTarget
from draftsmith.testing import tiny_causal_lm


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    return FrozenTarget(tiny_causal_lm("llama", vocab_size=40, hidden_size=32, num_layers=3, seed=0))


def random_head(target, **cfg) -> EagleHead:
    torch.manual_seed(1)
    head = EagleHead(EagleConfig(**cfg), target.dims)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.3)  # far from the identity-ish init: every path matters
    return head.eval()


def test_registered():
    assert HEADS["eagle"] is EagleHead


def test_accept_drops_the_tree_and_the_next_step_continues(target):
    head = random_head(target, depth=2)
    drafter = HeadDrafter(head, target, DynamicTreeSpec(depth=2, topk=3, budget=5))
    prompt = torch.randint(3, 40, (1, 6), generator=torch.Generator().manual_seed(4))
    feats = target.features(prompt)
    drafter.reset(prompt)
    tree = drafter.propose(DraftState(tokens=prompt, new_hidden=feats.final_hidden[:, :5]))
    assert tree.size == 6 and drafter.session.caches[0]["k"].shape[2] > 5
    from draftsmith.runtime.verify import verify_greedy

    result = verify_greedy(tree, target.lm_head(torch.zeros(1, tree.size, 32)))
    drafter.accept(result)
    assert drafter.session.caches[0]["k"].shape[2] == 5 == drafter.session.decided
    with pytest.raises(DrafterError, match="holds 5 positions but the state continues at 2"):
        drafter.propose(DraftState(tokens=prompt, new_hidden=feats.final_hidden[:, :3]))


def test_loss_reaches_only_the_head_and_counts_steps(target):
    head = random_head(target, depth=3, train_depth=2).train()
    ids = torch.randint(3, 40, (2, 12), generator=torch.Generator().manual_seed(5))
    feats = target.features(ids)
    mask = torch.ones_like(ids)
    mask[:, :4] = 0
    loss, stats = head.loss(feats, mask)
    loss.backward()
    assert stats["count"].tolist() == [2 * 8, 2 * 8]  # labels x_{t+2} (t = 2..9), x_{t+3} (t = 1..8) on trained tokens
    assert all(p.grad is not None for p in head.parameters())
    assert not any(p.requires_grad for p in target.model.parameters())
    assert not set(head.state_dict()) & {f"target.{k}" for k in target.model.state_dict()}


def test_bad_configurations_fail_in_one_line(target):
    with pytest.raises(ValueError, match=r"'head.train_depth' must be in \[1, head.depth=2\], got 3"):
        EagleHead(EagleConfig(depth=2, train_depth=3), target.dims)
    with pytest.raises(ValueError, match="'head.num_key_value_heads'=3 must divide head.num_attention_heads=4"):
        EagleHead(EagleConfig(num_attention_heads=4, num_key_value_heads=3), target.dims)
    with pytest.raises(DrafterError, match="the tree is 3 deep but the eagle head drafts 2 tokens"):
        HeadDrafter(random_head(target, depth=2), target, TreeSpec.chain(3))


def test_features_keep_the_padding_out(target):
    """Left padding (attention_mask 0) changes nothing for the real positions."""
    head = random_head(target, depth=2)
    ids = torch.randint(3, 40, (1, 7), generator=torch.Generator().manual_seed(6))
    padded = torch.cat([torch.zeros(1, 3, dtype=ids.dtype), ids], dim=1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 7, dtype=torch.long)], dim=1)
    plain = target.features(ids)
    feats = target.features(padded, attention_mask=mask)
    padded_feats = TargetFeatures(
        input_ids=padded, attention_mask=mask, logits=None, hidden={},
        final_hidden=torch.cat([feats.final_hidden[:, :3], plain.final_hidden], dim=1),
        embed=target.embed, lm_head=target.lm_head,
    )  # fmt: skip
    with torch.no_grad():
        a, b = head(plain), head(padded_feats)
    assert torch.allclose(a[0, :, 0], b[0, 3:, 0], atol=1e-5)


def test_top_tokens_match_the_full_logits(target):
    from draftsmith.heads.medusa import MedusaConfig, MedusaHead

    ids = torch.randint(3, 40, (2, 10), generator=torch.Generator().manual_seed(7))
    feats = target.features(ids)
    medusa = MedusaHead(MedusaConfig(num_heads=3, lm_head="own"), target.dims)
    for head in (random_head(target, depth=3, num_layers=2), medusa.eval()):
        with torch.no_grad():
            assert torch.equal(head.top_tokens(feats, 5), head(feats).topk(5, dim=-1).indices), type(head).__name__
