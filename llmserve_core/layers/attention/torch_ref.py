"""Portable torch attention over the paged KV cache: the reference every fast kernel is tested against.

Loops over sequences on the host, gathers each one's context from its block table and runs plain
softmax attention in float32. Slow, obvious, and correct on CPU and CUDA.
"""
from __future__ import annotations

import torch

from llmserve_core.engine.batch import ForwardBatch
from llmserve_core.layers.fp8 import from_cache
from llmserve_core.layers.attention.base import store_kv_reference


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[seq_len, num_kv_heads, head_dim] of one sequence, read through its block table."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = cache[block_table[:num_blocks].long()]          # [nb, bs, kvh, d]
    return blocks.reshape(-1, *cache.shape[2:])[:seq_len]


def paged_attention_reference(q, k_cache, v_cache, batch: ForwardBatch, scale: float,
                              k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Causal attention of each sequence's query rows over its cached context (already stored)."""
    num_heads = q.shape[1]
    out = torch.empty_like(q)
    query_lens = batch.query_lens_cpu or (batch.query_start_loc[1:] - batch.query_start_loc[:-1]).tolist()
    seq_lens = batch.seq_lens_cpu or batch.seq_lens.tolist()
    start = 0
    for i, (q_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
        if q_len == 0:
            continue
        qi = q[start:start + q_len].float()                    # [q, H, D]
        ki = from_cache(gather_context(k_cache, batch.block_tables[i], seq_len), k_scale)
        vi = from_cache(gather_context(v_cache, batch.block_tables[i], seq_len), v_scale)
        group = num_heads // ki.shape[1]
        ki = ki.repeat_interleave(group, dim=1)                 # [s, H, D]
        vi = vi.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,shd->hqs", qi, ki) * scale
        # Query row j sits at absolute position seq_len - q_len + j and sees keys up to it.
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        allowed = k_pos[None, :] <= q_pos[:, None]
        if batch.tree_mask is not None:
            # Among this step's own tokens, the tree decides; the cached prefix stays fully visible.
            own = batch.tree_mask[start:start + q_len, :q_len]
            allowed = allowed.clone()
            allowed[:, seq_len - q_len:] = own
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:start + q_len] = torch.einsum("hqs,shd->qhd", probs, vi).to(q.dtype)
        start += q_len
    return out


class TorchAttentionBackend:
    name = "torch"

    def forward(self, q, k, v, k_cache, v_cache, batch: ForwardBatch, scale: float,
                k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
        store_kv_reference(k, v, k_cache, v_cache, batch.slot_mapping, k_scale, v_scale)
        return paged_attention_reference(q, k_cache, v_cache, batch, scale, k_scale, v_scale)
