"""DFlash heads against their definitions: every block of the training forward equals a plain
forward of that block alone (context = the target's states strictly before the anchor, the whole
block bidirectional, or causal), the loss equals a per-block reference with D-PACE and the other
weightings written out, the mask token chosen from the data, and bad settings in one line. That the
runtime drafts what the training forward computes is the head contract's (test_head_contract.py);
that vLLM computes the same is tests/interop's."""

import math

import pytest
import torch
import torch.nn.functional as F

from draftsmith.heads import HEADS
from draftsmith.heads.dflash import (
    DFlashConfig, DFlashHead, block_loss, choose_mask_token, decay_weights, dpace_weights, per_draft_layer_ids, sample_anchors,
)  # fmt: skip
from draftsmith.target import FrozenTarget
from draftsmith.testing import tiny_causal_lm

pytestmark = pytest.mark.usefixtures("one_thread")

V, H, N = 48, 32, 4


@pytest.fixture(scope="module")
def target():
    return FrozenTarget(tiny_causal_lm("llama", vocab_size=V, hidden_size=H, num_layers=N, seed=0, dtype=torch.float64))


def random_head(target, seed=1, **cfg):
    torch.manual_seed(seed)
    head = DFlashHead(DFlashConfig(**{"aux_layer_ids": [1, 2, 4], "block_size": 4, "num_layers": 2, "mask_token_id": V - 1, **cfg}), target.dims)
    head.init_from_target(target)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return head.double().eval()


