"""The target on a preallocated KV cache, its forwards replayed as CUDA graphs on a GPU.

On a GPU, a small model's forward at batch 1 is bound by the host: Python and kernel launches, not
arithmetic (a 30-layer, 135M-parameter Llama takes about 19 ms a step on an H200 in eager mode).
``StaticSession`` is ``TargetSession`` (prefill, forward_tree, keep) on a cache whose tensors never
move: every decoder layer's keys and values live in one buffer [L,1,H,capacity,Dh], a forward writes
its N entries at given slots, and every query attends over the whole buffer through an additive
mask that hides the slots not (yet) part of its context. Shapes then depend only on N, so on CUDA
each N's forward (embedding, decoder layers, final norm, LM head) is captured once as a CUDA graph
and replayed: one launch instead of hundreds. A tree's forward takes its tokens, depths, parents
and the cached length as device tensors and makes its positions, slots and mask inside the graph;
with ``forward_tree_verified`` the greedy verification runs in the same graph. The inputs of a
replay are copied into the graph's own buffers; its outputs are the graph's buffers too, valid until
the next forward.

On the CPU the same code runs eagerly (no graphs): it is the reference path's twin, token-identical
to ``TargetSession`` (tests/unit/test_static_session.py), which is what makes the CUDA path testable
without a GPU. Rolling back a rejected tree is one gather and one copy over all layers at once.

Works for decoders whose layers run in slices (``target.decoder_stack``: Llama, Qwen2, Mistral and
their kin); ``static_session_supported`` says whether a target is one.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from draftsmith.graphs import CapturedForward, Graphs, can_capture, graph_pool
from draftsmith.runtime.errors import DrafterError
from draftsmith.runtime.tree import DraftTree, ancestor_mask
from draftsmith.runtime.verdict import verdict_row
from draftsmith.runtime.verify import VerifyResult, logits_to_probs, verify_greedy_on_device, verify_sample_on_device
from draftsmith.sampling import draws_inputs, draws_key, with_uniforms
from draftsmith.target import TargetLoadError, decoder_stack

__all__ = ["CACHES", "StaticCache", "StaticSession", "check_cache", "drafting_capacity", "static_session_supported", "tree_visibility", "wants_static"]

# Slots reserved past prompt + new tokens for the largest tree a step may send.
TREE_ROOM = 256
# A draft model's read of at most this many new tokens (a step's accepted path and bonus) replays
# as one CUDA graph with the tree it then drafts (StaticSession.draft_tree); a longer one (a prompt)
# runs eagerly.
GRAPHED_READ = 8
# What decoding's `cache=` takes: "static" (this module), "dynamic" (transformers' DynamicCache, the
# reference) or "auto" (static on CUDA, dynamic elsewhere).
CACHES = ("auto", "dynamic", "static")


def check_cache(cache: str) -> str:
    """``cache`` when it is one of CACHES, else a ValueError naming them."""
    if cache not in CACHES:
        raise ValueError(f"cache must be one of {', '.join(CACHES)}, got {cache!r}")
    return cache


def wants_static(cache: str, device: torch.device) -> bool:
    """Whether ``cache`` asks a model on ``device`` for preallocated buffers ("auto": on CUDA)."""
    return cache == "static" or (cache == "auto" and device.type == "cuda")


def drafting_capacity(prompt: Optional[Tensor]) -> int:
    """Entries a drafter's preallocated cache starts with: the prompt and room for a few trees (it
    grows past that, doubling)."""
    return (0 if prompt is None else prompt.shape[1]) + 2 * TREE_ROOM


def static_session_supported(target) -> bool:
    """Whether ``target``'s decoder runs layer by layer with full attention in every layer (what
    the static session needs; a sliding-window layer keeps no entry per position)."""
    try:
        decoder_stack(target.model)
    except TargetLoadError:
        return False
    return "sliding_attention" not in (getattr(target.model.config, "layer_types", None) or ())


class StaticCache:
    """Keys and values of every decoder layer in two preallocated buffers [L,1,H,capacity,Dh].

    Speaks the one method of transformers' Cache that decoder layers call: ``update(keys, values,
    layer)`` writes the N new entries at ``slots`` (a [N] long tensor on the device, set before the
    forward) and returns the layer's whole buffer, which the caller's mask restricts."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, capacity: int, device, dtype) -> None:
        shape = (num_layers, 1, kv_heads, capacity, head_dim)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        self.capacity = capacity
        self.slots: Optional[Tensor] = None

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, cache_kwargs=None) -> tuple[Tensor, Tensor]:
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys.index_copy_(2, self.slots, key_states.to(keys.dtype))
        values.index_copy_(2, self.slots, value_states.to(values.dtype))
        return keys, values

    def move(self, start: int, sources: Tensor) -> None:
        """Slots start, start+1, ... take the entries of slots ``sources`` (ascending, sources[j] >=
        start + j), in every layer at once."""
        m = sources.numel()
        for buffer in (self.keys, self.values):
            buffer[:, :, :, start : start + m] = buffer.index_select(3, sources)


