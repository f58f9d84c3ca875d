"""Run a drafter on prompts and measure it: the engine behind `draftsmith generate` and `draftsmith eval`.

The drafter comes ready from draftsmith.runtime.load (any folder draftsmith.artifacts reads, with
its target); prompts are encoded and answers stopped by the one rule of draftsmith.data.chat;
SamplingParams says how tokens are chosen, end to end.
"""

from __future__ import annotations

import contextlib
import copy
import sys
import time
from typing import Optional

import torch

from draftsmith.data.chat import encode_prompt, stop_token_ids
from draftsmith.eval.acceptance import AcceptanceStats
from draftsmith.runtime.generate import autoregressive_generate, speculative_generate
from draftsmith.runs import log
from draftsmith.runtime.load import LoadedDrafter
from draftsmith.runtime.verify import GREEDY, SamplingParams


def load_prompts(spec: str, limit: Optional[int] = None) -> list[list[dict]]:
    """The first `limit` prompts (all without one), as chat messages ending with a user turn: a
    JSONL/JSON file (`prompt` field or chat `messages`) or a built-in set ("mtbench", "humaneval",
    "sharegpt"), in the order the source holds them. Only the first user turn (with any system
    message before it) of each conversation is kept."""
    from draftsmith.data import DataError, load_conversations
    from draftsmith.data.chat import first_user_turn

    counts: dict = {}
    conversations = load_conversations(spec, format="auto", limit=None, shuffle=False, stats=counts)
    prompts, skipped = [], counts.get("dropped_malformed", 0)
    for conv in conversations:
        head = first_user_turn(conv)
        if head is not None:
            prompts.append(head)
        else:
            skipped += 1
        if limit is not None and len(prompts) >= limit:
            break
    if not prompts:
        raise DataError(f"no usable prompts in {spec}: each record needs a `prompt` field or chat `messages` with a user turn")
    if skipped:
        log(f"warning: skipped {skipped} record(s) of {spec} with no usable prompt (empty, malformed, or no user turn)", stream=sys.stderr)
    return prompts


