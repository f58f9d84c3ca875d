"""Medusa heads: distinct blocks, identity start, depth labels, and no target weights inside."""

import shutil

import pytest
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


def test_the_heads_share_one_pass_through_the_targets_lm_head():
    """On the target's LM head the K heads' states go through it in one product (its weight read
    once a step, not K times), and the logits are head by head's; own LM heads stay one each."""
    target = _target()
    torch.manual_seed(2)
    head = MedusaHead(MedusaConfig(num_heads=3, num_layers=1), target.dims).eval()
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    calls = []

    def lm_head(h):
        calls.append(tuple(h.shape))
        return target.model.lm_head(h)

    hidden = torch.randn(2, 5, 32)
    logits = head.head_logits(hidden, lm_head)
    assert calls == [(2, 5, 3, 32)] and logits.shape == (2, 5, 3, 40)
    for k, block in enumerate(head.blocks):
        torch.testing.assert_close(logits[..., k, :], target.model.lm_head(block(hidden)))
    own = MedusaHead(MedusaConfig(num_heads=3, num_layers=1, lm_head="own"), target.dims).eval()
    assert own.head_logits(hidden, lm_head).shape == (2, 5, 3, 40) and calls == [(2, 5, 3, 32)]


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


def _saved_bytes(fn) -> int:
    """Bytes of the distinct tensors autograd keeps for backward while fn() builds its graph."""
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def test_soft_cross_entropy_equals_the_autograd_formula_in_less_memory():
    """The fused soft cross-entropy gives the log-softmax formula's value and gradient (fp32 logits,
    and bf16 as autocast hands them over), targets with zeros and mass below 1 included, and keeps
    less for backward than that formula does."""
    from draftsmith.heads.base import soft_cross_entropy

    torch.manual_seed(0)
    M, V = 64, 300
    probs = torch.softmax(torch.randn(M, V) * 3, dim=-1)
    probs[:, :50] = 0.0  # a teacher restricted to part of the vocabulary: mass below 1
    upstream = torch.randn(M)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        base = (torch.randn(M, V) * 4).to(dtype)
        ref_in = base.clone().requires_grad_()
        new_in = base.clone().requires_grad_()
        ref, ref_kept = _saved_bytes(lambda: -(probs * torch.log_softmax(ref_in.float(), dim=-1)).sum(-1))
        new, new_kept = _saved_bytes(lambda: soft_cross_entropy(new_in, probs))
        assert new.dtype == torch.float32
        torch.testing.assert_close(new, ref, rtol=1e-5, atol=1e-5)
        (ref * upstream).sum().backward()
        (new * upstream).sum().backward()
        assert new_in.grad.dtype == dtype
        torch.testing.assert_close(new_in.grad.float(), ref_in.grad.float(), rtol=tol, atol=tol)
        # The formula keeps an fp32 log-softmax and the targets; the fused one the logits as they
        # came (half the bytes in bf16), the targets and two numbers a row.
        if dtype == torch.bfloat16:
            assert new_kept <= 0.8 * ref_kept, (new_kept, ref_kept)
        else:
            assert new_kept <= ref_kept + 2 * M * 4, (new_kept, ref_kept)
    # A target that needs a gradient takes the formula, so its gradient is there.
    p = probs.clone().requires_grad_()
    soft_cross_entropy(torch.randn(M, V), p).sum().backward()
    assert p.grad is not None and p.grad.abs().sum() > 0


def test_soft_cross_entropy_over_rows_of_a_table_keeps_no_copy_of_them():
    """Targets named as rows of a shared table (EAGLE-3's teacher, shifted per step): the same value
    and gradient as the gathered rows, and what backward keeps no longer holds the [M,V] rows."""
    from draftsmith.heads.base import soft_cross_entropy

    torch.manual_seed(1)
    R, M, V = 80, 64, 300
    table = torch.softmax(torch.randn(R, V) * 3, dim=-1)
    index = torch.randint(0, R, (M,))
    base = (torch.randn(M, V) * 4).to(torch.bfloat16)
    copied_in, indexed_in = base.clone().requires_grad_(), base.clone().requires_grad_()
    copied, copied_kept = _saved_bytes(lambda: soft_cross_entropy(copied_in, table[index]))
    indexed, indexed_kept = _saved_bytes(lambda: soft_cross_entropy(indexed_in, table, index))
    torch.testing.assert_close(indexed, copied, rtol=0, atol=0)
    upstream = torch.randn(M)
    (copied * upstream).sum().backward()
    (indexed * upstream).sum().backward()
    torch.testing.assert_close(indexed_in.grad, copied_in.grad, rtol=0, atol=0)
    # The copy's M x V fp32 rows are gone (the table itself is counted: it is the caller's, alive anyway).
    assert indexed_kept <= copied_kept - M * V * 4 + R * V * 4 + M * 8, (indexed_kept, copied_kept)
    assert copied_kept - M * V * 4 < indexed_kept


