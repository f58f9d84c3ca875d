"""Assistant-only loss masks, hand-verified: for the real SmolLM2 tokenizer (its own ChatML template with
a default system prompt), for the Qwen2.5 template on a char-level and on a BPE tokenizer, and for the
corner cases a naive implementation gets wrong (content that also occurs in the scaffolding, empty
answers, truncation, answers cut off during regeneration)."""

import copy

import pytest

from draftsmith.data import DataError, render_chat, tokenize_conversation
from draftsmith.testing import tiny_tokenizer

# The Qwen2.5 instruct chat template without its tool-calling branches: a default system prompt
# when the conversation has none, then ChatML turns.
QWEN25_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) or message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
QWEN_SYSTEM = "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
SMOL_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"

TWO_TURNS = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Can you help?"},
    {"role": "assistant", "content": "Sure."},
]


def split(tokenizer, example):
    """(decoded trained tokens, decoded untrained tokens), each concatenated in order."""
    ids, mask = example["input_ids"], example["loss_mask"]
    assert len(ids) == len(mask)
    trained = tokenizer.decode([t for t, m in zip(ids, mask) if m])
    context = tokenizer.decode([t for t, m in zip(ids, mask) if not m])
    return trained, context


def first_trained(example):
    return example["loss_mask"].index(1)


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from transformers import AutoTokenizer

    from draftsmith import target

    folder, gguf = target.resolve_model_path("smollm2-135m")
    # The dequantized copy load_causal_lm leaves behind holds the same tokenizer and loads in a
    # fraction of the GGUF parse time; fall back to the GGUF file when it is not there yet.
    cached_dir = getattr(target, "_dequantized_cache_dir", None)
    if cached_dir is not None and (cached_dir(folder, gguf) / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(cached_dir(folder, gguf))
    return AutoTokenizer.from_pretrained(folder, gguf_file=gguf)


@pytest.fixture()
def qwen_tiny():
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = QWEN25_TEMPLATE
    return tokenizer


@pytest.mark.assets
def test_smollm2_two_turns(smollm2_tokenizer):
    tok = smollm2_tokenizer
    example = tokenize_conversation(tok, TWO_TURNS, max_length=512)
    trained, context = split(tok, example)
    assert trained == "Hello!<|im_end|>Sure.<|im_end|>"
    assert context == (
        SMOL_SYSTEM + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        "\n<|im_start|>user\nCan you help?<|im_end|>\n<|im_start|>assistant\n\n"
    )
    # The untrained prefix is exactly the prompt the target sees before answering.
    prefix = tok.decode(example["input_ids"][: first_trained(example)])
    assert prefix == SMOL_SYSTEM + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    # The ids are the template's own tokenization, not a re-tokenization that differs from it.
    assert example["input_ids"] == tok.apply_chat_template(TWO_TURNS, tokenize=True, return_dict=True)["input_ids"]


@pytest.mark.assets
def test_smollm2_system_prompt_and_multiline_answers(smollm2_tokenizer):
    tok = smollm2_tokenizer
    messages = [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Say hello\ntwice"},
        {"role": "assistant", "content": "Bonjour\nBonjour !"},
        {"role": "user", "content": "And goodbye?"},
        {"role": "assistant", "content": "  Au revoir.\n"},
    ]
    example = tokenize_conversation(tok, messages, max_length=512)
    trained, context = split(tok, example)
    # BPE merges the header's newline with the answer's first space into one token ("\n "); a
    # token straddling scaffolding and answer stays context, so no template text is trained on.
    assert trained == "Bonjour\nBonjour !<|im_end|> Au revoir.\n<|im_end|>"
    assert context == (
        "<|im_start|>system\nAnswer in French.<|im_end|>\n<|im_start|>user\nSay hello\ntwice<|im_end|>\n"
        "<|im_start|>assistant\n\n<|im_start|>user\nAnd goodbye?<|im_end|>\n<|im_start|>assistant\n \n"
    )


def test_qwen25_template_on_char_tokenizer(qwen_tiny):
    example = tokenize_conversation(qwen_tiny, TWO_TURNS, max_length=1000)
    trained, context = split(qwen_tiny, example)
    assert trained == "Hello!<|im_end|>Sure.<|im_end|>"
    assert context == (
        QWEN_SYSTEM + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        "\n<|im_start|>user\nCan you help?<|im_end|>\n<|im_start|>assistant\n\n"
    )
    # Char-level tokens make positions checkable by hand: the mask is one run per answer.
    text = render_chat(qwen_tiny, TWO_TURNS)
    ids = example["input_ids"]
    # Five <|im_start|> (12 chars) and five <|im_end|> (10 chars) are one token each.
    assert len(ids) == len(text) - 5 * 12 - 5 * 10 + 10
    runs = [i for i in range(1, len(ids)) if example["loss_mask"][i] != example["loss_mask"][i - 1]]
    assert len(runs) == 4  # on, off, on, off


@pytest.mark.assets
def test_qwen25_template_on_bpe_tokenizer(smollm2_tokenizer):
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.chat_template = QWEN25_TEMPLATE
    messages = [{"role": "user", "content": "Write hello world in Python."}, {"role": "assistant", "content": 'print("hello world")'}]
    example = tokenize_conversation(tok, messages, max_length=512)
    trained, context = split(tok, example)
    assert trained == 'print("hello world")<|im_end|>'
    assert context == QWEN_SYSTEM + "<|im_start|>user\nWrite hello world in Python.<|im_end|>\n<|im_start|>assistant\n\n"


def test_content_that_also_appears_in_the_scaffolding(tiny_tokenizer):
    # "assistant" and "user" occur in the role headers; the mask must cover the message, not a header.
    messages = [
        {"role": "user", "content": "assistant"},
        {"role": "assistant", "content": "user"},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "a"},
    ]
    example = tokenize_conversation(tiny_tokenizer, messages, max_length=1000)
    trained, context = split(tiny_tokenizer, example)
    assert trained == "user<|im_end|>a<|im_end|>"
    assert context == (
        "<|im_start|>user\nassistant<|im_end|>\n<|im_start|>assistant\n\n<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\n\n"
    )


