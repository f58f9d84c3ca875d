"""Text to batches: conversations, chat templates with assistant-only loss masks, answers written by
the target, collation (padding or packing) and a resumable batch order.

The trainers use :func:`prepare_data` (a recipe's ``data:`` section to tokenized examples), a
:class:`Collator` and a :class:`BatchStream`.
"""

from draftsmith.data.chat import render_chat, tokenize_conversation
from draftsmith.data.collate import Batch, Collator, block_causal_mask
from draftsmith.data.errors import DataError
from draftsmith.data.order import BatchStream, epoch_order
from draftsmith.data.prepare import PreparedData, prepare_data
from draftsmith.data.regenerate import regenerate_conversations
from draftsmith.data.sources import BUILTIN_DATASETS, load_conversations, resolve_data_path

__all__ = [
    "BUILTIN_DATASETS",
    "Batch",
    "BatchStream",
    "Collator",
    "DataError",
    "PreparedData",
    "block_causal_mask",
    "epoch_order",
    "load_conversations",
    "prepare_data",
    "regenerate_conversations",
    "render_chat",
    "resolve_data_path",
    "tokenize_conversation",
]
