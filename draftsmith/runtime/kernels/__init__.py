"""Fused tree verification: one Triton step for a batch of draft trees, same contract as
`draftsmith.runtime.verify.verify`.

    from draftsmith.runtime.kernels import fused_verify, kernel_available
    verify_fn = fused_verify if kernel_available(logits.device) else verify

`fused_verify` matches the torch reference exactly in greedy mode and in distribution in sampling
mode (given the same `uniforms` it makes the same decisions, up to float rounding at a CDF or
acceptance boundary). On a CUDA device it runs compiled Triton kernels; on CPU tensors only under
`TRITON_INTERPRET=1`, set before anything in the process imports triton (torch and transformers
do, early): that is how the tests run them (tests/conftest.py). Without either, `kernel_available`
is False and callers use the reference. Triton is imported lazily, so importing this package never needs it.

Shapes: B trees, N nodes per tree, V vocabulary, D = the deepest node's depth in the batch.

Top-k / top-p: the kept set needs a sort (top-p) or a k-th largest value (top-k) over V for every
node. Doing that in the kernel would mean a per-node radix select; instead the launcher applies the
reference's own filtering in torch (`logits_to_probs` for top-p, the same k-th-largest threshold for
top-k) and hands the kernel logits that are -inf outside the kept set. The kept set is then
identical to the reference's by construction, and the kernel still does the temperature softmax,
the rejection walk, the residuals and the bonus draw. Without top-k / top-p (the common case) no
torch pass over the logits happens at all.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import sys
from typing import Optional

import torch
from torch import Tensor

from draftsmith.runtime.tree import DraftTree
from draftsmith.runtime.verify import GREEDY, SamplingParams, VerifyResult, logits_to_probs, verify, verify_typical

__all__ = ["VerifyWorkspace", "fused_verify", "kernel_available", "mode_conflict"]

_KERNEL_MODULE = "draftsmith.runtime.kernels.verify_kernels"


def kernel_available(device: torch.device | str) -> bool:
    """True iff `fused_verify` can run on tensors on `device`.

    CUDA: triton is installed and CUDA is up. CPU: triton is installed and the Triton interpreter is
    on (TRITON_INTERPRET=1) - and was on when the kernel module was imported, since `triton.jit`
    decides compiled vs interpreted at decoration time. Either way the kernels and triton's own
    library must be in the same mode (see `mode_conflict`).
    """
    device = torch.device(device)
    try:
        if importlib.util.find_spec("triton") is None:
            return False
    except (ImportError, ValueError):  # a triton stub without a spec (e.g. blocked in sys.modules)
        return False
    if mode_conflict() is not None:
        return False
    if device.type == "cuda":
        return torch.cuda.is_available()
    if device.type == "cpu":
        loaded = sys.modules.get(_KERNEL_MODULE)
        if loaded is not None:
            return bool(loaded.INTERPRETED)
        return _interpret_requested()
    return False


def _interpret_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def mode_conflict() -> Optional[str]:
    """Why the kernels cannot run in this process, if the reason is the interpreter switch; else None.

    triton.jit picks interpreted or compiled when a function is decorated: triton's library
    (tl.max, tl.sum, ...) when triton is first imported - torch and transformers import it early -
    and our kernels when their module is imported. Mixed modes fail inside the first launch.
    """
    loaded = sys.modules.get(_KERNEL_MODULE)
    if loaded is not None:
        kernels, library = loaded.INTERPRETED, loaded.LIBRARY_INTERPRETED
    else:
        language = sys.modules.get("triton.language")
        if language is None:
            return None
        kernels, library = _interpret_requested(), type(language.max).__name__ == "InterpretedFunction"
    if kernels == library:
        return None
    return (
        f"triton was imported with TRITON_INTERPRET={'1' if library else 'unset'} but the verification "
        f"kernels with TRITON_INTERPRET={'1' if kernels else 'unset'}; set it before anything imports "
        "triton (torch and transformers do), e.g. in the environment of the process"
    )


def _kernels():
    import importlib

    return importlib.import_module(_KERNEL_MODULE)


class VerifyWorkspace:
    """The buffers `fused_verify` writes (partials, scratch rows and outputs), kept from one call to
    the next (``workspace=``) and grown only when a call needs more: once the largest tree a loop
    drafts has been verified, a call allocates nothing on the device (each buffer is handed out as a
    contiguous view of its first elements). The result of a call made with a workspace lives in
    its buffers until the next call with the same workspace; a decoding loop, which reads each
    verdict before it verifies again, keeps one per run. Needs torch only, not triton."""

    def __init__(self, graphs: bool = False) -> None:
        self._buffers: dict[str, Tensor] = {}
        self.allocations = 0  # buffers made so far (tests: none once the shapes stop growing)
        # graphs=True, on CUDA: a call that comes again on the same tensors (same addresses, shapes
        # and strides, same settings: what a loop over static buffers does, as serving engines
        # keep them) replays its kernels as one CUDA graph; its result then lives in the graph's
        # own outputs until the same call comes again.
        self.graphs = graphs
        self._graphs: dict[tuple, object] = {}
        self.captures = self.replays = 0

    def graphed(self, key: tuple, launch, device: torch.device):
        """``launch()`` (the kernels on this call's tensors, allocating their own outputs), run as
        is the first time ``key`` is seen, captured as a CUDA graph the second time, replayed from
        then on. A launch that cannot be captured runs as is (said once)."""
        entry = self._graphs.get(key)
        if entry is None:
            if len(self._graphs) >= _GRAPHS_KEPT:  # callers that never repeat do not pile graphs up
                self._graphs.pop(next(iter(self._graphs)))
            self._graphs[key] = _SEEN
            return launch()
        if entry is _SEEN:
            try:
                entry = self._graphs[key] = _Captured(launch, device)
                self.captures += 1
            except RuntimeError as err:
                print(f"note: fused verification: CUDA graph capture failed ({str(err).splitlines()[0][:200]}); launching it as is", file=sys.stderr)
                entry = self._graphs[key] = _UNCAPTURABLE
        if entry is _UNCAPTURABLE:
            return launch()
        entry.graph.replay()
        self.replays += 1
        return entry.outputs

    def take(self, name: str, shape: tuple, dtype: torch.dtype, device: torch.device) -> Tensor:
        need = math.prod(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < need or buf.dtype != dtype or buf.device != device:
            buf = self._buffers[name] = torch.empty(need, dtype=dtype, device=device)
            self.allocations += 1
        return buf[:need].view(shape)


_GRAPHS_KEPT = 16
_SEEN, _UNCAPTURABLE = object(), object()


class _Captured:
    """``launch()`` captured once (after a warm-up on a side stream) as a CUDA graph on the tensors
    it closes over; ``outputs`` are the graph's, rewritten by each replay."""

    def __init__(self, launch, device: torch.device) -> None:
        side, current = torch.cuda.Stream(device), torch.cuda.current_stream(device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            launch()
        current.wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs = launch()


def _signature(*tensors: Optional[Tensor]) -> tuple:
    """Tensors as a graph sees them: where they are and how they are laid out."""
    return tuple(None if t is None else (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype) for t in tensors)


def _kernel_logits(target_logits: Tensor, temperature: float, top_k: int, top_p: float) -> tuple[Tensor, float]:
    """(logits, temperature) for the sampling kernel: -inf outside the reference's kept set.

    target_logits [B,N,V]. Without filtering the logits go through untouched and the kernel divides
    by the temperature; with filtering they come back already divided (temperature 1.0), because
    the reference filters the scaled logits.
    """
    V = target_logits.shape[-1]
    dtype = torch.promote_types(target_logits.dtype, torch.float32)
    if temperature == 0:
        # The reference's p is one-hot at the argmax (first index on ties): a 0 there and -inf
        # elsewhere is exactly that after the kernel's softmax.
        hot = target_logits.argmax(-1, keepdim=True)
        x = torch.full(target_logits.shape, float("-inf"), dtype=dtype, device=target_logits.device)
        return x.scatter_(-1, hot, 0.0), 1.0
    use_top_k = 0 < top_k < V
    if not use_top_k and top_p >= 1.0:
        return target_logits, float(temperature)
    x = target_logits.to(dtype) / temperature
    if top_p < 1.0:
        # Top-p needs the reference's stable sort; its zeros are exactly the dropped tokens.
        keep = logits_to_probs(target_logits, temperature, top_k, top_p) > 0
        return x.masked_fill(~keep, float("-inf")), 1.0
    kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
    return x.masked_fill(x < kth, float("-inf")), 1.0


def fused_verify(
    tree: DraftTree,
    target_logits: Tensor,
    sampling: Optional[SamplingParams] = None,
    generator: Optional[torch.Generator] = None,
    uniforms: Optional[Tensor] = None,
    workspace: Optional[VerifyWorkspace] = None,
) -> VerifyResult:
    """Verify B draft trees in one fused step. Same arguments and result as
    `draftsmith.runtime.verify.verify` (default greedy); with a ``workspace`` the call reuses its
    buffers and the result lives in them until the workspace's next call. A ``deterministic`` tree (fixed
    candidates, e.g. an EAGLE-2 dynamic tree) is walked with point masses in the kernel, as the
    reference does. Typical acceptance (Medusa's, NOT lossless) is not fused: it runs the torch
    reference, ``verify_typical``.

    tree: DraftTree (tokens, parents, depths [B,N], num_nodes [B], draft_probs [B,N,V] for
    sampling); target_logits [B,N,V], any float dtype. uniforms [B,N+1] in [0,1) (column c tests
    node c, column N draws the bonus) or None to draw them from `generator` exactly as the
    reference does, so the same generator state gives the same numbers to both.

    Returns VerifyResult: accept_len [B], best_node [B], path [B,D+1] (-1 padded),
    accepted_tokens [B,D] (-1 padded), bonus [B], all long.
    """
    sampling = sampling or GREEDY
    if sampling.mode == "typical":
        return verify_typical(tree, target_logits, sampling.temperature, sampling.posterior_threshold, sampling.posterior_alpha)
    if sampling.sampled and not tree.deterministic and tree.draft_probs is not None and tree.draft_probs.dtype == torch.float64:
        # The kernel carries q in fp32: a float64 q below fp32's range would read as 0 there, a child
        # it never accepts where the reference may. float64 drafts (tests, not drafters) take the reference.
        return verify(tree, target_logits, sampling, generator=generator, uniforms=uniforms)
    temperature, top_k, top_p = sampling.temperature, sampling.top_k, sampling.top_p
    B, N = tree.tokens.shape
    if target_logits.shape[:2] != (B, N):
        raise ValueError(f"target_logits has shape {tuple(target_logits.shape)}; the trees need [{B},{N},V]")
    device = target_logits.device
    if not kernel_available(device):
        conflict = mode_conflict()
        raise RuntimeError(
            f"the fused verification kernel cannot run on {device}: "
            + (conflict or "it needs CUDA and triton, or TRITON_INTERPRET=1 for CPU tensors")
            + "; use draftsmith.runtime.verify.verify"
        )
    vk = _kernels()
    path_len = tree.depth_bound + 1
    args = (tree.tokens, tree.parents, tree.num_nodes)
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        graphed = workspace is not None and workspace.graphs and device.type == "cuda"
        plain = sampling.greedy or ((top_k <= 0 or top_k >= target_logits.shape[-1]) and top_p >= 1.0 and temperature > 0)
        if graphed and plain and (sampling.greedy or (uniforms is not None and uniforms.device == device)):
            # The same call on the same tensors replays one CUDA graph: no launches, no Python
            # per kernel. The kernels allocate their own outputs there (the graph keeps them).
            draft = None if (sampling.greedy or tree.deterministic) else tree.draft_probs
            if not sampling.greedy and draft is None and not tree.deterministic:
                raise ValueError("sampled verification needs tree.draft_probs (the drafter's processed distributions)")
            key = (sampling.greedy, float(temperature), path_len, *_signature(*args, target_logits, draft, None if sampling.greedy else uniforms))
            if sampling.greedy:
                launch = lambda: vk.greedy(*args, target_logits, path_len, token_pad=-1)  # noqa: E731
            else:
                launch = lambda: vk.sample(*args, target_logits, float(temperature), draft, uniforms, path_len, token_pad=-1)  # noqa: E731
            outs = workspace.graphed(key, launch, device)
        elif sampling.greedy:
            outs = vk.greedy(*args, target_logits, path_len, token_pad=-1, workspace=workspace)
        else:
            if tree.draft_probs is None and not tree.deterministic:
                raise ValueError("sampled verification needs tree.draft_probs (the drafter's processed distributions)")
            if uniforms is None:
                # The reference's draw: same shape, dtype and generator call.
                dtype = torch.promote_types(target_logits.dtype, torch.float32)
                if tree.draft_probs is not None and not tree.deterministic:
                    dtype = torch.promote_types(dtype, tree.draft_probs.dtype)
                uniforms = torch.rand(B, N + 1, generator=generator, device=device, dtype=dtype)
            elif uniforms.shape != (B, N + 1):
                raise ValueError(f"uniforms must have shape [{B},{N + 1}], got {tuple(uniforms.shape)}")
            logits, kernel_temperature = _kernel_logits(target_logits, temperature, top_k, top_p)
            outs = vk.sample(
                *args, logits, kernel_temperature, None if tree.deterministic else tree.draft_probs, uniforms.to(device),
                path_len, token_pad=-1, workspace=workspace,
            )  # fmt: skip
    accept_len, best, bonus, path, accepted_tokens = outs
    return VerifyResult(
        accept_len=accept_len, best_node=best, path=path, accepted_tokens=accepted_tokens, bonus=bonus
    )
