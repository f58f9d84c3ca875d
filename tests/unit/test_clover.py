"""Clover heads: a fresh head's closed form (the augmenting block is an exact copy of the target's
last layer, every other piece starts as the identity), the attention decoder's cosine gate, the
regressive connection feeding depth 2, and the loss with its per-depth weighting against a hand
computation. That the training forward computes what the runtime drafts, greedy decoding is
lossless, packed rows and export are the head contract's (test_head_contract.py)."""

import pytest
import torch
import torch.nn.functional as F

from draftsmith.heads import HEADS
from draftsmith.heads.clover import CloverConfig, CloverHead
from draftsmith.heads.eagle import shifted
from draftsmith.target import FrozenTarget
from draftsmith.testing import tiny_causal_lm

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, HIDDEN, LAYERS = 40, 32, 2


def perturbed_norms(model, seed=0):
    """Random RMSNorm weights, so a copy of the wrong norm or layer would show."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.5 * torch.randn(p.shape, generator=gen))
    return model


@pytest.fixture(scope="module")
def target():
    return FrozenTarget(perturbed_norms(tiny_causal_lm("llama", vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=LAYERS, seed=0)))


def fresh_head(target, **cfg) -> CloverHead:
    torch.manual_seed(2)
    head = CloverHead(CloverConfig(**cfg), target.dims)
    head.init_from_target(target)
    return head.eval()


def random_head(target, **cfg) -> CloverHead:
    head = fresh_head(target, **cfg)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return head


def rms(x, weight, eps):
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize(
    "cfg",
    [{}, {"num_layers": 1, "token_first": False, "output": "residual"}, {"num_layers": 0}],
    ids=["clover2", "clover1", "no-augmenting-block"],
)
def test_a_fresh_head_is_the_target_with_copies_of_its_last_layer(target, cfg):
    """A fresh head's every depth = the target's LM head on its final norm applied to the output of
    a target extended by `num_layers` copies of its last layer (HF's own layers run the copies)."""
    assert HEADS["clover"] is CloverHead
    head = fresh_head(target, depth=3, **cfg)
    n = head.cfg.num_layers
    extended = tiny_causal_lm("llama", vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=LAYERS + n, seed=5)
    state = dict(target.model.state_dict())
    last = f"model.layers.{LAYERS - 1}."
    for i in range(n):
        state.update({f"model.layers.{LAYERS + i}." + k[len(last):]: v for k, v in state.items() if k.startswith(last)})
    extended.load_state_dict(state)
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        final = extended.model(input_ids=ids).last_hidden_state
        norm = target.model.model.norm
        want = target.lm_head(rms(final, norm.weight, norm.variance_epsilon))
        got = head(target.features(ids, layers=head.required_layers()))
    for k in range(3):
        torch.testing.assert_close(got[:, :, k], want, atol=2e-5, rtol=2e-5)


def test_the_attention_decoder_gates_each_heads_value_by_cosine_similarity(target):
    head = random_head(target, depth=2)
    decoder = head.regress
    gen = torch.Generator().manual_seed(3)
    x, e = torch.randn(5, HIDDEN, generator=gen), torch.randn(5, HIDDEN, generator=gen)
    H = head.cfg.num_attention_heads
    with torch.no_grad():
        q = decoder.q_proj(rms(x, decoder.norm.weight, decoder.eps)).view(5, H, -1)
        k, v = decoder.k_proj(e).view(5, H, -1), decoder.v_proj(e).view(5, H, -1)
        want = x + (F.cosine_similarity(q, k, dim=-1).unsqueeze(-1) * v).view(5, HIDDEN)
        torch.testing.assert_close(decoder(x, e), want)
    # A fresh decoder is the identity on x: its value starts at zero.
    fresh = fresh_head(target, depth=2).regress
    assert torch.equal(fresh(x, e), x)


@pytest.mark.parametrize("token_first", [True, False])
def test_depth_two_reads_the_depth_one_token_through_the_regressive_connection(target, token_first):
    """Depth-2 logits at t are HeadNorm(FC([AD(s, e(x_{t+2})); e(x_{t+2})])) with s the depth-1
    state: changing x_{t+2} alone changes them (and not depth 1), as the hand computation says."""
    head = random_head(target, depth=2, token_first=token_first)
    ids = torch.randint(3, VOCAB, (1, 8), generator=torch.Generator().manual_seed(4))
    t = 3
    other = ids.clone()
    other[0, t + 2] = (ids[0, t + 2] + 1 - 3) % (VOCAB - 3) + 3
    with torch.no_grad():
        feats_a, feats_b = (target.features(x, layers=head.required_layers()) for x in (ids, other))
        a, b = head(feats_a), head(feats_b)
        # Positions up to t + 1 and the tokens x_{t+1} read by depth 1 are the same in both rows.
        torch.testing.assert_close(a[0, t, 0], b[0, t, 0])
        assert (a[0, t, 1] - b[0, t, 1]).abs().max() > 1e-3  # logits here are ~0.1; rounding ~1e-7
        h = head.feature(feats_b.hidden)
        x = head.block_input(h, target.embed(shifted(other, 1)))[:, : t + 1] if token_first else h[:, : t + 1]
        allowed = torch.ones(t + 1, t + 1, dtype=torch.bool).tril().view(1, 1, t + 1, t + 1)
        s = head.augment_sequence(x, allowed)[0, t]
        e1, e2 = target.embed(other[0, t + 1]), target.embed(other[0, t + 2])
        if not token_first:
            s = head.regress(s, e1)
        s2 = head.regress(s, e2)
        o2 = rms(head.fc(torch.cat([s2, e2])), head.head_norm.weight, head.head_norm.eps)
        torch.testing.assert_close(b[0, t, 1], target.lm_head(o2), atol=1e-4, rtol=1e-4)


def test_loss_is_distillation_plus_regression_weighted_per_depth(target):
    head = random_head(target, depth=3).train()
    T = 10
    ids = torch.randint(3, VOCAB, (2, T), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(ids)
    mask[:, :4] = 0  # prompt tokens carry no label
    feats = target.features(ids, layers=head.required_layers())
    loss, stats = head.loss(feats, mask)
    with torch.no_grad():
        outputs = head.unroll(feats)
        ce, terms, counts = [], [], []
        for k in (1, 2, 3):
            # Depth k at t predicts x_{t+1+k}: positions t with t + 1 + k < T and a trained label.
            rows = [(b, t) for b in range(2) for t in range(T - 1 - k) if mask[b, t + 1 + k]]
            counts.append(float(len(rows)))
            o = torch.stack([outputs[k - 1][b, t] for b, t in rows])
            target_hidden = torch.stack([feats.final_hidden[b, t + k] for b, t in rows])
            teacher = torch.softmax(target.lm_head(target_hidden), -1)
            soft_ce = -(teacher * torch.log_softmax(target.lm_head(o), -1)).sum(-1).mean()
            smooth_l1 = F.smooth_l1_loss(o, target_hidden)
            ce.append(soft_ce)
            terms.append(1.0 * soft_ce + 10.0 * smooth_l1)
        weights = torch.tensor([1.0, 0.7, 0.49])
        want = (weights * torch.stack(terms)).sum() / weights.sum()
    torch.testing.assert_close(stats["ce"], torch.stack(ce), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(loss.detach(), want, atol=1e-5, rtol=1e-5)
    assert stats["count"].tolist() == counts == [12.0, 12.0, 12.0]


def test_data_token_loss_without_teacher_or_regression(target):
    head = random_head(target, depth=2, teacher=False, regression_weight=0.0).train()
    ids = torch.randint(3, VOCAB, (1, 8), generator=torch.Generator().manual_seed(8))
    feats = target.features(ids, layers=head.required_layers())
    loss, stats = head.loss(feats, torch.ones_like(ids))
    with torch.no_grad():
        logits = head(feats)
        ce = [F.cross_entropy(logits[0, : 8 - 1 - k, k - 1], ids[0, 1 + k :]) for k in (1, 2)]
    torch.testing.assert_close(stats["ce"], torch.stack(ce), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(loss.detach(), (ce[0] + 0.7 * ce[1]) / 1.7, atol=1e-5, rtol=1e-5)


def test_a_qwen2_target_is_copied_without_its_attention_biases(capsys):
    target = FrozenTarget(tiny_causal_lm("qwen2", vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=LAYERS, seed=0))
    head = fresh_head(target, depth=2, num_layers=1)
    last = target.layers[-1]
    assert torch.equal(head.augment[0].self_attn.q_proj.weight, last.self_attn.q_proj.weight)
    assert torch.equal(head.augment[0].mlp.down_proj.weight, last.mlp.down_proj.weight)
    assert "without self_attn.k_proj.bias, self_attn.q_proj.bias, self_attn.v_proj.bias" in capsys.readouterr().out


@pytest.mark.parametrize(
    "cfg,message",
    [
        ({"output": "mlp"}, "head.output"),
        ({"depth": 0}, "head.depth"),
        ({"ce_weight": 0.0, "regression_weight": 0.0}, "head.ce_weight"),
        ({"loss_decay": 0.0}, "head.loss_decay"),
        ({"num_attention_heads": 5, "num_key_value_heads": 5}, "head.num_attention_heads"),
    ],
)
def test_bad_configs_name_their_key(target, cfg, message):
    with pytest.raises(ValueError, match=message):
        CloverHead(CloverConfig(**cfg), target.dims)