def context_length(loaded: LoadedDrafter) -> Optional[int]:
    """Positions the target has (its config's max_position_embeddings), or None where it does not say."""
    value = getattr(loaded.target.model.config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None


def too_long(loaded: LoadedDrafter, messages: list[dict], max_new_tokens: int) -> Optional[str]:
    """Why a prompt does not fit the target's context with `max_new_tokens` after it (it is not
    cut: a cut prompt asks something else), or None when it fits."""
    limit = context_length(loaded)
    n = len(encode_prompt(loaded.target.tokenizer, messages))
    if limit is None or n + max_new_tokens <= limit:
        return None
    return f"{n} prompt tokens + --max-new-tokens {max_new_tokens} exceed the target's context of {limit} positions"


def fitting_prompts(loaded: LoadedDrafter, prompts: list[list[dict]], max_new_tokens: int) -> list[list[dict]]:
    """The prompts that fit the target's context with `max_new_tokens` after them; the others are
    skipped (not cut) with one warning that counts them. DataError when none fits."""
    from draftsmith.data import DataError

    reasons = [too_long(loaded, messages, max_new_tokens) for messages in prompts]
    kept = [messages for messages, reason in zip(prompts, reasons) if reason is None]
    dropped = [reason for reason in reasons if reason is not None]
    if not kept:
        raise DataError(f"no prompt fits the target's context: {dropped[0]} (lower --max-new-tokens, or use shorter prompts)")
    if dropped:
        log(f"warning: skipping {len(dropped)} of {len(prompts)} prompts longer than the target's context (not cut; the first: {dropped[0]})", stream=sys.stderr)
    return kept


def _prompt_ids(loaded: LoadedDrafter, messages: list[dict]) -> torch.Tensor:
    return torch.tensor([encode_prompt(loaded.target.tokenizer, messages)], device=loaded.target.device)


def _stops(loaded: LoadedDrafter) -> list[int]:
    return stop_token_ids(loaded.target.tokenizer, loaded.target.model.generation_config)


def generate_one(loaded: LoadedDrafter, messages: list[dict], max_new_tokens: int, sampling: SamplingParams = GREEDY, seed: int = 0):
    """Speculative generation for one prompt. Returns (completion text, new token ids, GenerationStats)."""
    ids = _prompt_ids(loaded, messages)
    gen = torch.Generator(device=loaded.target.device).manual_seed(seed)
    out, stats = speculative_generate(loaded.target, loaded.drafter, ids, max_new_tokens, sampling, eos_token_id=_stops(loaded), generator=gen, cache=loaded.cache)
    new = out[0, ids.shape[1] :]
    return loaded.target.tokenizer.decode(new, skip_special_tokens=True), new, stats


def _count_forwards(model):
    """Count a model's forward calls at its full depth (assisted generation's target passes; an
    early-exit assistant runs the same model with fewer layers, and those passes do not count)."""
    counter = {"n": 0}
    depth = getattr(model.config, "num_hidden_layers", None)

    def hook(module, *_):
        if getattr(module.config, "num_hidden_layers", None) == depth:
            counter["n"] += 1

    return counter, model.register_forward_pre_hook(hook)


@contextlib.contextmanager
def _state_kept(drafter):
    """Put back, after the block, what ``drafter`` carries across generations: the attributes its
    ``carried`` names (lookup's reliability and matcher; none for most drafters)."""
    kept = {name: copy.deepcopy(getattr(drafter, name)) for name in getattr(drafter, "carried", ())}
    try:
        yield
    finally:
        for name, value in kept.items():
            setattr(drafter, name, value)


def _generator(target, seed: int) -> torch.Generator:
    return torch.Generator(device=target.device).manual_seed(seed)


def evaluate(
    loaded: LoadedDrafter,
    prompts: list[list[dict]],
    max_new_tokens: int = 128,
    sampling: SamplingParams = GREEDY,
    seed: int = 0,
    baseline: bool = True,
    assisted: bool = False,
    progress: bool = True,
) -> tuple[AcceptanceStats, dict]:
    """Speculative decoding over `prompts`, plus plain decoding of the same target in the same
    process (``sampling.target_alone()``: typical acceptance's baseline samples at its
    temperature), plus transformers' assisted generation when asked (standalone and early-exit
    drafters). Returns the stats and extra figures (greedy outputs identical to the baseline, draft
    time, one row per prompt)."""
    from tqdm.auto import tqdm

    target, tok = loaded.target, loaded.target.tokenizer
    eos = _stops(loaded)
    plain = sampling.target_alone()
    stats = AcceptanceStats()
    identical, draft_time = 0, 0.0
    draft_forwards: Optional[int] = 0  # None once a generation's drafter does not count its passes
    if baseline and prompts:
        # Timed only once both paths have run (first calls: lazy initialisation, kernels' first
        # launches, on a GPU every graph's capture): one untimed generation of each on the first
        # prompt. What a drafter carries from one generation to the next is put back after it.
        ids = _prompt_ids(loaded, prompts[0])
        with _state_kept(loaded.drafter):
            speculative_generate(target, loaded.drafter, ids, max_new_tokens, sampling, eos_token_id=eos, generator=_generator(target, seed), cache=loaded.cache)
        autoregressive_generate(target, ids, max_new_tokens, plain, eos_token_id=eos, generator=_generator(target, seed), cache=loaded.cache)
    for i, messages in enumerate(tqdm(prompts, desc="eval", disable=not progress, dynamic_ncols=True)):
        ids = _prompt_ids(loaded, messages)
        gen = torch.Generator(device=target.device).manual_seed(seed + i)
        out, g = speculative_generate(target, loaded.drafter, ids, max_new_tokens, sampling, eos_token_id=eos, generator=gen, cache=loaded.cache)
        for accepted, attempted, depth in zip(g.accept_lens, g.attempted_depths, g.draft_depths):
            stats.add_step(accepted, max(depth, 1), attempted=min(attempted, max(depth, 1)))
        stats.add_generation(g.new_tokens, g.wall_time, g.target_forwards)
        draft_time += g.draft_time
        draft_forwards = None if draft_forwards is None or g.draft_forwards is None else draft_forwards + g.draft_forwards
        if baseline:
            gen = torch.Generator(device=target.device).manual_seed(seed + i)
            # The baseline on the same kind of cache (graphs on a GPU for both): a fair speedup.
            base, b = autoregressive_generate(target, ids, max_new_tokens, plain, eos_token_id=eos, generator=gen, cache=loaded.cache)
            stats.add_baseline(b.new_tokens, b.wall_time)
            identical += int(torch.equal(base, out))
        assist = loaded.assist or ({"assistant_model": loaded.draft_model} if loaded.draft_model is not None else {})
        if assisted and assist:
            counter, handle = _count_forwards(target.model)
            kwargs = {"do_sample": False} if plain.greedy else {
                "do_sample": True, "temperature": plain.temperature, "top_k": plain.top_k or None, "top_p": plain.top_p}
            started = time.perf_counter()
            try:
                res = target.model.generate(
                    ids, attention_mask=torch.ones_like(ids), **assist,
                    max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=tok.pad_token_id or eos[0], **kwargs,
                )
            finally:
                handle.remove()
            stats.add_assisted(res.shape[1] - ids.shape[1], time.perf_counter() - started, counter["n"])
    extra = {"draft_seconds": round(draft_time, 3)}
    if draft_forwards is not None and stats.new_tokens:
        # EAGLE drafts k tokens in k passes, DFlash in one: what drafting costs beside the target.
        extra["draft_forwards"] = draft_forwards
        extra["draft_forwards_per_token"] = round(draft_forwards / stats.new_tokens, 4)
    if baseline and sampling.greedy:
        extra["greedy_identical_to_baseline"] = f"{identical}/{len(prompts)}"
        dtype = loaded.target.dtype
        if identical < len(prompts) and dtype != torch.float32:
            # Verification is exact; the target's own logits are not: in bf16 a tree's forward
            # and a one-token forward round differently, and where two tokens nearly tie the
            # outputs part. fp32 decodes token-identically (tests/integration/test_lossless.py).
            name = str(dtype).replace("torch.", "")
            extra["greedy_identity_note"] = (
                f"the target ran in {name}: a speculative step's forward over several tokens rounds differently from a one-token "
                f"forward, so greedy outputs part where two tokens nearly tie; --dtype float32 decodes token-identically"
            )
    return stats, extra
