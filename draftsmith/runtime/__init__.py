"""The decoding runtime: draft trees, verification, drafters and the speculative decoding loop.

    tree.py      TreeSpec / DynamicTreeSpec / AdaptiveTreeSpec / DraftTree, masks and positions,
                 build_dynamic_tree (EAGLE-2), build_scored_tree (OPT-Tree, lookup candidates merged)
    verify.py    reference verification in torch (greedy, lossless sampling); the kernels match it
    drafters.py  the Drafter protocol and its adapters (HeadDrafter for every head kind, StandaloneDrafter)
    lookup.py    drafting without training (prompt lookup, suffix matching) and the hybrid with a head
    early_exit.py  EarlyExitDrafter: the target drafting with its first layers (LayerSkip), sharing its cache
    generate.py  speculative_generate and the autoregressive baseline (batch size 1)
    kernels/     the fused Triton verification kernel
"""

from draftsmith.runtime.drafters import DrafterError, Drafter, DraftState, HeadDrafter, StandaloneDrafter
from draftsmith.runtime.early_exit import EarlyExitDrafter
from draftsmith.runtime.lookup import HybridDrafter, LookupDrafter, PromptLookup, SuffixMatcher
from draftsmith.runtime.generate import GenerationStats, TargetSession, autoregressive_generate, speculative_generate
from draftsmith.runtime.tree import AdaptiveTreeSpec, DraftTree, DynamicTreeSpec, TreeError, TreeSpec, default_tree, parse_tree
# The function verify stays in its module: re-exported here it would shadow the submodule
# draftsmith.runtime.verify (``import draftsmith.runtime.verify as v`` would get the function).
from draftsmith.runtime.verify import SamplingParams, VerifyResult, logits_to_probs

__all__ = [
    "AdaptiveTreeSpec",
    "HybridDrafter",
    "LookupDrafter",
    "PromptLookup",
    "SuffixMatcher",
    "DraftState",
    "DraftTree",
    "Drafter",
    "DrafterError",
    "DynamicTreeSpec",
    "EarlyExitDrafter",
    "GenerationStats",
    "HeadDrafter",
    "SamplingParams",
    "StandaloneDrafter",
    "TargetSession",
    "TreeError",
    "TreeSpec",
    "VerifyResult",
    "autoregressive_generate",
    "default_tree",
    "logits_to_probs",
    "parse_tree",
    "speculative_generate",
]
