"""Linear layers on prepacked MKL weights while a frozen model decodes in fp32 on a CPU.

A speculative step's verify forward multiplies a few rows (the tree's nodes) by every weight of
the target. On a CPU in fp32 ``F.linear`` does that poorly at a few rows: on the 2-core Xeon of
docs/lookup.md, SmolLM2-135M's LM head (49,152 x 576) took 4.0 ms for one row and 18.1 ms for 11.
From a weight packed once into MKL's own layout (``cblas_sgemm_compute``, the path torch's inductor
takes for frozen CPU weights) the 11 rows took 6.0 ms, and a whole 11-node forward of that model
went from 91.7 to 75.8 ms (``scripts/bench_tree_forward.py --unpacked-too``). One row stays on
``F.linear``: a one-token step measured no faster packed.

``packed_linears(model)`` is a context: inside it every fp32 ``nn.Linear`` of ``model`` on the CPU
runs from its packed copy, outside it the module is untouched (so transformers' own ``generate``,
the reference the tests compare with, runs as it always did). The packs are made on first entry and
kept with the model; a weight that changed since (its version counter or its storage) is packed
again, but a write through ``weight.data`` moves neither and goes unseen: pack only weights that
stay put (decoding packs the frozen target alone). Results differ from ``F.linear`` by rounding only; with gradients on, the layers run as
usual. The packs hold a second copy of the linear weights: a model whose linear weights exceed a
quarter of the memory available runs unpacked (said once), and ``DRAFTSMITH_PACKED_LINEARS=0`` in
the environment turns packing off (to compare, or to save the memory).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import weakref
from typing import Iterator, Optional

import torch
from torch import Tensor, nn

__all__ = ["packed_layers", "packed_linears", "packing_available", "suspended"]

# The row count MKL is told to pack for. It tunes the layout; the pack multiplies other row counts
# too (tests/unit/test_packed.py checks 2-40 rows on 1 and 2 threads against F.linear). 16 measured
# faster than 1 at both one row and eleven (docs/lookup.md).
PACK_ROWS = 16


def packing_available() -> bool:
    """Whether this torch build has MKL's packed matrix products (x86 builds do)."""
    try:
        return torch.backends.mkl.is_available() and bool(torch.ops.mkl._mkl_linear) and bool(torch.ops.mkl._mkl_reorder_linear_weight)
    except (AttributeError, RuntimeError):
        return False


def _packed_product(x: Tensor, packed: Tensor, weight: Tensor, bias: Optional[Tensor], rows: int) -> Tensor:
    # The last argument is the row count the pack is used for: given the call's own, MKL's packed
    # product always runs (torch otherwise falls back to F.linear when it differs from the pack's).
    return torch.ops.mkl._mkl_linear(x, packed, weight, bias, rows)


class _Packed:
    """One linear layer's packed weight, and the forward that uses it."""

    def __init__(self, layer: nn.Linear) -> None:
        self.layer = layer
        self.pack()

    def pack(self) -> None:
        weight = self.layer.weight.detach()
        self.stamp = (weight._version, weight.data_ptr())
        self.packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, PACK_ROWS)

    def forward(self, input: Tensor) -> Tensor:  # noqa: A002 (nn.Linear's own name: layer(input=...) works)
        weight, bias = self.layer.weight, self.layer.bias
        trains = torch.is_grad_enabled() and (input.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))
        rows = input.numel() // input.shape[-1] if input.dim() else 0
        # One row is a matrix-vector product, which F.linear already runs at memory speed: a whole
        # one-token step measured no faster packed (docs/lookup.md).
        if trains or rows <= 1 or input.dtype != torch.float32 or input.device.type != "cpu" or weight.device.type != "cpu":
            return nn.functional.linear(input, weight, bias)
        if (weight._version, weight.data_ptr()) != self.stamp:
            self.pack()
        out = _packed_product(input.reshape(rows, input.shape[-1]), self.packed, weight.detach(), None if bias is None else bias.detach(), rows)
        return out.view(*input.shape[:-1], out.shape[-1])


