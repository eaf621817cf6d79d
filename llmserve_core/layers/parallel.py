"""Tensor-parallel layers: a vocabulary-split embedding, which keeps the parameter name of the layer it
replaces, so checkpoints load unchanged; the group object (distributed.group.TPGroup) brings the
collectives. Row-split projections (o_proj, down_proj) are plain linears whose partial products the
model all-reduces itself."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class VocabParallelEmbedding(nn.Embedding):
    """Holds vocabulary rows [first, first + rows): ids outside embed to zero here and come from their owner."""

    def __init__(self, rows: int, hidden_size: int, first: int, tp):
        super().__init__(rows, hidden_size)
        self.first, self.tp = first, tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.first
        outside = (local < 0) | (local >= self.num_embeddings)
        h = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(h.masked_fill(outside[:, None], 0))
