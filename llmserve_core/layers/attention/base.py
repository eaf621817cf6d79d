"""The attention backend interface: store this step's K/V into the paged cache, then attend.

KV cache layout, shared by every backend and the block manager's slot arithmetic:
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
(the layout of FlashAttention's paged API), one pair per layer.
"""
from __future__ import annotations

from typing import Protocol

import torch

from llmserve_core.engine.batch import ForwardBatch
from llmserve_core.layers.fp8 import to_cache_dtype


class AttentionBackend(Protocol):
    name: str

    def forward(
        self,
        q: torch.Tensor,        # [T, num_heads, head_dim]
        k: torch.Tensor,        # [T, num_kv_heads, head_dim]
        v: torch.Tensor,        # [T, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        batch: ForwardBatch,
        scale: float,
        k_scale: float = 1.0,   # an FP8 cache holds k / k_scale and v / v_scale; other caches ignore both
        v_scale: float = 1.0,
    ) -> torch.Tensor:          # [T, num_heads, head_dim]
        ...


def store_kv_reference(k, v, k_cache, v_cache, slot_mapping, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Write each token's K/V into its cache slot; slot -1 marks a token that must not be stored."""
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = to_cache_dtype(k[keep], k_cache.dtype, k_scale)
    v_cache[blocks, offsets] = to_cache_dtype(v[keep], v_cache.dtype, v_scale)
