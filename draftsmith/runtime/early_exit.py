"""Self-speculative decoding (LayerSkip): the target's first E decoder layers draft, the rest verify.

``EarlyExitDrafter`` drafts a chain with the target itself exiting after E layers (the final norm
and LM head read layer E-1's output) and shares the target session's KV cache:

- propose: the root and every drafted token but the last go through layers 0..E-1 one at a time,
  appending to those layers' cache entries; the drafter keeps their layer E-1 outputs.
- verify_forward (instead of the session's forward_tree): the last drafted token goes through
  layers 0..E-1, then every node goes through layers E..L-1 from the kept outputs
  (``TargetSession.forward_tree_from``). The first E layers never compute a position twice.
- After verification every layer holds the same entries, and the session's ``keep`` drops the
  rejected nodes from all of them.

On the static cache (``runtime.static.StaticSession``: "auto" on CUDA) node i of the chain sits at
slot length + i in every layer, so the draft and the verify forward are functions of device tensors:
greedy, the whole chain (each level's early layers, norm, LM head and top-1) replays as one CUDA
graph and the verify forward as another, with nothing read back; sampled, the levels run one by one.

Greedy output is the target's own greedy output and sampling is lossless (the usual verification);
the drafter only changes how much work a step costs.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from draftsmith.runtime.drafters import DrafterError, DraftState, grow_static_tree, grow_static_tree_on_device, spec_on_device
from draftsmith.runtime.tree import DraftTree, TreeSpec, tree_attention_mask
from draftsmith.runtime.verify import VerifyResult
from draftsmith.sampling import DeviceDraws, draws_inputs, draws_key, with_uniforms
from draftsmith.target import TargetLoadError, decoder_stack

__all__ = ["DEFAULT_DRAFT_LENGTH", "EarlyExitDrafter", "ExitLayerError", "check_exit_layer"]

# Tokens drafted per step unless a chain length is given (the official examples use 4-12 on
# 7B-70B models; a small model's early exits agree less, so short chains pay off there).
DEFAULT_DRAFT_LENGTH = 4


class ExitLayerError(DrafterError):
    """An exit layer the model does not have (outside 1..L-1). One line; the command line exits 2
    (a DrafterError, bad input)."""


def check_exit_layer(exit_layer: int, num_layers: int, what: str = "exit layer") -> None:
    """Raise ExitLayerError unless 1 <= exit_layer <= num_layers - 1 (exit L would be the model itself)."""
    if not 1 <= exit_layer <= num_layers - 1:
        raise ExitLayerError(f"{what} {exit_layer} is outside 1..{num_layers - 1}: the model has {num_layers} decoder layers")


def is_chain(tree) -> bool:
    """True for a TreeSpec with one child per node (classic chain drafting)."""
    return isinstance(tree, TreeSpec) and list(tree.parents) == list(range(-1, tree.num_nodes - 1))


class EarlyExitDrafter:
    """The target drafting for itself with its first ``exit_layer`` decoder layers (see the module
    docstring). ``tree``: a chain (``TreeSpec.chain(k)``), drafted greedily or sampled.

    Besides the Drafter protocol it has ``bind(session)`` and ``verify_forward(tree)``, which
    ``speculative_generate`` uses for a drafter that shares the target's cache.
    """

    def __init__(self, target, exit_layer: int, tree: TreeSpec = TreeSpec.chain(DEFAULT_DRAFT_LENGTH)) -> None:
        try:
            self.stack = decoder_stack(target.model)
        except TargetLoadError as err:
            raise DrafterError(str(err)) from None
        check_exit_layer(exit_layer, self.stack.num_layers)
        if not is_chain(tree):
            raise DrafterError(f"early-exit drafting drafts a chain (e.g. --tree 1,1,1,1); got a tree of {getattr(tree, 'num_nodes', '?')} nodes with branches")
        self.target = target
        self.exit_layer = exit_layer
        self.tree = tree
        self.session = None
        self.static = False  # drafting on a StaticSession (bind)
        self._exit_hidden: list[Tensor] = []

    def required_layers(self) -> Sequence[int]:
        return []

    def bind(self, session) -> None:
        """Draft on this session's KV cache (a TargetSession or a StaticSession; called once per
        generation, before reset)."""
        from draftsmith.runtime.static import StaticSession

        self.session = session
        self.static = isinstance(session, StaticSession)

    def reset(self, prompt: Optional[Tensor]) -> None:
        self._exit_hidden = []

    def _early(self, ids: Tensor, positions: Tensor) -> Tensor:
        """Layers 0..E-1 on new tokens ids [1,n] at positions [1,n] on the shared cache: layer E-1's output [1,n,D]."""
        n = ids.shape[1]
        mask = None
        if n > 1:  # one query sees every cached entry; several see each other causally
            cached = self.session.cached_lengths()[0]
            mask = tree_attention_mask(torch.arange(-1, n - 1, device=ids.device).unsqueeze(0), cached, self.target.dtype)
        return self.session.run_layers(self.stack.embed(ids), 0, self.exit_layer, positions, mask)

    @torch.no_grad()
    def propose(self, state: DraftState) -> DraftTree:
        if self.session is None:
            raise DrafterError("the early-exit drafter drafts on the target's cache: speculative_generate binds it to the session")
        if self._exit_hidden:
            raise DrafterError("propose was called again before accept: the shared cache still holds the last draft")
        P = state.prefix_len
        if self.session.length != P or (not self.static and self.session.cached_lengths()[0] != P):
            raise DrafterError(f"the shared cache holds {self.session.length} positions but the state continues at {P}; call reset(prompt) first")
        device = state.tokens.device
        if self.static:
            return self._propose_static(state)

        def level_logits(frontier) -> Tensor:
            # A chain has one node per level: the newest token, never seen by any layer yet.
            (node,) = frontier.nodes
            ids = torch.tensor([[frontier.tokens[node]]], device=device)
            hidden = self._early(ids, torch.tensor([[P + frontier.depths[node]]], device=device))
            self._exit_hidden.append(hidden)
            return self.target.lm_head(self.stack.norm(hidden))[0]

        tree, _ = grow_static_tree(self.tree, state.root, level_logits, state.sampling, state.generator, device)
        return tree

    # ----------------------------------------------------------------------------- on the static cache

    def _exit_logits(self, ids: Tensor, position: Tensor) -> Tensor:
        """One chain node, ids [1,1] at slot and position ``position`` [1], through layers
        0..E-1: keeps layer E-1's output, returns the early exit's logits [1,V]."""
        hidden = self.session.run_layers(self.stack.embed(ids), 0, self.exit_layer, position)
        self._exit_hidden.append(hidden)
        return self.target.lm_head(self.stack.norm(hidden))[0]

    def _chain(self, root: Tensor, base: Tensor, draws=None) -> tuple[Tensor, ...]:
        """The chain from the root [1] at slot ``base`` [1], greedy or sampled from ``draws``
        (``runtime.drafters.DeviceDraws``): (tokens [1,k+1], layer E-1's outputs at nodes 0..k-1
        [1,k,D], and the draft_probs [1,k+1,V] where sampled). Device tensors only: one graph."""

        self._exit_hidden = []

        def level_logits(frontier) -> Tensor:
            return self._exit_logits(frontier.tokens.view(1, 1), base + (frontier.level - 1))

        tree = grow_static_tree_on_device(self.tree, root, level_logits, root.device, draws)
        exits, self._exit_hidden = self._drafted_exits(root.device), []
        return (tree.tokens, exits) if tree.draft_probs is None else (tree.tokens, exits, tree.draft_probs)

    def _drafted_exits(self, device) -> Tensor:
        """Layer E-1's outputs at the drafted levels' nodes [1,d,D] (d = 0 for a chain of 0)."""
        if self._exit_hidden:
            return torch.cat(self._exit_hidden, dim=1)
        return torch.zeros(1, 0, self.target.dims.hidden_size, dtype=self.target.dtype, device=device)

    def _propose_static(self, state: DraftState) -> DraftTree:
        session, k, device = self.session, self.tree.max_depth, state.tokens.device
        session.reserve(k + 1)
        base = session.columns[session.length : session.length + 1]
        draws = DeviceDraws.draw(self.tree, state.sampling, self.target.dims.vocab_size, state.generator, device)

        def chain(root: Tensor, base: Tensor, *uniforms: Tensor) -> tuple[Tensor, ...]:
            return self._chain(root, base, with_uniforms(draws, uniforms))

        name = ("early-exit draft", self.exit_layer, k, draws_key(draws))
        out, replayed = session.graphs.run(name, chain, (state.tokens[0, -1:], base, *draws_inputs(draws)), "the early-exit draft")
        tokens, exits, *probs = (x.clone() for x in out) if replayed else out
        self._exit_hidden = [exits]
        return DraftTree(tokens, *spec_on_device(self.tree, device), draft_probs=probs[0] if probs else None, known_max_depth=k)

    def _verified_static(self, tokens: Tensor, done: Tensor, base: Tensor) -> tuple[Tensor, Tensor]:
        """The verify forward on the static cache: the chain's nodes past the ``done`` [1,d,D]
        ones through layers 0..E-1, then every node through layers E..L-1, the final norm and the
        LM head. Returns (logits [1,N,V], final hidden [1,N,D])."""
        n, d = tokens.shape[1], done.shape[1]
        positions = base + torch.arange(n, device=tokens.device)
        rest = self.session.run_layers(self.stack.embed(tokens[:, d:]), 0, self.exit_layer, positions[d:])
        out = self.session.run_layers(torch.cat([done, rest], dim=1), self.exit_layer, self.stack.num_layers, positions)
        final = self.stack.norm(out)
        return self.target.lm_head(final), final

    def _checked_static(
        self, tokens: Tensor, parents: Tensor, depths: Tensor, num_nodes: Tensor, done: Tensor, base: Tensor, bound: int, sampled: Optional[tuple] = None
    ):
        """``_verified_static``, then the chain's verification (greedy, or ``sampled`` as
        ``runtime.static.verified_in_graph`` takes it) and the step's verdict row in the same
        function (one graph on CUDA, the fused kernel's launches inside), as
        ``StaticSession._tree_verified``. Returns (logits, final hidden, the VerifyResult's tensors)."""
        from draftsmith.runtime.static import verified_in_graph

        logits, final = self._verified_static(tokens, done, base)
        return logits, final, verified_in_graph(tokens, parents, depths, num_nodes, logits, bound, sampled)

    @torch.no_grad()
    def verify_forward(self, tree: DraftTree, verified: bool = False, sampling=None, generator: Optional[torch.Generator] = None):
        """The target's forward over the proposed chain, reusing the draft's early layers.
        Returns what TargetSession.forward_tree returns; with ``verified`` (on a static session),
        what ``StaticSession.forward_tree_verified`` returns: the verification (greedy, or as
        ``sampling`` says from ``generator``'s uniforms) made in the same graph, its VerifyResult
        fourth."""
        if self.static:
            from draftsmith.runtime.static import sampled_inputs, verification_draws, with_sampled

            session, done = self.session, self._drafted_exits(tree.tokens.device)
            base = session.columns[session.length : session.length + 1]
            if verified:
                bound = tree.size - 1  # paths sized for the deepest tree of N nodes, as forward_tree_verified
                sampled = verification_draws(tree, sampling, generator, (self.target.dims.vocab_size, self.target.dtype, tree.tokens.device))
                named, drawn = sampled_inputs(sampled)

                def checked(tokens: Tensor, parents: Tensor, depths: Tensor, num_nodes: Tensor, done: Tensor, base: Tensor, *drawn: Tensor):
                    return self._checked_static(tokens, parents, depths, num_nodes, done, base, bound, with_sampled(sampled, drawn))

                name, fn = ("early-exit verify", self.exit_layer, tree.size, done.shape[1], "verified", *named), checked
                inputs = (tree.tokens, tree.parents, tree.depths, tree.num_nodes, done, base, *drawn)
            else:
                name, fn, inputs = ("early-exit verify", self.exit_layer, tree.size, done.shape[1]), self._verified_static, (tree.tokens, done, base)
            (logits, final, *result), replayed = session.graphs.run(name, fn, inputs, "the early-exit verify forward")
            session.entered(tree.size)
            # The logits and the verdict are read before the next forward; the features may outlive the graph's buffers.
            out = (logits, final.clone() if replayed else final, {})
            return (*out, VerifyResult(*result[0])) if verified else out
        done = len(self._exit_hidden)
        N = tree.size
        positions = torch.arange(self.session.length + done, self.session.length + N, device=tree.tokens.device).unsqueeze(0)
        rest = self._early(tree.tokens[:, done:], positions)
        hidden = torch.cat([*self._exit_hidden, rest], dim=1)
        return self.session.forward_tree_from(tree, self.exit_layer, hidden)

    def accept(self, result: VerifyResult) -> None:
        """Forget the draft; the session's keep() rolls every layer's cache back to the accepted path."""
        self._exit_hidden = []
