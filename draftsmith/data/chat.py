"""Chat templates and assistant-only loss masks.

A draft model learns to predict what the target says, so only the assistant's tokens are trained
on: the content of each assistant message plus the end-of-turn token that closes it (the drafter has
to learn when the target stops). System and user turns, role headers and the template's scaffolding
between turns are context only.

The mask is found in text space, which works for any template without knowing its layout: the
conversation is rendered once, each assistant message's character span is located in it (the
rendering of the conversation up to that message with ``add_generation_prompt=True`` says exactly
where its content begins), and the tokenizer's offset mapping turns character spans into tokens.
A token is trained when it starts inside an answer: a BPE token that straddles the header and the
answer's first characters (``"\n "`` before an answer that opens with spaces) stays context, so
no template text is ever trained on.
"""

from __future__ import annotations

from typing import Any, Optional

from draftsmith.data.errors import DataError


def tokenizer_name(tokenizer: Any) -> str:
    """A readable name for error messages."""
    return getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__


def render_chat(tokenizer: Any, messages: list[dict], add_generation_prompt: bool = False) -> str:
    """The conversation as text through the tokenizer's chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"tokenizer {tokenizer_name(tokenizer)} has no chat template; use an instruction-tuned "
            "target or set tokenizer.chat_template"
        )
    # Only role and content reach the template: bookkeeping keys (e.g. "complete") stay ours.
    clean = [{"role": m["role"], "content": m["content"]} for m in messages]
    return tokenizer.apply_chat_template(clean, tokenize=False, add_generation_prompt=add_generation_prompt)


def first_user_turn(conversation: list[dict]) -> Optional[list[dict]]:
    """The messages of a conversation up to its first user turn (any system message before it
    included): the prompt a served request or an evaluation starts from. None when it has no user
    turn, or an empty one."""
    head = []
    for message in conversation:
        head.append({"role": message["role"], "content": message["content"]})
        if message["role"] == "user":
            break
    return head if head and head[-1]["role"] == "user" and head[-1]["content"].strip() else None


def encode_prompt(tokenizer: Any, messages: list[dict], max_length: Optional[int] = None) -> list[int]:
    """A prompt's token ids, ready for the model to answer: the conversation rendered with the
    tokenizer's chat template and the generation prompt (a tokenizer without a template gets the
    messages' contents, one per line). With `max_length`, cut from the left to fit. Every decoding
    path (eval, generate, the online trainer) encodes prompts here."""
    if getattr(tokenizer, "chat_template", None):
        text = render_chat(tokenizer, messages, add_generation_prompt=True)
    else:
        text = "\n".join(m["content"] for m in messages)
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return ids[-max_length:] if max_length else ids


def stop_token_ids(tokenizer: Any, generation_config: Any = None) -> list[int]:
    """Token ids that end an answer, the one rule of every decoding and regeneration path: the
    tokenizer's eos, the model's generation config's eos ids (when the caller has a model), and
    ChatML's ``<|im_end|>`` when the vocabulary has it. DataError when there is none."""
    ids: list[int] = []
    candidates = [tokenizer.eos_token_id, getattr(generation_config, "eos_token_id", None), tokenizer.convert_tokens_to_ids("<|im_end|>")]
    for value in candidates:
        for token in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(token, int) and token != tokenizer.unk_token_id and token not in ids:
                ids.append(int(token))
    if not ids:
        raise DataError(f"tokenizer {tokenizer_name(tokenizer)} has no eos token: nothing says where an answer ends")
    return ids


def _closing_token_ids(tokenizer: Any) -> set[int]:
    # Any special token can close a turn (<|im_end|>, <|eot_id|>, <end_of_turn>, </s>, ...).
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def assistant_spans(tokenizer: Any, messages: list[dict], text: str, stop_at: Optional[int] = None) -> list[tuple[int, int]]:
    """Character spans [start, end) of each assistant message's content inside ``text``.

    ``text`` is ``render_chat(tokenizer, messages)``. Spans starting at or after ``stop_at`` are not
    searched for (they would be truncated away anyway), which saves rendering long conversations.
    """
    spans = []
    cursor = 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = cursor
        if i > 0:  # some templates cannot render an empty conversation
            prefix = render_chat(tokenizer, messages[:i], add_generation_prompt=True)
            # Templates that rewrite earlier turns (e.g. dropping old reasoning) break the prefix
            # property; then the content is searched for after the previous span instead.
            if text.startswith(prefix):
                start = max(len(prefix), cursor)
        if stop_at is not None and start >= stop_at:
            break
        content = message["content"]
        found = text.find(content, start)
        if found < 0 and content.strip():
            content = content.strip()  # some templates strip message contents
            found = text.find(content, start)
        if found < 0:
            raise DataError(
                f"the chat template of {tokenizer_name(tokenizer)} does not render assistant message {i} "
                "verbatim, so its loss mask cannot be located"
            )
        spans.append((found, found + len(content)))
        cursor = found + len(content)
    return spans


