"""EAGLE-3 heads: the draft vocabulary chosen from the data and its d2t/t2d, the loss against its
definition, the engines' auxiliary-layer convention, and bad configurations in one line. That the
training forward computes what the runtime drafts is the head contract's (test_head_contract.py);
that vLLM computes the same is tests/interop's."""

import pytest
import torch

from draftsmith.heads import HEADS
from draftsmith.heads.eagle3 import Eagle3Config, Eagle3Head
from draftsmith.heads.vocab import draft_vocabulary
from draftsmith.target import FrozenTarget
from draftsmith.testing import tiny_causal_lm

V = 48


@pytest.fixture(scope="module")
def target():
    return FrozenTarget(tiny_causal_lm("llama", vocab_size=V, hidden_size=32, num_layers=8, seed=0))


def test_registered_and_default_layers_follow_vllm(target):
    assert HEADS["eagle3"] is Eagle3Head
    head = Eagle3Head(Eagle3Config(), target.dims)
    # vLLM's default (2, N//2, N-3) for N = 8; id L is the output of our decoder layer L - 1.
    assert head.cfg.aux_layer_ids == [2, 4, 5] and head.required_layers() == [1, 3, 4]
    assert head.cfg.draft_vocab_size == V  # min(32000, the target's vocabulary)
    feats = target.features(torch.randint(3, V, (1, 6)), layers=head.required_layers())
    ref = target.model(feats.input_ids, output_hidden_states=True).hidden_states
    for layer, vllm_id in zip(head.required_layers(), head.cfg.aux_layer_ids):
        # HF's hidden_states[L] is the input of decoder layer L (for L < N): vLLM's id L.
        torch.testing.assert_close(feats.hidden[layer], ref[vllm_id])


def test_draft_vocabulary_by_frequency_and_its_maps():
    examples = [
        {"input_ids": [5, 7, 7, 9, 9, 9, 2], "loss_mask": [0, 1, 1, 1, 1, 1, 1]},
        {"input_ids": [3, 3, 3, 11, 9], "loss_mask": [0, 0, 0, 1, 1]},  # the 3s are prompt: not counted
    ]
    vocab = draft_vocabulary(examples, vocab_size=16, draft_vocab_size=3)
    # Scored counts: 9 x4, 7 x2, 2 x1, 11 x1 -> the 3 most frequent, ties to the lower id, ascending.
    assert vocab.ids.tolist() == [2, 7, 9]
    assert (torch.arange(3) + vocab.d2t).tolist() == [2, 7, 9]
    assert vocab.t2d.nonzero().flatten().tolist() == [2, 7, 9]
    assert vocab.coverage == pytest.approx(7 / 8)
    # Fewer distinct scored tokens than asked: the lowest unused ids fill the rest.
    assert draft_vocabulary(examples, 16, 6).ids.tolist() == [0, 1, 2, 7, 9, 11]
    with pytest.raises(ValueError, match="a draft vocabulary of 17 tokens does not fit a target vocabulary of 16"):
        draft_vocabulary(examples, 16, 17)


def test_init_from_data_sets_the_maps_and_the_lm_head_rows(target):
    head = Eagle3Head(Eagle3Config(draft_vocab_size=8), target.dims)
    gen = torch.Generator().manual_seed(0)
    examples = [{"input_ids": torch.randint(3, V, (20,), generator=gen).tolist(), "loss_mask": [1] * 20} for _ in range(6)]
    note = head.init_from_data(examples)
    head.init_from_target(target)
    expected = draft_vocabulary(examples, V, 8)
    assert torch.equal(head.d2t, expected.d2t) and torch.equal(head.t2d, expected.t2d)
    assert "draft vocabulary of 8 tokens covers" in note
    # The LM head starts as the target's rows of those tokens, and logits land on those target ids.
    torch.testing.assert_close(head.lm_head.weight, target.lm_head_weight()[expected.ids])
    logits = head.logits(torch.randn(2, 32))
    assert logits.shape == (2, V)
    assert torch.isfinite(logits).sum(-1).tolist() == [8, 8]
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == expected.ids.tolist()