def greedy_in_graph(tokens: Tensor, parents: Tensor, depths: Tensor, num_nodes: Tensor, logits: Tensor, depth_bound: int) -> VerifyResult:
    """Greedy verification with no value read to the host: the fused kernel where it runs (CUDA
    with triton), ``verify_greedy_on_device`` elsewhere. Both equal ``verify_greedy``."""
    if logits.is_cuda:
        from draftsmith.runtime.kernels import _kernels, kernel_available

        if kernel_available(logits.device):
            with torch.cuda.device(logits.device):  # triton launches on the current device
                accept_len, best, bonus, path, accepted = _kernels().greedy(tokens, parents, num_nodes, logits, depth_bound + 1, token_pad=-1)
            return VerifyResult(accept_len=accept_len, best_node=best, path=path, accepted_tokens=accepted, bonus=bonus)
    return verify_greedy_on_device(tokens, parents, depths, depth_bound, logits)


def sampled_in_graph(
    tokens: Tensor, parents: Tensor, depths: Tensor, num_nodes: Tensor, logits: Tensor, depth_bound: int, sampling, draft_probs: Optional[Tensor], uniforms: Tensor
) -> VerifyResult:
    """Lossless sampled verification with no value read to the host, from ``uniforms`` [1,N+1]
    drawn before (as ``verify_sample`` would draw them): the fused kernel where it runs (CUDA with
    triton; a float64 draft, which the kernel would carry in fp32, excepted),
    ``verify_sample_on_device`` elsewhere. ``draft_probs`` None: fixed candidates. Both decide what
    ``verify_sample`` decides from the same uniforms."""
    fp64_draft = draft_probs is not None and draft_probs.dtype == torch.float64
    if logits.is_cuda and not fp64_draft:
        from draftsmith.runtime.kernels import _kernel_logits, _kernels, kernel_available

        if kernel_available(logits.device):
            x, temperature = _kernel_logits(logits, sampling.temperature, sampling.top_k, sampling.top_p)
            with torch.cuda.device(logits.device):  # triton launches on the current device
                accept_len, best, bonus, path, accepted = _kernels().sample(tokens, parents, num_nodes, x, temperature, draft_probs, uniforms, depth_bound + 1, token_pad=-1)
            return VerifyResult(accept_len=accept_len, best_node=best, path=path, accepted_tokens=accepted, bonus=bonus)
    probs = logits_to_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p)
    return verify_sample_on_device(tokens, parents, depths, num_nodes, probs, draft_probs, uniforms, depth_bound)


def verification_draws(tree: DraftTree, sampling, generator: Optional[torch.Generator], logits_like: tuple[int, torch.dtype, torch.device]) -> Optional[tuple]:
    """What a sampled verification inside a graph takes besides the tree (``verified_in_graph``'s
    ``sampled``): (sampling, the draft's distributions or None for fixed candidates, the uniforms
    [1,N+1] ``verify_sample`` would draw: the same shape, dtype and generator call, for logits of
    ``logits_like`` = (vocabulary, dtype, device)). None unless ``sampling`` samples. The tree is
    checked as ``verify_sample`` checks it, with what the host knows (no read): a capture would
    fail on a wrong shape, and a drawn tree without its distributions is a drafter's bug."""
    if sampling is None or not sampling.sampled:
        return None
    vocab, dtype, device = logits_like
    draft = None if tree.deterministic else tree.draft_probs
    if draft is None and not tree.deterministic and tree.size > 1:
        raise ValueError("sampled verification needs tree.draft_probs (the drafter's processed distributions)")
    if draft is not None and tuple(draft.shape) != (1, tree.size, vocab):
        raise ValueError(f"draft_probs has shape {tuple(draft.shape)}, target probs {(1, tree.size, vocab)}")
    drawn = torch.promote_types(dtype, torch.float32)
    drawn = drawn if draft is None else torch.promote_types(drawn, draft.dtype)
    return sampling, draft, torch.rand(1, tree.size + 1, generator=generator, device=device, dtype=drawn)


def sampled_inputs(sampled: Optional[tuple]) -> tuple[tuple, tuple[Tensor, ...]]:
    """(what a graph's name adds, the graph inputs it adds) for ``verification_draws``' result;
    ``with_sampled`` takes the inputs back inside the graph function. The name holds the settings
    and the draft's dtype (None: fixed candidates), which decide what the capture runs."""
    if sampled is None:
        return (), ()
    sampling, draft, uniforms = sampled
    named = (sampling.temperature, sampling.top_k, sampling.top_p, None if draft is None else draft.dtype)
    return named, (uniforms,) if draft is None else (uniforms, draft)


