"""Self-speculative decoding (runtime/early_exit.py) on tiny random Llama and Qwen2 models in fp32.

Greedy output is token-identical to HF ``generate(do_sample=False)`` at every exit layer and chain
length, with real rollbacks; every decoder layer computes each position exactly once (the first E
layers' cache from drafting is reused, never recomputed); after a step the shared cache equals a
fresh forward. Sampled output follows the target's distribution (chi-square), and the same check
rejects a verifier that always accepts. Bad exit layers, branching trees and models whose layers
cannot be skipped are refused in one line.
"""

import pytest
import torch

from draftsmith.runtime import verify as verify_module
from draftsmith.runtime.drafters import DrafterError
from draftsmith.runtime.early_exit import EarlyExitDrafter, ExitLayerError
from draftsmith.runtime.generate import TargetSession, speculative_generate
from draftsmith.runtime.tree import TreeSpec, default_tree
from draftsmith.runtime.verify import SamplingParams, verify_greedy
from draftsmith.target import FrozenTarget
from draftsmith.testing import joint_p_value, tiny_causal_lm, tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["Hi", "x", "The quick brown fox", "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"]
MAX_NEW = 24
EOS = 2


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def setup(request):
    tokenizer = tiny_tokenizer()
    target = FrozenTarget(tiny_causal_lm(request.param, vocab_size=len(tokenizer), num_layers=4, seed=0))
    prompts = [torch.tensor([tokenizer.encode(p)]) for p in PROMPTS]
    references = [
        target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=EOS, pad_token_id=0)
        for ids in prompts
    ]
    return target, prompts, references


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("exit_layer,length", [(1, 4), (2, 1), (2, 3), (3, 6)])
def test_greedy_self_speculation_equals_hf_greedy(setup, exit_layer, length, cache):
    target, prompts, references = setup
    drafter = EarlyExitDrafter(target, exit_layer, TreeSpec.chain(length))
    accepted = drafted = 0
    for ids, reference in zip(prompts, references):
        out, st = speculative_generate(target, drafter, ids, MAX_NEW, eos_token_id=EOS, cache=cache)
        assert out.tolist() == reference.tolist(), f"exit {exit_layer}, chain {length}, prompt {ids.tolist()}"
        accepted += sum(st.accept_lens)
        drafted += sum(st.draft_depths)
    assert 0 < accepted < drafted  # random early exits agree sometimes: rollbacks really happen


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_every_layer_computes_each_position_once(setup, cache):
    """Tokens through each decoder layer over a generation = tokens the target cached (prefill plus
    every verified tree): the early layers never recompute what drafting computed."""
    target, prompts, _ = setup
    seen = [0] * len(target.layers)
    hooks = [
        layer.register_forward_hook(lambda m, args, out, i=i: seen.__setitem__(i, seen[i] + args[0].shape[1]))
        for i, layer in enumerate(target.layers)
    ]
    try:
        ids = prompts[2]
        out, st = speculative_generate(target, EarlyExitDrafter(target, 2, TreeSpec.chain(3)), ids, MAX_NEW, eos_token_id=EOS, cache=cache)
    finally:
        for hook in hooks:
            hook.remove()
    verified = sum(depth + 1 for depth in st.draft_depths)  # chain nodes, root included, per step
    assert seen == [ids.shape[1] - 1 + verified] * len(target.layers), (seen, verified)
    assert sum(st.accept_lens) < sum(st.draft_depths)  # some of them were rolled back


