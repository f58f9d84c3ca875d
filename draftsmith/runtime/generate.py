"""The speculative decoding loop with KV-cache bookkeeping, and the plain autoregressive baseline.

Batch size 1. Each step: the drafter proposes a tree rooted at the last decided token, the target
reads all tree nodes in ONE forward (tree attention mask, tree position ids) on top of its
DynamicCache, the tree is verified, and the cache keeps the accepted path's entries and drops the
others by moving tensors (the prefix is never recomputed). The step emits the accepted tokens plus
the bonus token, which becomes the next root. Greedy output is token-identical to the target's own
greedy decoding (in fp32; bf16 rounding differs between one-token and many-token forwards and can
flip near-ties), and sampled output follows the target's processed distribution.
"""

from __future__ import annotations

import functools
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable, Optional, Sequence, Union

import torch
from torch import Tensor
from transformers import DynamicCache

from draftsmith.packed import packed_linears
from draftsmith.runtime.drafters import Drafter, DrafterError, DraftState, compact_cache
from draftsmith.runtime.static import CACHES, check_cache
from draftsmith.runtime.tree import DraftTree, tree_attention_mask, tree_positions
from draftsmith.runtime.verdict import verdict_row
from draftsmith.runtime.verify import GREEDY, SamplingParams, VerifyResult, logits_to_probs, verify
from draftsmith.target import DecoderStack, decoder_stack

__all__ = [
    "CACHES", "GenerationStats", "TargetSession", "Verdict", "autoregressive_generate", "cache_in_use", "default_verify_fn", "open_session",
    "read_verdict", "resolve_cache", "speculative_generate", "verification_kernel",
]  # fmt: skip


@dataclass
class GenerationStats:
    """What one generation did.

    accept_lens[s]: drafted tokens accepted at step s (the step emitted accept_lens[s] + 1 tokens,
        fewer only when EOS or max_new_tokens cut it short). attempted_depths[s]: how many depths
        step s judged (accepted, plus one when the node it stopped at had children). draft_depths[s]: the deepest node of
        step s's tree. depth_attempts[d-1] / depth_accepts[d-1]: steps in which a drafted token at
        depth d was judged (the step reached depth d-1 and the node reached there had children) /
        accepted. target_forwards: target forward passes, the prefill included. new_tokens: tokens
        emitted. wall_time: seconds for the whole call; draft_time: seconds inside the drafter.
        draft_forwards: the drafter's forward passes (its ``forwards`` after the call; None where
        the drafter does not count them).
    The autoregressive baseline reports one step per token, each with accept_len 0.
    """

    accept_lens: list[int] = field(default_factory=list)
    attempted_depths: list[int] = field(default_factory=list)
    draft_depths: list[int] = field(default_factory=list)
    depth_attempts: list[int] = field(default_factory=list)
    depth_accepts: list[int] = field(default_factory=list)
    target_forwards: int = 0
    new_tokens: int = 0
    wall_time: float = 0.0
    draft_time: float = 0.0
    draft_forwards: Optional[int] = None

    @property
    def steps(self) -> int:
        return len(self.accept_lens)

    @property
    def mean_accept_len(self) -> float:
        """Mean accepted drafted tokens per step (tau - 1 in the papers' notation)."""
        return sum(self.accept_lens) / len(self.accept_lens) if self.accept_lens else 0.0

    def record_step(self, verdict: "Verdict") -> None:
        a, attempted = verdict.accept_len, verdict.attempted
        self.accept_lens.append(a)
        self.draft_depths.append(verdict.draft_depth)
        self.attempted_depths.append(attempted)
        for counts, n in ((self.depth_attempts, attempted), (self.depth_accepts, a)):
            counts.extend([0] * max(0, n - len(counts)))
            for d in range(n):
                counts[d] += 1

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(steps=self.steps, mean_accept_len=self.mean_accept_len)
        return out


@dataclass
class Verdict:
    """One step's outcome on the host, read from the device at once (``read_verdict``).

    accept_len: drafted tokens accepted; emitted: those tokens, then the bonus; attempted: depths
    judged (``GenerationStats``: accept_len, plus one when the node it stopped at had children);
    draft_depth: the tree's deepest node; rooted: whether the tree's root was the decided token;
    path: the accepted path's node indices, root first.
    """

    accept_len: int
    emitted: list[int]
    attempted: int
    draft_depth: int
    rooted: bool
    path: list[int]


