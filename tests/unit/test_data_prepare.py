"""prepare_data end to end on small files: the deterministic train/eval split, examples identical to
tokenizing the selected conversations, exact counts, caches that are hit when nothing changed and
missed when anything that matters did, regeneration feeding the examples, and one-line errors."""

import copy
import json
from pathlib import Path

import pytest

from draftsmith.data import DataError, load_conversations, prepare_data, tokenize_conversation
from draftsmith.data import prepare as prepare_module
from draftsmith.recipe import DataConfig, RegenerateConfig
from draftsmith.testing import tiny_causal_lm


pytestmark = pytest.mark.usefixtures("one_thread")


def U(text):
    return {"role": "user", "content": text}


def A(text):
    return {"role": "assistant", "content": text}


def write_edge_case_chats(path: Path) -> Path:
    records = [{"messages": [U(f"question {i}?"), A(f"answer {i}."), U(f"more {i}?"), A(f"yes {i}")]} for i in range(10)]
    records.append({"messages": [U("a prompt nobody answered")]})
    records.append({"messages": [U("too long " * 20), A("this answer lies beyond max_length")]})
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def config(path, **kwargs):
    values = dict(path=str(path), eval_size=3, max_length=64, seed=5)
    values.update(kwargs)
    return DataConfig(**values)


def expected_examples(tokenizer, conversations, max_length):
    out = []
    for conversation in conversations:
        while conversation and conversation[-1]["role"] != "assistant":
            conversation = conversation[:-1]
        if conversation:
            example = tokenize_conversation(tokenizer, conversation, max_length)
            if any(example["loss_mask"]):
                out.append(example)
    return out


def trained_text(tokenizer, example):
    return tokenizer.decode([t for t, m in zip(example["input_ids"], example["loss_mask"]) if m])


def test_split_examples_and_counts(tiny_tokenizer, tmp_path):
    path = write_edge_case_chats(tmp_path / "chats.jsonl")
    data = prepare_data(config(path), tiny_tokenizer, tmp_path / "cache", progress=False)
    conversations = load_conversations(str(path), seed=5)
    train_conv, eval_conv = conversations[:9], conversations[9:]
    assert data.train == expected_examples(tiny_tokenizer, train_conv, 64)
    assert data.eval == expected_examples(tiny_tokenizer, eval_conv, 64)
    s = data.stats
    assert (s["records"], s["kept"], s["train_conversations"], s["eval_conversations"]) == (12, 12, 9, 3)
    # By construction: one conversation has no answer, one has its answer beyond max_length.
    assert s["dropped_no_answer"] == 1 and s["dropped_no_trained_tokens"] == 1
    assert s["train_examples"] + s["eval_examples"] == 10
    assert s["tokens"] == sum(len(e["input_ids"]) for e in data.train)
    assert s["trained_tokens"] == sum(sum(e["loss_mask"]) for e in data.train)
    assert s["cached"] is False and s["regenerated"] is False
    # Held-out answers never appear in training.
    train_answers = {trained_text(tiny_tokenizer, e) for e in data.train}
    assert not train_answers & {trained_text(tiny_tokenizer, e) for e in data.eval}
    # A different seed holds out different conversations.
    other = prepare_data(config(path, seed=6), tiny_tokenizer, tmp_path / "cache", progress=False)
    assert {trained_text(tiny_tokenizer, e) for e in other.eval} != {trained_text(tiny_tokenizer, e) for e in data.eval}


