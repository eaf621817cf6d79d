"""FlashAttention over the paged KV cache: FlashAttention-4 (flash_attn.cute) when present, else the
flash_attn 2/3 paged interface. K/V are already in the cache (see base.py); a speculative tree mask, which
FlashAttention cannot express, goes through the Triton prefill kernel.

FlashAttention reads whole pages: cache rows past a sequence's length must hold finite values (allocate the
cache with zeros), since a masked score times a NaN value row is still NaN.
"""
from __future__ import annotations

import torch

from llmserve_core.layers.attention.base import AttentionBackend
from llmserve_core.layers.batch import ForwardBatch
from llmserve_core.kernels.paged_prefill import paged_prefill


def load_fa4():
    """flash_attn.cute's varlen forward (FlashAttention-4); ImportError when it is not installed."""
    from flash_attn.cute import flash_attn_varlen_func
    return flash_attn_varlen_func


def fa4_paged(fn, q, k_cache, v_cache, batch: ForwardBatch, scale: float) -> torch.Tensor:
    """Causal varlen attention of the packed queries over the paged cache (lengths from device tensors)."""
    out = fn(q, k_cache, v_cache, cu_seqlens_q=batch.query_start_loc, seqused_k=batch.seq_lens,
             page_table=batch.block_tables, max_seqlen_q=batch.max_query_len, softmax_scale=scale, causal=True)
    return out[0] if isinstance(out, tuple) else out


def _load_flash_attn():
    """('fa4', varlen) or ('fa2', (varlen, with_kvcache)); ImportError naming both when neither exists."""
    try:
        return "fa4", load_fa4()
    except ImportError as fa4_error:
        try:
            from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
            return "fa2", (flash_attn_varlen_func, flash_attn_with_kvcache)
        except ImportError as fa2_error:
            raise ImportError(
                "attention_backend 'flash-attn' needs FlashAttention: install flash-attn-4 (import flash_attn.cute) "
                f"or flash-attn 2/3 (import flash_attn); got: {fa4_error}; {fa2_error}. "
                "Or choose attention_backend 'triton'."
            ) from fa2_error


class FlashAttentionBackend(AttentionBackend):
    name = "flash-attn"

    def __init__(self):
        self.flavor, self._fn = _load_flash_attn()

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch,
               scale: float, k_scale: float = 1.0, v_scale: float = 1.0, pdl: bool = False,
               quant=None) -> torch.Tensor:
        if k_cache.dtype == torch.float8_e4m3fn:
            raise ValueError("kv_cache_dtype: fp8_e4m3 is read by the triton and torch attention backends, "
                             "not flash-attn")
        if batch.tree_mask is not None:
            return paged_prefill(q, k_cache, v_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables,
                                 batch.max_query_len, scale, tree_mask=batch.tree_mask)
        if self.flavor == "fa4":
            return fa4_paged(self._fn, q, k_cache, v_cache, batch, scale)
        varlen, with_kvcache = self._fn
        if batch.is_decode:
            out = with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=batch.seq_lens,
                               block_table=batch.block_tables, softmax_scale=scale, causal=True)
            return out.squeeze(1)
        cu_seqlens_k = torch.nn.functional.pad(batch.seq_lens.cumsum(0, dtype=torch.int32), (1, 0))
        return varlen(q, k_cache, v_cache, batch.query_start_loc, cu_seqlens_k, batch.max_query_len,
                      batch.max_seq_len, softmax_scale=scale, causal=True, block_table=batch.block_tables)
