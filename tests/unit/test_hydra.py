"""Hydra heads: the reference's Hydra++ layout (nonlinearity over the whole concatenation, a prefix
layer with a final norm, 4 MLP layers, NEFTune noise), a fresh plain head is Medusa's (the target's
own next-token logits), and the loss is the token cross-entropy plus the teacher's soft
cross-entropy. That the training forward computes what the runtime drafts is the head contract's
(test_head_contract.py)."""

import pytest
import torch
import torch.nn.functional as F

from draftsmith.heads import HEADS
from draftsmith.heads.hydra import ConcatBlock, HydraConfig, HydraHead, neftune_noise
from draftsmith.runtime.drafters import DrafterError, HeadDrafter
from draftsmith.runtime.tree import TreeSpec
from draftsmith.target import FrozenTarget
from draftsmith.testing import tiny_causal_lm

D = 32


@pytest.fixture(scope="module")
def target():
    return FrozenTarget(tiny_causal_lm("llama", vocab_size=40, hidden_size=D, num_layers=2, seed=0))


def random_head(target, **cfg) -> HydraHead:
    torch.manual_seed(2)
    head = HydraHead(HydraConfig(**cfg), target.dims)
    head.init_from_target(target)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return head.eval()


def test_defaults_are_hydra_plus_plus(target):
    cfg = HydraConfig()
    assert (cfg.num_layers, cfg.lm_head, cfg.prefix_attention, cfg.token_weight, cfg.teacher_weight) == (4, "own", True, 1.0, 1.0)
    assert cfg.input_noise > 0 and cfg.loss_decay == 1.0
    head = HydraHead(HydraConfig(num_heads=3), target.dims)
    for k in range(1, 4):
        # The first block's nonlinearity reads the whole concatenation (h and k embeddings) ...
        assert isinstance(head.inputs[k - 1], ConcatBlock) and head.inputs[k - 1].linear.in_features == (k + 1) * D
        # ... and 3 more residual layers on the hidden size make 4.
        assert len(head.blocks[k - 1].layers) == 3
    assert len(head.lm_heads) == 3 and head.prefix is not None and head.prefix_norm is not None


def test_the_prefix_layer_ends_with_a_norm(target):
    """The heads read the prefix layer's output after an RMSNorm (weight 1 at the start): every
    context row has mean square 1, whatever the layer computed."""
    head = random_head(target, num_heads=2)
    with torch.no_grad():
        head.prefix_norm.weight.fill_(1.0)
    ids = torch.randint(3, 40, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        context = head.context(target.features(ids).final_hidden)
    torch.testing.assert_close(context.pow(2).mean(-1), torch.ones(2, 9), atol=1e-4, rtol=1e-4)


def test_concat_block_is_the_reference_formula_and_starts_at_its_first_input():
    block = ConcatBlock(3 * D, D)
    x = torch.randn(5, 3 * D)
    torch.testing.assert_close(block(x), x[:, :D])  # fresh: R = [I, 0, 0], W = 0
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn_like(p))
    expected = x @ block.residual.weight.T + F.silu(x @ block.linear.weight.T + block.linear.bias)
    torch.testing.assert_close(block(x), expected)
    # The nonlinearity sees the embeddings directly: changing only them moves SiLU's input.
    y = x.clone()
    y[:, D:] += 1.0
    assert not torch.allclose(F.silu(block.linear(x)), F.silu(block.linear(y)))


def test_registered_and_a_fresh_plain_head_is_the_targets_next_token(target):
    assert HEADS["hydra"] is HydraHead
    for lm_head in ("target", "own"):
        head = HydraHead(HydraConfig(num_heads=3, num_layers=2, prefix_attention=False, lm_head=lm_head), target.dims)
        head.init_from_target(target)
        ids = torch.randint(3, 40, (2, 8), generator=torch.Generator().manual_seed(1))
        feats = target.features(ids)
        with torch.no_grad():
            logits = head(feats)
        for k in range(3):
            assert torch.allclose(logits[:, :, k], feats.logits, atol=1e-5), (lm_head, k)


@pytest.mark.parametrize("token_weight, teacher_weight", [(1.0, 1.0), (0.0, 1.0), (1.0, 0.0), (0.5, 2.0)])
def test_loss_adds_the_teacher_term_to_the_token_term(target, token_weight, teacher_weight):
    head = random_head(target, num_heads=2, token_weight=token_weight, teacher_weight=teacher_weight, input_noise=0.0, loss_decay=0.8).train()
    ids = torch.randint(3, 40, (2, 10), generator=torch.Generator().manual_seed(4))
    feats = target.features(ids)
    loss, stats = head.loss(feats, torch.ones_like(ids))
    with torch.no_grad():
        logits = head(feats)  # [B,T,K,V]; no dropout, no noise in this configuration
        terms = []
        for k in (1, 2):
            draft = torch.log_softmax(logits[:, : 10 - 1 - k, k - 1], dim=-1)
            teacher = torch.softmax(feats.logits[:, k : 10 - 1], dim=-1)
            soft = -(teacher * draft).sum(-1).mean()
            hard = -draft.gather(-1, ids[:, 1 + k :].unsqueeze(-1)).mean()
            terms.append(teacher_weight * soft + token_weight * hard)
    weights = torch.tensor([1.0, 0.8])
    assert torch.allclose(loss, (weights * torch.stack(terms)).sum() / weights.sum(), atol=1e-5)


def test_input_noise_is_neftune_scaled_and_only_in_training(target):
    like = torch.zeros(2, 50, D)
    noise = neftune_noise(like, 5.0, torch.tensor([50, 8]))
    for row, length in ((0, 50), (1, 8)):
        bound = 5.0 / (length * D) ** 0.5
        assert noise[row].abs().max() <= bound and noise[row].abs().max() > 0.9 * bound
    head = random_head(target, num_heads=2, input_noise=5.0)
    ids = torch.randint(3, 40, (2, 10), generator=torch.Generator().manual_seed(4))
    feats = target.features(ids)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        head.eval()
        assert torch.equal(head.loss(feats, mask)[0], head.loss(feats, mask)[0])
        head.train()
        assert not torch.equal(head.loss(feats, mask)[0], head.loss(feats, mask)[0])


def test_bad_config_is_one_line(target):
    for bad, key in (({"num_layers": 0}, "head.num_layers"), ({"token_weight": 0.0, "teacher_weight": 0.0}, "head.token_weight"),
                     ({"input_noise": -1.0}, "head.input_noise")):
        with pytest.raises(ValueError, match=key.replace(".", r"\.")):
            HydraHead(HydraConfig(**bad), target.dims)


def test_too_deep_a_tree_is_refused(target):
    with pytest.raises(DrafterError, match="the hydra head drafts 2 tokens"):
        HeadDrafter(random_head(target, num_heads=2), target, TreeSpec.chain(3))
