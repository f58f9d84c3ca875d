"""Assistant turns rewritten by the target, so the drafter learns the target's own distribution.

Conversations are answered turn by turn: the target sees the conversation up to a user turn (with
its own earlier answers), generates, its answer is appended, and the next user turn follows.
Generation is batched with left padding through ``model.generate``.

Determinism: greedy decoding is a pure function of the prompt. Sampling draws each token from a
torch.Generator owned by one (conversation, turn), seeded from (cfg.seed, conversation index,
turn), so a conversation's answer does not depend on which batch it lands in, and a resumed run
gives the same answers as an uninterrupted one.

Two backends answer (data.regenerate.backend): ``hf``, transformers' ``generate()`` in this
process, and ``server``, an OpenAI-compatible serving engine (draftsmith/data/server.py). Both
store each answer's token ids beside its text (``"token_ids"`` in the assistant message), and the
examples are built from those ids: the drafter trains on the tokens the target produced, not on a
re-tokenization of their decoded text, which can differ.

The cache is a JSONL file, one line per finished conversation with its index and a key hashing the
source conversation and the generation settings; lines are appended and flushed as conversations
finish (after every batch for ``hf``, every conversation for ``server``). A rerun skips every
conversation whose line is there, and a half-written last line (a run killed mid-write) is cut off
before appending.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch
from torch import Tensor

from draftsmith.data.chat import render_chat, stop_token_ids
from draftsmith.data.errors import DataError
from draftsmith.recipe import RegenerateConfig
from draftsmith.sampling import logits_to_probs

if TYPE_CHECKING:
    from draftsmith.data.server import RegenerationServer

Conversation = list[dict]


def _split(conversation: Conversation, max_turns: Optional[int]) -> tuple[Conversation, list[str]]:
    """(leading system message or [], the user turns to answer)."""
    system = [dict(conversation[0])] if conversation and conversation[0]["role"] == "system" else []
    users = [m["content"] for m in conversation if m["role"] == "user"]
    return system, users[:max_turns] if max_turns is not None else users


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, ensure_ascii=False).encode()).hexdigest()[:20]


def _settings(cfg: RegenerateConfig, max_length: Optional[int]) -> dict:
    # batch_size and the server's address and concurrency are left out: they change how work is
    # grouped, not what is generated.
    settings = {
        "max_new_tokens": cfg.max_new_tokens,
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "max_turns": cfg.max_turns,
        "seed": cfg.seed,
        "max_length": max_length,
    }
    if cfg.backend != "hf":  # an engine's answers can differ from generate()'s in the last bits
        settings.update(backend=cfg.backend, model=cfg.server.model)
    return settings


def _turn_seed(seed: int, index: int, turn: int) -> int:
    digest = hashlib.sha256(f"draftsmith-regenerate:{seed}:{index}:{turn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _row_sampler(generators: list[torch.Generator], temperature: float, top_p: float):
    from transformers import LogitsProcessor

    class RowSampler(LogitsProcessor):
        """Samples each row with its own generator, then leaves only that token: generate's greedy
        step picks it. One draw per row per step, so row r's k-th token uses its k-th draw."""

        def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
            probs = logits_to_probs(scores, temperature, top_p=top_p).cpu()  # the runtime's own processing
            chosen = torch.stack([torch.multinomial(probs[r], 1, generator=g) for r, g in enumerate(generators)])
            out = torch.full_like(scores, float("-inf"))
            return out.scatter(-1, chosen.to(scores.device), 0.0)

    return RowSampler()


def _row_budget(prompt_width: int, budgets: list[int]):
    from transformers import StoppingCriteria

    class RowBudget(StoppingCriteria):
        """Marks a row finished once it has generated its own token budget."""

        def __init__(self) -> None:
            self.budgets = torch.tensor(budgets)

        def __call__(self, input_ids: Tensor, scores, **kwargs) -> Tensor:
            generated = input_ids.shape[1] - prompt_width
            return (generated >= self.budgets).to(input_ids.device)

    return RowBudget()


def _read_cache(cache_file: Path, keys: list[str]) -> dict[int, Conversation]:
    """Finished conversations in the cache, by index; repairs a half-written last line."""
    if not cache_file.is_file():
        return {}
    data = cache_file.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with open(cache_file, "r+b") as fh:
            fh.truncate(end)
    done: dict[int, Conversation] = {}
    for line in data[:end].splitlines():
        try:
            record = json.loads(line)
            index = record["index"]
        except (json.JSONDecodeError, KeyError, TypeError):
            continue  # a damaged line is just redone
        if isinstance(index, int) and 0 <= index < len(keys) and record.get("key") == keys[index]:
            done[index] = record["messages"]
    return done