def read_verdict(tree: DraftTree, result: VerifyResult, root: int) -> Verdict:
    """Everything the loop and its statistics need of a verified step, in one device read (the one
    sync a step needs: one copy of the step's small tensors, judged on the host). B = 1."""
    row = result.verdict
    if row is None:
        row = verdict_row(tree.tokens, tree.parents, None if tree.known_max_depth is not None else tree.depths, result)
    a, bonus, first, *rest = row.tolist()
    P, D = result.path.shape[1], result.accepted_tokens.shape[1]
    path, accepted, parents = rest[:P][: a + 1], rest[P : P + D], rest[P + D : P + D + tree.size]
    draft_depth = tree.known_max_depth if tree.known_max_depth is not None else max(rest[P + D + tree.size :])
    # Padding and the root have parent -1, so only a real child of the best node matches.
    deeper = int(path[-1] in parents)
    return Verdict(accept_len=a, emitted=accepted[:a] + [bonus], attempted=a + deeper, draft_depth=draft_depth, rooted=first == root, path=path)


class TargetSession:
    """The frozen target and its KV cache during one generation (B = 1).

    ``length`` tokens are cached. ``prefill`` appends tokens; ``forward_tree`` appends a tree's N
    nodes (cache slots length .. length+N-1, node i at slot length+i); ``keep`` then keeps only the
    accepted path's slots, packed after the prefix.
    """

    def __init__(self, target, layers: Sequence[int] = ()) -> None:
        self.target = target
        self.layers = list(layers)
        self.cache = DynamicCache(config=target.model.config)
        self.length = 0
        self._tree_base: Optional[int] = None
        self._stack: Optional[DecoderStack] = None

    def _run(self, ids: Tensor, positions: Tensor, mask: Optional[Tensor]) -> tuple[Tensor, dict[int, Tensor]]:
        base = self.target.model.base_model
        with self.target.capture(self.layers) as captured:
            out = base(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=self.cache, use_cache=True)
        n = len(self.target.layers)
        return out.last_hidden_state, {i: captured[i % n] for i in self.layers}

    @torch.no_grad()
    def prefill(self, ids: Tensor) -> tuple[Tensor, dict[int, Tensor]]:
        """Append ids [1,M] to the cache. Returns (final hidden [1,M,D], {layer: [1,M,D]})."""
        positions = torch.arange(self.length, self.length + ids.shape[1], device=ids.device).unsqueeze(0)
        hidden, layers = self._run(ids, positions, None)
        self.length += ids.shape[1]
        return hidden, layers

    @torch.no_grad()
    def next_logits(self, ids: Tensor) -> Tensor:
        """Append ids [1,M]; the logits [V] after the last of them (a plain decoding step)."""
        hidden, _ = self.prefill(ids)
        return self.target.lm_head(hidden[:, -1])[0]

    @torch.no_grad()
    def forward_tree(self, tree: DraftTree) -> tuple[Tensor, Tensor, dict[int, Tensor]]:
        """One forward over a tree's nodes. Returns (logits [1,N,V], final hidden [1,N,D], layers)."""
        mask = tree_attention_mask(tree.parents, self.length, self.target.dtype)
        hidden, layers = self._run(tree.tokens, tree_positions(tree.depths, self.length), mask)
        self._tree_base = self.length
        self.length += tree.size
        return self.target.lm_head(hidden), hidden, layers

    @property
    def stack(self) -> DecoderStack:
        """The target's layers as a DecoderStack, for forwards that start or stop mid-model."""
        if self._stack is None:
            self._stack = decoder_stack(self.target.model)
        return self._stack

    def cached_lengths(self) -> list[int]:
        """Entries held by each decoder layer's cache (they differ while a self-drafter drafts)."""
        return [layer.get_seq_length() for layer in self.cache.layers]

    @torch.no_grad()
    def run_layers(self, hidden: Tensor, start: int, stop: int, positions: Tensor, mask: Optional[Tensor]) -> Tensor:
        """Decoder layers start..stop-1 on hidden [1,N,D] at positions [1,N] on this cache (mask: 4D
        additive over the layers' cached entries plus the N new ones, None for all visible). Appends
        N entries to those layers' caches only; ``length`` is unchanged (see forward_tree_from)."""
        return self.stack.run(hidden, start, stop, positions, mask, self.cache)

    @torch.no_grad()
    def forward_tree_from(self, tree: DraftTree, layer: int, hidden: Tensor) -> tuple[Tensor, Tensor, dict[int, Tensor]]:
        """forward_tree for a self-drafter that already ran the tree's N nodes through decoder layers
        0..layer-1 on this cache (those layers hold ``length + N`` entries, the others ``length``):
        hidden [1,N,D] is layer layer-1's output at the nodes. Runs layers layer..L-1 on it, then
        the final norm and LM head. Returns (logits [1,N,V], final hidden [1,N,D], {}); ``keep``
        then works as after forward_tree."""
        N = tree.size
        lengths = self.cached_lengths()
        want = [self.length + N] * layer + [self.length] * (len(lengths) - layer)
        if lengths != want:
            raise DrafterError(f"forward_tree_from(layer={layer}) needs layer caches of {want[0]} and {want[-1]} entries, found {sorted(set(lengths))}")
        mask = tree_attention_mask(tree.parents, self.length, self.target.dtype)
        out = self.run_layers(hidden, layer, len(lengths), tree_positions(tree.depths, self.length), mask)
        final = self.stack.norm(out)
        self._tree_base = self.length
        self.length += N
        return self.target.lm_head(final), final, {}

    def keep(self, path: Union[Tensor, Sequence[int]]) -> None:
        """Keep the entries of tree nodes ``path`` (ascending node indices, root first) of the last
        forward_tree, drop the other nodes' entries."""
        if self._tree_base is None:
            raise DrafterError("keep() needs a forward_tree() first")
        path = torch.as_tensor(path, dtype=torch.long)
        compact_cache(self.cache, self._tree_base, path)
        self.length = self._tree_base + int(path.numel())
        self._tree_base = None

    def keep_first(self, n: int) -> None:
        """``keep(range(n))``: the first n tree nodes are the accepted path."""
        self.keep(list(range(n)))