def test_opening_assistant_greeting_is_trained(qwen_tiny):
    # Not a shape load_conversations produces, but tokenize_conversation takes any message list.
    messages = [{"role": "assistant", "content": "How can I help?"}, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hey"}]
    trained, context = split(qwen_tiny, tokenize_conversation(qwen_tiny, messages, max_length=1000))
    assert trained == "How can I help?<|im_end|>Hey<|im_end|>"
    assert context == QWEN_SYSTEM + "<|im_start|>assistant\n\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n\n"


def test_empty_answer_trains_only_the_end_of_turn(tiny_tokenizer):
    messages = [{"role": "user", "content": "Say nothing."}, {"role": "assistant", "content": ""}]
    example = tokenize_conversation(tiny_tokenizer, messages, max_length=1000)
    assert split(tiny_tokenizer, example)[0] == "<|im_end|>"
    assert sum(example["loss_mask"]) == 1


def test_incomplete_answer_does_not_train_the_end_of_turn(tiny_tokenizer):
    messages = [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "cut off mid", "complete": False},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": "done", "complete": True},
    ]
    example = tokenize_conversation(tiny_tokenizer, messages, max_length=1000)
    assert split(tiny_tokenizer, example)[0] == "cut off middone<|im_end|>"
    # The bookkeeping key never reaches the template.
    assert render_chat(tiny_tokenizer, messages) == render_chat(tiny_tokenizer, [{"role": m["role"], "content": m["content"]} for m in messages])


def test_truncation_keeps_ids_and_mask_aligned(tiny_tokenizer):
    full = tokenize_conversation(tiny_tokenizer, TWO_TURNS, max_length=1000)
    for max_length in [1, 20, 40, first_trained(full) + 3, len(full["input_ids"]) - 1]:
        cut = tokenize_conversation(tiny_tokenizer, TWO_TURNS, max_length=max_length)
        assert cut["input_ids"] == full["input_ids"][:max_length]
        assert cut["loss_mask"] == full["loss_mask"][:max_length]
    cut = tokenize_conversation(tiny_tokenizer, TWO_TURNS, max_length=first_trained(full) + 3)
    assert split(tiny_tokenizer, cut)[0] == "Hel"


def test_no_chat_template_is_an_error_naming_the_tokenizer(tiny_tokenizer):
    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = None
    tok.name_or_path = "my-base-model"
    with pytest.raises(DataError, match="tokenizer my-base-model has no chat template"):
        tokenize_conversation(tok, TWO_TURNS, max_length=100)


def test_template_that_rewrites_content_is_an_error(tiny_tokenizer):
    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | upper }}<|im_end|>\n{% endfor %}"
    with pytest.raises(DataError, match="does not render assistant message 1 verbatim"):
        tokenize_conversation(tok, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}], max_length=100)


def test_first_user_turn_keeps_the_system_message_and_stops_at_the_first_user_turn():
    from draftsmith.data.chat import first_user_turn

    conv = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    assert first_user_turn(conv) == conv[:2]
    assert first_user_turn([{"role": "assistant", "content": "hello"}]) is None
    assert first_user_turn([{"role": "user", "content": "  "}]) is None
    assert first_user_turn([]) is None