@torch.no_grad()
def _generate_turn(
    model: Any,
    tokenizer: Any,
    prompts: list[list[int]],
    budgets: list[int],
    generators: Optional[list[torch.Generator]],
    cfg: RegenerateConfig,
    stop_ids: list[int],
    pad_id: int,
) -> list[tuple[list[int], str, bool]]:
    """Answers to a batch of tokenized prompts: (token ids, text, complete) per prompt, complete
    meaning the target ended the answer itself rather than running into its token budget."""
    from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.as_tensor(prompt)  # left padding
        attention_mask[row, width - len(prompt) :] = 1
    # A fresh config: the model's own generation_config may ask for sampling or penalties.
    config = GenerationConfig(
        max_new_tokens=max(budgets),
        do_sample=False,
        num_beams=1,
        eos_token_id=stop_ids,
        pad_token_id=pad_id,
    )
    processors = LogitsProcessorList([_row_sampler(generators, cfg.temperature, cfg.top_p)] if generators else [])
    out = model.generate(
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        generation_config=config,
        logits_processor=processors,
        stopping_criteria=StoppingCriteriaList([_row_budget(width, budgets)]),
    )
    answers = []
    for row, budget in enumerate(budgets):
        tokens = out[row, width : width + budget].tolist()
        stop = next((i for i, t in enumerate(tokens) if t in stop_ids), None)
        ids = tokens[:stop] if stop is not None else tokens
        answers.append((ids, tokenizer.decode(ids, skip_special_tokens=True), stop is not None))
    return answers


def _assistant(ids: Optional[list[int]], text: str, complete: bool) -> dict:
    message = {"role": "assistant", "content": text, "complete": complete}
    if ids is not None:
        message["token_ids"] = ids
    return message


def regenerate_conversations(
    model: Any,
    tokenizer: Any,
    conversations: Sequence[Conversation],
    cfg: RegenerateConfig,
    cache_file: Path,
    progress: bool = True,
    max_length: Optional[int] = None,
    server: Optional["RegenerationServer"] = None,
) -> list[Conversation]:
    """Conversations whose assistant turns are written by the target: ``model`` (an HF causal LM)
    with cfg.backend ``hf``, the server at cfg.server.url with ``server`` (``server`` may be given,
    already built; tests do).

    Each conversation keeps its system message and its first ``cfg.max_turns`` user turns (all when
    None); every user turn is followed by the target's answer: greedy when cfg.temperature == 0,
    else sampled with temperature and top_p; at most cfg.max_new_tokens tokens, ending at eos /
    ``<|im_end|>``. Assistant messages carry ``"token_ids"`` (the answer's tokens, the closing one
    left out) and ``"complete": False`` when the answer hit its token budget instead of ending (its
    closing token is then not trained on, see tokenize_conversation).

    ``max_length`` (the training sequence length) bounds the work: a turn whose prompt already has
    max_length tokens is not generated (the conversation ends before it), and an answer stops at
    max_length tokens in all, because training truncates everything beyond.

    Results are appended to ``cache_file`` (JSONL) as they finish; a rerun continues where an
    interrupted one stopped. Returns the conversations in input order.
    """
    cache_file = Path(cache_file)
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    settings = _settings(cfg, max_length)
    keys = [_digest({"conversation": c, "settings": settings}) for c in conversations]
    done = _read_cache(cache_file, keys)
    stop_ids = stop_token_ids(tokenizer, getattr(model, "generation_config", None))
    plans = {i: _split(c, cfg.max_turns) for i, c in enumerate(conversations)}

    def first_prompt_chars(i: int) -> int:
        system, users = plans[i]
        return sum(len(m["content"]) for m in system) + (len(users[0]) if users else 0)

    # Similar prompt lengths share a batch, so little compute goes to left padding. The order
    # depends only on the conversations, so a resumed run forms the same batches.
    todo = sorted((i for i in range(len(conversations)) if i not in done), key=lambda i: (first_prompt_chars(i), i))

    def prompt_of(messages: Conversation, user: str) -> tuple[list[int], int]:
        """The tokenized prompt for the next answer and that answer's token budget (<= 0: no room)."""
        text = render_chat(tokenizer, messages + [{"role": "user", "content": user}], add_generation_prompt=True)
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
        budget = cfg.max_new_tokens if max_length is None else min(cfg.max_new_tokens, max_length - len(prompt))
        return prompt, budget

    from tqdm.auto import tqdm

    bar = tqdm(total=len(conversations), initial=len(done), desc=f"regenerate ({cfg.backend})", unit="conv", disable=not progress, dynamic_ncols=True)
    try:
        with open(cache_file, "a", encoding="utf-8") as cache:

            def save(finished: dict[int, Conversation]) -> None:
                cache.write("".join(json.dumps({"index": i, "key": keys[i], "messages": m}, ensure_ascii=False) + "\n" for i, m in finished.items()))
                cache.flush()
                os.fsync(cache.fileno())
                done.update(finished)
                bar.update(len(finished))

            if cfg.backend == "server":
                if server is None:
                    server = server_from_config(cfg)
                _with_server(server, tokenizer, plans, todo, cfg, stop_ids, prompt_of, save)
            else:
                if model is None:
                    raise DataError("data.regenerate.backend 'hf' needs the target model in this process")
                _with_hf(model, tokenizer, plans, todo, cfg, stop_ids, prompt_of, save)
    finally:
        bar.close()
    return [done[i] for i in range(len(conversations))]


