"""EAGLE-3 dynamic trees (speculative/dynamic_tree.py, as SGLang grows them): each level expands the
top-k most likely nodes of the frontier. Level d's forward runs the frontiers of levels 1..d, each node
reading its parent's draft state and seeing its ancestors through the growth's mask, which differs per
request and step (the level graphs take it as an input)."""
from __future__ import annotations

import torch

from llmserve_core.engine.spec.eagle_tree import TreeDrafter
from llmserve_core.engine.step_graphs import StepGraphs
from llmserve_core.speculative.dynamic_tree import TreeGrowth
from llmserve_core.speculative.shape import DraftShape
from llmserve_core.speculative.tree import TreeBatch


class DynamicTreeDrafter(TreeDrafter):
    def __init__(self, eagle, shape: DraftShape, device: torch.device):
        self.shape = shape.dynamic
        self.depth = shape.depth
        self.row_depths = self.shape.row_depths(self.shape.num_expanded).numpy()     # every expanded node's
        super().__init__(eagle, device)

    def capture(self, graphs: dict[str, StepGraphs], draft_rows: dict) -> None:
        k = self.shape.topk
        for level in range(1, self.shape.num_steps):
            m = k * level                                          # the frontiers of levels 1..level
            graphs[f"dynamic level {level}"] = StepGraphs(
                f"dynamic level {level}", self.level_forward(m), m,
                tree_mask=torch.ones(m, m, dtype=torch.bool).tril(), **draft_rows)

    def level_forward(self, rows: int):
        """`rows` expanded nodes per request -> (logits of the newest frontier, pre-norms)."""
        e, k = self.eagle, self.shape.topk

        def forward(ids, hidden, batch):
            normed, prenorm = e.draft(ids, hidden, batch, e.kv)
            return e.draft.compute_logits(normed.view(-1, rows, normed.shape[-1])[:, rows - k:].flatten(0, 1)), prenorm
        return forward

    def grow(self, logits: torch.Tensor, h: torch.Tensor, roots: torch.Tensor,
             run_level) -> tuple[TreeBatch, torch.Tensor]:
        shape, n = self.shape, roots.shape[0]
        growth = TreeGrowth(shape, torch.log_softmax(logits.float(), -1), self.eagle.draft.d2t)
        prenorm = h.new_zeros(n, 1 + shape.num_expanded, h.shape[-1])     # 0: the root; e + 1: expanded node e
        prenorm[:, 0] = h
        while not growth.done:
            tokens, source, mask = growth.draft_rows()
            m = tokens.shape[1]
            hidden = prenorm.gather(1, source[:, :, None].expand(-1, -1, prenorm.shape[-1]))
            frontier_logits, pre = run_level(f"dynamic level {m // shape.topk}", self.level_forward(m),
                                             tokens.flatten(), hidden.flatten(0, 1), slice(0, m), mask)
            prenorm[:, 1:m + 1] = pre.view(n, m, -1)
            growth.grow(torch.log_softmax(frontier_logits.float(), -1))
        return growth.finish(roots)

    def tree_batch(self, parents: torch.Tensor) -> TreeBatch:
        return TreeBatch(parents, self.shape.num_steps, self.shape.topk, bounded=True)

    def verify_layout(self, trees: TreeBatch, n: int, on_device: bool):
        # Node depths stay on the device: the verify batch adds them to its rotary positions there.
        return trees.depths(), trees.attention_masks()
