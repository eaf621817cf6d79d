"""Dynamic draft trees (EAGLE-2 / EAGLE-3): grown per request and step from the draft's own confidence.

From the root, level 1 holds the draft's top-k tokens after the root. Each later level expands the
current frontier (k nodes): every frontier node proposes its top-k children, and the k best of those
k * k candidates by cumulative draft log-probability become the next frontier. After num_steps levels
every candidate ever proposed (k at level 1, k * k per later level) competes for the verify tree: the
best num_draft_tokens - 1 by cumulative log-probability, plus the root.

The kept set is a connected subtree: a child's score is its parent's plus a log-probability <= 0, so it
never beats its parent, and ties go to the earlier candidate (the pool is in level order, so the parent).

Draft rows. Level d's draft forward runs every frontier node of levels 1..d (d * k rows, in expansion
order, each node at a fixed row across levels), so each node sees exactly its ancestors through a
per-request tree mask; re-running the earlier levels (a few rows) is what lets the attention backends'
"cached prefix plus masked own rows" convention express a tree. Everything here is tensor work on the
device, with no host sync; the caller runs the draft forwards.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from llmserve_core.speculative.tree import TreeBatch


@dataclass(frozen=True)
class DynamicTreeShape:
    num_steps: int              # tree depth: levels of candidates (draft forwards: 1 catch-up + num_steps - 1)
    topk: int                   # children per expanded node, and frontier width
    num_draft_tokens: int       # verified nodes per request, the root included

    def __post_init__(self):
        if self.num_steps < 1:
            raise ValueError("speculative_num_steps: must be >= 1")
        if self.topk < 1:
            raise ValueError("speculative_eagle_topk: must be >= 1")
        if not 2 <= self.num_draft_tokens <= self.pool_size + 1:
            raise ValueError(f"speculative_num_draft_tokens: must be in [2, {self.pool_size + 1}] for "
                             f"{self.num_steps} steps of top-{self.topk} (the candidates the tree can grow, plus the root)")

    @property
    def num_expanded(self) -> int:
        """Nodes the draft runs (the frontiers of levels 1 .. num_steps - 1)."""
        return self.topk * (self.num_steps - 1)

    @property
    def pool_size(self) -> int:
        return self.topk + (self.num_steps - 1) * self.topk * self.topk

    @property
    def lookahead(self) -> int:
        """KV slots past a drafting request's next token: the verify tree's nodes (target) and the
        expanded nodes' rows (draft, which start one position earlier)."""
        return max(self.num_draft_tokens - 1, self.num_expanded - 1)

    def row_depths(self, rows: int) -> torch.Tensor:
        """Depth of each of the first `rows` expanded nodes (expansion order: level 1's frontier first)."""
        return torch.arange(rows) // self.topk + 1


def _draft_topk(logprobs: torch.Tensor, k: int, d2t: torch.Tensor | None):
    lp, ids = logprobs.topk(k, dim=-1)
    # log_softmax is <= 0 up to rounding; clamping keeps a child's score from ever beating its parent's.
    return lp.clamp_max(0.0), (ids if d2t is None else ids + d2t[ids])


