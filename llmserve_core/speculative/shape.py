"""What a speculative step drafts, from the configuration: a chain, a static named tree, or a dynamic tree.

Flags follow SGLang's names: num_steps (draft depth; `speculative_gamma` is the older name of the same
thing), eagle_topk (children per expanded node) and num_draft_tokens (verified nodes per request, root
included). A dynamic tree is grown when eagle_topk > 1 or when asked for by name ("dynamic"); a named
static tree takes its shape from the name; otherwise the draft is a chain of num_steps tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

from llmserve_core.speculative.dynamic_tree import DynamicTreeShape
from llmserve_core.speculative.tree import TREE_NAMES, CandidateTree, get_tree

DYNAMIC = "dynamic"


@dataclass(frozen=True)
class DraftShape:
    kind: str                                  # chain | static | dynamic
    depth: int                                 # draft tokens along any verified path
    static_tree: CandidateTree | None = None
    dynamic: DynamicTreeShape | None = None

    @property
    def verify_width(self) -> int:
        """Target rows a drafting request verifies: the root (its last token) and its drafts."""
        if self.static_tree is not None:
            return self.static_tree.num_nodes
        if self.dynamic is not None:
            return self.dynamic.num_draft_tokens
        return self.depth + 1

    @property
    def lookahead(self) -> int:
        """KV slots a drafting request needs past its next token."""
        return self.dynamic.lookahead if self.dynamic is not None else self.verify_width - 1

    def describe(self) -> str:
        if self.static_tree is not None:
            return f"tree {self.static_tree.name} ({self.static_tree.num_nodes} nodes, depth {self.depth})"
        if self.dynamic is not None:
            d = self.dynamic
            return f"dynamic tree ({d.num_steps} steps, top-{d.topk}, {d.num_draft_tokens} nodes)"
        return f"chain gamma {self.depth}"


DEFAULT_DEPTH = 3
# Bounds well past what pays (SGLang's usual settings stay under 8 steps, top-10, 64 tokens), kept so a
# typo cannot ask for trees whose KV lookahead or verify rows would dwarf the model.
MAX_DEPTH, MAX_TOPK, MAX_DRAFT_TOKENS = 32, 32, 256


def _bounded(value, name: str, low: int, high: int) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high):
        raise ValueError(f"{name}: must be an integer in [{low}, {high}], got {value!r}")


def draft_shape(gamma: int | None, num_steps: int | None, topk: int, num_draft_tokens: int | None,
                tree: str | None) -> DraftShape:
    """Resolve and check the speculative_* shape fields; errors name the field at fault."""
    if num_steps is not None and gamma is not None and num_steps != gamma:
        raise ValueError(f"speculative_num_steps: {num_steps} disagrees with speculative_gamma {gamma} "
                         "(the same setting under two names): set one")
    _bounded(gamma, "speculative_gamma", 1, MAX_DEPTH)
    _bounded(num_steps, "speculative_num_steps", 1, MAX_DEPTH)
    _bounded(topk, "speculative_eagle_topk", 1, MAX_TOPK)
    _bounded(num_draft_tokens, "speculative_num_draft_tokens", 2, MAX_DRAFT_TOKENS)
    depth = num_steps if num_steps is not None else gamma if gamma is not None else DEFAULT_DEPTH
    if tree is not None and tree != DYNAMIC:
        if tree not in TREE_NAMES:
            raise ValueError(f"speculative_tree: unknown tree {tree!r}, choose from {', '.join(TREE_NAMES + (DYNAMIC,))}")
        if topk > 1:
            raise ValueError(f"speculative_eagle_topk: the static tree {tree!r} fixes its own branching; "
                             f"use speculative_tree={DYNAMIC} (or leave it unset) for top-{topk} dynamic trees")
        static = get_tree(tree, depth)
        if num_draft_tokens is not None and num_draft_tokens != static.num_nodes:
            raise ValueError(f"speculative_num_draft_tokens: the static tree {tree!r} at depth {depth} has "
                             f"{static.num_nodes} nodes, not {num_draft_tokens}")
        return DraftShape("static", depth, static_tree=static)
    if tree == DYNAMIC or topk > 1:
        n = num_draft_tokens if num_draft_tokens is not None else min(topk * depth + 1, MAX_DRAFT_TOKENS)
        return DraftShape("dynamic", depth, dynamic=DynamicTreeShape(depth, topk, n))
    if num_draft_tokens is not None and num_draft_tokens != depth + 1:
        raise ValueError(f"speculative_num_draft_tokens: a chain of {depth} drafts verifies {depth + 1} tokens, "
                         f"not {num_draft_tokens}; raise speculative_eagle_topk for a tree")
    return DraftShape("chain", depth)