def test_eagle3_loss_and_gradients_are_those_of_the_log_softmax_formula():
    """The EAGLE-3 loss through the fused soft cross-entropy equals, in value and in every
    parameter's gradient, the same loss with the autograd formula patched back in."""
    import draftsmith.heads.base as base

    target = _target()
    cls = HEADS["eagle3"]
    torch.manual_seed(3)
    head = cls(cls.config_class(depth=3, train_depth=3, draft_vocab_size=24, aux_layer_ids=[1, 2, 3]), target.dims)
    head.init_from_target(target)
    ids = torch.randint(3, 40, (2, 12))
    feats = target.features(ids, attention_mask=torch.ones_like(ids), layers=head.required_layers())

    def run():
        head.zero_grad()
        loss, stats = head.loss(feats, torch.ones_like(ids))
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}

    fused_loss, fused_grads = run()
    def formula(logits, probs, index=None):
        probs = probs if index is None else probs[index]
        return -(probs * torch.log_softmax(logits.to(probs.dtype), dim=-1)).sum(-1)

    original = base.soft_cross_entropy
    base.soft_cross_entropy = formula
    try:
        ref_loss, ref_grads = run()
    finally:
        base.soft_cross_entropy = original
    torch.testing.assert_close(fused_loss, ref_loss)
    assert fused_grads.keys() == ref_grads.keys() and len(fused_grads) > 3
    for name in ref_grads:
        torch.testing.assert_close(fused_grads[name], ref_grads[name], rtol=1e-5, atol=1e-6, msg=name)


