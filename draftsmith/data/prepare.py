"""One entry point from a recipe's ``data:`` section to tokenized train and eval examples.

load conversations (limit, seed) -> hold out cfg.eval_size of them -> optionally let the target
rewrite the assistant turns -> tokenize with the chat template and assistant-only loss masks ->
drop examples with nothing to train on.

Two caches live in ``cache_dir``: the regenerated conversations (JSONL, resumable, the expensive
part) and the tokenized examples (one torch file). Both are keyed by hashes of what determines
their content (source file, data settings, tokenizer, target weights), so a changed input never
reads a stale cache and an unchanged one is not recomputed. The tokenizer and model are identified
by content, not by path: the same model loaded from its GGUF file or from its dequantized copy
shares the caches.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from draftsmith.atomic import atomic_path
from draftsmith.data.chat import tokenize_conversation
from draftsmith.data.errors import DataError
from draftsmith.data.regenerate import regenerate_conversations
from draftsmith.data.sources import load_conversations, resolve_data_path
from draftsmith.recipe import DataConfig
from draftsmith.target import model_fingerprint

# Bump when the meaning of cached examples changes (masking rules, cleaning rules, file layout).
CACHE_VERSION = 1


@dataclass
class PreparedData:
    """Tokenized examples ``{"input_ids": [int], "loss_mask": [int]}`` and counts of how they were made.

    stats: records, dropped_malformed, kept, selected, train_conversations, eval_conversations,
    regenerated, dropped_no_answer, dropped_no_trained_tokens, truncated, train_examples,
    eval_examples, tokens, trained_tokens (the last two over train), cached.
    """

    train: list[dict]
    eval: list[dict]
    stats: dict = field(default_factory=dict)


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:20]


def source_fingerprint(path: Path) -> dict:
    """Identity of a data file or folder: resolved path, sizes and modification times."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return {"path": str(path.resolve()), "files": [(str(p.name), p.stat().st_size, p.stat().st_mtime_ns) for p in files]}


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A hash of what decides how text becomes tokens: vocabulary, specials, chat template and the
    tokenization of a probe string (normalizers and merges)."""
    vocab = sorted(tokenizer.get_vocab().items())
    probe = "<|im_start|>user\nHello,  world! 1234 \t caf\u00e9 \u4e2d\u6587<|im_end|>\n"
    return _digest(
        {
            "vocab": hashlib.sha256(json.dumps(vocab).encode()).hexdigest(),
            "special": list(getattr(tokenizer, "all_special_tokens", [])),
            "eos": tokenizer.eos_token,
            "template": getattr(tokenizer, "chat_template", None),
            "probe": tokenizer(probe, add_special_tokens=False)["input_ids"],
        }
    )


def _pack(examples: list[dict]) -> dict:
    """Examples as three flat tensors: cheap to save and load, unlike lists of Python ints."""
    lengths = [len(e["input_ids"]) for e in examples]
    ids = [t for e in examples for t in e["input_ids"]]
    mask = [m for e in examples for m in e["loss_mask"]]
    return {
        "lengths": torch.tensor(lengths, dtype=torch.long),
        "input_ids": torch.tensor(ids, dtype=torch.long),
        "loss_mask": torch.tensor(mask, dtype=torch.uint8),
    }


def _unpack(packed: dict) -> list[dict]:
    ids = packed["input_ids"].tolist()
    mask = packed["loss_mask"].tolist()
    out, start = [], 0
    for n in packed["lengths"].tolist():
        out.append({"input_ids": ids[start : start + n], "loss_mask": mask[start : start + n]})
        start += n
    return out


def _tokenize_all(conversations: list[list[dict]], tokenizer: Any, max_length: int, counts: dict, progress: bool, desc: str) -> list[dict]:
    from tqdm.auto import tqdm

    examples = []
    for conversation in tqdm(conversations, desc=desc, unit="conv", disable=not progress, dynamic_ncols=True):
        # Trailing user turns have no answer to learn from; they would only use up max_length.
        end = len(conversation)
        while end and conversation[end - 1]["role"] != "assistant":
            end -= 1
        if end == 0:
            counts["dropped_no_answer"] += 1
            continue
        example = tokenize_conversation(tokenizer, conversation[:end], max_length)
        if not any(example["loss_mask"]):
            counts["dropped_no_trained_tokens"] += 1
            continue
        if len(example["input_ids"]) == max_length:
            counts["truncated"] += 1
        examples.append(example)
    return examples


def prepare_data(
    cfg: DataConfig,
    tokenizer: Any,
    cache_dir: Path,
    target_model: Any = None,
    progress: bool = True,
) -> PreparedData:
    """Tokenized train and eval examples for a recipe's ``data:`` section.

    The eval set is the last cfg.eval_size conversations of the seeded selection, held out before
    anything else happens. With ``cfg.regenerate.enabled`` the target (``target_model``, an HF causal
    LM sharing ``tokenizer``) rewrites the assistant turns of train and eval conversations alike, so
    evaluation also measures agreement with the target. Raises DataError, naming the recipe key or
    file, when the data cannot give a single training example.
    """
    cache_dir = Path(cache_dir)
    source = resolve_data_path(cfg.path)
    regen = cfg.regenerate
    if regen.enabled and regen.backend == "hf" and target_model is None:
        raise DataError("data.regenerate.enabled needs the target model, but prepare_data got target_model=None")
    if cfg.max_length <= 0:
        raise DataError(f"data.max_length must be positive, got {cfg.max_length}")
    if cfg.eval_size < 0:
        raise DataError(f"data.eval_size must be >= 0, got {cfg.eval_size}")

    selection = {"source": source_fingerprint(source), "format": cfg.format, "limit": cfg.limit, "seed": cfg.seed}
    tok_id = tokenizer_fingerprint(tokenizer)
    regen_key = None
    if regen.enabled:
        # What decides the answers: the server's address, concurrency and retries do not.
        settings = {k: v for k, v in dataclasses.asdict(regen).items() if k not in ("backend", "server")}
        if regen.backend != "hf":
            settings.update(backend=regen.backend, model=regen.server.model)
        model = model_fingerprint(target_model) if target_model is not None else regen.server.model
        regen_key = _digest({"selection": selection, "tokenizer": tok_id, "model": model, "regenerate": settings, "max_length": cfg.max_length})
    key = _digest(
        {
            "version": CACHE_VERSION,
            "selection": selection,
            "eval_size": cfg.eval_size,
            "max_length": cfg.max_length,
            "tokenizer": tok_id,
            "regenerated": regen_key,
        }
    )
    cache_file = cache_dir / f"examples-{key}.pt"
    if cache_file.is_file():
        saved = torch.load(cache_file, weights_only=True)
        return PreparedData(_unpack(saved["train"]), _unpack(saved["eval"]), {**saved["stats"], "cached": True})

    counts: dict = {}
    conversations = load_conversations(cfg.path, cfg.format, cfg.limit, cfg.seed, stats=counts)
    n_eval = cfg.eval_size
    if n_eval >= len(conversations):
        raise DataError(
            f"data.eval_size={n_eval} leaves no training conversations: {cfg.path} gives {len(conversations)} "
            f"usable conversations (data.limit={cfg.limit})"
        )
    n_train = len(conversations) - n_eval
    counts.update(train_conversations=n_train, eval_conversations=n_eval, regenerated=regen.enabled)
    if regen.enabled:
        conversations = regenerate_conversations(
            target_model,
            tokenizer,
            conversations,
            regen,
            cache_dir / f"regenerated-{regen_key}.jsonl",
            progress=progress,
            max_length=cfg.max_length,
        )
    counts.update(dropped_no_answer=0, dropped_no_trained_tokens=0, truncated=0)
    train = _tokenize_all(conversations[:n_train], tokenizer, cfg.max_length, counts, progress, "tokenize")
    # The error below reports the training split's own drops, before the eval split adds to them.
    train_drops = counts["dropped_no_answer"], counts["dropped_no_trained_tokens"]
    evaluation = _tokenize_all(conversations[n_train:], tokenizer, cfg.max_length, counts, progress, "tokenize eval")
    if not train:
        raise DataError(
            f"no usable examples after filtering {cfg.path}: {n_train} training conversations, "
            f"{train_drops[0]} without an assistant answer, {train_drops[1]} with no "
            f"assistant token within data.max_length={cfg.max_length}"
            + (" (prompt-only data needs data.regenerate.enabled=true)" if train_drops[0] and not regen.enabled else "")
        )
    counts.update(
        train_examples=len(train),
        eval_examples=len(evaluation),
        tokens=sum(len(e["input_ids"]) for e in train),
        trained_tokens=sum(sum(e["loss_mask"]) for e in train),
    )
    with atomic_path(cache_file) as tmp:  # readers (other ranks, later runs) never see a partial file
        torch.save({"train": _pack(train), "eval": _pack(evaluation), "stats": counts}, tmp)
    return PreparedData(train, evaluation, {**counts, "cached": False})
