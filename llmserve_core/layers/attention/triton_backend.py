"""Triton attention over the paged KV cache: split-KV decode or varlen prefill/extend.

The decode path is CUDA-graph safe: its launch shape depends only on the batch size and the cache shape,
it reads every length from device tensors, and its split-KV scratch is allocated once and only grown.
"""
from __future__ import annotations

import torch

from llmserve_core.layers.attention.base import AttentionBackend, QKPrep
from llmserve_core.layers.batch import ForwardBatch
from llmserve_core.kernels.paged_decode import (MAX_TILE_ROWS, DecodeScratch, choose_num_splits, paged_decode,
                                                paged_decode_qkv)
from llmserve_core.kernels.paged_prefill import paged_prefill


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def __init__(self):
        self.scratch = DecodeScratch()

    def attend_qkv(self, qkv: torch.Tensor, prep: QKPrep, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   batch: ForwardBatch, scale: float, k_scale: float = 1.0, v_scale: float = 1.0,
                   pdl: bool = False) -> torch.Tensor:
        if not (batch.is_decode and choose_num_splits(batch.num_seqs, prep.num_kv_heads) > 1):
            return super().attend_qkv(qkv, prep, k_cache, v_cache, batch, scale, k_scale, v_scale, pdl)
        # A split decode's kernel norms and rotates q and k and stores K/V itself: one launch a layer fewer.
        # On the H200 (benchmarks/results/decode_qkv_h200.md) that took the FP8 batch-1 step from 2.955 to
        # 2.899 ms (bf16 4.127 -> 4.122); one-piece decodes (batch 64 and up) lost with it (6.0 -> 6.5 ms at
        # batch 64): the extra live registers through their long pipelined loop cost more than the launch.
        return paged_decode_qkv(qkv, batch.positions, batch.slot_mapping, prep.q_weight, prep.k_weight, prep.cos,
                                prep.sin, prep.eps, prep.num_heads, k_cache, v_cache, batch.block_tables,
                                batch.seq_lens, scale, scratch=self.scratch, k_scale=k_scale, v_scale=v_scale,
                                pdl=pdl)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch,
               scale: float, k_scale: float = 1.0, v_scale: float = 1.0, pdl: bool = False) -> torch.Tensor:
        if batch.is_decode:
            # One query row per sequence, in sequence order, so row b of q belongs to sequence b.
            return paged_decode(q, k_cache, v_cache, batch.block_tables, batch.seq_lens, scale,
                                scratch=self.scratch, k_scale=k_scale, v_scale=v_scale, pdl=pdl)
        rows = batch.uniform_query_len
        if rows and rows * (q.shape[1] // k_cache.shape[2]) <= MAX_TILE_ROWS:
            # A verify (or padded catch-up): a few rows per sequence read the KV once, like a decode.
            return paged_decode(q, k_cache, v_cache, batch.block_tables, batch.seq_lens, scale,
                                scratch=self.scratch, rows_per_seq=rows, tree_mask=batch.tree_mask,
                                k_scale=k_scale, v_scale=v_scale)
        return paged_prefill(q, k_cache, v_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables,
                             batch.max_query_len, scale, tree_mask=batch.tree_mask, k_scale=k_scale,
                             v_scale=v_scale)