def open_session(target, layers: Sequence[int], cache: str, capacity: int):
    """The target's session for one generation. ``cache``: "dynamic" (TargetSession, transformers'
    DynamicCache: the reference), "static" (StaticSession: a preallocated cache, its forwards
    replayed as CUDA graphs on a GPU, eager on the CPU) or "auto" (static on CUDA where the target
    supports it, dynamic elsewhere). A self-drafter (early exit) drafts on either."""
    from draftsmith.runtime.static import StaticSession

    if resolve_cache(target, cache) == "static":
        return StaticSession.for_target(target, layers, capacity)
    return TargetSession(target, layers)


def resolve_cache(target, cache: str) -> str:
    """"dynamic" or "static": what ``cache`` ("auto", "dynamic", "static") means for ``target``."""
    from draftsmith.runtime.static import static_session_supported, wants_static

    if check_cache(cache) == "auto":
        return "static" if wants_static(cache, target.device) and static_session_supported(target) else "dynamic"
    return cache


def cache_in_use(target, cache: str = "auto") -> str:
    """Which KV cache decoding with ``cache`` uses for ``target``, in words (reports, logs)."""
    if resolve_cache(target, cache) == "dynamic":
        return "dynamic cache (transformers)"
    return "static cache, CUDA graphs" if target.device.type == "cuda" else "static cache"


def _capacity(input_ids: Tensor, max_new_tokens: int) -> int:
    from draftsmith.runtime.static import TREE_ROOM

    return input_ids.shape[1] + max_new_tokens + TREE_ROOM


def default_verify_fn(device) -> Callable[..., VerifyResult]:
    """The fused kernel where it compiles for the device (CUDA with triton), else the reference.

    The Triton interpreter also runs the kernel on CPU, but far slower than the torch reference, so
    it is used only when a caller passes ``verify_fn=fused_verify`` explicitly (tests).
    """
    from draftsmith.runtime.kernels import fused_verify, kernel_available

    device = torch.device(device)
    return fused_verify if device.type == "cuda" and kernel_available(device) else verify


def _with_workspace(verify_fn: Callable[..., VerifyResult]) -> Callable[..., VerifyResult]:
    """The fused kernel with one workspace for the run: each step reads its verdict before the next
    verification, so the buffers can be refilled instead of allocated every step."""
    from draftsmith.runtime import kernels

    if verify_fn is not kernels.fused_verify:
        return verify_fn
    return functools.partial(kernels.fused_verify, workspace=kernels.VerifyWorkspace())


def verification_kernel(device, sampling: SamplingParams = GREEDY) -> str:
    """Which verification speculative_generate runs for a target on `device`, in words."""
    if sampling.mode == "typical":
        return "torch reference (typical acceptance)"
    return "fused Triton kernel" if default_verify_fn(device) is not verify else "torch reference"


def _eos_set(eos_token_id: Union[int, Iterable[int], None]) -> set[int]:
    if eos_token_id is None:
        return set()
    if isinstance(eos_token_id, int):
        return {eos_token_id}
    return {int(t) for t in eos_token_id}


