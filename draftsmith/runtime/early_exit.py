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

Greedy output is the target's own greedy output and sampling is lossless (the usual verification);
the drafter only changes how much work a step costs.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from draftsmith.runtime.drafters import DrafterError, DraftState, grow_static_tree
from draftsmith.runtime.tree import DraftTree, TreeSpec, tree_attention_mask
from draftsmith.runtime.verify import VerifyResult
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
        self._exit_hidden: list[Tensor] = []

    def required_layers(self) -> Sequence[int]:
        return []

    def bind(self, session) -> None:
        """Draft on this TargetSession's KV cache (called once per generation, before reset)."""
        self.session = session

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
        if self.session.length != P or self.session.cached_lengths()[0] != P:
            raise DrafterError(f"the shared cache holds {self.session.length} positions but the state continues at {P}; call reset(prompt) first")
        device = state.tokens.device

        def level_logits(frontier) -> Tensor:
            # A chain has one node per level: the newest token, never seen by any layer yet.
            (node,) = frontier.nodes
            ids = torch.tensor([[frontier.tokens[node]]], device=device)
            hidden = self._early(ids, torch.tensor([[P + frontier.depths[node]]], device=device))
            self._exit_hidden.append(hidden)
            return self.target.lm_head(self.stack.norm(hidden))[0]

        tree, _ = grow_static_tree(self.tree, state.root, level_logits, state.sampling, state.generator, device)
        return tree

    @torch.no_grad()
    def verify_forward(self, tree: DraftTree) -> tuple[Tensor, Tensor, dict[int, Tensor]]:
        """The target's forward over the proposed chain, reusing the draft's early layers.
        Returns what TargetSession.forward_tree returns."""
        done = len(self._exit_hidden)
        N = tree.size
        positions = torch.arange(self.session.length + done, self.session.length + N, device=tree.tokens.device).unsqueeze(0)
        rest = self._early(tree.tokens[:, done:], positions)
        hidden = torch.cat([*self._exit_hidden, rest], dim=1)
        return self.session.forward_tree_from(tree, self.exit_layer, hidden)

    def accept(self, result: VerifyResult) -> None:
        """Forget the draft; the session's keep() rolls every layer's cache back to the accepted path."""
        self._exit_hidden = []
