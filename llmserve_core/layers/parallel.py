"""Tensor-parallel layers: a row-split linear (bf16 or FP8) whose partial sums are all-reduced, and a
vocabulary-split embedding. They keep the parameter names of the layers they replace, so checkpoints load unchanged; the
group object (distributed.group.TPGroup) brings the collectives."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmserve_core.layers.fp8_linear import Fp8Linear
from llmserve_core.layers.linear import Linear


class RowParallelLinear(Linear):
    """Holds a slice of the input features: each rank's product is a partial sum of the full one."""

    def __init__(self, in_features: int, out_features: int, tp):
        super().__init__(in_features, out_features)
        self.tp = tp

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.tp.all_reduce(super().forward(x, out_dtype))


class RowParallelFp8Linear(Fp8Linear):
    """RowParallelLinear with an FP8 weight: its scales are the slice's (per-row ones whole, block ones
    the slice's K blocks), and its partial product is all-reduced the same way."""

    def __init__(self, in_features: int, out_features: int, block: tuple[int, int] | None, tp):
        super().__init__(in_features, out_features, block)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(super().forward(x))


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
