"""`evaluate` counts the drafter's forward passes: one per tree level for a head that feeds its
own outputs back (EAGLE), one per step for a block drafter (DFlash), none counted for heads
without a layer stack, and never the passes of transformers' assisted generation."""

from pathlib import Path

import pytest
import torch

from draftsmith.data.chat import encode_prompt, stop_token_ids
from draftsmith.heads.dflash import DFlashConfig, DFlashHead
from draftsmith.heads.eagle import EagleConfig, EagleHead
from draftsmith.heads.medusa import MedusaConfig, MedusaHead
from draftsmith.eval.run import evaluate
from draftsmith.runtime.drafters import HeadDrafter, StandaloneDrafter
from draftsmith.runtime.generate import speculative_generate
from draftsmith.runtime.load import LoadedDrafter
from draftsmith.runtime.tree import TreeSpec
from draftsmith.target import FrozenTarget
from draftsmith.testing import tiny_causal_lm, tiny_tokenizer

MAX_NEW = 20
CHATS = [[{"role": "user", "content": text}] for text in ("say red cat", "add 2 and 3", "the quick brown fox")]


@pytest.fixture(scope="module")
def target():
    tokenizer = tiny_tokenizer()
    return FrozenTarget(tiny_causal_lm("llama", vocab_size=len(tokenizer), seed=0), tokenizer)


def _dflash(target):
    torch.manual_seed(1)
    head = DFlashHead(DFlashConfig(aux_layer_ids=[1, target.dims.num_layers], num_layers=2, block_size=4), target.dims)
    head.init_from_target(target)
    return head


def _eagle(target):
    torch.manual_seed(2)
    return EagleHead(EagleConfig(depth=3, num_layers=2), target.dims)


def _loaded(target, drafter, **kw):
    return LoadedDrafter(kind="test", drafter=drafter, target=target, folder=Path("."), target_path="tiny", **kw)


def _draft_depths(target, drafter):
    """Each step's deepest drafted node, decoding the same prompts as evaluate does (greedy)."""
    depths, stops = [], stop_token_ids(target.tokenizer, target.model.generation_config)
    for messages in CHATS:
        ids = torch.tensor([encode_prompt(target.tokenizer, messages)])
        _, g = speculative_generate(target, drafter, ids, MAX_NEW, eos_token_id=stops)
        depths += g.draft_depths
    return depths


@pytest.mark.parametrize(
    "build, forwards",
    [
        # DFlash: one block forward drafts every depth, however many layers the head has.
        (lambda t: HeadDrafter(_dflash(t), t, TreeSpec.chain(3)), lambda depths: sum(d > 0 for d in depths)),
        # EAGLE: the forward that reads the accepted tokens drafts depth 1; each further depth is one more.
        (lambda t: HeadDrafter(_eagle(t), t, TreeSpec.chain(3)), lambda depths: sum(depths)),
    ],
    ids=["dflash", "eagle"],
)
def test_draft_forwards_per_generated_token(target, build, forwards):
    drafter = build(target)
    stats, extra = evaluate(_loaded(target, drafter), CHATS, max_new_tokens=MAX_NEW, baseline=False, progress=False)
    expected = forwards(_draft_depths(target, build(target)))
    assert expected > 0 and extra["draft_forwards"] == expected
    assert extra["draft_forwards_per_token"] == round(expected / stats.new_tokens, 4)


def test_assisted_generation_passes_are_not_the_drafters(target):
    draft = tiny_causal_lm("llama", vocab_size=len(target.tokenizer), hidden_size=32, num_layers=1, seed=5)
    loaded = _loaded(target, StandaloneDrafter(draft, TreeSpec.chain(3)), draft_model=draft)
    stats, extra = evaluate(loaded, CHATS, max_new_tokens=MAX_NEW, baseline=False, assisted=True, progress=False)
    assert stats.assisted_tokens_per_second is not None  # assisted generation ran with the same draft model
    # A standalone drafter's first forward reads the tokens it has not seen and drafts depth 1.
    assert extra["draft_forwards"] == sum(_draft_depths(target, StandaloneDrafter(draft, TreeSpec.chain(3))))


