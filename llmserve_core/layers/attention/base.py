"""The attention backend interface: store this step's K/V into the paged cache, then attend.

KV cache layout, shared by every backend and the block manager's slot arithmetic:
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
(the layout of FlashAttention's paged API), one pair per layer.
"""
from __future__ import annotations

from typing import Protocol

import torch

from llmserve_core.layers.batch import ForwardBatch


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
