"""Regeneration with a tiny model: batched, left-padded, multi-turn greedy answers equal the model's own
one-at-a-time greedy generate; an interrupted run resumes to the uninterrupted run's file byte for
byte; sampled answers do not depend on batching; token budgets and max_turns hold."""

import json

import pytest
import torch

from draftsmith.data import regenerate_conversations
from draftsmith.data.regenerate import _row_sampler
from draftsmith.recipe import RegenerateConfig
from draftsmith.sampling import logits_to_probs
from draftsmith.testing import answering_model, tiny_tokenizer


def U(text):
    return {"role": "user", "content": text}


def A(text):
    return {"role": "assistant", "content": text}


CONVERSATIONS = [
    [U("Hi"), A("original answer that the target replaces")],
    [{"role": "system", "content": "Be terse."}, U("What is the capital of France?"), A("Paris."), U("And of Italy?"), A("Rome.")],
    [U("Tell me a story about a dragon.")],
    [U("x"), U("y"), U("z")],  # prompt-only, three turns (MT-bench style)
    [U("2+2=?"), A("4"), U("Why?"), A("Because.")],
    [U("Name three colors")],
    [U("Why is the sky blue?"), A("Rayleigh scattering.")],
]
MAX_NEW = 16


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return answering_model(tok)


def reference(model, tok, conversation, max_new_tokens=MAX_NEW, max_turns=None):
    """One conversation, one turn at a time, through HF generate without padding."""
    messages = [m for m in conversation[:1] if m["role"] == "system"]
    users = [m["content"] for m in conversation if m["role"] == "user"][:max_turns]
    for question in users:
        messages = messages + [U(question)]
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        out = model.generate(input_ids=ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        new = out[0, ids.shape[1] :].tolist()
        ended = tok.eos_token_id in new
        new = new[: new.index(tok.eos_token_id)] if ended else new
        messages = messages + [{"role": "assistant", "content": tok.decode(new, skip_special_tokens=True), "complete": ended, "token_ids": new}]
    return messages


def run(model, tok, path, conversations=CONVERSATIONS, **cfg):
    settings = dict(enabled=True, max_new_tokens=MAX_NEW, batch_size=3)
    settings.update(cfg)
    return regenerate_conversations(model, tok, conversations, RegenerateConfig(**settings), path, progress=False)


def test_batched_greedy_equals_one_at_a_time(model, tok, tmp_path):
    got = run(model, tok, tmp_path / "regen.jsonl")
    expected = [reference(model, tok, c) for c in CONVERSATIONS]
    assert got == expected
    answers = [m for c in got for m in c if m["role"] == "assistant"]
    # The setup exercises both endings, and multi-turn prompts that carry earlier answers.
    assert any(m["complete"] for m in answers) and any(not m["complete"] for m in answers)
    assert len(got[3]) == 6 and [m["role"] for m in got[3]] == ["user", "assistant"] * 3
    assert got[1][0] == {"role": "system", "content": "Be terse."}
    assert "original answer" not in json.dumps(got)


def test_max_turns_truncates_the_rest(model, tok, tmp_path):
    got = run(model, tok, tmp_path / "regen.jsonl", max_turns=1)
    assert got == [reference(model, tok, c, max_turns=1) for c in CONVERSATIONS]
    assert all(sum(m["role"] == "assistant" for m in c) == 1 for c in got)


def test_interrupted_run_resumes_to_the_same_file(model, tok, tmp_path, monkeypatch):
    full_file = tmp_path / "full.jsonl"
    full = run(model, tok, full_file)
    cache = tmp_path / "resumed.jsonl"
    original = model.generate
    calls = {"n": 0}

    def generate_until_first_batch_is_saved(*args, **kwargs):
        if cache.exists() and cache.read_text().count("\n") >= 3:
            raise KeyboardInterrupt  # killed after the first batch of 3 was flushed
        calls["n"] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(model, "generate", generate_until_first_batch_is_saved)
    with pytest.raises(KeyboardInterrupt):
        run(model, tok, cache)
    first_calls = calls["n"]
    assert cache.read_text().count("\n") == 3
    # A run killed mid-write leaves half a line behind.
    with open(cache, "a") as fh:
        fh.write('{"index": 4, "key": "0123')
    monkeypatch.setattr(model, "generate", lambda *a, **k: (calls.__setitem__("n", calls["n"] + 1), original(*a, **k))[1])
    resumed = run(model, tok, cache)
    assert resumed == full
    assert cache.read_bytes() == full_file.read_bytes()
    # Only the unfinished conversations were generated again.
    total_calls = calls["n"]
    calls["n"] = 0
    run(model, tok, tmp_path / "again.jsonl")
    assert total_calls == calls["n"] and first_calls > 0
    # A finished cache generates nothing.
    monkeypatch.setattr(model, "generate", lambda *a, **k: pytest.fail("regenerated a cached conversation"))
    assert run(model, tok, cache) == full


def test_cache_lines_from_other_settings_are_not_reused(model, tok, tmp_path):
    path = tmp_path / "regen.jsonl"
    run(model, tok, path, max_new_tokens=4)
    assert run(model, tok, path, max_new_tokens=MAX_NEW) == run(model, tok, tmp_path / "fresh.jsonl", max_new_tokens=MAX_NEW)


def test_sampling_is_seeded_per_conversation(model, tok, tmp_path):
    sampled = run(model, tok, tmp_path / "a.jsonl", temperature=1.0, top_p=0.9, batch_size=4)
    # Each conversation owns its generators: batching does not change a single draw.
    assert run(model, tok, tmp_path / "b.jsonl", temperature=1.0, top_p=0.9, batch_size=1) == sampled
    greedy = run(model, tok, tmp_path / "c.jsonl")
    other_seed = run(model, tok, tmp_path / "d.jsonl", temperature=1.0, top_p=0.9, batch_size=4, seed=1)
    assert sampled != greedy and sampled != other_seed


def test_max_length_bounds_prompts_and_answers(model, tok, tmp_path):
    long_first = [U("a very long question " * 5), A("x")]  # its prompt alone exceeds max_length
    conversations = CONVERSATIONS + [long_first]
    max_length = 80
    got = regenerate_conversations(model, tok, conversations, RegenerateConfig(enabled=True, max_new_tokens=MAX_NEW, batch_size=3), tmp_path / "r.jsonl", progress=False, max_length=max_length)
    unbounded = run(model, tok, tmp_path / "u.jsonl")
    assert got[-1] == []  # nothing to answer within max_length: no turns at all
    for conversation, bounded, free in zip(conversations, got, unbounded):
        turns = len([m for m in bounded if m["role"] == "assistant"])
        # Greedy answers under a budget are prefixes of the unbounded ones, and each prompt plus
        # its answer fits in the training window.
        for i, message in enumerate(bounded):
            if message["role"] == "assistant":
                assert free[i]["content"].startswith(message["content"])
                prompt = tok.apply_chat_template(bounded[:i], tokenize=False, add_generation_prompt=True)
                assert len(tok(prompt, add_special_tokens=False)["input_ids"]) + len(tok(message["content"], add_special_tokens=False)["input_ids"]) <= max_length
        # A turn is left out only when its prompt alone fills the window.
        users = [m["content"] for m in conversation if m["role"] == "user"]
        if turns < len(users):
            prompt = tok.apply_chat_template(bounded + [U(users[turns])], tokenize=False, add_generation_prompt=True)
            assert len(tok(prompt, add_special_tokens=False)["input_ids"]) >= max_length
    assert got != unbounded  # the budget did bind somewhere


def test_sampling_filters_top_p_as_the_runtime_does():
    """Regeneration samples from logits_to_probs, the runtime's processing: the tail beyond
    cumulative mass top_p goes (the most likely token always stays), renormalised."""
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.05, 0.15, 0.3, 0.5]])
    picked = set()
    for seed in range(60):
        sampler = _row_sampler([torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 100)], 1.0, 0.8)
        out = sampler(torch.zeros(2, 1, dtype=torch.long), probs.log())
        assert (out == 0).sum(-1).tolist() == [1, 1]  # one token left per row: generate's greedy step takes it
        picked |= {(r, int(out[r].argmax())) for r in range(2)}
    assert picked == {(0, 0), (0, 1), (1, 2), (1, 3)}  # 0.15 and 0.05 lie past 0.8 of the mass
    torch.testing.assert_close(logits_to_probs(probs.log(), top_p=0.85)[0], torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95)