def with_sampled(sampled: Optional[tuple], drawn: Sequence[Tensor]) -> Optional[tuple]:
    """``sampled`` on the inputs a graph function received (``sampled_inputs``' order)."""
    return None if sampled is None else (sampled[0], drawn[1] if len(drawn) > 1 else None, drawn[0])


def verified_in_graph(
    tokens: Tensor, parents: Tensor, depths: Tensor, num_nodes: Tensor, logits: Tensor, depth_bound: int, sampled: Optional[tuple] = None
) -> tuple[Tensor, ...]:
    """``greedy_in_graph`` (or, with ``sampled`` = (sampling, draft_probs or None, uniforms),
    ``sampled_in_graph``) and the step's verdict row made beside it (the step's one read, inside
    the verify forward's graph): the VerifyResult's tensors, the verdict last."""
    if sampled is None:
        result = greedy_in_graph(tokens, parents, depths, num_nodes, logits, depth_bound)
    else:
        result = sampled_in_graph(tokens, parents, depths, num_nodes, logits, depth_bound, *sampled)
    return result.accept_len, result.best_node, result.path, result.accepted_tokens, result.bonus, verdict_row(tokens, parents, depths, result)


def tree_visibility(columns: Tensor, parents: Tensor, base: Tensor) -> Tensor:
    """visible [N, C] bool over a static cache's C slots (``columns`` = arange(C)) for N tree nodes
    written at slots base .. base+N-1 (``parents`` [N], topological, -1 for the root): every slot
    before ``base`` [1] and, among the tree's slots, the node's ancestors and itself. No host
    value: the same kernels whatever ``base`` and the tree's shape."""
    n = parents.shape[0]
    relative = columns - base  # a slot's node index in the tree (negative: the cache before it)
    ancestors = ancestor_mask(parents.unsqueeze(0))[0]  # [N,N]
    in_tree = (relative >= 0) & (relative < n)
    return (relative < 0) | (ancestors.index_select(1, relative.clamp(0, n - 1)) & in_tree)