def test_cache_is_hit_only_when_nothing_changed(tiny_tokenizer, tmp_path, monkeypatch):
    path = write_edge_case_chats(tmp_path / "chats.jsonl")
    cache = tmp_path / "cache"
    first = prepare_data(config(path), tiny_tokenizer, cache, progress=False)

    def no_reading(*args, **kwargs):
        raise AssertionError("read the source although the cache holds the result")

    monkeypatch.setattr(prepare_module, "load_conversations", no_reading)
    second = prepare_data(config(path), tiny_tokenizer, cache, progress=False)
    assert second.train == first.train and second.eval == first.eval
    assert second.stats == {**first.stats, "cached": True}
    # packing and cache_dir change how examples are batched or where they live, not what they are.
    assert prepare_data(config(path, packing=True), tiny_tokenizer, cache, progress=False).stats["cached"]

    changed_template = copy.deepcopy(tiny_tokenizer)
    changed_template.chat_template = tiny_tokenizer.chat_template.replace("<|im_end|>' + '\n'", "<|im_end|>' + '\n\n'")
    assert changed_template.chat_template != tiny_tokenizer.chat_template
    for cfg, tokenizer in [
        (config(path, max_length=32), tiny_tokenizer),
        (config(path, eval_size=2), tiny_tokenizer),
        (config(path, limit=11), tiny_tokenizer),
        (config(path), changed_template),
    ]:
        with pytest.raises(AssertionError, match="read the source"):
            prepare_data(cfg, tokenizer, cache, progress=False)
    # The source file itself changing is a miss too.
    path.write_text(path.read_text().replace("answer 3.", "answer three."))
    with pytest.raises(AssertionError, match="read the source"):
        prepare_data(config(path), tiny_tokenizer, cache, progress=False)


def test_regenerated_answers_become_the_examples(tiny_tokenizer, tmp_path, monkeypatch):
    path = write_edge_case_chats(tmp_path / "chats.jsonl")
    model = tiny_causal_lm("llama", vocab_size=len(tiny_tokenizer), seed=0)
    regen = RegenerateConfig(enabled=True, max_new_tokens=6, batch_size=4, max_turns=1)
    cfg = config(path, regenerate=regen)
    data = prepare_data(cfg, tiny_tokenizer, tmp_path / "cache", target_model=model, progress=False)
    files = list((tmp_path / "cache").glob("regenerated-*.jsonl"))
    assert len(files) == 1
    lines = [json.loads(line) for line in files[0].read_text().splitlines()]
    regenerated = [r["messages"] for r in sorted(lines, key=lambda r: r["index"])]
    assert len(regenerated) == 12  # train and eval conversations alike
    assert data.train == expected_examples(tiny_tokenizer, regenerated[:9], 64)
    assert data.eval == expected_examples(tiny_tokenizer, regenerated[9:], 64)
    # The too-long conversation's prompt fills max_length, so it is not answered at all.
    assert data.stats["regenerated"] is True and data.stats["dropped_no_answer"] == 1
    assert regenerated.count([]) == 1
    texts = [trained_text(tiny_tokenizer, e) for e in data.train + data.eval]
    assert not any("answer" in t or "yes" in t for t in texts)  # the file's answers are gone
    # The prompt nobody answered got an answer; it is a training or eval example now.
    assert data.stats["train_examples"] + data.stats["eval_examples"] == 11

    # Another eval split re-tokenizes but reuses every regenerated answer.
    monkeypatch.setattr(model, "generate", lambda *a, **k: pytest.fail("regenerated although the answers are cached"))
    again = prepare_data(config(path, regenerate=regen, eval_size=2), tiny_tokenizer, tmp_path / "cache", target_model=model, progress=False)
    assert again.stats["cached"] is False
    assert again.train + again.eval == data.train + data.eval