# ----------------------------------------------------------------------------- a plain reference


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, pos, theta):
    """Rotate-half RoPE of x [P, heads, Dh] at positions [P]."""
    Dh = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, Dh, 2, dtype=torch.float64) / Dh))
    ang = pos.double()[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1)[:, None], torch.cat([ang.sin(), ang.sin()], -1)[:, None]
    return x * cos + torch.cat([-x[..., Dh // 2 :], x[..., : Dh // 2]], -1) * sin


def layer_outputs(model, ids):
    """{i: output of decoder layer i [T,D]} before the final norm (forward hooks: HF's last
    hidden_states entry is after the norm)."""
    outs = {}
    hooks = [layer.register_forward_hook(lambda m, a, o, i=i: outs.__setitem__(i, (o[0] if isinstance(o, tuple) else o)[0])) for i, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        model(ids)
    for hook in hooks:
        hook.remove()
    return outs


def reference_block(head, model, prefix, anchor):
    """Logits [K,V] of the block [anchor, mask, ...] placed right after `prefix` (x_0..x_t), with
    the target run on the prefix alone: nothing at or after the anchor can reach the context."""
    cfg, w = head.cfg, {k: v.double() for k, v in head.state_dict().items()}
    eps, S = cfg.rms_norm_eps, cfg.block_size
    nh, nkv, Dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    outs = layer_outputs(model, torch.tensor([prefix]))
    aux = torch.cat([outs[i - 1] for i in cfg.aux_layer_ids], -1)  # vLLM id L = output of layer L - 1
    ctx = rms(aux @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    block = torch.tensor([anchor] + [cfg.mask_token_id] * (S - 1))
    x = model.get_input_embeddings().weight.double()[block].clone()
    if cfg.mask_embedding:
        x[block == cfg.mask_token_id] = w["mask_embedding"]
    C = len(prefix)
    qpos, kpos = torch.arange(C, C + S), torch.arange(0, C + S)
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"], eps)
        q = rope(rms((h @ w[p + "self_attn.q_proj.weight"].T).view(S, nh, Dh), w[p + "self_attn.q_norm.weight"], eps), qpos, cfg.rope_theta)
        kv_in = torch.cat([ctx, h])
        k = rope(rms((kv_in @ w[p + "self_attn.k_proj.weight"].T).view(-1, nkv, Dh), w[p + "self_attn.k_norm.weight"], eps), kpos, cfg.rope_theta)
        v = (kv_in @ w[p + "self_attn.v_proj.weight"].T).view(-1, nkv, Dh)
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(Dh)
        if cfg.causal:  # slot i sees the context and slots j <= i
            scores[:, :, C:] = scores[:, :, C:].masked_fill(~torch.ones(S, S, dtype=torch.bool).tril(), float("-inf"))
        o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(S, nh * Dh)
        x = x + o @ w[p + "self_attn.o_proj.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"], eps)
        x = x + (F.silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    x = rms(x, w["norm.weight"], eps)[1:]
    if "lm_head.weight" in w:
        full = torch.full((S - 1, V), float("-inf"), dtype=torch.float64)
        full[:, torch.arange(cfg.draft_vocab_size) + head.d2t] = x @ w["lm_head.weight"].T
        return full
    return x @ model.lm_head.weight.double().T


CONFIGS = [
    {},
    {"causal": True, "block_size": 3},
    {"aux_layer_ids": [4], "num_layers": 1, "mask_embedding": True, "draft_vocab_size": 20, "block_size": 5},
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=["bidirectional", "causal", "mask-vector-draft-vocab"])
def test_every_block_of_the_training_forward_is_the_block_computed_alone(target, cfg):
    head = random_head(target, **cfg)
    if head.cfg.draft_vocab_size:  # a draft vocabulary that is not a prefix of the target's
        ids = torch.arange(head.cfg.draft_vocab_size) * 2 + 3
        head.d2t.copy_(ids - torch.arange(head.cfg.draft_vocab_size))
        head.t2d.zero_()
        head.t2d[ids] = True
    ids = torch.randint(3, V - 1, (1, 11), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        logits = head(target.features(ids, layers=head.required_layers()))  # [1,T,K,V]
    assert logits.shape == (1, 11, head.depth, V)
    for t in range(ids.shape[1] - 1):
        want = reference_block(head, target.model, ids[0, : t + 1].tolist(), int(ids[0, t + 1]))
        finite = torch.isfinite(want)
        assert torch.equal(torch.isfinite(logits[0, t]), finite)
        torch.testing.assert_close(logits[0, t][finite], want[finite], rtol=1e-9, atol=1e-9, msg=f"block after position {t}")


# ----------------------------------------------------------------------------- the loss


def test_dpace_weights_are_their_definition():
    # Written out for K = 3, alpha = 0.5: s_k = 0.5 q_k + 0.5 on scored slots, 1 elsewhere;
    # P_k = prod_{j<=k} s_j; w_k = m_k sum_{i>=k} m_i P_i.
    q = torch.tensor([[0.5, 0.2, 0.9], [0.5, 0.2, 0.9], [0.0, 1.0, 1.0]])
    m = torch.tensor([[1, 1, 1], [1, 0, 1], [1, 1, 0]], dtype=torch.bool)
    w = dpace_weights(q, m, 0.5)
    # Row 1: s = .75, .6, .95; P = .75, .45, .4275.  Row 2: s = .75, 1, .95; P = .75, .75, .7125.
    # Row 3: s = .5, 1, 1; P = .5, .5, .5 (the third slot unscored).
    expected = torch.tensor([[0.75 + 0.45 + 0.4275, 0.45 + 0.4275, 0.4275], [0.75 + 0.7125, 0.0, 0.7125], [1.0, 0.5, 0.0]])
    torch.testing.assert_close(w, expected)
    # alpha = 1: every confidence counts as 1, the weight of a slot is the number of scored slots from it on.
    torch.testing.assert_close(dpace_weights(q, m, 1.0), torch.tensor([[3.0, 2, 1], [2, 0, 1], [2, 1, 0]]))
    # Against a loop over random values, and no gradient through q.
    gen = torch.Generator().manual_seed(0)
    q = torch.rand(5, 7, generator=gen, dtype=torch.float64, requires_grad=True)
    m = torch.rand(5, 7, generator=gen) > 0.3
    w = dpace_weights(q, m, 0.3)
    assert not w.requires_grad
    for n in range(5):
        s = [(0.7 * float(q[n, k].detach()) + 0.3) if m[n, k] else 1.0 for k in range(7)]
        P = [math.prod(s[: k + 1]) for k in range(7)]
        for k in range(7):
            assert float(w[n, k]) == pytest.approx(float(m[n, k]) * sum(float(m[n, i]) * P[i] for i in range(k, 7)), rel=1e-12)
    torch.testing.assert_close(decay_weights(4, 2.0), torch.tensor([1.0, math.exp(-0.5), math.exp(-1.0), math.exp(-1.5)]))
    torch.testing.assert_close(decay_weights(3, None), torch.ones(3))


@pytest.mark.parametrize(
    "weighting, anchors, labels",
    [("dpace", "scored", "data"), ("exp", "scored", "data"), ("uniform", "scored", "data"), ("dpace", "full_block", "data"), ("exp", "scored", "target_argmax")],
)
def test_loss_is_the_per_block_reference(target, weighting, anchors, labels):
    """Blocks at every answer token with a scored slot (with anchors full_block: every slot
    scored), fewer than max_anchors; slot k scored against x_{t+1+k} where it is an answer token
    (with labels target_argmax: against the target's greedy guess of it from x_0..x_{t+k}); sum of
    weight x cross-entropy / scored slots."""
    head = random_head(target, loss_weighting=weighting, dpace_alpha=0.4, decay_gamma=2.0, block_size=4, anchors=anchors, labels=labels)
    ids = torch.randint(3, V - 1, (2, 12), generator=torch.Generator().manual_seed(6))
    mask = torch.zeros_like(ids)
    mask[0, 4:] = 1
    mask[1, 2:7] = 1  # an answer that ends inside the row: the last blocks are scored in part
    loss, stats = head.loss(target.features(ids, layers=head.required_layers()), mask)
    K = head.depth
    with torch.no_grad():
        greedy = target.model(ids).logits.argmax(-1)  # [2,12]: position j's guess of x_{j+1}
    label_of = (lambda b, j: greedy[b, j - 1 : j]) if labels == "target_argmax" else (lambda b, j: ids[b, j : j + 1])
    assert labels == "data" or bool((greedy[:, :-1] != ids[:, 1:]).any())  # the two labels differ here
    blocks = 0
    total, slots, per_slot = 0.0, 0, [0] * K
    for b in range(2):
        for t in range(11):
            scored = [t + 1 + k < 12 and bool(mask[b, t + 1 + k]) for k in range(1, K + 1)]
            if not (mask[b, t + 1] and (all(scored) if anchors == "full_block" else any(scored))):
                continue  # an anchor is an answer token with at least one scored slot (full_block: all)
            blocks += 1
            logits = reference_block(head, target.model, ids[b, : t + 1].tolist(), int(ids[b, t + 1]))
            ce = [float(F.cross_entropy(logits[k : k + 1], label_of(b, t + 2 + k))) if scored[k] else 0.0 for k in range(K)]
            if weighting == "dpace":
                s = [(0.6 * math.exp(-ce[k]) + 0.4) if scored[k] else 1.0 for k in range(K)]
                P = [math.prod(s[: k + 1]) for k in range(K)]
                w = [sum(P[i] for i in range(k, K) if scored[i]) for k in range(K)]
            else:
                w = [math.exp(-k / 2.0) if weighting == "exp" else 1.0 for k in range(K)]
            for k in range(K):
                if scored[k]:
                    total += w[k] * ce[k]
                    slots += 1
                    per_slot[k] += 1
    assert stats["count"].tolist() == per_slot
    assert float(loss.detach()) == pytest.approx(total / slots, rel=1e-9)
    # Row 0's answer (4..11) runs to the row's end, row 1's (2..6) ends inside it; block anchors
    # t..t+3: full blocks end by the answer's last token, t <= 7 and t <= 2, scored ones t <= 9, 4.
    assert blocks == (5 + 2 if anchors == "full_block" else 7 + 4)


def test_block_loss_keeps_the_graph_when_nothing_is_trained():
    ce = torch.rand(2, 3, requires_grad=True)
    loss = block_loss(ce, torch.zeros(2, 3, dtype=torch.bool), torch.ones(3))
    assert float(loss.detach()) == 0.0 and loss.requires_grad


def test_anchors_are_all_eligible_positions_or_a_sample_without_replacement():
    eligible = torch.zeros(3, 40, dtype=torch.bool)
    eligible[0, 5:30] = True
    eligible[1, [3, 9]] = True
    torch.manual_seed(0)
    anchors = sample_anchors(eligible, 8)
    assert anchors.shape == (3, 8)
    first = anchors[0].tolist()
    assert len(set(first)) == 8 and first == sorted(first) and all(5 <= a < 30 for a in first)
    assert anchors[1].tolist() == [3, 9] + [-1] * 6 and anchors[2].tolist() == [-1] * 8
    assert sample_anchors(eligible, 100)[0, :25].tolist() == list(range(5, 30))


def test_training_samples_max_anchors_per_row(target):
    head = random_head(target, max_anchors=3).train()
    ids = torch.randint(3, V - 1, (2, 16), generator=torch.Generator().manual_seed(2))
    _, stats = head.loss(target.features(ids, layers=head.required_layers()), torch.ones_like(ids))
    # 3 blocks per row, each with its K slots inside the row (anchors far enough from the end or not).
    assert 2 * 3 * 1 <= float(stats["count"][0]) <= 2 * 3 and float(stats["count"].sum()) <= 2 * 3 * head.depth


def test_a_frozen_own_lm_head_gets_no_gradient_and_stays_the_targets(target):
    head = DFlashHead(DFlashConfig(aux_layer_ids=[1, 2, 4], block_size=4, num_layers=1, mask_token_id=V - 1, draft_vocab_size=20, train_lm_head=False), target.dims)
    head.init_from_target(target)
    head = head.double().train()
    assert not head.lm_head.weight.requires_grad
    ids = torch.randint(3, V - 1, (2, 16), generator=torch.Generator().manual_seed(4))
    loss, stats = head.loss(target.features(ids, layers=head.required_layers()), torch.ones_like(ids))
    loss.backward()
    assert float(stats["count"].sum()) > 0 and head.fc.weight.grad is not None and head.fc.weight.grad.abs().sum() > 0
    assert head.lm_head.weight.grad is None
    torch.testing.assert_close(head.lm_head.weight, target.lm_head_weight()[head.draft_ids].double())


# ----------------------------------------------------------------------------- the mask token


def test_the_mask_token_is_chosen_where_no_text_reaches(tiny_tokenizer):
    tok = tiny_tokenizer
    n = len(tok)
    assert choose_mask_token(n + 8, tok)[0] == n  # the first row past the tokenizer (z-lab's choice)
    # No spare row: a special token the data never holds, not bos/eos/pad/unk (<|im_start|> is 1).
    assert choose_mask_token(n, tok, seen=[5, 6])[0] == tok.convert_tokens_to_ids("<|im_start|>")
    # Every such special in the data (chat templates hold <|im_start|>): the highest unseen id.
    assert choose_mask_token(n, tok, seen=[1, n - 1])[0] == n - 2
    assert choose_mask_token(10, None, seen=[9, 8])[0] == 7
    with pytest.raises(ValueError, match="set recipe key 'head.mask_token_id'"):
        choose_mask_token(3, None, seen=[0, 1, 2])


def test_init_chooses_or_checks_the_mask_token(target):
    examples = [{"input_ids": [3, 4, 47, 5, 6], "loss_mask": [0, 0, 0, 1, 1]}, {"input_ids": [7, 8, 46, 9], "loss_mask": [0, 0, 1, 1]}]
    head = DFlashHead(DFlashConfig(aux_layer_ids=[1, 2, 4], mask_embedding=True), target.dims)
    head.init_from_data(examples)
    note = head.init_from_target(target)
    assert head.cfg.mask_token_id == 45 and "mask token id 45" in note  # 47 and 46 occur in the data
    torch.testing.assert_close(head.mask_embedding.data, target.model.get_input_embeddings().weight[45].float())
    # An explicit id that is an answer token is refused (vLLM would read such an anchor as a mask slot).
    with pytest.raises(ValueError, match=r"'head.mask_token_id'=46 is a token of the training answers \(1 times\)"):
        DFlashHead(DFlashConfig(aux_layer_ids=[1, 2, 4], mask_token_id=46), target.dims).init_from_data(examples)
    # A prompt token is not emitted by the target: allowed.
    DFlashHead(DFlashConfig(aux_layer_ids=[1, 2, 4], mask_token_id=47), target.dims).init_from_data(examples)


# ----------------------------------------------------------------------------- configuration


def test_registered_with_eagle3s_layer_convention(target):
    assert HEADS["dflash"] is DFlashHead
    eight = FrozenTarget(tiny_causal_lm("llama", vocab_size=V, hidden_size=H, num_layers=8, seed=0))
    head = DFlashHead(DFlashConfig(mask_token_id=0), eight.dims)
    # vLLM's default (2, N//2, N-3) for N = 8, as EAGLE-3's: the two share one feature cache.
    assert head.cfg.aux_layer_ids == [2, 4, 5] and head.required_layers() == [1, 3, 4]
    assert head.required_layers() == HEADS["eagle3"](HEADS["eagle3"].config_class(), eight.dims).required_layers()
    assert head.depth == 7 and head.cfg.head_dim == H // 4 and head.cfg.num_layers == 5
    assert {n for n, _ in head.named_parameters()} >= {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.4.self_attn.k_norm.weight"}
    assert not any(n.startswith(("lm_head", "embed")) for n in head.state_dict())


def test_per_draft_layer_rule_reads_z_labs_layers(target):
    """z-lab's and SpecForge's rule, in vLLM's capture ids (their 0-based layer outputs + 1): their
    Qwen3-8B draft (36 layers, 5 draft layers) reads outputs 1, 9, 17, 25, 33; one draft layer reads
    the middle layer's output."""
    assert per_draft_layer_ids(36, 5) == [2, 10, 18, 26, 34]
    assert per_draft_layer_ids(30, 1) == [16] and per_draft_layer_ids(8, 2) == [2, 6]
    eight = FrozenTarget(tiny_causal_lm("llama", vocab_size=V, hidden_size=H, num_layers=8, seed=0))
    one = DFlashHead(DFlashConfig(mask_token_id=0, num_layers=1, aux_layer_rule="per_draft_layer"), eight.dims)
    assert one.cfg.aux_layer_ids == [5] and one.required_layers() == [4] and one.fc.in_features == H
    assert DFlashHead(DFlashConfig(mask_token_id=0, num_layers=2, aux_layer_rule="per_draft_layer"), eight.dims).cfg.aux_layer_ids == [2, 6]
    # Explicit ids win over the rule.
    assert DFlashHead(DFlashConfig(mask_token_id=0, num_layers=1, aux_layer_rule="per_draft_layer", aux_layer_ids=[3]), eight.dims).cfg.aux_layer_ids == [3]
    # A draft deeper than the target has room for: the rule's ids collide, refused in one line.
    with pytest.raises(ValueError, match=r"recipe key 'head.aux_layer_ids' must name one or more distinct layers"):
        DFlashHead(DFlashConfig(mask_token_id=0, num_layers=3, aux_layer_rule="per_draft_layer"), target.dims)


def test_bad_configurations_fail_in_one_line(target):
    cases = [
        (dict(block_size=1), "recipe key 'head.block_size' must be >= 2"),
        (dict(aux_layer_ids=[1, 5]), "recipe key 'head.aux_layer_ids'=[1, 5] lies outside the target: ids run from 1"),
        (dict(aux_layer_ids=[2, 2]), "recipe key 'head.aux_layer_ids' must name one or more distinct layers"),
        (dict(aux_layer_ids=[1], mask_token_id=V), f"recipe key 'head.mask_token_id'={V} is outside the target's vocabulary of {V}"),
        (dict(aux_layer_ids=[1], draft_vocab_size=V + 1), "recipe key 'head.draft_vocab_size'=49 is larger"),
        (dict(aux_layer_ids=[1], dpace_alpha=0.0), "recipe keys 'head.dpace_alpha' in (0, 1]"),
    ]
    for cfg, message in cases:
        with pytest.raises(ValueError) as err:
            DFlashHead(DFlashConfig(**cfg), target.dims)
        assert message in str(err.value) and "\n" not in str(err.value), (cfg, str(err.value))


@pytest.mark.parametrize(
    "head, message",
    [
        ("{kind: dflash, block_size: 1}", "recipe key 'head.block_size' must be >= 2"),
        ("{kind: dflash, aux_layer_ids: [1, 2, 9]}", "recipe key 'head.aux_layer_ids'=[1, 2, 9] lies outside the target"),
        ("{kind: dflash, aux_layer_ids: [1, 2, 3], mask_token_id: 5000}", "recipe key 'head.mask_token_id'=5000 is outside the target's vocabulary"),
    ],
)
def test_cli_refuses_bad_settings_in_one_line_exit_2_writing_nothing(tmp_path, tiny_llama_dir, capsys, head, message):
    from draftsmith import cli
    from draftsmith.testing import write_chats

    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"trainer: heads\noutput_dir: {tmp_path / 'run'}\ntarget: {{path: {tiny_llama_dir}}}\n"
        f"data: {{path: {write_chats(tmp_path / 'chats.jsonl', n=8)}, eval_size: 2}}\nhead: {head}\n"
    )
    assert cli.main(["train", str(recipe)]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], errors
    assert not (tmp_path / "run" / "checkpoints").exists()