def test_top_tokens_rank_the_draft_vocabulary_as_the_full_logits_do(target, monkeypatch):
    """Evaluation's top-k over the draft vocabulary alone, named in target ids: what a top-k over
    the logits spread over the whole vocabulary gives (10 draft tokens of 48, top 5, then every
    one), without spreading them (the spread raises inside top_tokens here)."""
    import draftsmith.heads.eagle3 as eagle3

    head = Eagle3Head(Eagle3Config(draft_vocab_size=10, depth=3, train_depth=3), target.dims)
    gen = torch.Generator().manual_seed(1)
    head.init_from_data([{"input_ids": torch.randint(3, V, (40,), generator=gen).tolist(), "loss_mask": [1] * 40}])
    head.init_from_target(target)
    feats = target.features(torch.randint(3, V, (2, 9), generator=gen), layers=head.required_layers())
    with torch.no_grad():
        full = {k: head(feats).topk(k, dim=-1).indices for k in (5, 10)}
        spread = eagle3.to_target_vocab
        monkeypatch.setattr(eagle3, "to_target_vocab", lambda *a: (_ for _ in ()).throw(AssertionError("spread over the vocabulary")))
        for k in (5, 10):
            top = head.top_tokens(feats, k)
            assert top.shape == (2, 9, 3, k) and set(top.unique().tolist()) <= set(head.draft_ids.tolist())
            assert torch.equal(top, full[k])
        monkeypatch.setattr(eagle3, "to_target_vocab", spread)


@pytest.mark.parametrize("out_of_vocab", ["skip", "keep"])
def test_loss_is_the_soft_cross_entropy_on_the_draft_vocabulary(target, out_of_vocab):
    """skip: positions whose label is outside the draft vocabulary are left out; keep (speculators'
    rule): every trained position, against the target renormalised over the draft vocabulary."""
    torch.manual_seed(1)
    head = Eagle3Head(Eagle3Config(draft_vocab_size=24, depth=2, train_depth=2, out_of_vocab=out_of_vocab), target.dims)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    ids = torch.randint(3, V, (2, 12), generator=torch.Generator().manual_seed(2))
    feats = target.features(ids, layers=head.required_layers())
    mask = torch.ones_like(ids)
    loss, stats = head.loss(feats, mask)
    vocab = head.draft_ids
    with torch.no_grad():
        outputs, _ = head.unroll(feats, 2)
        expected, counts = [], []
        for s in (1, 2):
            T = 12 - 1 - s  # positions t with a label x_{t+1+s}
            labels = ids[:, 1 + s :]
            keep = head.t2d[labels] if out_of_vocab == "skip" else torch.ones_like(labels, dtype=torch.bool)
            draft = torch.log_softmax(head.draft_logits(outputs[s - 1][:, :T]), dim=-1)
            teacher = torch.softmax(feats.logits[:, s : s + T][..., vocab], dim=-1)
            expected.append(-(teacher * draft).sum(-1)[keep].mean())
            counts.append(float(keep.sum()))
    assert stats["count"].tolist() == counts and 0 < counts[0] <= 2 * 10
    assert (counts[0] < 2 * 10) == (out_of_vocab == "skip")  # some labels fell outside the draft vocabulary
    torch.testing.assert_close(stats["ce"], torch.stack(expected))
    weights = torch.tensor([1.0, 0.8])
    torch.testing.assert_close(loss, (weights * torch.stack(expected)).sum() / weights.sum())


def test_bad_configurations_fail_in_one_line(target):
    small = FrozenTarget(tiny_causal_lm("llama", vocab_size=V, hidden_size=32, num_layers=3))
    with pytest.raises(ValueError, match=r"default auxiliary layers \(2, N//2, N-3\) = \(2, 1, 0\) of a 3-layer target"):
        Eagle3Head(Eagle3Config(), small.dims)
    with pytest.raises(ValueError, match=r"'head.aux_layer_ids'=\[1, 5, 9\] lies outside the target: ids run from 1 .* to 8"):
        Eagle3Head(Eagle3Config(aux_layer_ids=[1, 5, 9]), target.dims)
    with pytest.raises(ValueError, match="must name 3 distinct layers"):
        Eagle3Head(Eagle3Config(aux_layer_ids=[2, 2, 5]), target.dims)
    with pytest.raises(ValueError, match=f"'head.draft_vocab_size'=64 is larger than the target's vocabulary of {V}"):
        Eagle3Head(Eagle3Config(draft_vocab_size=64), target.dims)