def test_errors_name_the_recipe_key_or_file(tiny_tokenizer, tmp_path):
    path = write_edge_case_chats(tmp_path / "chats.jsonl")
    with pytest.raises(DataError, match="data.regenerate.enabled needs the target model"):
        prepare_data(config(path, regenerate=RegenerateConfig(enabled=True)), tiny_tokenizer, tmp_path / "c", progress=False)
    with pytest.raises(DataError, match="data.eval_size=12 leaves no training conversations"):
        prepare_data(config(path, eval_size=12), tiny_tokenizer, tmp_path / "c", progress=False)
    with pytest.raises(DataError, match=r"no usable examples after filtering .*chats\.jsonl.*data\.max_length=8"):
        prepare_data(config(path, max_length=8, eval_size=0), tiny_tokenizer, tmp_path / "c", progress=False)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "hello"}) + "\n" + json.dumps({"prompt": "again"}) + "\n")
    with pytest.raises(DataError, match="prompt-only data needs data.regenerate.enabled=true"):
        prepare_data(config(prompts, eval_size=0), tiny_tokenizer, tmp_path / "c", progress=False)
    # The counts describe the training split alone, not the held-out conversation too.
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("one", "two", "three")))
    with pytest.raises(DataError, match="2 training conversations, 2 without an assistant answer"):
        prepare_data(config(prompts, eval_size=1), tiny_tokenizer, tmp_path / "c", progress=False)
    with pytest.raises(DataError, match="data file not found"):
        prepare_data(config(tmp_path / "missing.jsonl"), tiny_tokenizer, tmp_path / "c", progress=False)


def test_cli_prepare_regenerates_records_the_recipe_and_training_reuses_it(tmp_path, tiny_llama_dir, tiny_tokenizer, capsys):
    from draftsmith import cli
    from draftsmith.recipe import load_recipe

    path = tmp_path / "r.yaml"
    path.write_text(
        f"""
trainer: heads
output_dir: {tmp_path / 'run'}
target: {{path: {tiny_llama_dir}}}
data: {{path: {write_edge_case_chats(tmp_path / 'chats.jsonl')}, eval_size: 3, max_length: 64, regenerate: {{enabled: true, max_new_tokens: 6}}}}
head: {{kind: medusa, num_heads: 2}}
"""
    )
    assert cli.main(["prepare", str(path)]) == 0
    out = capsys.readouterr().out
    data_dir = tmp_path / "run" / "data"
    assert f"data cached in {data_dir.resolve()}" in out
    stats = json.loads(out[: out.rindex("}") + 1])
    assert stats["regenerated"] is True and stats["train_examples"] > 0 and stats["cached"] is False
    assert len(list(data_dir.glob("regenerated-*.jsonl"))) == 1 and len(list(data_dir.glob("examples-*.pt"))) == 1
    assert load_recipe(data_dir / "recipe.yaml").data.regenerate.enabled
    assert (data_dir / "command.txt").read_text().split()[1:3] == ["prepare", str(path)]
    # The training run of the same recipe finds everything prepared: no second regeneration.
    from draftsmith.target import FrozenTarget

    recipe = load_recipe(path)
    again = prepare_data(recipe.data, tiny_tokenizer, recipe.data_dir(), target_model=FrozenTarget.load(str(tiny_llama_dir)).model, progress=False)
    assert again.stats["cached"] is True and len(again.train) == stats["train_examples"]


def test_what_the_data_step_left_out_is_said_in_one_line(tiny_tokenizer, tmp_path):
    """train logs this line: a record the file holds but training never sees is not a silent loss."""
    from draftsmith.trainers.data import describe_data

    path = write_edge_case_chats(tmp_path / "chats.jsonl")
    with path.open("a") as fh:
        fh.write(json.dumps({"messages": [{"role": "system", "content": "only a system turn"}]}) + "\n")
    data = prepare_data(config(path), tiny_tokenizer, tmp_path / "cache", progress=False)
    line = describe_data(data.stats, len(data.train), len(data.eval))
    assert line.startswith(f"data: 13 records (messages), {len(data.train)} training and {len(data.eval)} held-out examples; left out: ")
    assert "1 malformed or empty records" in line and "1 conversations without an assistant answer" in line
    assert "1 conversations with no trained token within data.max_length" in line
    again = prepare_data(config(path), tiny_tokenizer, tmp_path / "cache", progress=False)
    assert describe_data(again.stats, len(again.train), len(again.eval)).endswith("read from the data cache")