def _with_hf(model, tokenizer, plans, todo, cfg: RegenerateConfig, stop_ids, prompt_of, save) -> None:
    """Batches of cfg.batch_size conversations, answered turn by turn with ``generate()``."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    sampling = cfg.temperature > 0
    for start in range(0, len(todo), cfg.batch_size):
        batch = todo[start : start + cfg.batch_size]
        messages = {i: list(plans[i][0]) for i in batch}
        active = [i for i in batch if plans[i][1]]
        turn = 0
        while active:
            prompts, budgets, rows = [], [], []
            for i in active:
                prompt, budget = prompt_of(messages[i], plans[i][1][turn])
                if budget <= 0:
                    continue  # no room left for an answer: the conversation ends here
                prompts.append(prompt)
                budgets.append(budget)
                rows.append(i)
            if not rows:
                break
            generators = [torch.Generator().manual_seed(_turn_seed(cfg.seed, i, turn)) for i in rows] if sampling else None
            answers = _generate_turn(model, tokenizer, prompts, budgets, generators, cfg, stop_ids, pad_id)
            for i, (ids, text, complete) in zip(rows, answers):
                messages[i].append({"role": "user", "content": plans[i][1][turn]})
                messages[i].append(_assistant(ids, text, complete))
            turn += 1
            active = [i for i in rows if turn < len(plans[i][1])]
        save(messages)


def server_from_config(cfg: RegenerateConfig) -> "RegenerationServer":
    from draftsmith.data.server import RegenerationServer

    s = cfg.server
    if not s.url or not s.model:
        raise DataError("data.regenerate.backend 'server' needs data.regenerate.server.url and .model")
    return RegenerationServer(s.url, s.model, timeout=s.timeout, max_retries=s.max_retries, backoff=s.backoff)


def probe_text(tokenizer: Any) -> str:
    """A chat turn rendered with the template (its special tokens included) around text that
    exercises normalization: doubled spaces, a tab, digits, accents, CJK and an emoji."""
    return render_chat(tokenizer, [{"role": "user", "content": "Hello,  world!\t1234 caf\u00e9 na\u00efve \u4e2d\u6587 \U0001f600"}], add_generation_prompt=True)


def _with_server(server: "RegenerationServer", tokenizer, plans, todo, cfg: RegenerateConfig, stop_ids, prompt_of, save) -> None:
    """cfg.server.concurrency conversations in flight, each answered turn by turn by the server;
    every conversation is saved the moment it is finished."""
    import warnings

    from draftsmith.data.server import run_pool

    server.check(tokenizer, probe_text(tokenizer))
    sampling = cfg.temperature > 0

    def answer(i: int) -> Conversation:
        system, users = plans[i]
        messages = list(system)
        for turn, user in enumerate(users):
            prompt, budget = prompt_of(messages, user)
            if budget <= 0:
                break
            seed = _turn_seed(cfg.seed, i, turn) if sampling else None
            got = server.complete(prompt, budget, cfg.temperature, cfg.top_p, seed, stop_ids)
            if got.token_ids is not None:
                text = tokenizer.decode(got.token_ids, skip_special_tokens=True)  # the text of exactly those ids
            else:
                text = got.text
            messages.append({"role": "user", "content": user})
            messages.append(_assistant(got.token_ids, text, got.complete))
        return messages

    warned = False

    def finished(i: int, messages: Conversation) -> None:
        nonlocal warned
        if server.returns_token_ids is False and not warned:
            warnings.warn(
                f"the server at {server.url} returns answers as text only (no token_ids): they are re-tokenized when the "
                "examples are built, which can differ from the tokens the target produced",
                stacklevel=2,
            )
            warned = True
        save({i: messages})

    run_pool(todo, answer, cfg.server.concurrency, finished)