class StaticSession:
    """``TargetSession`` on a ``StaticCache`` (B = 1), with CUDA graphs on a GPU (``graphs``: None =
    where the target is on CUDA). Same interface and the same results: ``prefill`` appends tokens,
    ``forward_tree`` appends a tree's nodes at slots length .. length+N-1, ``keep`` packs the
    accepted path after the prefix. ``capacity``: slots to allocate (the prompt, the new tokens and
    room for one tree); the cache grows, dropping its graphs, if a forward needs more."""

    def __init__(self, target, layers: Sequence[int] = (), capacity: int = 1024, graphs: Optional[bool] = None) -> None:
        self.target = target
        self.stack = decoder_stack(target.model)
        n = self.stack.num_layers
        self.layers = list(layers)
        self._wanted = sorted({i % n for i in self.layers})
        config = target.model.config
        self.kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.device, self.dtype = target.device, target.dtype
        graphs = can_capture(self.device) if graphs is None else graphs
        if graphs and not can_capture(self.device):
            raise ValueError(f"CUDA graphs need the target on a CUDA device; it is on {self.device}")
        self.graphs = Graphs(graphs)
        self.length = 0
        self._tree_base: Optional[int] = None
        self._one: Optional[tuple[Tensor, Tensor]] = None  # a plain step's depths and parents
        self._allocate(capacity)

    @classmethod
    def for_target(cls, target, layers: Sequence[int] = (), capacity: int = 1024) -> "StaticSession":
        """An empty session for ``target``, kept on it and reused by later generations, so that each
        tree size's graph is captured once per target, not once per prompt."""
        sessions = target.__dict__.setdefault("_static_sessions", {})
        key = (tuple(layers), target.device, target.dtype)
        session = sessions.get(key)
        if session is None:
            session = sessions[key] = cls(target, layers, capacity)
        session.reset(capacity)
        return session

    def reset(self, capacity: int = 0) -> None:
        """Forget every entry (the buffers and graphs stay); grow to ``capacity`` slots if smaller."""
        self.length = 0
        self._tree_base = None
        if capacity > self.cache.capacity:
            self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        old = getattr(self, "cache", None)
        self.cache = StaticCache(self.stack.num_layers, self.kv_heads, self.head_dim, capacity, self.device, self.dtype)
        if old is not None and self.length:
            self.cache.keys[:, :, :, : self.length] = old.keys[:, :, :, : self.length]
            self.cache.values[:, :, :, : self.length] = old.values[:, :, :, : self.length]
        self.columns = torch.arange(capacity, device=self.device)
        # Graphs replay on the cache they were captured on: a new cache, new graphs.
        self.graphs.clear()
        self.graphs.pool = graph_pool(self.device) if self.graphs else None

    def _room(self, n: int) -> None:
        if self.length + n > self.cache.capacity:
            self._allocate(max(2 * self.cache.capacity, self.length + n + TREE_ROOM))

    def additive_mask(self, visible: Tensor) -> Tensor:
        """The attention mask [1,1,N,capacity] of N new entries from ``visible`` [N,capacity] bool:
        0 where an entry sees a slot, the dtype's lowest value where it does not."""
        mask = torch.zeros(1, 1, visible.shape[0], self.cache.capacity, dtype=self.dtype, device=self.device)
        return mask.masked_fill_(~visible.reshape(mask.shape), torch.finfo(self.dtype).min)

    # ----------------------------------------------------------------------------- the forward

    def _eager(self, ids: Tensor, positions: Tensor, slots: Tensor, mask: Tensor, logits: str = "all") -> tuple[Optional[Tensor], Tensor, list[Tensor]]:
        """Embedding, decoder layers (writing the cache at `slots`), final norm and LM head (on
        every row, the last or none: `logits`). Returns (logits [1,N or 1,V] or None, final hidden
        [1,N,D], the wanted layers' outputs)."""
        self.cache.slots = slots
        hidden = self.stack.embed(ids)
        position_embeddings = self.stack.rotary(hidden, positions)
        wanted = []
        for i, layer in enumerate(self.stack.layers):
            out = layer(hidden, attention_mask=mask, position_ids=positions, past_key_values=self.cache, use_cache=True,
                        position_embeddings=position_embeddings)  # fmt: skip
            hidden = out[0] if isinstance(out, tuple) else out
            if i in self._wanted:
                wanted.append(hidden)
        final = self.stack.norm(hidden)
        head = {"all": final, "last": final[:, -1:], "none": None}[logits]
        return (None if head is None else self.target.lm_head(head)), final, wanted

    def _graph(self, inputs: tuple[Tensor, ...]) -> Optional[CapturedForward]:
        """The graph of this many tokens, captured on first use (its warm-ups write the slots the
        forward is about to write anyway); None (and eager from then on, said once) where the
        capture fails: a model with an operation that cannot be captured still decodes."""
        return self.graphs.get(inputs[0].shape[1], self._eager, inputs, "the target's forward")

    def _tree_eager(self, ids: Tensor, depths: Tensor, parents: Tensor, base: Tensor) -> tuple[Optional[Tensor], Tensor, list[Tensor]]:
        """A tree's forward as one function of device tensors, ``base`` [1] (the cached length)
        included: its rotary positions, its slots and its mask are made here, so on CUDA the whole
        verify forward (mask included) is one graph per tree size, the same graph every step."""
        n = ids.shape[1]
        mask = self.additive_mask(tree_visibility(self.columns, parents[0], base))
        return self._eager(ids, depths + base, self.columns[:n] + base, mask)

    def _tree_verified(self, ids: Tensor, depths: Tensor, parents: Tensor, base: Tensor, num_nodes: Tensor, depth_bound: int, sampled: Optional[tuple] = None):
        """``_tree_eager``, then the tree's verification on its logits (greedy, or ``sampled`` as
        ``verified_in_graph`` takes it), in the same function (one graph on CUDA: the fused
        kernel's launches replay with the forward). Returns the forward's outputs and the
        VerifyResult's tensors, its verdict row last."""
        out, final, wanted = self._tree_eager(ids, depths, parents, base)
        return out, final, wanted, verified_in_graph(ids, parents, depths, num_nodes, out, depth_bound, sampled)

    def _tree_forward(self, ids: Tensor, depths: Tensor, parents: Tensor, verify: Optional[tuple] = None):
        """N = ids.shape[1] tree nodes (depths and parents [1,N], parents topological, -1 for the
        root) appended at slots length.., each seeing the cache and its ancestors. Replays the
        tree-size graph where the session has graphs. ``verify`` (num_nodes [1], depth bound, and
        for sampling (sampling, draft_probs or None, uniforms), else None): verify in the same
        graph and return the VerifyResult too."""
        n = ids.shape[1]
        self._room(n)
        inputs = (ids, depths, parents, self.columns[self.length : self.length + 1])
        if verify is None:
            fn, key, what = self._tree_eager, ("tree", n), "the target's tree forward"
        else:
            num_nodes, bound, sampled = verify
            # Sampled, the uniforms (and the draft's distributions, but for fixed candidates) are
            # inputs; the settings are baked into the graph, named by them.
            named, drawn = sampled_inputs(sampled)
            inputs += (num_nodes, *drawn)
            key, what = ("tree-verify", n, *named), "the target's tree forward and verification"

            def fn(ids, depths, parents, base, num_nodes, *drawn):
                return self._tree_verified(ids, depths, parents, base, num_nodes, bound, with_sampled(sampled, drawn))

        (out, final, wanted, *checked), replayed = self.graphs.run(key, fn, inputs, what)
        if replayed:
            # The features a drafter may keep are copied (small); the logits and the verdict are
            # read before the next forward overwrites them.
            final, wanted = final.clone(), [h.clone() for h in wanted]
        self.length += n
        outputs = dict(zip(self._wanted, wanted))
        layers = {i: outputs[i % self.stack.num_layers] for i in self.layers}
        if verify is None:
            return out, final, layers
        return out, final, layers, VerifyResult(*checked[0])

    def _forward(self, ids: Tensor, positions: Tensor, visible: Tensor, logits: str = "all") -> tuple[Optional[Tensor], Tensor, dict[int, Tensor]]:
        """N = ids.shape[1] new entries at slots length.., `visible` [N,capacity] bool. A tree or a
        single token replays N's CUDA graph where the session has graphs (logits on every row); a
        prompt runs eagerly, its length varying (logits as asked)."""
        n = ids.shape[1]
        slots = self.columns[self.length : self.length + n]
        inputs = (ids, positions, slots, self.additive_mask(visible))
        graph = self._graph(inputs) if self.graphs and (logits == "all" or n == 1) else None
        if graph is not None:
            # The graph's buffers are overwritten by its next replay: the features a drafter may
            # keep are copied (small); the logits are read before the next forward.
            out, final, wanted = graph(*inputs)
            final, wanted = final.clone(), [h.clone() for h in wanted]
        else:
            out, final, wanted = self._eager(*inputs, logits)
        outputs = dict(zip(self._wanted, wanted))
        return out, final, {i: outputs[i % self.stack.num_layers] for i in self.layers}

    # ----------------------------------------------------------------------------- TargetSession's interface

    @torch.no_grad()
    def append(self, ids: Tensor, positions: Tensor, visible: Tensor, logits: str = "all") -> tuple[Optional[Tensor], Tensor, dict[int, Tensor]]:
        """Append N entries, ids [1,N] at rotary positions [1,N], at slots length .. length+N-1;
        visible [N, length+N] bool says which cached entries and new ones each of them sees (a
        draft model's tree levels). Returns (logits [1,N,V] ("all"; "last": [1,1,V]; "none":
        None), final hidden [1,N,D], layers); a graph replays where logits == "all" or N == 1."""
        n = ids.shape[1]
        self._room(n)
        full = torch.zeros(n, self.cache.capacity, dtype=torch.bool, device=self.device)
        full[:, : self.length + n] = visible
        out = self._forward(ids, positions, full, logits)
        self.length += n
        return out

    def pack(self, start: int, sources: Tensor) -> None:
        """Keep the first ``start`` entries, then the entries at slots ``sources`` (ascending, each
        >= its new place), packed after them; drop the rest."""
        self.cache.move(start, sources.to(self.device))
        self.length = start + int(sources.numel())
        self._tree_base = None

    def _append(self, ids: Tensor, logits: str):
        """Append ids [1,M] at positions length.., each seeing the cache and itself (causal)."""
        m = ids.shape[1]
        positions = torch.arange(self.length, self.length + m, device=self.device).unsqueeze(0)
        visible = torch.ones(m, self.length + m, dtype=torch.bool, device=self.device).tril(diagonal=self.length)
        return self.append(ids, positions, visible, logits)

    @torch.no_grad()
    def prefill(self, ids: Tensor) -> tuple[Tensor, dict[int, Tensor]]:
        """Append ids [1,M] to the cache. Returns (final hidden [1,M,D], {layer: [1,M,D]})."""
        _, hidden, layers = self._append(ids, "none")
        return hidden, layers

    @torch.no_grad()
    def next_logits(self, ids: Tensor) -> Tensor:
        """Append ids [1,M]; the logits [V] after the last of them (a plain decoding step: one
        token, the one-node tree's graph)."""
        if ids.shape[1] == 1:
            if self._one is None:
                self._one = (torch.zeros(1, 1, dtype=torch.long, device=self.device), torch.full((1, 1), -1, dtype=torch.long, device=self.device))
            logits, _, _ = self._tree_forward(ids.to(self.device), *self._one)
        else:
            logits, _, _ = self._append(ids, "last")
        return logits[0, -1]

    @torch.no_grad()
    def forward_tree(self, tree: DraftTree) -> tuple[Tensor, Tensor, dict[int, Tensor]]:
        """One forward over a tree's nodes. Returns (logits [1,N,V], final hidden [1,N,D], layers)."""
        base = self.length
        out = self._tree_forward(tree.tokens, tree.depths, tree.parents)
        self._tree_base = base
        return out

    @torch.no_grad()
    def forward_tree_verified(self, tree: DraftTree, sampling=None, generator: Optional[torch.Generator] = None) -> tuple[Tensor, Tensor, dict[int, Tensor], VerifyResult]:
        """``forward_tree`` and the tree's verification in one graph: (logits, final hidden,
        layers, VerifyResult). Greedy (``sampling`` None or greedy), the result equals
        ``verify_greedy``'s (the fused kernel's on CUDA); sampled (lossless), ``verify_sample``'s
        from the uniforms it would draw from ``generator``, drawn here first. Its path and accepted
        tokens are padded to N - 1 steps, and it lives in the graph's buffers until the next
        forward."""
        base = self.length
        sampled = verification_draws(tree, sampling, generator, (self.target.dims.vocab_size, self.dtype, self.device))
        # Paths sized for the deepest tree of N nodes (N - 1), not this tree's bound: one graph per
        # tree size, whatever depth each step's tree reaches (a lookup's trees vary).
        out = self._tree_forward(tree.tokens, tree.depths, tree.parents, verify=(tree.num_nodes, tree.size - 1, sampled))
        self._tree_base = base
        return out

    def keep(self, path: Union[Tensor, Sequence[int]]) -> None:
        """Keep the entries of tree nodes ``path`` (ascending node indices, root first) of the last
        forward_tree, drop the other nodes' entries."""
        if self._tree_base is None:
            raise DrafterError("keep() needs a forward_tree() first")
        self.pack(self._tree_base, torch.as_tensor(path, dtype=torch.long, device=self.device) + self._tree_base)

    # ----------------------------------------------------------------------------- pieces of a forward (a self-drafter's)

    def reserve(self, n: int) -> None:
        """Make room for ``n`` entries past ``length`` (a larger cache drops the graphs, which are
        then captured again)."""
        self._room(n)

    def causal_mask(self, positions: Tensor) -> Tensor:
        """The additive mask [1,1,N,capacity] of N new entries at slots ``positions`` [N] (their
        rotary positions too), each seeing every slot up to its own."""
        return self.additive_mask(self.columns <= positions.unsqueeze(1))

    def run_layers(self, hidden: Tensor, start: int, stop: int, positions: Tensor) -> Tensor:
        """Decoder layers start..stop-1 on hidden [1,N,D] of N consecutive entries at slots (and
        rotary positions) ``positions`` [N], each seeing the cache up to itself (``causal_mask``);
        writes those layers' entries only. A function of device tensors: a graph may hold it."""
        self.cache.slots = positions
        rows = positions.unsqueeze(0)
        mask = self.causal_mask(positions)
        position_embeddings = self.stack.rotary(hidden, rows)
        for layer in self.stack.layers[start:stop]:
            out = layer(hidden, attention_mask=mask, position_ids=rows, past_key_values=self.cache, use_cache=True,
                        position_embeddings=position_embeddings)  # fmt: skip
            hidden = out[0] if isinstance(out, tuple) else out
        return hidden

    def entered(self, n: int) -> None:
        """A forward made outside ``forward_tree`` (a self-drafter's) wrote a tree's ``n`` entries
        at slots length..length+n-1 in every layer: they become the tree ``keep`` rolls back."""
        self._tree_base = self.length
        self.length += n

    # ----------------------------------------------------------------------------- a draft model's step

    def tree_rows(self, spec) -> list[int]:
        """For a draft model drafting the static tree ``spec`` on this session (``draft_tree``):
        each spec node's entry among those the drafting writes after the decided tokens (spec
        order: the nodes below the root that get children), -1 for the root and the leaves."""
        return self._tree_plan(spec)[0]

    def _tree_plan(self, spec) -> tuple[list[int], Tensor, Tensor]:
        """(``tree_rows``, the same as a device tensor [N], the written nodes' parents as rows [F],
        -1 below the root), made once per spec."""
        plans = self.__dict__.setdefault("_plans", {})
        if spec not in plans:
            written = [n for n in range(1, spec.num_nodes) if spec.children(n)]
            rows = [-1] * spec.num_nodes
            for row, node in enumerate(written):
                rows[node] = row
            long = dict(dtype=torch.long, device=self.device)
            plans[spec] = (rows, torch.tensor(rows, **long), torch.tensor([rows[spec.parents[n]] for n in written], **long))
        return plans[spec]

    def _drafted_tree(self, spec, build, root_logits: Tensor, root_token: Tensor, base: Tensor, draws=None) -> tuple[Tensor, ...]:
        """The tree ``spec`` grown from the root's logits [V] (``build``:
        ``runtime.drafters.grow_static_tree_on_device``), greedy or sampled from ``draws``
        (``runtime.drafters.DeviceDraws``): each level's nodes that get children are forwarded at
        slots ``base`` [1] + their row (``tree_rows``), at rotary position base - 1 + depth, each
        seeing the cache before ``base``, its ancestors and itself. A function of device tensors
        only: one graph per spec. Returns (the tree's tokens [1,N], and its draft_probs [1,N,V]
        where sampled)."""
        _, rows, parents = self._tree_plan(spec)
        visible = tree_visibility(self.columns, parents, base) if parents.numel() else None  # [F, capacity]

        def level_logits(frontier) -> Tensor:
            if frontier.level == 1:
                return root_logits.unsqueeze(0)
            own = rows[frontier.nodes]
            positions = (base + (frontier.level - 2)).expand(own.shape[0]).unsqueeze(0)
            logits, _, _ = self._eager(frontier.tokens.unsqueeze(0), positions, base + own, self.additive_mask(visible.index_select(0, own)))
            return logits[0]

        tree = build(spec, root_token, level_logits, self.device, draws)
        return (tree.tokens,) if tree.draft_probs is None else (tree.tokens, tree.draft_probs)

    def _read_then_draft(self, spec, build, ids: Tensor, start: Tensor, draws=None) -> tuple[Tensor, ...]:
        """``_drafted_tree`` after appending ids [1,M] at slots ``start`` [1] + 0..M-1 (causal over
        the cache), its root the last of them: a draft model's whole step as one function."""
        m = ids.shape[1]
        positions = start + torch.arange(m, device=self.device)
        logits, _, _ = self._eager(ids, positions.unsqueeze(0), positions, self.causal_mask(positions))
        return self._drafted_tree(spec, build, logits[0, -1], ids[0, -1:], start + m, draws)

    @torch.no_grad()
    def draft_tree(self, spec, ids: Tensor, build, draws=None) -> tuple[Tensor, Optional[Tensor]]:
        """A draft model's step on its own session on a static tree ``spec``, greedy or sampled from
        ``draws`` (``runtime.drafters.DeviceDraws``): append ids [1,M] (the decided tokens it has not
        read, the root last), then grow the tree (``build``:
        ``runtime.drafters.grow_static_tree_on_device``) with one forward a level, writing the
        entries of the nodes that get children after the M (``tree_rows``). Nothing is read to the
        host. Where the session has graphs, a read of up to ``GRAPHED_READ`` tokens and the whole
        tree replay as one CUDA graph (one per M and sampling settings, the draws' uniforms an
        input); a longer read (a prompt) runs eagerly, then the tree replays a graph of its own.
        Returns (the tree's tokens [1,N] (spec order), its draft_probs [1,N,V] or None: greedy)."""
        _, _, parents = self._tree_plan(spec)
        m = ids.shape[1]
        self._room(m + parents.numel())  # may reallocate, dropping the graphs: they are captured again
        start = self.columns[self.length : self.length + 1]
        key, extra = draws_key(draws), draws_inputs(draws)

        if m <= GRAPHED_READ:

            def step(ids: Tensor, start: Tensor, *uniforms: Tensor) -> tuple[Tensor, ...]:
                return self._read_then_draft(spec, build, ids, start, with_uniforms(draws, uniforms))

            out, replayed = self.graphs.run(("draft", spec, m, key), step, (ids, start, *extra), "the draft model's step")
            self.length += m
        else:
            logits, _, _ = self._append(ids, "last")
            base = self.columns[self.length : self.length + 1]

            def tree(root_logits: Tensor, root: Tensor, base: Tensor, *uniforms: Tensor) -> tuple[Tensor, ...]:
                return self._drafted_tree(spec, build, root_logits, root, base, with_uniforms(draws, uniforms))

            out, replayed = self.graphs.run(("draft-tree", spec, key), tree, (logits[0, -1], ids[0, -1:], base, *extra), "the draft model's tree")
        self.length += parents.numel()
        self._tree_base = None
        tokens, *probs = (x.clone() for x in out) if replayed else out
        return tokens, probs[0] if probs else None

    def _dynamic_tree(self, spec, build, rank, root_logits: Tensor, root_token: Tensor, base: Tensor, deterministic: bool) -> tuple[Tensor, ...]:
        """The EAGLE-2 tree ``spec`` (``build``: ``runtime.tree.build_dynamic_tree_on_device``,
        candidates ranked by ``rank`` of the logits) grown from the root's logits [V]: level L >= 2
        forwards its ``topk`` frontier nodes at slots ``base`` [1] + (L-2) * topk + their row, at
        rotary position base + L - 2, each seeing the cache before ``base``, its ancestors' entries
        and its own. A function of device tensors only: one graph per spec. Returns the tree's
        (tokens, parents, depths, num_nodes [1], and each node's entry after ``base`` [N], -1 for
        the root and the nodes never forwarded)."""
        k = spec.topk
        created = 1 + k + (spec.depth - 1) * k * k  # build_dynamic_tree_on_device's ids
        entry_of = torch.full((created,), -1, dtype=torch.long, device=self.device)
        level: dict = {}

        def expand(frontier) -> Tensor:
            if frontier.level == 1:
                level.update(nodes=frontier.nodes, seen=torch.zeros(1, 0, dtype=torch.bool, device=self.device))
                return rank(root_logits.unsqueeze(0))
            width, done = frontier.nodes.shape[0], (frontier.level - 2) * k
            # Each node's parent is one of the last level's nodes: it sees what its parent saw, and itself.
            parent_rows = frontier.rows_in(level["nodes"])
            seen = torch.cat([level["seen"][parent_rows], torch.eye(width, dtype=torch.bool, device=self.device)], dim=1)
            entries = done + torch.arange(width, device=self.device)
            visible = (self.columns < base).expand(width, -1).clone()
            visible.index_copy_(1, base + torch.arange(done + width, device=self.device), seen)
            positions = (base + (frontier.level - 2)).expand(width).unsqueeze(0)
            logits, _, _ = self._eager(frontier.tokens.unsqueeze(0), positions, base + entries, self.additive_mask(visible))
            entry_of.index_copy_(0, frontier.nodes, entries)
            level.update(nodes=frontier.nodes, seen=seen)
            return rank(logits[0])

        tree, kept = build(expand, root_token, spec.depth, k, spec.budget, self.device, deterministic)
        return tree.tokens, tree.parents, tree.depths, tree.num_nodes, entry_of[kept]

    @torch.no_grad()
    def draft_dynamic_tree(self, spec, ids: Tensor, build, rank, key: tuple, deterministic: bool) -> tuple[Tensor, ...]:
        """A draft model's step on its own session drafting the EAGLE-2 tree ``spec`` on the device,
        as ``draft_tree`` drafts a static one: append ids [1,M] (the root last), then the tree
        (``_dynamic_tree``; ``key`` names what ``rank`` depends on), its levels writing (depth - 1)
        * topk entries after the M. Nothing is read to the host; on CUDA, a read of up to
        ``GRAPHED_READ`` tokens and the tree replay as one graph. Returns ``_dynamic_tree``'s."""
        m, entries = ids.shape[1], (spec.depth - 1) * spec.topk
        self._room(m + entries)  # may reallocate, dropping the graphs: they are captured again
        start = self.columns[self.length : self.length + 1]
        name = ("draft-dynamic", spec.depth, spec.topk, spec.budget, key)
        if m <= GRAPHED_READ:

            def step(ids: Tensor, start: Tensor) -> tuple[Tensor, ...]:
                positions = start + torch.arange(m, device=self.device)
                logits, _, _ = self._eager(ids, positions.unsqueeze(0), positions, self.causal_mask(positions))
                return self._dynamic_tree(spec, build, rank, logits[0, -1], ids[0, -1:], start + m, deterministic)

            out, replayed = self.graphs.run((*name, m), step, (ids, start), "the draft model's step")
            self.length += m
        else:
            logits, _, _ = self._append(ids, "last")
            base = self.columns[self.length : self.length + 1]

            def tree(root_logits: Tensor, root: Tensor, base: Tensor) -> tuple[Tensor, ...]:
                return self._dynamic_tree(spec, build, rank, root_logits, root, base, deterministic)

            out, replayed = self.graphs.run((*name, "tree"), tree, (logits[0, -1], ids[0, -1:], base), "the draft model's tree")
        self.length += entries
        self._tree_base = None
        return tuple(x.clone() for x in out) if replayed else out

    def keep_entries(self, start: int, rows: Sequence[int]) -> None:
        """``pack(start, start + rows)`` for rows known on the host (ascending), moving nothing
        where they are already in place (0, 1, 2, ...: a chain's accepted path)."""
        if list(rows) == list(range(len(rows))):
            self.length, self._tree_base = start + len(rows), None
        else:
            self.pack(start, torch.tensor(list(rows), dtype=torch.long, device=self.device) + start)

    def keep_first(self, n: int) -> None:
        """``keep(range(n))`` without moving anything: the first n tree nodes' entries are already
        where the accepted path goes (the rest is written over)."""
        if self._tree_base is None:
            raise DrafterError("keep_first() needs a forward_tree() first")
        self.length, self._tree_base = self._tree_base + n, None
