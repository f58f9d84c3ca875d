"""The data package on real inputs: ShareGPT through the real SmolLM2 tokenizer (every trained token is
assistant text), packed batches through FrozenTarget (same features as unpacked), and SmolLM2
answering MT-bench prompts exactly as its own greedy generate does."""

import json

import pytest
import torch

from draftsmith.data import BatchStream, Collator, load_conversations, prepare_data
from draftsmith.recipe import DataConfig, RegenerateConfig
from draftsmith.target import FrozenTarget


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from transformers import AutoTokenizer

    from draftsmith import target

    folder, gguf = target.resolve_model_path("smollm2-135m")
    cached_dir = getattr(target, "_dequantized_cache_dir", None)
    if cached_dir is not None and (cached_dir(folder, gguf) / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(cached_dir(folder, gguf))
    return AutoTokenizer.from_pretrained(folder, gguf_file=gguf)


@pytest.mark.assets
def test_sharegpt_with_smollm2_trains_exactly_the_answers(smollm2_tokenizer, tmp_path):
    tok = smollm2_tokenizer
    cfg = DataConfig(path="sharegpt", limit=48, eval_size=8, max_length=100_000, seed=0)
    data = prepare_data(cfg, tok, tmp_path, progress=False)
    conversations = load_conversations("sharegpt", limit=48, seed=0)
    with_answers = [c for c in conversations[:40] if any(m["role"] == "assistant" for m in c)]
    assert len(data.train) == len(with_answers) == data.stats["train_examples"]
    exact = 0
    for conversation, example in zip(with_answers, data.train):
        trained = tok.decode([t for t, m in zip(example["input_ids"], example["loss_mask"]) if m])
        answers = [m["content"] for m in conversation if m["role"] == "assistant"]
        if any(a[:1].isspace() for a in answers):
            # A leading space can merge into the header's newline token, which stays context.
            assert trained.replace(" ", "").replace("\n", "") == "".join(a + "<|im_end|>" for a in answers).replace(" ", "").replace("\n", "")
        else:
            assert trained == "".join(a + "<|im_end|>" for a in answers)
            exact += 1
    assert exact >= len(with_answers) // 2


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_packed_batches_through_the_frozen_target(arch, request, tiny_tokenizer, tmp_path):
    target = FrozenTarget.load(str(request.getfixturevalue(f"tiny_{arch}_dir")))
    conversations = [[{"role": "user", "content": f"q{i}" * (i + 1)}, {"role": "assistant", "content": f"a{i}" * (5 - i)}] for i in range(5)]
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    data = prepare_data(DataConfig(path=str(path), eval_size=0, max_length=64), tiny_tokenizer, tmp_path / "cache", progress=False)
    packed_stream = BatchStream(data.train, 5, Collator(tiny_tokenizer.pad_token_id, 128, packing=True), seed=0)
    padded_stream = BatchStream(data.train, 5, Collator(tiny_tokenizer.pad_token_id, 128), seed=0)
    packed, padded = packed_stream.next_batch(), padded_stream.next_batch()
    assert packed["input_ids"].shape[0] < padded["input_ids"].shape[0]
    fp = target.features(packed["input_ids"], packed["attention_mask"], layers=[0, 1], position_ids=packed["position_ids"])
    fu = target.features(padded["input_ids"], padded["attention_mask"], layers=[0, 1], position_ids=padded["position_ids"])
    # Walk the packed rows' segments in order; they are the padded rows in the same order.
    example = 0
    for row in range(packed["input_ids"].shape[0]):
        for segment in packed["segment_ids"][row].unique().tolist():
            if segment == 0:
                continue
            where = packed["segment_ids"][row] == segment
            n = int(where.sum())
            assert packed["input_ids"][row, where].tolist() == padded["input_ids"][example, :n].tolist()
            torch.testing.assert_close(fp.logits[row, where], fu.logits[example, :n], atol=1e-5, rtol=1e-4)
            for layer in (0, 1):
                torch.testing.assert_close(fp.hidden[layer][row, where], fu.hidden[layer][example, :n], atol=1e-5, rtol=1e-4)
            example += 1
    assert example == 5


@pytest.mark.assets
@pytest.mark.slow
def test_smollm2_regenerates_mtbench_like_its_own_generate(tmp_path):
    target = FrozenTarget.load("smollm2-135m", dtype="float32")  # fp32: bf16 batching flips near-ties
    model, tok = target.model, target.tokenizer
    cfg = DataConfig(path="mtbench", limit=4, eval_size=1, max_length=256, seed=0, regenerate=RegenerateConfig(enabled=True, max_new_tokens=10, batch_size=4, max_turns=1))
    data = prepare_data(cfg, tok, tmp_path, target_model=model, progress=False)
    conversations = load_conversations("mtbench", limit=4, seed=0)
    examples = data.train + data.eval
    assert len(examples) == 4
    for conversation, example in zip(conversations, examples):
        messages = [{"role": "user", "content": conversation[0]["content"]}]
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        out = model.generate(**ids, max_new_tokens=10, do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        new = out[0, ids["input_ids"].shape[1] :].tolist()
        ended = tok.eos_token_id in new
        answer = tok.decode(new[: new.index(tok.eos_token_id)] if ended else new, skip_special_tokens=True)
        trained = tok.decode([t for t, m in zip(example["input_ids"], example["loss_mask"]) if m])
        # An answer cut off by max_new_tokens does not train the end-of-turn token.
        assert trained == answer + ("<|im_end|>" if ended else "")
