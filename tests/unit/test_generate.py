"""The decoding loop: KV-cache bookkeeping against fresh forwards, stopping rules, stats, errors."""

import pytest
import torch

from draftsmith.runtime.drafters import DrafterError, StandaloneDrafter
from draftsmith.runtime.generate import GenerationStats, TargetSession, Verdict, autoregressive_generate, read_verdict, speculative_generate
from draftsmith.runtime.tree import DraftTree, TreeSpec, default_tree
from draftsmith.runtime.verify import SamplingParams, verify_greedy
from draftsmith.target import FrozenTarget
from draftsmith.testing import tiny_causal_lm


pytestmark = pytest.mark.usefixtures("one_thread")

V = 60


def _target(arch="llama", seed=0):
    return FrozenTarget(tiny_causal_lm(arch, vocab_size=V, hidden_size=32, num_layers=2, seed=seed))


def _hf_greedy(target, ids, n, eos=None):
    out = target.model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, eos_token_id=eos, pad_token_id=0
    )
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_kv_cache_after_a_step_matches_a_fresh_forward(arch):
    """After verify + keep, the cache holds prefix + accepted + 1 entries, and the next tree's
    logits equal a full forward over all decided tokens (fp32)."""
    target = _target(arch)
    prompt = torch.tensor([[5, 9, 14, 3, 22, 7]])
    session = TargetSession(target)
    session.prefill(prompt[:, :-1])
    with torch.no_grad():
        greedy = target.model(prompt).logits[0, -1].argmax().item()
        after = target.model(torch.cat([prompt, torch.tensor([[greedy]])], 1)).logits[0, -1].argmax().item()
    # root 7 -> wrong, right(greedy) -> right(after) -> wrong ; right -> sibling
    tree = DraftTree.from_lists([7, (greedy + 1) % V, greedy, after, (after + 1) % V], [-1, 0, 0, 2, 2])
    logits, _, _ = session.forward_tree(tree)
    assert session.cache.get_seq_length() == 5 + 5
    result = verify_greedy(tree, logits)
    assert result.path.tolist() == [[0, 2, 3]]
    session.keep(result.path[0, :3])
    assert session.length == session.cache.get_seq_length() == 5 + 2 + 1
    decided = torch.cat([prompt, torch.tensor([[greedy, after]])], 1)
    next_tree = DraftTree.from_lists([int(result.bonus), 1, 2, 3], [-1, 0, 1, 0])
    next_logits, _, _ = session.forward_tree(next_tree)
    with torch.no_grad():
        for node, path in enumerate([[0], [0, 1], [0, 1, 2], [0, 3]]):
            full = target.model(torch.cat([decided, next_tree.tokens[:, path]], 1)).logits[0, -1]
            torch.testing.assert_close(next_logits[0, node], full, atol=1e-5, rtol=1e-5)


def test_stats_count_attempts_and_accepts_per_depth():
    stats = GenerationStats()
    tree = DraftTree.from_lists([0, 1, 2, 3, 4], [-1, 0, 0, 1, 3])  # depth 3 along 0-1-3-4; node 2 a leaf
    logits = torch.zeros(1, 5, 8)
    logits[0, 0, 2] = 1  # accept node 2 (a leaf): depth 1 accepted, depth 2 never judged
    stats.record_step(read_verdict(tree, verify_greedy(tree, logits), root=0))
    logits = torch.zeros(1, 5, 8)
    logits[0, 0, 1] = logits[0, 1, 3] = 1  # accept 1, 3; reject 4
    stats.record_step(read_verdict(tree, verify_greedy(tree, logits), root=0))
    assert stats.accept_lens == [1, 2] and stats.draft_depths == [3, 3]
    assert stats.depth_attempts == [2, 1, 1] and stats.depth_accepts == [2, 1]
    assert stats.mean_accept_len == 1.5 and stats.to_dict()["steps"] == 2


def test_one_read_says_the_whole_verdict():
    """read_verdict on a tree grown on the device (depth not known on the host, padding at the
    end): the emitted tokens, the depths judged, the deepest real node, whether it was rooted,
    the accepted path."""
    tree = DraftTree(
        tokens=torch.tensor([[7, 1, 2, 3, 0]]), parents=torch.tensor([[-1, 0, 0, 1, -1]]),
        depths=torch.tensor([[0, 1, 1, 2, 0]]), num_nodes=torch.tensor([4]), known_depth_bound=4,
    )  # fmt: skip
    logits = torch.zeros(1, 5, 8)
    logits[0, 0, 1] = logits[0, 1, 3] = logits[0, 3, 5] = 1  # accept 1 then 3 (a leaf); the bonus is 5
    result = verify_greedy(tree, logits)
    assert result.accepted_tokens.shape == (1, 4)  # sized by the bound, -1 past the path
    verdict = read_verdict(tree, result, root=7)
    assert verdict == Verdict(accept_len=2, emitted=[1, 3, 5], attempted=2, draft_depth=2, rooted=True, path=[0, 1, 3])
    logits[0, 3, 5], logits[0, 1, 3] = 0, 0
    logits[0, 1, 6] = 1  # accept 1 only; node 3 (its child) was judged and rejected
    assert read_verdict(tree, verify_greedy(tree, logits), root=7) == Verdict(1, [1, 6], 2, 2, True, [0, 1])
    assert not read_verdict(tree, result, root=8).rooted