def test_recomputed_attention_trains_the_same_and_keeps_less(monkeypatch):
    """With attention recomputed in backward (what an accelerator without FlexAttention gets),
    EAGLE-3's and DFlash's losses and every gradient equal those with attention kept, and autograd
    keeps fewer bytes: the [B,H,T,T] softmax is no longer among them."""
    import draftsmith.heads.layers as layers

    target = _target()
    ids = torch.randint(3, 40, (2, 24), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    configs = {
        "eagle3": dict(depth=3, train_depth=3, draft_vocab_size=24, aux_layer_ids=[1, 2, 3]),
        "dflash": dict(block_size=4, num_layers=1, aux_layer_ids=[1, 2, 3]),
    }
    for kind, values in configs.items():
        cls = HEADS[kind]
        torch.manual_seed(5)
        head = cls(cls.config_class(**values), target.dims)
        head.init_from_target(target)
        feats = target.features(ids, attention_mask=mask, layers=head.required_layers())

        def run(recompute: bool):
            monkeypatch.setattr(layers, "TRAINING_ATTENTION", "recompute" if recompute else "keep")
            head.zero_grad()
            torch.manual_seed(6)  # DFlash draws its anchors
            loss, kept = _saved_bytes(lambda: head.loss(feats, mask)[0])
            loss.backward()
            return loss.detach(), kept, {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}

        kept_loss, kept_bytes, kept_grads = run(False)
        loss, bytes_, grads = run(True)
        torch.testing.assert_close(loss, kept_loss, msg=kind)
        assert grads.keys() == kept_grads.keys() and grads, kind
        for name in grads:
            torch.testing.assert_close(grads[name], kept_grads[name], msg=f"{kind}: {name}")
        assert bytes_ < kept_bytes, (kind, bytes_, kept_bytes)


def _block_masks_checked(monkeypatch) -> list:
    """From here on every block mask flex_attend builds is checked against create_block_mask's for
    the same mask (the CPU's FlexAttention calls the mask at every pair and would not notice a
    missing tile; on CUDA the kernel skips it). Returns the list of key lengths built."""
    from torch.nn.attention.flex_attention import create_block_mask

    import draftsmith.heads.layers as layers

    built, build = [], layers.training_block_mask

    def checked(mask_mod, allowed, KV, own_keys=None, own_seen=None, block=128):
        got = build(mask_mod, allowed, KV, own_keys, own_seen, block)
        want = create_block_mask(mask_mod, allowed.shape[0], None, allowed.shape[-2], KV, device="cpu", BLOCK_SIZE=block)
        for table in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
            assert torch.equal(getattr(got, table), getattr(want, table)), table
        built.append(KV)
        return got

    monkeypatch.setattr(layers, "training_block_mask", checked)
    return built


@pytest.mark.filterwarnings("ignore:.*flex_attention.*:UserWarning")
def test_flex_attention_sees_what_attend_sees(monkeypatch):
    """flex_attend (training attention on CUDA) equals attend: causal, packed segments and padding
    in the shared keys, per-row masks, grouped-query heads, and the own entries as EAGLE's
    training-time test (all seen) and DFlash's blocks (own_allowed) use them. Forward only: on the
    CPU FlexAttention has no backward (tests/gpu holds the gradients on CUDA). The CPU's
    FlexAttention calls the mask at every pair, so each block mask flex_attend builds is also
    checked against create_block_mask's for the same mask: on CUDA the kernel skips the tiles the
    block mask leaves out."""
    from draftsmith.heads.layers import BlockEntries, attend, causal_allowed, flex_attend

    built = _block_masks_checked(monkeypatch)

    g = torch.Generator().manual_seed(7)
    B, H, Hkv, T, Dh = 2, 4, 2, 40, 8
    q = torch.randn(B, H, T, Dh, generator=g)
    k, v = torch.randn(B, Hkv, T, Dh, generator=g), torch.randn(B, Hkv, T, Dh, generator=g)
    own = [(torch.randn(B, Hkv, T, Dh, generator=g), torch.randn(B, Hkv, T, Dh, generator=g)) for _ in range(3)]
    segments = torch.tensor([[0] * 15 + [1] * 25, [0] * 40])
    padding = torch.ones(B, T, dtype=torch.long)
    padding[1, 30:] = 0
    masks = {
        "causal": causal_allowed(T, q.device),
        "segments and padding": causal_allowed(T, q.device, segments, padding),
    }
    own_allowed = torch.rand(T, 3, generator=g) > 0.4
    for name, allowed in masks.items():
        for extra, seen in (((), None), (own, None), (own, own_allowed)):
            ref = attend(q, k, v, allowed, extra, seen)
            got = flex_attend(q, k, v, allowed, extra, seen)
            torch.testing.assert_close(got.float(), ref, rtol=1e-4, atol=1e-5, msg=f"{name}, {len(extra)} own, own_allowed {seen is not None}")
    # DFlash's blocks of slots (33 blocks of 8 over P = 264 positions, past two 128-key tiles, 40
    # context keys): as P more keys through FlexAttention, as own runs through attend, and as the
    # runs written out by hand.
    N, G, C = 33, 8, 40
    q = torch.randn(B, H, N * G, Dh, generator=g)
    kb, vb = torch.randn(B, Hkv, N * G, Dh, generator=g), torch.randn(B, Hkv, N * G, Dh, generator=g)
    anchors = torch.randint(0, C, (B, N, 1), generator=g)
    context = (torch.arange(C) < anchors).repeat_interleave(G, dim=1).unsqueeze(1)  # [B,1,P,C]: a block sees the context before its anchor
    for seen_in_block in (torch.ones(G, G, dtype=torch.bool), torch.ones(G, G, dtype=torch.bool).tril()):
        block = BlockEntries(kb, vb, G, seen_in_block)
        runs = [tuple(t.view(B, Hkv, N, G, Dh)[:, :, :, j].repeat_interleave(G, dim=2) for t in (kb, vb)) for j in range(G)]
        by_hand = attend(q, k, v, context, runs, seen_in_block.repeat(N, 1))
        torch.testing.assert_close(attend(q, k, v, context, block), by_hand)
        got = flex_attend(q, k, v, context, block)
        torch.testing.assert_close(got.float(), by_hand, rtol=1e-4, atol=1e-5)
    # Positions and keys padded to 128 (flex_length), DFlash's 264 slots to 384.
    assert built == [128, 4 * 128, 4 * 128] * 2 + [128 + 384] * 2


@pytest.mark.filterwarnings("ignore:.*flex_attention.*:UserWarning")
@pytest.mark.parametrize("B, P, S, n, block", [(2, 40, 40, 0, 16), (2, 42, 40, 3, 16), (1, 70, 33, 2, 16), (3, 64, 64, 4, 16), (2, 300, 300, 2, 128)])
def test_the_training_block_mask_is_create_block_masks(B, P, S, n, block):
    """training_block_mask counts tiles instead of calling the mask at every pair: its block tables
    (partial and full, by query tile and by key tile) are create_block_mask's for the same mask,
    over shared keys with causal, packed and padded rows (one mask for all rows, or one each), own
    entries as EAGLE's training-time test lays them out (n runs of P, seen by all or as
    own_allowed says) and as DFlash's blocks do (P more keys seen inside blocks of n, all or
    causally), and lengths that are not whole tiles."""
    from torch.nn.attention.flex_attention import create_block_mask

    from draftsmith.heads.layers import causal_allowed, training_block_mask

    g = torch.Generator().manual_seed(B * P + n)
    segments = torch.randint(0, 3, (B, P), generator=g).sort(dim=1).values
    padding = (torch.rand(B, P, generator=g) > 0.1).long()
    shared = [causal_allowed(P, torch.device("cpu"))[..., :S], causal_allowed(P, torch.device("cpu"), segments, padding)[..., :S]]
    shared.append(torch.rand(B, 1, P, S, generator=g) > 0.7)  # tiles of every kind: empty, partial, full
    shared.append(torch.ones(1, 1, P, S, dtype=torch.bool))
    shared.append(shared[-1].clone())
    shared[-1][..., 0, 0] = False  # one pair short of a full tile
    p = torch.arange(P)
    layouts = [("none", None, None, S)]
    if n:
        keys = S + torch.arange(n).view(n, 1) * P + p
        layouts += [("runs", keys, None, S + n * P), ("runs, own_allowed", keys, torch.rand(n, P, generator=g) > 0.3, S + n * P)]
        blocks = S + (p // n) * n + torch.arange(n).view(n, 1)
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        layouts += [("blocks", blocks, None, S + P), ("causal blocks", blocks, causal[p % n].t(), S + P)]
    for allowed in shared:
        for name, own_keys, own_seen, KV in layouts:
            visible = allowed.expand(allowed.shape[0], 1, P, S)
            seen_at = torch.zeros(P, KV, dtype=torch.bool)  # each position's own keys, written out
            if own_keys is not None:
                seen_at[p.expand_as(own_keys), own_keys] = True if own_seen is None else own_seen

            def mask_mod(b, h, qi, kv):
                return ((kv < S) & visible[b, 0, qi, kv.clamp(max=S - 1)]) | seen_at[qi, kv]

            want = create_block_mask(mask_mod, allowed.shape[0], None, P, KV, device="cpu", BLOCK_SIZE=block)
            got = training_block_mask(mask_mod, allowed, KV, own_keys, own_seen, block=block)
            assert got.seq_lengths == want.seq_lengths and got.BLOCK_SIZE == want.BLOCK_SIZE
            for table in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):
                assert torch.equal(getattr(got, table), getattr(want, table)), (table, name, allowed.shape)
    assert int(want.full_kv_num_blocks.sum()) > 0 or S < block  # the last masks have full tiles


@pytest.mark.filterwarnings("ignore:.*flex_attention.*:UserWarning")
def test_training_time_test_steps_share_one_key_length_and_one_compiled_kernel(monkeypatch):
    """EAGLE's unrolled steps bring 0 .. S - 1 own runs; padded to own_capacity they reach
    FlexAttention with one key length, so a compiled FlexAttention compiles once, not once a step
    (counted with dynamo's CompileCounter, forward only: the CPU has no backward for it). The
    padding changes nothing: each step equals attend without it, with P = 150 positions (so a
    128-key tile of each run holds real entries and padding), with every run seen and with
    own_allowed (padded too, so it does not recompile either), and the block masks are
    create_block_mask's. The unroll hands every call its capacity."""
    from torch._dynamo.testing import CompileCounter
    from torch.nn.attention.flex_attention import flex_attention

    import draftsmith.heads.layers as layers
    from draftsmith.heads.layers import attend, causal_allowed, flex_attend

    g = torch.Generator().manual_seed(11)
    B, H, Hkv, P, Dh, steps = 1, 2, 1, 150, 8, 5
    allowed = causal_allowed(P, torch.device("cpu"))
    k, v = torch.randn(B, Hkv, P, Dh, generator=g), torch.randn(B, Hkv, P, Dh, generator=g)
    runs = [(torch.randn(B, Hkv, P, Dh, generator=g), torch.randn(B, Hkv, P, Dh, generator=g)) for _ in range(steps - 1)]
    seen_runs = torch.rand(P, steps - 1, generator=g) > 0.3
    built = _block_masks_checked(monkeypatch)
    counts = {}
    for capacity, some_seen in ((steps - 1, False), (0, False), (steps - 1, True)):
        torch._dynamo.reset()  # earlier tests' compiled entries count against dynamo's recompile limit
        counter = CompileCounter()
        compiled = torch.compile(flex_attention, backend=counter, dynamic=False)
        monkeypatch.setattr(layers, "_flex_runner", lambda device: compiled)
        for n in range(steps):
            q = torch.randn(B, H, P, Dh, generator=g)
            seen = seen_runs[:, :n] if some_seen else None
            got = flex_attend(q, k, v, allowed, runs[:n], seen, own_capacity=capacity)
            torch.testing.assert_close(got.float(), attend(q, k, v, allowed, runs[:n], seen), rtol=1e-4, atol=1e-5, msg=f"{n} runs, capacity {capacity}")
        counts[(capacity, some_seen)] = counter.frame_count
    assert counts == {(steps - 1, False): 1, (0, False): steps, (steps - 1, True): 1}
    Pp = 256  # flex_length(150): the positions and each run padded to whole tiles
    assert built == [Pp * steps] * steps + [Pp * (1 + n) for n in range(steps)] + [Pp * steps] * steps
    # The unroll's calls: every one with the unroll's capacity (train_depth - 1).
    seen = []
    real = layers.attend_in_training
    monkeypatch.setattr(layers, "attend_in_training", lambda *a, own_capacity=0, **kw: seen.append(own_capacity) or real(*a, own_capacity=own_capacity, **kw))
    target = _target()
    cls = HEADS["eagle3"]
    head = cls(cls.config_class(depth=3, train_depth=3, draft_vocab_size=24, aux_layer_ids=[1, 2, 3]), target.dims)
    ids = torch.randint(3, 40, (1, 12), generator=g)
    head.loss(target.features(ids, attention_mask=torch.ones_like(ids), layers=head.required_layers()), torch.ones_like(ids))
    assert seen == [2, 2, 2]


@pytest.mark.skipif(shutil.which("g++") is None, reason="inductor compiles FlexAttention for the CPU with a C++ compiler")
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_compiled_flex_attention_reads_the_block_tables_it_is_given(monkeypatch):
    """The CPU's eager FlexAttention calls the mask at every pair; a compiled kernel (inductor's, as
    torch.compile makes it on CUDA) visits only the tiles the block tables list. Compiled on the
    CPU (forward: there is no backward there), flex_attend equals attend past one 128-key tile:
    EAGLE's runs padded to their capacity, with per-row masks and own_allowed, and DFlash's blocks,
    whole and causal. And the kernel does read the tables: empty ones change its output."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    import draftsmith.heads.layers as layers
    from draftsmith.heads.layers import BlockEntries, attend, causal_allowed, flex_attend, training_block_mask

    torch._dynamo.reset()  # earlier tests' compiled entries count against dynamo's recompile limit
    compiled = torch.compile(flex_attention, dynamic=False)
    monkeypatch.setattr(layers, "_flex_runner", lambda device: compiled)
    g = torch.Generator().manual_seed(21)
    B, H, P, Dh = 2, 2, 300, 16

    def rand(*shape):
        return torch.randn(*shape, generator=g)

    q, k, v = rand(B, H, P, Dh), rand(B, 1, P, Dh), rand(B, 1, P, Dh)
    causal = causal_allowed(P, torch.device("cpu"))
    full = training_block_mask(lambda b, h, qi, kv: qi >= kv, causal, P)
    empty = training_block_mask(lambda b, h, qi, kv: qi >= kv, torch.zeros_like(causal), P)
    empty = BlockMask.from_kv_blocks(empty.kv_num_blocks, empty.kv_indices, empty.full_kv_num_blocks, empty.full_kv_indices, 128, full.mask_mod, (P, P))
    read = compiled(q, k, v, block_mask=full, enable_gqa=True)
    torch.testing.assert_close(read, attend(q, k, v, causal), rtol=1e-4, atol=1e-5)
    assert not torch.allclose(compiled(q, k, v, block_mask=empty, enable_gqa=True), read)

    segments = torch.randint(0, 3, (B, P), generator=g).sort(dim=1).values
    per_row = causal_allowed(P, torch.device("cpu"), segments)
    runs = [(rand(B, 1, P, Dh), rand(B, 1, P, Dh)) for _ in range(3)]
    for n in range(4):
        for seen in (None, torch.rand(P, n, generator=g) > 0.3) if n else (None,):
            q = rand(B, H, P, Dh)
            got = flex_attend(q, k, v, per_row, runs[:n], seen, own_capacity=3)
            torch.testing.assert_close(got, attend(q, k, v, per_row, runs[:n], seen), rtol=1e-4, atol=1e-5, msg=f"{n} runs")
    N, G, C = 37, 8, 300
    q, kb, vb = rand(B, H, N * G, Dh), rand(B, 1, N * G, Dh), rand(B, 1, N * G, Dh)
    context = (torch.arange(C) < torch.randint(1, C, (B, N, 1), generator=g)).repeat_interleave(G, dim=1).unsqueeze(1)
    for seen_in_block in (torch.ones(G, G, dtype=torch.bool), torch.ones(G, G, dtype=torch.bool).tril()):
        block = BlockEntries(kb, vb, G, seen_in_block)
        torch.testing.assert_close(flex_attend(q, k, v, context, block), attend(q, k, v, context, block), rtol=1e-4, atol=1e-5)


@pytest.mark.filterwarnings("ignore:.*flex_attention.*:UserWarning")
def test_batches_of_nearby_lengths_share_a_compiled_kernel(monkeypatch):
    """A batch is as long as its longest row, so lengths change from batch to batch: flex_attend
    pads them to flex_length, and a compiled FlexAttention compiles once for 130, 200 and 256
    positions, once more for 300; every output equals attend's on the unpadded batch (EAGLE's
    runs and DFlash's blocks), and the block masks are create_block_mask's."""
    from torch._dynamo.testing import CompileCounter
    from torch.nn.attention.flex_attention import flex_attention

    import draftsmith.heads.layers as layers
    from draftsmith.heads.layers import BlockEntries, attend, causal_allowed, flex_attend, flex_length

    assert [flex_length(n) for n in (1, 128, 129, 256, 300, 1024, 1100, 2048, 3000)] == [128, 128, 256, 256, 384, 1024, 1280, 2048, 3072]
    assert flex_length(264, 24) == 384 and flex_length(300, 24) == 384 and flex_length(390, 24) == 528
    _block_masks_checked(monkeypatch)
    g = torch.Generator().manual_seed(12)
    for name in ("runs", "blocks"):
        torch._dynamo.reset()  # earlier tests' compiled entries count against dynamo's recompile limit
        counter = CompileCounter()
        compiled = torch.compile(flex_attention, backend=counter, dynamic=False)
        monkeypatch.setattr(layers, "_flex_runner", lambda device: compiled)
        frames = []
        for T in (130, 200, 256, 300):
            k, v = torch.randn(2, 1, T, 8, generator=g), torch.randn(2, 1, T, 8, generator=g)
            segments = torch.randint(0, 2, (2, T), generator=g).sort(dim=1).values
            allowed = causal_allowed(T, torch.device("cpu"), segments)
            if name == "runs":
                q = torch.randn(2, 2, T, 8, generator=g)
                own = [(torch.randn(2, 1, T, 8, generator=g), torch.randn(2, 1, T, 8, generator=g))]
            else:  # 8 blocks of 4 slots over the T context keys
                q = torch.randn(2, 2, 32, 8, generator=g)
                own = BlockEntries(torch.randn(2, 1, 32, 8, generator=g), torch.randn(2, 1, 32, 8, generator=g), 4, torch.ones(4, 4, dtype=torch.bool).tril())
                allowed = (torch.arange(T) < torch.randint(1, T, (2, 8, 1), generator=g)).repeat_interleave(4, dim=1).unsqueeze(1)
            torch.testing.assert_close(flex_attend(q, k, v, allowed, own), attend(q, k, v, allowed, own), rtol=1e-4, atol=1e-5, msg=f"{name}, {T}")
            frames.append(counter.frame_count)
        assert frames == [1, 1, 1, 2], name


def test_block_entries_refuse_positions_that_make_no_whole_blocks():
    from draftsmith.heads.layers import BlockEntries

    k = torch.zeros(1, 1, 20, 4)
    with pytest.raises(ValueError, match="20 positions do not make whole blocks of 8"):
        BlockEntries(k, k, 8, torch.ones(8, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"allowed has shape \(4, 4\)"):
        BlockEntries(k, k, 5, torch.ones(4, 4, dtype=torch.bool))


def test_a_flex_attention_that_fails_falls_back_to_recomputing_once(monkeypatch, capsys):
    """Forced onto FlexAttention where it cannot train (the CPU has no backward for it), training
    says so once and goes on with the recomputed attention: the same loss and gradients."""
    import draftsmith.heads.layers as layers

    target = _target()
    cls = HEADS["eagle3"]
    torch.manual_seed(5)
    head = cls(cls.config_class(depth=2, train_depth=2, draft_vocab_size=24, aux_layer_ids=[1, 2, 3]), target.dims)
    ids = torch.randint(3, 40, (1, 16), generator=torch.Generator().manual_seed(2))
    feats = target.features(ids, attention_mask=torch.ones_like(ids), layers=head.required_layers())
    monkeypatch.setattr(layers, "_flex_failed", None)
    results = {}
    for choice in ("keep", "flex", "flex"):
        monkeypatch.setattr(layers, "TRAINING_ATTENTION", choice)
        head.zero_grad()
        loss, _ = head.loss(feats, torch.ones_like(ids))
        loss.backward()
        results.setdefault(choice, []).append((loss.detach(), head.fc.weight.grad.clone()))
    notes = [line for line in capsys.readouterr().err.splitlines() if "FlexAttention failed" in line]
    assert len(notes) == 1 and "recomputed" in notes[0]
    assert layers._flex_failed
    for loss, grad in results["flex"]:
        torch.testing.assert_close(loss, results["keep"][0][0])
        torch.testing.assert_close(grad, results["keep"][0][1])


def test_the_rotary_frequencies_stay_float64_when_the_head_is_cast():
    """A head cast as a whole (``head.bfloat16()``, ``head.to(dtype)``: scripts/bench_gpu.py casts
    its heads so, older DeepSpeed releases cast a bf16 model so) keeps its rotary frequencies in
    float64: rounded to bf16 they turned position 3,000 by radians. The angles then equal an uncast
    head's."""
    from draftsmith.heads import EagleConfig

    target = FrozenTarget(tiny_causal_lm("llama", vocab_size=40, hidden_size=32, num_layers=8))
    reference = HEADS["eagle3"](HEADS["eagle3"].config_class(), target.dims).rotary
    positions = torch.arange(3000, 3016)
    cos, sin = reference(positions, torch.float32)
    for cast in (lambda m: m.bfloat16(), lambda m: m.to(torch.float16), lambda m: m.double().float()):
        head = cast(HEADS["eagle3"](HEADS["eagle3"].config_class(), target.dims))
        assert head.rotary.frequencies.dtype == torch.float64
        got = head.rotary(positions, torch.float32)
        assert torch.equal(got[0], cos) and torch.equal(got[1], sin)
    head = HEADS["eagle"](EagleConfig(), target.dims).bfloat16()
    assert head.rotary.frequencies.dtype == torch.float64
    # A move that changes nothing, or a cast, keeps the tensor itself: a captured graph goes on reading it.
    kept = head.rotary.frequencies
    assert head.to("cpu").rotary.frequencies is kept and head.to(torch.bfloat16).rotary.frequencies is kept and head.float().rotary.frequencies is kept
    assert head.to("meta").rotary.frequencies.device.type == "meta"  # a move moves them
    assert torch.equal(head.to_empty(device="cpu").rotary.frequencies, kept)  # and back from the meta device, with their values


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rms_norm_gives_the_bits_of_its_formula(dtype):
    """RMSNorm through torch's rms_norm (one kernel on CUDA) gives on the CPU the bits of the formula
    it replaced: weight * x / sqrt(mean(x^2) + eps) in at least fp32, for fp32, fp64 and bf16 inputs
    and weights of the same precision or another."""
    from draftsmith.heads.layers import RMSNorm

    g = torch.Generator().manual_seed(3)
    for x_dtype, w_dtype in ((dtype, dtype), (torch.bfloat16, dtype), (torch.bfloat16, torch.bfloat16), (dtype, torch.bfloat16)):
        norm = RMSNorm(48, 1e-6)
        norm.weight.data = torch.randn(48, generator=g).to(w_dtype)
        x = torch.randn(2, 5, 48, generator=g).to(x_dtype)
        wide = torch.promote_types(x.dtype, torch.float32)
        y = x.to(wide)
        formula = (norm.weight.to(wide) * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + norm.eps))).to(x.dtype)
        assert torch.equal(norm(x), formula)


