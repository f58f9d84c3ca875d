"""A forward captured once as a CUDA graph and replayed on new inputs.

At batch size 1 a decoding forward on a GPU costs what launching its kernels costs. Captured as a
CUDA graph, the whole forward is one launch. A graph replays fixed kernels on fixed memory, so the
forward must keep its shapes: callers capture one graph per shape (a tree size, a frontier size),
on caches that never move (runtime/static.py, heads/eagle.py).
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Hashable, Optional, Sequence

import torch
from torch import Tensor

__all__ = ["CapturedForward", "Graphs", "can_capture", "capture_or_none", "graph_pool"]

# What captures on a device other than CUDA: None (nothing does), or, inside a test's
# ``draftsmith.testing.simulated_cuda_graphs()``, a stand-in with CapturedForward's contract that
# runs on the CPU (a traced replay), so the CPU suite decodes through every capture as CUDA would.
_simulation: Optional[Callable[..., Any]] = None


def can_capture(device) -> bool:
    """Whether forwards on ``device`` are captured as graphs: on CUDA (or while a test simulates
    CUDA graphs on the CPU)."""
    return torch.device(device).type == "cuda" or _simulation is not None


def graph_pool(device):
    """A memory pool for the graphs of one cache (None where there is no CUDA)."""
    return torch.cuda.graph_pool_handle() if torch.device(device).type == "cuda" else None


class CapturedForward:
    """``fn(*inputs)`` captured as a CUDA graph on buffers made from the first ``inputs``.

    Calling it copies new inputs (same shapes and dtypes) into those buffers and replays the graph.
    What it returns are the graph's own output buffers: valid until the next replay of this graph
    or of another graph sharing its memory ``pool``. The warm-up runs before the capture (two on a
    side stream, as CUDA graphs ask) run ``fn`` for real: its side effects happen twice on the first
    inputs before the capture records them (three times under the CPU's simulated graphs, whose
    trace runs too), so ``fn`` must tolerate that (a cache write at the same slots does).
    """

    def __init__(self, fn: Callable[..., Any], inputs: Sequence[Tensor], pool=None, warmup: int = 2) -> None:
        self.inputs = [x.clone() for x in inputs]
        device = self.inputs[0].device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fn(*self.inputs)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.outputs = fn(*self.inputs)

    def __call__(self, *inputs: Tensor) -> Any:
        for buffer, value in zip(self.inputs, inputs):
            buffer.copy_(value)
        self.graph.replay()
        return self.outputs


def capture_or_none(fn: Callable[..., Any], inputs: Sequence[Tensor], what: str, pool=None) -> Optional[CapturedForward]:
    """``CapturedForward(fn, inputs, pool)``, or None, with one note on stderr naming ``what``, where
    the forward holds an operation a CUDA graph cannot capture: the caller then runs it eagerly."""
    capture = CapturedForward if inputs[0].is_cuda or _simulation is None else _simulation
    try:
        return capture(fn, inputs, pool)
    except RuntimeError as err:
        print(f"note: {what}: CUDA graph capture failed ({type(err).__name__}: {str(err).splitlines()[0][:200]}); going on without graphs", file=sys.stderr)
        return None


class Graphs:
    """The graphs one session captures, by name, each on its first use, and whether it still does:
    true while every capture has worked, false for good after one fails (the session then runs
    eagerly, said once by ``capture_or_none``), so a model with an operation a graph cannot hold
    still decodes. Truthy as that flag. ``captured`` maps each name to its graph (None: it failed)."""

    def __init__(self, enabled: bool, pool=None) -> None:
        self.enabled = enabled
        self.pool = pool
        self.captured: dict[Hashable, Optional[CapturedForward]] = {}

    def __bool__(self) -> bool:
        return self.enabled

    def get(self, name: Hashable, fn: Callable[..., Any], inputs: Sequence[Tensor], what: str) -> Optional[CapturedForward]:
        """The graph ``name``, captured now from ``fn(*inputs)`` where it is new; None where the
        session runs eagerly (graphs off, or a capture failed). ``what`` names it in the note."""
        if not self.enabled:
            return None
        if name not in self.captured:
            self.captured[name] = capture_or_none(fn, inputs, what, self.pool)
            self.enabled = self.captured[name] is not None
        return self.captured[name]

    def run(self, name: Hashable, fn: Callable[..., Any], inputs: Sequence[Tensor], what: str) -> tuple[Any, bool]:
        """``fn(*inputs)``: the graph ``name`` replayed (captured first where it is new), or ``fn``
        run eagerly where the session runs so. Returns (outputs, replayed); a replay's outputs are
        the graph's own buffers, overwritten by its next replay: copy what must outlive it."""
        graph = self.get(name, fn, inputs, what)
        return (graph(*inputs), True) if graph is not None else (fn(*inputs), False)

    def clear(self) -> None:
        """Drop every graph (the buffers they replay on are gone); the flag stays."""
        self.captured.clear()