def _check_prompt(input_ids: Tensor, max_new_tokens: int) -> None:
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] < 1:
        raise ValueError(f"input_ids must have shape [1,T] with T >= 1 (batch size 1), got {tuple(input_ids.shape)}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")


def _on_packed_weights(generate: Callable) -> Callable:
    """Runs ``generate(target, ...)`` with the target's linear layers on packed weights where it
    decodes in fp32 on a CPU (``draftsmith.packed``): the speculative loop and the plain baseline
    alike, so their speeds compare on the same matrix products. Only the frozen target: a drafter's
    weights may change under it (the online trainer's), and packing its small head measured no
    gain."""

    @functools.wraps(generate)
    def run(target, *args, **kwargs):
        with packed_linears(target.model):
            return generate(target, *args, **kwargs)

    return run


@torch.no_grad()
@_on_packed_weights
def speculative_generate(
    target,
    drafter: Drafter,
    input_ids: Tensor,
    max_new_tokens: int,
    sampling: SamplingParams = GREEDY,
    eos_token_id: Union[int, Iterable[int], None] = None,
    generator: Optional[torch.Generator] = None,
    verify_fn: Optional[Callable[..., VerifyResult]] = None,
    cache: str = "auto",
) -> tuple[Tensor, GenerationStats]:
    """Speculative decoding with ``drafter`` against ``target`` (a FrozenTarget), batch size 1.

    input_ids [1,T] (T >= 1; on any device: decoding runs on the target's). Returns (output_ids
    [1,T+n] = prompt + n new tokens, on input_ids' device, stats). Stops after the first EOS
    (emitted, as in HF ``generate``) or after ``max_new_tokens``; never emits past either. eos_token_id: an id, several, or None (no EOS).
    ``sampling`` says how tokens are chosen (SamplingParams: greedy, lossless sampling, or Medusa's
    typical acceptance, which is NOT lossless: the output does not follow the target's
    distribution). ``generator``
    (on the target's device, or None for the global RNG) drives the drafter's draws and the
    verification. The target's attention must apply a custom 4D mask (eager or SDPA; FrozenTarget
    checks). ``verify_fn`` defaults to ``default_verify_fn`` for the target's device: the fused
    Triton kernel on a GPU, the torch reference elsewhere; typical acceptance always runs in the
    torch reference. ``cache``: the target's KV cache (see ``open_session``): "auto" replays the
    target's forwards as CUDA graphs on a static cache on a GPU.
    """
    _check_prompt(input_ids, max_new_tokens)
    caller, input_ids = input_ids.device, input_ids.to(target.device)
    chosen = verify_fn
    verify_fn = verify if sampling.mode == "typical" else verify_fn or default_verify_fn(input_ids.device)
    verify_fn = _with_workspace(verify_fn)
    eos = _eos_set(eos_token_id)
    stats = GenerationStats()
    start = time.perf_counter()
    # A self-drafter (early exit) drafts on the target's own cache and verifies from its exit layer.
    shares_cache = hasattr(drafter, "bind")
    session = open_session(target, drafter.required_layers(), cache, _capacity(input_ids, max_new_tokens))
    if shares_cache:
        drafter.bind(session)
    drafter.reset(input_ids)
    # A static session with graphs verifies inside its tree forward's graph, a self-drafter's verify
    # forward included (the default verification only: a caller's verify_fn runs as given): greedy,
    # and lossless sampling, its uniforms drawn before the graph from the generator.
    in_graph = chosen is None and getattr(session, "graphs", False) and sampling.mode in ("greedy", "sample")
    tokens = input_ids
    # The last prompt token is the first root: it enters the cache with the first tree.
    hidden, layers = None, {}
    if input_ids.shape[1] > 1:
        hidden, layers = session.prefill(input_ids[:, :-1])
        stats.target_forwards += 1
    new: list[int] = []
    finished = max_new_tokens == 0
    # The decided tokens on the host too: one read of the prompt, then what each step emits. A
    # step then syncs with the device once, where it reads the verdict.
    decided = input_ids[0].tolist()
    root = decided[-1]
    while not finished:
        state = DraftState(tokens=tokens, new_hidden=hidden, new_layers=layers, sampling=sampling, generator=generator, last_token=root,
                           host_tokens=decided)  # fmt: skip
        t0 = time.perf_counter()
        tree = drafter.propose(state)
        stats.draft_time += time.perf_counter() - t0
        if tree.batch_size != 1:
            raise DrafterError(f"{type(drafter).__name__} proposed {tree.batch_size} trees for one sequence")
        if in_graph:
            # On graphs: the verification replays inside the tree forward's graph.
            if shares_cache:
                logits, tree_hidden, tree_layers, result = drafter.verify_forward(tree, verified=True, sampling=sampling, generator=generator)
            else:
                logits, tree_hidden, tree_layers, result = session.forward_tree_verified(tree, sampling, generator)
        else:
            logits, tree_hidden, tree_layers = drafter.verify_forward(tree) if shares_cache else session.forward_tree(tree)
            result = verify_fn(tree, logits, sampling, generator=generator)
        stats.target_forwards += 1
        verdict = read_verdict(tree, result, root)  # the step's one read from the device
        result.host_path = verdict.path  # the drafter's accept reads it from here
        if not verdict.rooted:
            raise DrafterError(f"{type(drafter).__name__} proposed a tree whose root is not the last decided token")
        t0 = time.perf_counter()
        drafter.accept(result)
        stats.draft_time += time.perf_counter() - t0
        stats.record_step(verdict)

        a, emitted = verdict.accept_len, verdict.emitted
        # Where the accepted nodes are the tree's first (a chain, or nothing accepted), their cache
        # entries and features already sit in place: nothing to move or gather.
        in_place = verdict.path == list(range(a + 1))
        path = None if in_place else result.path[0, : a + 1]
        if in_place:
            session.keep_first(a + 1)
        else:
            session.keep(path)
        for token in emitted:
            new.append(token)
            if token in eos or len(new) >= max_new_tokens:
                finished = True
                break
        # The decided tokens grow on the device from the verdict's own tensors (no upload).
        tokens = torch.cat([tokens, result.accepted_tokens[:, :a].to(tokens.dtype), result.bonus[:1].view(1, 1).to(tokens.dtype)], dim=1)
        root = emitted[-1]
        decided.extend(emitted)
        # The next drafter sees the target's features of the positions just cached: the path.
        if in_place:
            hidden, layers = tree_hidden[:, : a + 1], {i: h[:, : a + 1] for i, h in tree_layers.items()}
        else:
            path = path.to(tree_hidden.device)
            hidden, layers = tree_hidden[:, path], {i: h[:, path] for i, h in tree_layers.items()}
    stats.new_tokens = len(new)
    stats.wall_time = time.perf_counter() - start
    stats.draft_forwards = getattr(drafter, "forwards", None)
    out = torch.tensor([new], dtype=input_ids.dtype, device=input_ids.device)
    return torch.cat([input_ids, out], dim=1).to(caller), stats


