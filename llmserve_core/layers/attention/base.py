"""The attention backend interface: store this step's K/V into the paged cache, then attend.

KV cache layout, shared by every backend and the block manager's slot arithmetic:
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
(the layout of FlashAttention's paged API), one pair per layer.

On the fast path the model writes K/V into the cache itself, in the kernel that norms and rotates q and k
(kernels/qk_norm_rope.py), and calls `attend`; `forward` is the unfused path (CPU, the torch reference):
the torch store, then `attend`.
"""
from __future__ import annotations

import torch

from llmserve_core.kernels.attention_reference import store_kv_reference
from llmserve_core.kernels.fp8_format import RowQuant
from llmserve_core.layers.batch import ForwardBatch


class AttentionBackend:
    name: str

    def attend(
        self,
        q: torch.Tensor,        # [T, num_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], this step's K/V stored
        v_cache: torch.Tensor,
        batch: ForwardBatch,
        scale: float,
        k_scale: float = 1.0,   # an FP8 cache holds k / k_scale and v / v_scale; other caches ignore both
        v_scale: float = 1.0,
        pdl: bool = False,      # a Triton decode may launch under PDL (kernels/pdl.py); others ignore it
        quant: RowQuant | None = None,  # a Triton decode may hand its rows to o_proj quantized so (see below)
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """[T, num_heads, head_dim]; or, where quant is given and the backend's kernel writes it (a Triton
        decode, quant.group == head_dim), (e4m3 codes, scales) of the rows [T, num_heads * head_dim] in
        quant's layout (fp8_format.empty_quantized), as an FP8 o_proj's W8A8 GEMM reads them."""
        raise NotImplementedError

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, batch: ForwardBatch, scale: float, k_scale: float = 1.0,
                v_scale: float = 1.0) -> torch.Tensor:
        """k, v: [T, num_kv_heads, head_dim], stored at batch.slot_mapping before attending. The store
        indexes with a mask (a host sync): the unfused path is not for CUDA graphs."""
        store_kv_reference(k, v, k_cache, v_cache, batch.slot_mapping, k_scale, v_scale)
        return self.attend(q, k_cache, v_cache, batch, scale, k_scale, v_scale)
