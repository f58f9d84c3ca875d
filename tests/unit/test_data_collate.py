"""Collation: exact padded tensors; packed rows whose 4D mask and restarted positions give every example
the same target logits as running it alone (eager and SDPA attention, Llama and Qwen2); and the batch
order: seeded epochs, disjoint rank shards, and resume that reproduces the uninterrupted stream."""

import pytest
import torch

from draftsmith.data import BatchStream, Collator, DataError, block_causal_mask
from draftsmith.testing import tiny_causal_lm


def ex(ids, mask=None):
    return {"input_ids": list(ids), "loss_mask": list(mask if mask is not None else [1] * len(ids))}


def test_padding_exact_tensors():
    batch = Collator(pad_token_id=0, max_length=4)([ex([5, 6, 7], [0, 1, 1]), ex([8], [1]), ex([9, 10, 11, 12, 13], [0, 0, 1, 1, 1])])
    assert batch["input_ids"].tolist() == [[5, 6, 7, 0], [8, 0, 0, 0], [9, 10, 11, 12]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1, 0], [1, 0, 0, 0], [0, 0, 1, 1]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0], [0, 0, 0, 0], [0, 1, 2, 3]]
    assert batch["segment_ids"].tolist() == [[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]]
    assert all(t.dtype == torch.long for t in batch.values())


def test_packing_exact_layout():
    examples = [ex([1, 2, 3], [0, 1, 1]), ex([4, 5], [1, 1]), ex([6, 7, 8, 9], [0, 0, 0, 1]), ex([10, 11], [1, 1])]
    batch = Collator(pad_token_id=0, max_length=6, packing=True)(examples)
    # Greedy in order: 3 + 2 fit in 6, the 4-token example opens row 2, the 2-token one joins it.
    # Rows are padded to the longest row.
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5, 0], [6, 7, 8, 9, 10, 11]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1, 1, 1, 0], [0, 0, 0, 1, 1, 1]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]]
    assert batch["segment_ids"].tolist() == [[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 2, 2]]
    mask = batch["attention_mask"]
    assert mask.shape == (2, 1, 6, 6) and mask.dtype == torch.float32
    allowed = (mask[0, 0] == 0).int().tolist()
    assert allowed == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [0, 0, 0, 1, 0, 0],
        [0, 0, 0, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],  # padding attends only to itself: no fully blocked row, no NaN
    ]
    assert torch.all((mask == 0) | (mask == torch.finfo(torch.float32).min))


def test_block_causal_mask_against_loops():
    g = torch.Generator().manual_seed(0)
    segments = torch.sort(torch.randint(1, 4, (3, 9), generator=g), dim=1).values
    segments[:, 7:] = 0
    mask = block_causal_mask(segments)
    for b in range(3):
        for q in range(9):
            for k in range(9):
                ok = (k <= q and segments[b, q] == segments[b, k] and segments[b, q] > 0) or q == k
                assert (mask[b, 0, q, k] == 0).item() == ok


def test_truncation_to_max_length_in_both_modes():
    long = ex(range(1, 11), [0] * 5 + [1] * 5)
    for packing in (False, True):
        batch = Collator(pad_token_id=0, max_length=7, packing=packing)([long, ex([20, 21])])
        assert batch["input_ids"][0].tolist() == [1, 2, 3, 4, 5, 6, 7]
        assert batch["loss_mask"][0].tolist() == [0, 0, 0, 0, 0, 1, 1]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_packed_row_gives_the_logits_of_separate_examples(arch, attn):
    model = tiny_causal_lm(arch, vocab_size=50, seed=1)
    model.set_attn_implementation(attn)
    g = torch.Generator().manual_seed(2)
    examples = [ex(torch.randint(3, 50, (n,), generator=g).tolist()) for n in (7, 5, 9, 4)]
    batch = Collator(pad_token_id=0, max_length=20, packing=True)(examples)
    assert batch["input_ids"].shape[0] == 2  # 7+5 in row 1 (the 9 does not fit), 9+4 in row 2
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]).logits
        alone = [model(input_ids=torch.tensor([e["input_ids"]])).logits[0] for e in examples]
        # Without the 4D mask the second example of a row sees the first: the check can fail.
        leaky = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], attention_mask=(batch["segment_ids"] > 0).long()).logits
    starts = {(0, 0): 0, (0, 1): 7, (1, 0): 0, (1, 1): 9}
    for (row, k), start in starts.items():
        index = 2 * row + k
        n = len(examples[index]["input_ids"])
        torch.testing.assert_close(packed[row, start : start + n], alone[index], atol=1e-5, rtol=1e-4)
    assert (leaky[0, 7:12] - alone[1]).abs().max() > 1e-3


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_float32_packed_mask_works_for_a_bfloat16_target(attn):
    # The quickstart runs its target in bf16; the mask stays float32 and must still block.
    model = tiny_causal_lm("llama", vocab_size=50, seed=1, dtype=torch.bfloat16)
    model.set_attn_implementation(attn)
    examples = [ex(range(3, 10)), ex(range(10, 15))]
    batch = Collator(pad_token_id=0, max_length=20, packing=True)(examples)
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]).logits
        alone = model(input_ids=torch.tensor([list(range(10, 15))])).logits[0]
        leaky = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], attention_mask=torch.ones_like(batch["input_ids"])).logits
    torch.testing.assert_close(packed[0, 7:12].float(), alone.float(), atol=2e-2, rtol=2e-2)
    assert (leaky[0, 7:12].float() - alone.float()).abs().max() > 0.05


