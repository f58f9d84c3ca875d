"""Tiny random models and a character-level chat tokenizer, built in-process for tests and benchmarks.

Nothing here downloads anything. The tokenizer speaks ChatML (like SmolLM2 and Qwen2), so chat
templates, loss masks and regeneration run on it exactly as on a real model.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Literal

import torch

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

SPECIAL_TOKENS = ["<pad>", "<|im_start|>", "<|im_end|>", "<unk>"]


def tiny_tokenizer():
    """A character-level fast tokenizer with ChatML specials: ~100 tokens, any ASCII text."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    chars = list(string.printable)
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in chars:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<|im_end|>",
        bos_token=None,
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def tiny_causal_lm(
    arch: Literal["llama", "qwen2"] = "llama",
    vocab_size: int = 104,
    hidden_size: int = 64,
    num_layers: int = 3,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
):
    """A small random Llama or Qwen2 causal LM (eager attention, fp32 by default)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=2,
        bos_token_id=1,
    )
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        raise ValueError(f"unknown tiny architecture {arch!r}")
    return model.to(dtype).eval()


def save_tiny_model(folder: str | Path, arch: Literal["llama", "qwen2"] = "llama", seed: int = 0, **kwargs) -> Path:
    """Save a tiny model plus the tiny tokenizer as an HF folder that FrozenTarget.load reads."""
    folder = Path(folder)
    tokenizer = tiny_tokenizer()
    model = tiny_causal_lm(arch, vocab_size=len(tokenizer), seed=seed, **kwargs)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
