"""Triton attention over the paged KV cache: split-KV decode or varlen prefill/extend.

The decode path is CUDA-graph safe: its launch shape depends only on the batch size and the cache shape,
it reads every length from device tensors, and its split-KV scratch is allocated once and only grown.
Handed the packed qkv projection (attend_qkv), a decode's kernel also norms and rotates q and k and stores
the new K/V itself, so the layer launches no separate q/k kernel.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from llmserve_core.layers.attention.base import AttentionBackend
from llmserve_core.layers.batch import ForwardBatch
from llmserve_core.kernels.fp8_format import RowQuant
from llmserve_core.kernels.paged_decode import MAX_TILE_ROWS, DecodeScratch, paged_decode
from llmserve_core.kernels.paged_prefill import paged_prefill

if TYPE_CHECKING:
    from llmserve_core.kernels.qk_norm_rope import HeadPrep


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def __init__(self):
        self.scratch = DecodeScratch()

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch,
               scale: float, k_scale: float = 1.0, v_scale: float = 1.0, pdl: bool = False,
               quant: RowQuant | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if batch.is_decode:
            return self._decode(q, k_cache, v_cache, batch, scale, k_scale, v_scale, pdl, quant)
        rows = batch.uniform_query_len
        if rows and rows * (q.shape[1] // k_cache.shape[2]) <= MAX_TILE_ROWS:
            # A verify (or padded catch-up): a few rows per sequence read the KV once, like a decode.
            return paged_decode(q, k_cache, v_cache, batch.block_tables, batch.seq_lens, scale,
                                scratch=self.scratch, rows_per_seq=rows, tree_mask=batch.tree_mask,
                                k_scale=k_scale, v_scale=v_scale)
        return paged_prefill(q, k_cache, v_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables,
                             batch.max_query_len, scale, tree_mask=batch.tree_mask, k_scale=k_scale,
                             v_scale=v_scale)

    def attend_qkv(self, qkv: torch.Tensor, prep: HeadPrep, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   batch: ForwardBatch, scale: float, k_scale: float = 1.0, v_scale: float = 1.0, pdl: bool = False,
                   quant: RowQuant | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if not batch.is_decode:
            return super().attend_qkv(qkv, prep, k_cache, v_cache, batch, scale, k_scale, v_scale, pdl, quant)
        # The decode kernel reads the q heads as the projection left them: a view of qkv's rows.
        head_dim = k_cache.shape[3]
        q = qkv[:, :qkv.shape[1] - 2 * k_cache.shape[2] * head_dim].view(qkv.shape[0], -1, head_dim)
        return self._decode(q, k_cache, v_cache, batch, scale, k_scale, v_scale, pdl, quant, prep)

    def _decode(self, q, k_cache, v_cache, batch: ForwardBatch, scale: float, k_scale: float, v_scale: float,
                pdl: bool, quant: RowQuant | None, prep: HeadPrep | None = None):
        # One query row per sequence, in sequence order, so row b of q belongs to sequence b.
        return paged_decode(q, k_cache, v_cache, batch.block_tables, batch.seq_lens, scale, scratch=self.scratch,
                            k_scale=k_scale, v_scale=v_scale, pdl=pdl, prep=prep,
                            quant=quant if quant is not None and quant.group == q.shape[-1] else None)
