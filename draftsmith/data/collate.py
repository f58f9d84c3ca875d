"""Examples to tensors: right padding, or packing several examples into one row.

Packed rows keep examples apart in three ways: position ids restart at 0 for each example, a 4D
block-diagonal causal attention mask stops attention across examples, and ``segment_ids`` lets the
loss drop labels that would cross from one example into the next.

The 4D mask is additive and float32 (0 = attend, the most negative float = blocked), because HF
models in transformers 5 pass a 4D mask through untouched: eager attention adds it to the scores
(a bool mask would be added as 0/1 and silently mask nothing), and SDPA accepts a float32 mask for
any query dtype. Padding queries attend to themselves so no row of the mask is fully blocked.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from draftsmith.data.errors import DataError


def block_causal_mask(segment_ids: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Additive attention mask [B,1,T,T] from segment ids [B,T] (0 = padding, 1..n = example).

    Query t may attend to key s iff s <= t and both belong to the same example; a padding query
    attends only to itself. Allowed entries are 0, blocked ones ``torch.finfo(dtype).min``.
    """
    B, T = segment_ids.shape
    same = segment_ids.unsqueeze(2) == segment_ids.unsqueeze(1)  # [B,T,T]
    causal = torch.ones(T, T, dtype=torch.bool, device=segment_ids.device).tril()
    real = (segment_ids > 0).unsqueeze(2)
    eye = torch.eye(T, dtype=torch.bool, device=segment_ids.device)
    allowed = (same & causal & real) | eye
    mask = torch.zeros(B, 1, T, T, dtype=dtype, device=segment_ids.device)
    return mask.masked_fill(~allowed.unsqueeze(1), torch.finfo(dtype).min)


class Batch(dict):
    """A collated batch: field name -> tensor (Collator says which). Batches are made on the host
    and reach a model through one call, ``batch.to(device)``, which moves every field at once; the
    trainers call it where a batch meets the model, never field by field."""

    def to(self, device: torch.device | str) -> "Batch":
        device = torch.device(device)
        # non_blocking: a copy to a GPU overlaps with the host's next work; the CPU ignores it.
        return Batch({name: value.to(device, non_blocking=True) for name, value in self.items()})

    @property
    def device(self) -> torch.device:
        return self["input_ids"].device


class Collator:
    """Turns a list of examples (``{"input_ids": [int], "loss_mask": [int]}``) into a batch.

    Without packing, one example per row, right-padded to the longest (B = len(examples)):
      input_ids [B,T] long, attention_mask [B,T] long (1 real, 0 pad), loss_mask [B,T] long,
      position_ids [B,T] long (0..len-1, 0 on padding), segment_ids [B,T] long (1 real, 0 pad).
    With packing, examples fill rows greedily in the given order up to max_length tokens
    (B <= len(examples)); position_ids restart at 0 for each example, segment_ids number the
    examples of a row 1..n, and attention_mask is the block-diagonal causal mask [B,1,T,T] float32
    of :func:`block_causal_mask`. Examples longer than max_length are truncated in both modes.
    """

    def __init__(self, pad_token_id: int, max_length: int, packing: bool = False) -> None:
        if pad_token_id is None:
            raise DataError("the collator needs a pad token id; the tokenizer has neither pad nor eos token")
        if max_length <= 0:
            raise DataError(f"data.max_length must be positive, got {max_length}")
        self.pad_token_id = int(pad_token_id)
        self.max_length = int(max_length)
        self.packing = packing

    def _rows(self, examples: Sequence[dict]) -> list[list[dict]]:
        if not self.packing:
            return [[example] for example in examples]
        rows: list[list[dict]] = []
        used = self.max_length  # forces a new row for the first example
        for example in examples:
            n = min(len(example["input_ids"]), self.max_length)
            if used + n > self.max_length:
                rows.append([])
                used = 0
            rows[-1].append(example)
            used += n
        return rows

    def __call__(self, examples: Sequence[dict]) -> Batch:
        if not examples:
            raise DataError("cannot collate an empty list of examples")
        rows = self._rows(examples)
        lengths = [sum(min(len(e["input_ids"]), self.max_length) for e in row) for row in rows]
        B, T = len(rows), max(lengths)
        input_ids = torch.full((B, T), self.pad_token_id, dtype=torch.long)
        loss_mask = torch.zeros(B, T, dtype=torch.long)
        position_ids = torch.zeros(B, T, dtype=torch.long)
        segment_ids = torch.zeros(B, T, dtype=torch.long)
        for b, row in enumerate(rows):
            start = 0
            for segment, example in enumerate(row, start=1):
                ids = example["input_ids"][: self.max_length]
                n = len(ids)
                input_ids[b, start : start + n] = torch.as_tensor(ids, dtype=torch.long)
                loss_mask[b, start : start + n] = torch.as_tensor(example["loss_mask"][:n], dtype=torch.long)
                position_ids[b, start : start + n] = torch.arange(n)
                segment_ids[b, start : start + n] = segment
                start += n
        if self.packing:
            attention_mask = block_causal_mask(segment_ids)
        else:
            attention_mask = (segment_ids > 0).long()
        return Batch(
            input_ids=input_ids,
            attention_mask=attention_mask,
            loss_mask=loss_mask,
            position_ids=position_ids,
            segment_ids=segment_ids,
        )