def test_heads_without_a_layer_stack_report_no_count(target):
    head = MedusaHead(MedusaConfig(num_heads=3, num_layers=1), target.dims)
    _, extra = evaluate(_loaded(target, HeadDrafter(head, target, TreeSpec.chain(3))), CHATS[:1], max_new_tokens=8, baseline=False, progress=False)
    assert "draft_forwards" not in extra and "draft_forwards_per_token" not in extra


def test_timings_follow_an_untimed_generation_of_each_kind_that_changes_nothing_else(target, monkeypatch):
    """With the baseline timed, evaluate first decodes the first prompt once each way, untimed
    (first calls, and on a GPU every graph's capture, would otherwise land in the first timed
    generation). What a drafter carries across generations is put back after it: a suffix matcher
    with its cross-answer cache, which would otherwise meet the first prompt's own answer again,
    accepts exactly what it accepts without the warm-up."""
    import draftsmith.eval.run as run
    from draftsmith.runtime.lookup import LookupDrafter, SuffixMatcher

    calls = {"speculative": 0, "plain": 0}
    speculative, plain = run.speculative_generate, run.autoregressive_generate

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(run, "speculative_generate", counted("speculative", speculative))
    monkeypatch.setattr(run, "autoregressive_generate", counted("plain", plain))
    chats = CHATS + CHATS[:1]  # the first prompt again: the cross-answer cache has its answer by then
    figures = {}
    for baseline in (False, True):
        drafter = LookupDrafter(SuffixMatcher(global_cache=True))
        stats, extra = evaluate(_loaded(target, drafter), chats, max_new_tokens=MAX_NEW, baseline=baseline, progress=False)
        summary = stats.summary()
        figures[baseline] = ({k: summary[k] for k in ("mean_accepted_length", "acceptance_rate", "per_depth_acceptance")}, stats.new_tokens,
                             drafter.reliability.tested, drafter.reliability.accepted)  # fmt: skip
    assert calls == {"speculative": 2 * len(chats) + 1, "plain": len(chats) + 1}
    assert figures[True] == figures[False] and figures[True][0]["mean_accepted_length"] > 1  # the cache drafted, and the same
    assert extra["greedy_identical_to_baseline"] == f"{len(chats)}/{len(chats)}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_low_precision_target_whose_outputs_part_is_explained(monkeypatch, dtype):
    """Greedy outputs that differ from the plain baseline under a bf16 target come with the reason
    (rounding, not verification) and the way to identical outputs; in fp32 a difference is left to
    speak for itself (it would be a bug)."""
    import draftsmith.eval.run as run
    from draftsmith.runtime.lookup import LookupDrafter, PromptLookup

    tokenizer = tiny_tokenizer()
    target = FrozenTarget(tiny_causal_lm("llama", vocab_size=len(tokenizer), seed=0).to(dtype), tokenizer)
    plain = run.autoregressive_generate

    def parted(*args, **kwargs):  # the baseline's last token changed: the outputs part
        out, stats = plain(*args, **kwargs)
        out = out.clone()
        out[0, -1] = (out[0, -1] + 1) % target.dims.vocab_size
        return out, stats

    monkeypatch.setattr(run, "autoregressive_generate", parted)
    _, extra = evaluate(_loaded(target, LookupDrafter(PromptLookup())), CHATS[:2], max_new_tokens=6, progress=False)
    assert extra["greedy_identical_to_baseline"] == "0/2"
    if dtype == torch.float32:
        assert "greedy_identity_note" not in extra
    else:
        assert "bfloat16" in extra["greedy_identity_note"] and "--dtype float32" in extra["greedy_identity_note"]