@pytest.mark.parametrize(
    "head, message",
    [
        ("{kind: eagle3, aux_layer_ids: [1, 2, 9]}", "recipe key 'head.aux_layer_ids'=[1, 2, 9] lies outside the target"),
        ("{kind: eagle3, aux_layer_ids: [1, 2, 3], draft_vocab_size: 5000}", "recipe key 'head.draft_vocab_size'=5000 is larger than the target's vocabulary"),
    ],
)
def test_cli_refuses_settings_the_target_cannot_take(tmp_path, tiny_llama_dir, capsys, head, message):
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


def _rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def test_the_eagle31_switches_compute_what_speculators_and_vllm_define(target):
    """norm_before_fc: one RMSNorm over the concatenated states before fc; fc_norm: one per state;
    both (vLLM's order): input_norm first. norm_output: a step hands norm(s) on, and the logits are
    lm_head of that same normed state. Written out by hand against the head's own modules."""
    torch.manual_seed(0)
    feats = target.features(torch.randint(3, V, (1, 6)), layers=[1, 3, 4])
    states = [feats.hidden[i] for i in (1, 3, 4)]
    for switches in ({"norm_before_fc": True}, {"fc_norm": True}, {"norm_before_fc": True, "fc_norm": True}, {}):
        head = Eagle3Head(Eagle3Config(**switches), target.dims)
        with torch.no_grad():
            for p in head.parameters():
                p.add_(torch.randn_like(p) * 0.1)  # norms away from 1, so a skipped norm shows
        eps = head.cfg.rms_norm_eps
        x = torch.cat(states, dim=-1)
        if switches.get("norm_before_fc"):
            x = _rms(x, head.input_norm.weight, eps)
        if switches.get("fc_norm"):
            x = torch.cat([_rms(part, norm.weight, eps) for norm, part in zip(head.fc_norm, x.chunk(3, -1))], dim=-1)
        torch.testing.assert_close(head.feature(feats.final_hidden, feats.hidden), x @ head.fc.weight.T)
        assert ("input_norm.weight" in head.runtime_state_dict()) == bool(switches.get("norm_before_fc"))
        assert ("fc_norm.2.weight" in head.runtime_state_dict()) == bool(switches.get("fc_norm"))
    plain, normed = (Eagle3Head(Eagle3Config(norm_output=on), target.dims) for on in (False, True))
    normed.load_state_dict(plain.state_dict())
    s = torch.randn(2, 32)
    torch.testing.assert_close(plain.carry(s), s)
    torch.testing.assert_close(normed.carry(s), _rms(s, normed.norm.weight, normed.cfg.rms_norm_eps))
    # The logits of a step are the same either way; what differs is the state the next step reads.
    torch.testing.assert_close(normed.draft_logits(normed.carry(s)), plain.draft_logits(plain.carry(s)))


def test_a_frozen_lm_head_gets_no_gradient_and_stays_the_targets(target):
    head = Eagle3Head(Eagle3Config(draft_vocab_size=24, depth=2, train_depth=2, train_lm_head=False), target.dims)
    head.init_from_target(target)
    assert not head.lm_head.weight.requires_grad
    ids = torch.randint(3, V, (1, 10), generator=torch.Generator().manual_seed(3))
    loss, _ = head.loss(target.features(ids, layers=head.required_layers()), torch.ones_like(ids))
    loss.backward()
    assert head.lm_head.weight.grad is None and head.fc.weight.grad is not None
    torch.testing.assert_close(head.lm_head.weight, target.lm_head_weight()[head.draft_ids])
