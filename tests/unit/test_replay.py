"""The online replay buffer: verified records from runtime statistics, bounded FIFO, empty buffers."""

import pytest

from draftsmith.data.replay import ReplayBuffer, verified_record


def test_verified_record_marks_accepted_and_rejected_positions():
    # chain of depth 3: step 1 accepts 2 (3rd rejected -> the target's correction), step 2 accepts
    # all 3 (+ a bonus token, no rejection), step 3 accepts 0 (correction at once).
    prompt = [7, 8]
    emitted = [10, 11, 12, 20, 21, 22, 23, 30]
    rec = verified_record(prompt, emitted, accept_lens=[2, 3, 0], draft_depths=[3, 3, 3])
    assert rec["input_ids"] == prompt + emitted
    assert rec["loss_mask"] == [0, 0] + [1] * 8
    #                             p  p  10 11 12 20 21 22 23 30
    assert rec["rejected_mask"] == [0, 0, 0, 0, 1, 0, 0, 0, 0, 1]
    assert rec["accepted"] == 5
    assert rec["judged"] == 3 + 3 + 1  # as eval.AcceptanceStats: accepted + 1 per step with a rejection


def test_buffer_is_bounded_fifo_and_sampling_is_seeded():
    buf = ReplayBuffer(capacity=3, seed=1, train_on="verified")
    for i in range(5):
        buf.add({"input_ids": [i, i], "loss_mask": [0, 1]})
    assert len(buf) == 3 and [r["input_ids"][0] for r in buf.records] == [2, 3, 4]
    (a,) = buf.sample(6)
    other = ReplayBuffer(capacity=3, seed=1, train_on="verified")
    other.load_state_dict({**buf.state_dict(), "draws": 0})
    assert other.sample(6) == [a]
    assert {r["input_ids"][0] for r in a} <= {2, 3, 4}
    # Several batches in one draw: the first is the single draw's batch, so one process taking all
    # batches and several processes taking one each see the same records.
    other.load_state_dict({**buf.state_dict(), "draws": 0})
    many = other.sample(6, count=3)
    assert len(many) == 3 and many[0] == a and other.draws == 1


def test_empty_buffer_samples_nothing():
    buf = ReplayBuffer(capacity=4, train_on="verified")
    assert buf.sample(2) is None
    buf.add({"input_ids": [1, 2], "loss_mask": [0, 0], "rejected_mask": [0, 0]})  # a request that produced no verified token
    assert buf.trainable_tokens == 0 and buf.sample(2) is None
    with pytest.raises(ValueError):
        ReplayBuffer(capacity=0)
    with pytest.raises(ValueError, match="train_on"):
        ReplayBuffer(capacity=2, train_on="everything")


def test_rejected_positions_only_by_default_and_clear():
    """OSD's default: updates see only the positions where the draft was wrong; a record without a
    rejection is never drawn; the verified variant sees every verified token."""
    prompt = [7, 8]
    wrong = verified_record(prompt, [10, 11, 12, 20], accept_lens=[2, 0], draft_depths=[3, 3])
    right = verified_record(prompt, [10, 11, 12, 13], accept_lens=[3], draft_depths=[3])
    assert sum(right["rejected_mask"]) == 0 and sum(wrong["rejected_mask"]) == 2
    buf = ReplayBuffer(capacity=4, seed=3)
    buf.extend([wrong, right])
    assert buf.trainable_tokens == 2
    for batch in buf.sample(5, count=3):
        for record in batch:
            assert record["input_ids"] == wrong["input_ids"] and record["loss_mask"] == wrong["rejected_mask"]
    assert buf.records[0]["loss_mask"] == wrong["loss_mask"]  # the stored record keeps both masks
    verified = ReplayBuffer(capacity=4, seed=3, train_on="verified")
    verified.extend([wrong, right])
    assert verified.trainable_tokens == 8
    drawn = {tuple(r["input_ids"]) for batch in verified.sample(8, count=4) for r in batch}
    assert drawn == {tuple(wrong["input_ids"]), tuple(right["input_ids"])}
    buf.clear()
    assert len(buf) == 0 and buf.sample(2) is None