_packs: "weakref.WeakKeyDictionary[nn.Module, dict[nn.Linear, _Packed]]" = weakref.WeakKeyDictionary()
_depth: "weakref.WeakKeyDictionary[nn.Module, int]" = weakref.WeakKeyDictionary()  # nested entries
_noted: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()  # models a note was printed for
_lock = threading.Lock()  # entries and exits from several threads patch and restore once
_suspended = 0  # > 0 inside ``suspended()``


def _eligible(model: nn.Module) -> list[nn.Linear]:
    """The fp32 CPU linear layers whose weights stay put and whose forward is nn.Linear's own: not
    those DeepSpeed ZeRO-3 partitions (``ds_id``: gathered anew for each forward), not inference
    tensors (no version counter to notice a change by), not a layer whose forward something else
    (an accelerate hook) already replaced."""
    return [
        m for m in model.modules()
        if type(m) is nn.Linear and "forward" not in m.__dict__ and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"
        and m.weight.numel() and not hasattr(m.weight, "ds_id") and not m.weight.is_inference()
    ]  # fmt: skip


def _memory_available() -> Optional[int]:
    """Bytes the kernel could hand out now (MemAvailable: free pages and reclaimable cache)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _note_once(model: nn.Module, text: str) -> None:
    if model not in _noted:
        _noted.add(model)
        print(f"note: {text}", file=sys.stderr)


def _packs_for(model: nn.Module) -> dict[nn.Linear, _Packed]:
    """The model's packs, made on first use. Nothing is kept while there is nothing to pack (the
    model elsewhere or in another dtype, too little memory): a later entry looks again."""
    packs = _packs.get(model)
    if packs is not None:
        return packs
    first = next(model.parameters(), None)
    if first is None or first.device.type != "cpu":  # a GPU's model: nothing to look through
        return {}
    layers = _eligible(model)
    if not layers:
        return {}
    size = sum(layer.weight.numel() * layer.weight.element_size() for layer in layers)
    free = _memory_available()
    if free is not None and size > free // 4:
        _note_once(model, f"the model's linear weights ({size / 2**30:.1f} GiB) run unpacked: their packed copy would take over a quarter of the {free / 2**30:.1f} GiB available")  # fmt: skip
        return {}
    try:
        packs = {layer: _Packed(layer) for layer in layers}
    except RuntimeError as err:  # a torch whose MKL packing refuses these weights: decode as before
        _note_once(model, f"the model's linear layers run unpacked: MKL packing failed ({str(err).splitlines()[0][:200]})")
        packs = {}
    _packs[model] = packs
    return packs


def packed_layers(model: nn.Module) -> int:
    """How many of ``model``'s linear layers decoding runs from packed weights (reports say it)."""
    with packed_linears(model) as count:
        return count


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """No packing inside (``draftsmith.testing.simulated_cuda_graphs``: a CUDA device never packs)."""
    global _suspended
    with _lock:
        _suspended += 1
    try:
        yield
    finally:
        with _lock:
            _suspended -= 1


@contextlib.contextmanager
def packed_linears(model: nn.Module, enabled: bool = True) -> Iterator[int]:
    """Inside, ``model``'s fp32 CPU linear layers run from packed weights (see the module). Yields
    how many layers do (0 where packing is unavailable, disabled, or the model is elsewhere)."""
    enabled = enabled and not _suspended and os.environ.get("DRAFTSMITH_PACKED_LINEARS", "1") != "0"
    packs = _packs_for(model) if enabled and packing_available() else {}
    if not packs:
        yield 0
        return
    with _lock:
        depth = _depth.get(model, 0)
        if depth == 0:
            for layer, packed in packs.items():
                layer.forward = packed.forward
        _depth[model] = depth + 1
    try:
        yield len(packs)
    finally:
        with _lock:
            _depth[model] -= 1
            if _depth[model] == 0:
                for layer in packs:
                    layer.__dict__.pop("forward", None)  # the class's forward again