class TreeGrowth:
    """One step's dynamic trees for a batch, grown level by level.

    Pool: every candidate so far, in level order (level 1: k; each later level: k * k, candidate r * k + j
    being child j of frontier node r). Expanded: the frontier nodes the draft runs, in expansion order."""

    def __init__(self, shape: DynamicTreeShape, root_logprobs: torch.Tensor, d2t: torch.Tensor | None):
        """root_logprobs [B, draft_vocab]: the draft's log-probabilities of the token after the root."""
        self.shape = shape
        k = shape.topk
        batch = root_logprobs.shape[0]
        dev = root_logprobs.device
        self.batch, self.device = batch, dev
        scores, tokens = _draft_topk(root_logprobs.float(), k, d2t)
        self.d2t = d2t
        self.pool_scores = [scores]                                            # chunks of [B, *]
        self.pool_tokens = [tokens]
        self.pool_parent = [torch.full((batch, k), -1, dtype=torch.long, device=dev)]
        self.pool_len = k
        # Expanded nodes: their pool index and their parent's expanded index (-1: the root).
        ar = torch.arange(k, device=dev).expand(batch, k)
        self.exp_pool = ar.clone()
        self.exp_parent = torch.full((batch, k), -1, dtype=torch.long, device=dev)
        self.frontier_scores = scores
        e = max(shape.num_expanded, k)
        self.exp_anc = torch.zeros(batch, e, e, dtype=torch.bool, device=dev)    # ancestors among expanded
        # (slice assignments of device tensors only: a Python scalar through an index would be a host
        # copy, which a CUDA graph cannot capture)
        self.exp_anc[:, :k, :k] = torch.eye(k, dtype=torch.bool, device=dev)
        self.level = 1

    @property
    def done(self) -> bool:
        return self.level >= self.shape.num_steps

    def draft_rows(self):
        """The next draft forward's rows (every expanded node so far): (tokens [B, m] as target ids,
        hidden source [B, m] (0: the root's draft state, e + 1: expanded node e's), mask [B, m, m])."""
        m = self.exp_pool.shape[1]
        tokens = torch.cat(self.pool_tokens, 1).gather(1, self.exp_pool)
        return tokens, self.exp_parent + 1, self.exp_anc[:, :m, :m]

    def grow(self, frontier_logprobs: torch.Tensor) -> None:
        """Add the next level from the draft's log-probabilities at the current frontier's rows
        ([B * k, draft_vocab], request-major, frontier order)."""
        if self.done:
            raise ValueError("tree growth: all num_steps levels are already grown")
        k, b, dev = self.shape.topk, self.batch, self.device
        lp, tokens = _draft_topk(frontier_logprobs.float().view(b * k, -1), k, self.d2t)
        scores = (self.frontier_scores[:, :, None] + lp.view(b, k, k)).flatten(1)          # [B, k * k]
        frontier = self.exp_pool[:, -k:]                                                     # pool ids of the frontier
        self.pool_scores.append(scores)
        self.pool_tokens.append(tokens.view(b, k * k))
        self.pool_parent.append(frontier.repeat_interleave(k, dim=1))
        base = self.pool_len
        self.pool_len += k * k
        self.level += 1
        if self.done:
            return
        # The next frontier: the k best candidates of this level.
        best_scores, best = scores.topk(k, dim=1)
        first = self.exp_pool.shape[1]
        parent_exp = first - k + best // k                                                   # expanded ids of parents
        self.exp_pool = torch.cat([self.exp_pool, base + best], 1)
        self.exp_parent = torch.cat([self.exp_parent, parent_exp], 1)
        rows = self.exp_anc.gather(1, parent_exp[:, :, None].expand(-1, -1, self.exp_anc.shape[2]))
        rows[:, :, first:first + k] |= torch.eye(k, dtype=torch.bool, device=dev)
        self.exp_anc[:, first:first + k] = rows
        self.frontier_scores = best_scores

    def finish(self, root_tokens: torch.Tensor) -> tuple[TreeBatch, torch.Tensor]:
        """The verify trees: (TreeBatch, node tokens [B, num_draft_tokens], node 0 = root_tokens [B])."""
        n = self.shape.num_draft_tokens
        scores = torch.cat(self.pool_scores, 1)
        tokens = torch.cat(self.pool_tokens, 1)
        parent = torch.cat(self.pool_parent, 1)
        # Best first; the stable sort keeps pool (level) order among ties, so parents stay ahead.
        order = scores.sort(dim=1, descending=True, stable=True).indices[:, :n - 1]
        kept = order.sort(dim=1).values                                  # pool order: parents before children
        where = torch.full_like(parent, -1)
        where.scatter_(1, kept, torch.arange(1, n, device=self.device).expand(self.batch, n - 1))
        kept_parent = parent.gather(1, kept)
        node_parent = torch.where(kept_parent < 0, torch.zeros_like(kept_parent),
                                  where.gather(1, kept_parent.clamp_min(0)))
        parents = torch.cat([torch.full((self.batch, 1), -1, dtype=torch.long, device=self.device), node_parent], 1)
        node_tokens = torch.cat([root_tokens.to(self.device, torch.long)[:, None], tokens.gather(1, kept)], 1)
        return TreeBatch(parents, self.shape.num_steps, self.shape.topk, bounded=True), node_tokens