def test_drafting_attention_equals_attend():
    """attend_cached (drafting's attention, one fused kernel on CUDA) gives attend's result with
    grouped-query heads and without, for one query and for several, whatever the mask hides
    (each row sees itself at least), in fp64 to rounding and in bf16 to bf16's."""
    from draftsmith.heads.layers import attend, attend_cached

    g = torch.Generator().manual_seed(11)
    for H, Hkv, P, S in ((4, 2, 3, 10), (8, 8, 1, 5), (6, 2, 4, 33), (4, 1, 2, 7)):
        q, k, v = torch.randn(1, H, P, 16, generator=g), torch.randn(1, Hkv, S, 16, generator=g), torch.randn(1, Hkv, S, 16, generator=g)
        visible = torch.rand(P, S, generator=g) > 0.5
        visible[:, S - P :] |= torch.eye(P, dtype=torch.bool)
        want = attend(q.double(), k.double(), v.double(), visible.view(1, 1, P, S))
        got = attend_cached(q.double(), k.double(), v.double(), visible)
        assert got.shape == want.shape == (1, H, P, 16)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        low = attend_cached(q.bfloat16(), k.bfloat16(), v.bfloat16(), visible)
        assert low.dtype == torch.bfloat16
        torch.testing.assert_close(low.double(), want, rtol=0.03, atol=0.03)