@torch.no_grad()
@_on_packed_weights
def autoregressive_generate(
    target,
    input_ids: Tensor,
    max_new_tokens: int,
    sampling: SamplingParams = GREEDY,
    eos_token_id: Union[int, Iterable[int], None] = None,
    generator: Optional[torch.Generator] = None,
    cache: str = "auto",
) -> tuple[Tensor, GenerationStats]:
    """The target alone, one token per forward on its KV cache: the baseline for speedups.

    Same arguments, stopping rules and return value as ``speculative_generate`` (batch size 1).
    Sampling draws from ``logits_to_probs`` with ``torch.multinomial``; typical acceptance, which
    only means something for drafted tokens, samples at its temperature
    (``SamplingParams.target_alone``).
    """
    _check_prompt(input_ids, max_new_tokens)
    caller, input_ids = input_ids.device, input_ids.to(target.device)
    sampling = sampling.target_alone()
    eos = _eos_set(eos_token_id)
    stats = GenerationStats()
    start = time.perf_counter()
    session = open_session(target, (), cache, _capacity(input_ids, max_new_tokens))
    new: list[int] = []
    ids = input_ids
    while len(new) < max_new_tokens:
        logits = session.next_logits(ids)
        stats.target_forwards += 1
        if sampling.greedy:
            token = int(logits.argmax())
        else:
            probs = logits_to_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p)
            token = int(torch.multinomial(probs, 1, generator=generator))
        new.append(token)
        stats.accept_lens.append(0)
        stats.draft_depths.append(0)
        if token in eos:
            break
        ids = torch.tensor([[token]], dtype=input_ids.dtype, device=input_ids.device)
    stats.new_tokens = len(new)
    stats.wall_time = time.perf_counter() - start
    out = torch.tensor([new], dtype=input_ids.dtype, device=input_ids.device)
    return torch.cat([input_ids, out], dim=1).to(caller), stats