def tokenize_conversation(tokenizer: Any, messages: list[dict], max_length: int) -> dict[str, list[int]]:
    """Token ids of a conversation rendered with the chat template, and its assistant-only loss mask.

    Returns ``{"input_ids": [T], "loss_mask": [T]}`` with T <= max_length (the end is truncated).
    loss_mask is 1 on the tokens of every assistant message's content and on the special token that
    closes it (``<|im_end|>`` for ChatML), 0 everywhere else. An assistant message carrying
    ``"complete": False`` (an answer cut off by max_new_tokens during regeneration) keeps its
    closing token at 0: the target never chose to stop there.

    When every assistant message carries ``"token_ids"`` (answers regenerated by the target), those
    ids are the answers' tokens, spliced between the tokenized pieces of template text around them:
    the example holds the tokens the target produced, even where decoding them to text and
    tokenizing again would give other ids.

    Needs a fast tokenizer (for the offset mapping) with a chat template; otherwise DataError.
    """
    text = render_chat(tokenizer, messages)
    answers = [m for m in messages if m["role"] == "assistant"]
    if answers and all(m.get("token_ids") is not None for m in answers):
        return _spliced(tokenizer, answers, text, assistant_spans(tokenizer, messages, text), max_length)
    if not getattr(tokenizer, "is_fast", False):
        raise DataError(f"tokenizer {tokenizer_name(tokenizer)} is not a fast tokenizer; loss masks need its offset mapping")
    # The template already holds every special token (BOS included where the model wants one).
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    input_ids: list[int] = list(encoded["input_ids"])
    offsets: list[tuple[int, int]] = [tuple(o) for o in encoded["offset_mapping"]]
    stop_at = offsets[max_length - 1][1] if len(offsets) > max_length else None
    spans = assistant_spans(tokenizer, messages, text, stop_at)
    complete = [m.get("complete", True) for m in messages if m["role"] == "assistant"]
    closing = _closing_token_ids(tokenizer)

    loss_mask = [0] * len(input_ids)
    token = 0
    for (start, end), closes in zip(spans, complete):
        # Tokens are in text order, so one pass over them serves every span.
        while token < len(input_ids) and offsets[token][0] < start:
            token += 1
        while token < len(input_ids) and offsets[token][0] < end:
            loss_mask[token] = 1
            token += 1
        # The closing token is the first token at or after the content's end; for an empty
        # answer it is the only trained token.
        if closes and token < len(input_ids) and input_ids[token] in closing:
            loss_mask[token] = 1
            token += 1
    return {"input_ids": input_ids[:max_length], "loss_mask": loss_mask[:max_length]}


def _spliced(tokenizer: Any, answers: list[dict], text: str, spans: list[tuple[int, int]], max_length: int) -> dict[str, list[int]]:
    """tokenize_conversation for answers given as token ids: the template text between answers is
    tokenized piece by piece (as the target's prompts were), each answer's ids go in as they are."""
    closing = _closing_token_ids(tokenizer)
    input_ids: list[int] = []
    loss_mask: list[int] = []
    cursor, closes = 0, False
    for (start, end), message in zip([*spans, (len(text), len(text))], [*answers, None]):
        piece = tokenizer(text[cursor:start], add_special_tokens=False)["input_ids"] if start > cursor else []
        mask = [0] * len(piece)
        if closes and piece and piece[0] in closing:
            mask[0] = 1  # the token that closes the previous answer
        input_ids += piece
        loss_mask += mask
        if message is None or len(input_ids) >= max_length:
            break
        ids = [int(t) for t in message["token_ids"]]
        input_ids += ids
        loss_mask += [1] * len(ids)
        cursor, closes = end, message.get("complete", True)
    return {"input_ids": input_ids[:max_length], "loss_mask": loss_mask[:max_length]}