def test_drafting_attention_takes_the_layout_cudas_kernel_writes(monkeypatch):
    """On CUDA the memory-efficient attention kernel (the one that takes a mask) returns [B,M,H,K]
    storage seen as [B,H,M,K]; with grouped-query heads a plain view of it cannot merge the groups
    (it raised on CUDA). attend_cached gives the same result from that layout, and brings it to the
    heads' order in one copy, after which the attention output needs none."""
    import torch.nn.functional as F

    from draftsmith.heads import layers
    from draftsmith.heads.layers import attend, attend_cached

    real = F.scaled_dot_product_attention

    def cuda_layout(*args, **kwargs):
        return real(*args, **kwargs).transpose(1, 2).contiguous().transpose(1, 2)

    monkeypatch.setattr(layers.F, "scaled_dot_product_attention", cuda_layout)
    g = torch.Generator().manual_seed(12)
    for H, Hkv, P in ((8, 2, 4), (8, 2, 1), (4, 4, 3)):
        q, k, v = torch.randn(1, H, P, 16, generator=g), torch.randn(1, Hkv, 9, 16, generator=g), torch.randn(1, Hkv, 9, 16, generator=g)
        visible = torch.ones(P, 9, dtype=torch.bool)
        got = attend_cached(q, k, v, visible)
        torch.testing.assert_close(got, attend(q, k, v, visible.view(1, 1, P, 9)))
        assert got.transpose(1, 2).is_contiguous()  # Attention.output's reshape is a view
