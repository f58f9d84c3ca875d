"""A decoding step's verdict in one row: what the loop reads of a verification, copied to the host at
once (``runtime.generate.read_verdict``), and made inside the target's CUDA graph where the
verification runs there (``runtime.static.StaticSession.forward_tree_verified``)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

__all__ = ["verdict_row"]


def verdict_row(tokens: Tensor, parents: Tensor, depths: Optional[Tensor], result) -> Tensor:
    """Tree 0's step in one row (``result``: a VerifyResult): accept_len, bonus, the root's token,
    the path [D+1], the accepted tokens [D], the parents [N], then (unless None) the depths [N]."""
    parts = [result.accept_len[:1], result.bonus[:1], tokens[0, :1], result.path[0], result.accepted_tokens[0], parents[0]]
    return torch.cat(parts if depths is None else [*parts, depths[0]])
