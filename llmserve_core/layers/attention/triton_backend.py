"""Triton attention over the paged KV cache: split-KV decode or varlen prefill/extend.

The decode path is CUDA-graph safe: its launch shape depends only on the batch size and the cache shape,
it reads every length from device tensors, and its split-KV scratch is allocated once and only grown.
"""
from __future__ import annotations

import torch

from llmserve_core.layers.attention.base import AttentionBackend
from llmserve_core.layers.batch import ForwardBatch
from llmserve_core.kernels.fp8_format import RowQuant
from llmserve_core.kernels.paged_decode import MAX_TILE_ROWS, DecodeScratch, paged_decode
from llmserve_core.kernels.paged_prefill import paged_prefill


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def __init__(self):
        self.scratch = DecodeScratch()

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch,
               scale: float, k_scale: float = 1.0, v_scale: float = 1.0, pdl: bool = False,
               quant: RowQuant | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if batch.is_decode:
            # One query row per sequence, in sequence order, so row b of q belongs to sequence b.
            return paged_decode(q, k_cache, v_cache, batch.block_tables, batch.seq_lens, scale,
                                scratch=self.scratch, k_scale=k_scale, v_scale=v_scale, pdl=pdl,
                                quant=quant if quant is not None and quant.group == q.shape[-1] else None)
        rows = batch.uniform_query_len
        if rows and rows * (q.shape[1] // k_cache.shape[2]) <= MAX_TILE_ROWS:
            # A verify (or padded catch-up): a few rows per sequence read the KV once, like a decode.
            return paged_decode(q, k_cache, v_cache, batch.block_tables, batch.seq_lens, scale,
                                scratch=self.scratch, rows_per_seq=rows, tree_mask=batch.tree_mask,
                                k_scale=k_scale, v_scale=v_scale)
        return paged_prefill(q, k_cache, v_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables,
                             batch.max_query_len, scale, tree_mask=batch.tree_mask, k_scale=k_scale,
                             v_scale=v_scale)