def test_never_emits_past_max_new_tokens_or_eos():
    target = _target()
    prompt = torch.tensor([[4, 8, 15, 16, 23, 42]])
    reference = _hf_greedy(target, prompt, 20)[0, 6:].tolist()
    for n in (0, 1, 3, 5, 7):  # self-drafting accepts 4 per step: most cuts land mid-step
        out, stats = speculative_generate(target, StandaloneDrafter(target.model, TreeSpec.chain(4)), prompt, n)
        assert out[0, 6:].tolist() == reference[:n] and stats.new_tokens == n
    eos = reference[6]
    first = reference.index(eos)
    out, _ = speculative_generate(target, StandaloneDrafter(target.model, TreeSpec.chain(4)), prompt, 20, eos_token_id=[eos, -5])
    assert out[0, 6:].tolist() == reference[: first + 1]
    base, _ = autoregressive_generate(target, prompt, 20, eos_token_id=eos)
    assert torch.equal(base, out)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_autoregressive_baseline_equals_hf_greedy(arch):
    target = _target(arch, seed=1)
    prompt = torch.tensor([[1, 30, 31, 2, 40]])
    out, stats = autoregressive_generate(target, prompt, 15)
    assert torch.equal(out, _hf_greedy(target, prompt, 15))
    assert stats.target_forwards == 15 and stats.steps == 15


def test_one_token_prompt():
    target = _target()
    prompt = torch.tensor([[11]])
    out, stats = speculative_generate(target, StandaloneDrafter(target.model, default_tree(3, (2, 2))), prompt, 12)
    assert torch.equal(out, _hf_greedy(target, prompt, 12))
    assert stats.target_forwards == stats.steps  # nothing to prefill


def test_autoregressive_sampling_is_reproducible_and_uses_the_generator():
    target = _target()
    prompt = torch.tensor([[3, 4]])
    a, _ = autoregressive_generate(target, prompt, 10, SamplingParams("sample", 1.5), generator=torch.Generator().manual_seed(7))
    b, _ = autoregressive_generate(target, prompt, 10, SamplingParams("sample", 1.5), generator=torch.Generator().manual_seed(7))
    c, _ = autoregressive_generate(target, prompt, 10, SamplingParams("sample", 1.5), generator=torch.Generator().manual_seed(8))
    assert torch.equal(a, b) and not torch.equal(a, c)


class _WrongRoot:
    def required_layers(self):
        return []

    def reset(self, prompt):
        pass

    def propose(self, state):
        return DraftTree.from_lists([state.root + 1], [-1])

    def accept(self, result):
        pass


def test_errors():
    target = _target()
    with pytest.raises(ValueError, match="batch size 1"):
        speculative_generate(target, StandaloneDrafter(target.model), torch.zeros(2, 3, dtype=torch.long), 4)
    with pytest.raises(ValueError, match="mode"):
        speculative_generate(target, StandaloneDrafter(target.model), torch.zeros(1, 3, dtype=torch.long), 4, SamplingParams("beam"))
    with pytest.raises(DrafterError, match="root"):
        speculative_generate(target, _WrongRoot(), torch.zeros(1, 3, dtype=torch.long), 4)


def test_typical_acceptance_in_the_loop_at_its_two_extremes():
    """Typical acceptance (NOT lossless) through speculative_generate: a threshold no probability
    passes accepts nothing, so every step emits the target's argmax and the output is the greedy
    one; a vanishing threshold accepts whatever a random draft proposes."""
    target = _target(seed=2)
    draft = tiny_causal_lm("llama", vocab_size=V, hidden_size=16, num_layers=1, seed=9)
    prompt = torch.tensor([[1, 30, 31, 2, 40]])
    strict, stats = speculative_generate(
        target, StandaloneDrafter(draft, TreeSpec.chain(3)), prompt, 12, SamplingParams("typical", 0.8, posterior_threshold=1.0, posterior_alpha=10.0),
    )
    assert torch.equal(strict, _hf_greedy(target, prompt, 12)) and sum(stats.accept_lens) == 0
    _, lax = speculative_generate(
        target, StandaloneDrafter(draft, TreeSpec.chain(3)), prompt, 12, SamplingParams("typical", 0.8, posterior_threshold=1e-12, posterior_alpha=1e-12),
    )
    assert lax.accept_lens[:-1] == lax.draft_depths[: len(lax.accept_lens) - 1] and sum(lax.accept_lens) >= 9
    with pytest.raises(ValueError, match="top-k / top-p"):
        speculative_generate(target, StandaloneDrafter(draft), prompt, 4, SamplingParams("typical", 0.8, top_p=0.9))
