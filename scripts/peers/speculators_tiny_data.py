"""Build a tiny random verifier and an offline EAGLE-3 dataset in speculators' layout.

    ~/.cache/draftsmith/venvs/speculators-0.9.0/bin/python scripts/peers/speculators_tiny_data.py OUT_DIR

Runs inside the speculators venv (transformers, datasets, safetensors) and downloads nothing.
It writes:

    OUT_DIR/verifier/      a random LlamaForCausalLM (8 layers, hidden 64, vocab 512, untied
                           lm_head) saved with save_pretrained, plus a word-level tokenizer
    OUT_DIR/data/          datasets.save_to_disk folder, torch format, columns
                           input_ids (int64 [T]), loss_mask (int64 [T], aligned with
                           input_ids, 1 on "assistant" tokens), seq_len (int)
    OUT_DIR/data/hidden_states/hs_{i}.safetensors
                           {"hidden_states": bf16 [T, 4, H], "token_ids": int64 [T]}
    OUT_DIR/data/token_freq.pt
                           {token_id: count} over loss-masked tokens (speculators' format)

The four hidden states follow vLLM's `extract_hidden_states` convention that speculators
trains on: layer id i is the residual stream *entering* decoder layer i (HF
`output_hidden_states[i]`), for the ids [2, n // 2, n - 3], and the fourth is layer id n, the
output of the last decoder layer *before* the final norm (HF's last `output_hidden_states`
entry is after the norm, so it is captured with a hook here).

This is a smoke-test fixture for scripts/peers/speculators_train.py, not a benchmark.
"""

import sys
from pathlib import Path

import torch
from datasets import Dataset
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

NUM_SAMPLES = 12
VOCAB = 512
TOKENIZER_WORDS = 500  # < VOCAB, so speculators can add its <|MASK|> token in a free slot


def build_verifier(out: Path) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(out)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    vocab.update({f"w{i}": i for i in range(4, TOKENIZER_WORDS)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    ).save_pretrained(out)
    return model


@torch.no_grad()
def hidden_states_for(model: LlamaForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    n = model.config.num_hidden_layers
    captured = {}
    hook = model.model.layers[-1].register_forward_hook(
        lambda _m, _i, out: captured.__setitem__("last", out[0] if isinstance(out, tuple) else out)
    )
    out = model(ids[None], output_hidden_states=True)
    hook.remove()
    aux = [out.hidden_states[i][0] for i in (2, n // 2, n - 3)]
    last = captured["last"].reshape(ids.shape[0], -1)
    return torch.stack([*aux, last], dim=1)  # [T, 4, H]


def main(out_dir: str) -> None:
    out = Path(out_dir)
    model = build_verifier(out / "verifier")
    data = out / "data"
    (data / "hidden_states").mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(1)
    rows = {"input_ids": [], "loss_mask": [], "seq_len": []}
    freq: dict[int, int] = {}
    for i in range(NUM_SAMPLES):
        length = int(torch.randint(40, 120, (1,), generator=gen))
        # A skewed token distribution, so a pruned draft vocabulary is meaningful.
        ids = torch.multinomial(torch.arange(VOCAB, 0, -1.0) ** 2, length, replacement=True, generator=gen)
        mask = torch.zeros(length, dtype=torch.long)
        mask[length // 3 :] = 1
        hs = hidden_states_for(model, ids)
        save_file(
            {"hidden_states": hs.to(torch.bfloat16).contiguous(), "token_ids": ids.contiguous()},
            str(data / "hidden_states" / f"hs_{i}.safetensors"),
        )
        rows["input_ids"].append(ids.tolist())
        rows["loss_mask"].append(mask.tolist())
        rows["seq_len"].append(length)
        for t in ids[mask.bool()].tolist():
            freq[t] = freq.get(t, 0) + 1
    ds = Dataset.from_dict(rows)
    ds.set_format(type="torch")
    ds.save_to_disk(str(data))
    torch.save(freq, data / "token_freq.pt")
    print(f"wrote {out / 'verifier'} and {NUM_SAMPLES} samples to {data}")


if __name__ == "__main__":
    main(sys.argv[1])
