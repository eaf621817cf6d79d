"""EAGLE-3 tree drafting, what static and dynamic trees share: each level's draft forward, its batch
built on the host (the step by step path) or derived on the device (inside the fused graph), and the
fused step's verify over the grown tree. How a tree grows is the subclass's: eagle_static_tree.py,
eagle_dynamic_tree.py."""
from __future__ import annotations

import numpy as np
import torch

from llmserve_core.engine.request import Request
from llmserve_core.engine.spec.proposer import FusedStep, Proposal
from llmserve_core.engine.step_graphs import StepGraphs
from llmserve_core.speculative.tree import TreeBatch, tree_greedy_verify


class TreeDrafter:
    """Subclasses set depth and row_depths (the draft-row depths of the tree's levels, on the host) and
    implement capture, grow, tree_batch and verify_layout."""
    depth: int
    row_depths: np.ndarray

    def __init__(self, eagle, device: torch.device):
        self.eagle = eagle                  # the EagleProposer: its draft, KV, graphs and batches
        self.row_depths_device = torch.as_tensor(self.row_depths, device=device)

    def capture(self, graphs: dict[str, StepGraphs], draft_rows: dict) -> None:
        raise NotImplementedError

    def grow(self, logits: torch.Tensor, h: torch.Tensor, roots: torch.Tensor,
             run_level) -> tuple[TreeBatch, torch.Tensor]:
        """(TreeBatch, node tokens [B, N]) from the catch-up's proposal logits and pre-norm states [B, ...]
        and the root tokens [B]. run_level(graph name, forward, ids, hidden, depths, mask) runs one level's
        draft forward; `depths` slices row_depths (the level's rows), mask is [rows, rows] or [B, rows, rows]."""
        raise NotImplementedError

    def tree_batch(self, parents: torch.Tensor) -> TreeBatch:
        """The verify trees for these parents, with the bounds this tree kind guarantees."""
        raise NotImplementedError

    def verify_layout(self, trees: TreeBatch, n: int,
                      on_device: bool) -> tuple[np.ndarray | torch.Tensor, torch.Tensor]:
        """(node depths [n, N], ancestor masks [n, N, N]) of the verify rows; the depths on the device if
        on_device (inside a graph) or where they are only known there, else on the host."""
        raise NotImplementedError

    def draft(self, drafting: list[Request], logits: torch.Tensor, h: torch.Tensor, depth: int) -> Proposal:
        """A tree grown from level batches built on the host (each request's rows at KV positions
        num_tokens - 1 on, rotary positions num_tokens - 2 + depth), each level's forward through its
        graph where the batch fits one. A tree is drafted whole: `depth` is its own."""
        e = self.eagle
        b = e.ctx.builder

        def run_level(name, fn, level_ids, level_hidden, depths: slice, mask):
            rows = depths.stop - depths.start
            for i, r in enumerate(drafting):
                b.add_rows(r.block_ids, r.num_tokens - 2 + self.row_depths[depths],
                           np.arange(r.num_tokens - 1, r.num_tokens - 1 + rows), r.num_tokens - 1 + rows,
                           mask=mask[i] if mask.dim() == 3 else mask)
            return e.forward(name, fn, level_ids, level_hidden, b.finish(uniform_rows=True).batch)
        trees, nodes = self.grow(logits, h, e.ctx.staging.ints([r.token_ids[-1] for r in drafting]), run_level)
        depths, masks = self.verify_layout(trees, len(drafting), on_device=False)
        return Proposal(nodes, trees=trees, depths=depths, masks=masks)

    def fused_forward(self, ids, hidden, batch):
        """(node tokens [B, N], parents [B, N], verify logits, fused aux, greedy verification) from the
        padded catch-up batch: the tree grows as on the step by step path, each level's draft rows at KV
        positions seq_len .. seq_len + rows - 1 with rotary positions seq_len - 1 + depth, and the verify's
        nodes at seq_len .. seq_len + N - 1 with rotary positions seq_len + depth."""
        e = self.eagle
        width, n = e.catchup_rows, batch.num_seqs
        logits, h, context, live = e.fused_catchup(ids, hidden, batch)

        def run_level(name, fn, level_ids, level_hidden, depths: slice, mask):
            rows = depths.stop - depths.start
            level = e.continued_batch(batch, context, rows, live,
                                      rope=(context - 1)[:, None] + self.row_depths_device[depths],
                                      tree_mask=mask.flatten(0, 1) if mask.dim() == 3 else mask.repeat(n, 1))
            return fn(level_ids, level_hidden, level)
        trees, nodes = self.grow(logits, h, ids.view(n, width)[:, -1], run_level)
        depths, masks = self.verify_layout(trees, n, on_device=True)
        verify = e.continued_batch(batch, context, nodes.shape[1], live, rope=context[:, None] + depths,
                                   tree_mask=masks.flatten(0, 1), count_live=True)
        logits, *aux = e.ctx.verify_forward(nodes.flatten(), None, verify)
        out = tree_greedy_verify(trees, logits, nodes)
        return nodes, trees.parents, logits, e.draft.combine_aux(aux), out.packed()

    def fused_step(self, out: tuple[torch.Tensor, ...]) -> FusedStep:
        nodes, parents, logits, fused_aux, emitted = out
        return FusedStep(Proposal(nodes, trees=self.tree_batch(parents)), logits, emitted, kept=fused_aux)
