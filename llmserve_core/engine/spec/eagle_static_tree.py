"""EAGLE-3 static trees: a named candidate tree (speculative/tree.py) filled level by level with the
draft's top-k. Level d's forward re-runs every node above it as well (a few rows), so each node sees
exactly its ancestors through the tree mask."""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from llmserve_core.engine.spec.eagle_tree import TreeDrafter
from llmserve_core.engine.step_graphs import StepGraphs
from llmserve_core.speculative.propose import topk_propose
from llmserve_core.speculative.shape import DraftShape
from llmserve_core.speculative.tree import TreeBatch, fill_level


class StaticTreeDrafter(TreeDrafter):
    def __init__(self, eagle, shape: DraftShape, device: torch.device):
        tree = self.tree = shape.static_tree
        self.depth = tree.depth
        self.row_depths = np.asarray(tree.depths)           # every node's, the root's included
        super().__init__(eagle, device)
        self.mask = tree.attention_mask(device)
        self.parents = torch.tensor(tree.parents, device=device)
        self.one_tree = tree.batch(1, device)                # expanded per step: no host copy
        self.levels = [torch.tensor(tree.level(d), device=device) - 1 for d in range(tree.depth)]

    def capture(self, graphs: dict[str, StepGraphs], draft_rows: dict) -> None:
        for d in range(1, self.tree.depth):
            m = max(self.tree.level(d)) + 1                        # nodes 1..m-1: levels 1..d
            graphs[f"tree level {d}"] = StepGraphs(f"tree level {d}", self.level_forward(d), m - 1,
                                                   tree_mask=self.mask[1:m, 1:m], **draft_rows)

    def level_forward(self, d: int):
        """Level d: rows are nodes 1..m-1 -> (logits of level d's nodes, every row's pre-norm)."""
        e = self.eagle
        rows, level = max(self.tree.level(d)), self.levels[d]

        def forward(ids, hidden, batch):
            normed, prenorm = e.draft(ids, hidden, batch, e.kv)
            return e.draft.compute_logits(normed.view(-1, rows, normed.shape[-1])[:, level].flatten(0, 1)), prenorm
        return forward

    def grow(self, logits: torch.Tensor, h: torch.Tensor, roots: torch.Tensor,
             run_level) -> tuple[TreeBatch, torch.Tensor]:
        tree, n = self.tree, roots.shape[0]
        nodes = torch.zeros(n, tree.num_nodes, dtype=torch.long, device=roots.device)
        nodes[:, 0] = roots
        prenorm = h.new_zeros(n, tree.num_nodes, h.shape[-1])
        prenorm[:, 0] = h
        parents = self.parents
        for d in range(tree.depth):
            if d:
                m = max(tree.level(d)) + 1                            # nodes 1..m-1 are levels 1..d
                logits, pre = run_level(f"tree level {d}", self.level_forward(d), nodes[:, 1:m].flatten(),
                                        prenorm[:, parents[1:m]].flatten(0, 1), slice(1, m), self.mask[1:m, 1:m])
                prenorm[:, 1:m] = pre.view(n, m - 1, -1)
            k = tree.max_children(d)
            if k:
                top = topk_propose(logits, k, self.eagle.draft.d2t).view(n, len(tree.level(d)), k)
                fill_level(tree, d, top, nodes)
        return self.tree_batch(self.one_tree.parents.expand(n, -1)), nodes

    def tree_batch(self, parents: torch.Tensor) -> TreeBatch:
        return dataclasses.replace(self.one_tree, parents=parents)

    def verify_layout(self, trees: TreeBatch, n: int, on_device: bool):
        depths = self.row_depths_device.expand(n, -1) if on_device else np.tile(self.row_depths, (n, 1))
        return depths, self.mask.expand(n, -1, -1)