def test_shared_cache_after_a_step_matches_a_fresh_forward(setup):
    target = setup[0]
    prompt = torch.tensor([[5, 9, 14, 3, 22, 7]])
    session = TargetSession(target)
    drafter = EarlyExitDrafter(target, 2, TreeSpec.chain(3))
    drafter.bind(session)
    drafter.reset(prompt)
    session.prefill(prompt[:, :-1])
    from draftsmith.runtime.drafters import DraftState

    tree = drafter.propose(DraftState(tokens=prompt))
    # Drafting filled the first two layers' caches only: the root and two of the three drafts.
    assert session.cached_lengths() == [5 + 3, 5 + 3, 5, 5]
    logits, _, _ = drafter.verify_forward(tree)
    assert session.cached_lengths() == [5 + 4] * 4
    with torch.no_grad():
        full = target.model(torch.cat([prompt, tree.tokens[:, 1:]], 1)).logits[0, 5:]
    torch.testing.assert_close(logits[0], full, atol=1e-5, rtol=1e-5)
    result = verify_greedy(tree, logits)
    drafter.accept(result)
    a = int(result.accept_len[0])
    session.keep(result.path[0, : a + 1])
    assert session.cached_lengths() == [5 + a + 1] * 4 == [session.length] * 4
    decided = torch.cat([prompt, result.accepted_tokens[:, :a], result.bonus.view(1, 1)], 1)
    # The next step drafts on the rolled-back cache and verifies to the fresh forward's logits.
    tree = drafter.propose(DraftState(tokens=decided))
    logits, _, _ = drafter.verify_forward(tree)
    with torch.no_grad():
        full = target.model(torch.cat([decided, tree.tokens[:, 1:]], 1)).logits[0, decided.shape[1] - 1 :]
    torch.testing.assert_close(logits[0], full, atol=1e-5, rtol=1e-5)


def test_bad_exit_layers_trees_and_model_families_are_refused():
    target = FrozenTarget(tiny_causal_lm("llama", vocab_size=40, hidden_size=32, num_layers=3))
    for bad in (0, 3, -1):
        with pytest.raises(ExitLayerError, match=r"outside 1\.\.2: the model has 3 decoder layers"):
            EarlyExitDrafter(target, bad)
    with pytest.raises(DrafterError, match="drafts a chain"):
        EarlyExitDrafter(target, 1, default_tree(3, (2, 1, 1)))
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = FrozenTarget(GPT2LMHeadModel(GPT2Config(vocab_size=40, n_embd=32, n_layer=2, n_head=2)))
    with pytest.raises(DrafterError, match=r"GPT2LMHeadModel \(model_type gpt2\): its decoder layers cannot be skipped"):
        EarlyExitDrafter(gpt2, 1)


# ---------------------------------------------------------------- sampling

V = 8
PROMPT = torch.tensor([[3, 4, 5]])
TEMPERATURE, TOP_P = 0.8, 0.9


def _peaky():
    """A tiny 2-layer model whose next-token laws are far from uniform, and whose exit after layer
    1 disagrees with its full output (so drafts get rejected)."""
    model = tiny_causal_lm("llama", vocab_size=V, hidden_size=16, num_layers=2, seed=0)
    with torch.no_grad():
        model.lm_head.weight.mul_(15.0)
    return model


def _joint_p_value(n, seed):
    """(chi-square p-value of the first two sampled tokens against the target's law, drafts accepted)."""
    model = _peaky()
    target = FrozenTarget(model)
    drafter = EarlyExitDrafter(target, 1, TreeSpec.chain(2))
    gen = torch.Generator().manual_seed(seed)
    pairs, accepted = [], 0
    for _ in range(n):
        out, st = speculative_generate(target, drafter, PROMPT, 2, SamplingParams("sample", TEMPERATURE, top_p=TOP_P), generator=gen)
        pairs.append((int(out[0, 3]), int(out[0, 4])))
        accepted += st.accept_lens[0]
    return joint_p_value(pairs, model, PROMPT, TEMPERATURE, TOP_P), accepted


def test_sampled_self_speculation_follows_the_target():
    p_value, accepted = _joint_p_value(500, seed=0)
    assert p_value > 1e-3
    assert 0 < accepted < 2 * 500  # the exit's drafts are sometimes accepted, sometimes not


def test_the_sampling_check_rejects_a_verifier_that_always_accepts(monkeypatch):
    monkeypatch.setattr(verify_module, "_accepts", lambda u, p_x, q_x: torch.ones_like(p_x, dtype=torch.bool))
    assert _joint_p_value(200, seed=0)[0] < 1e-6