def test_padded_batch_gives_the_logits_of_separate_examples():
    model = tiny_causal_lm("llama", vocab_size=50, seed=3)
    examples = [ex([5, 6, 7, 8, 9]), ex([10, 11])]
    batch = Collator(pad_token_id=0, max_length=16)(examples)
    with torch.no_grad():
        padded = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]).logits
        alone = model(input_ids=torch.tensor([[10, 11]])).logits[0]
    torch.testing.assert_close(padded[1, :2], alone, atol=1e-5, rtol=1e-4)


# ------------------------------------------------------------------------------------- batch order


def ids_of(batch):
    """The example ids in a batch, for streams over examples whose only token is their index."""
    return batch["input_ids"][:, 0].tolist()


def make_stream(n=10, batch_size=3, seed=0, rank=0, world_size=1, shuffle=True):
    examples = [ex([i]) for i in range(n)]
    return BatchStream(examples, batch_size, Collator(pad_token_id=-1, max_length=4), seed=seed, shuffle=shuffle, rank=rank, world_size=world_size)


def test_epochs_are_seeded_permutations():
    stream = make_stream(n=12, batch_size=4)
    epochs = [sum((ids_of(stream.next_batch()) for _ in range(3)), []) for _ in range(3)]
    assert all(sorted(e) == list(range(12)) for e in epochs)
    assert epochs[0] != epochs[1] != epochs[2]
    again = make_stream(n=12, batch_size=4)
    assert sum((ids_of(again.next_batch()) for _ in range(9)), []) == sum(epochs, [])
    other_seed = make_stream(n=12, batch_size=4, seed=1)
    assert sum((ids_of(other_seed.next_batch()) for _ in range(3)), []) != epochs[0]
    ordered = make_stream(n=12, batch_size=4, shuffle=False)
    assert [ids_of(ordered.next_batch()) for _ in range(4)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [0, 1, 2, 3]]


def test_batches_run_across_epoch_boundaries_without_dropping():
    stream = make_stream(n=5, batch_size=3, shuffle=False)
    assert [ids_of(stream.next_batch()) for _ in range(4)] == [[0, 1, 2], [3, 4, 0], [1, 2, 3], [4, 0, 1]]
    tiny = make_stream(n=2, batch_size=3, shuffle=False)  # a data set smaller than one batch
    assert ids_of(tiny.next_batch()) == [0, 1, 0]


def test_resume_continues_with_the_uninterrupted_batches():
    reference = make_stream(n=10, batch_size=3, seed=7)
    expected = [ids_of(reference.next_batch()) for _ in range(12)]
    first = make_stream(n=10, batch_size=3, seed=7)
    seen = [ids_of(first.next_batch()) for _ in range(5)]
    state = first.state_dict()
    assert set(state) >= {"epoch", "position"} and state["epoch"] == 1
    resumed = make_stream(n=10, batch_size=3, seed=7)
    resumed.load_state_dict(state)
    assert seen + [ids_of(resumed.next_batch()) for _ in range(7)] == expected


def test_ranks_take_disjoint_slices_of_each_global_batch():
    world = 3
    single = make_stream(n=11, batch_size=2 * world, seed=4)
    shards = [make_stream(n=11, batch_size=2, seed=4, rank=r, world_size=world) for r in range(world)]
    for _ in range(5):
        global_batch = ids_of(single.next_batch())
        parts = [ids_of(s.next_batch()) for s in shards]
        # Rank r holds positions [2r, 2r+2) of the global batch: together exactly the global batch.
        assert sum(parts, []) == global_batch and all(len(p) == 2 for p in parts)


def test_resume_refuses_a_different_data_set():
    state = make_stream(n=10).state_dict()
    with pytest.raises(DataError, match="saved over 10 examples, this run has 9"):
        make_stream(n=9).load_state_dict(state)
    with pytest.raises(DataError, match="data.seed=0"):
        make_stream(n=10, seed=5).load_state_dict(state)
