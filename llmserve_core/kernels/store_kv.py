"""Write this step's K/V rows into the paged cache at their slots (slot = block * block_size + offset).

A slot of -1 marks a token whose K/V must not be stored (padding, or a token whose slot already holds it).
An FP8 (e4m3) cache stores k / k_scale and v / v_scale, saturated to e4m3's range; other caches ignore the scales.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmserve_core.kernels.attention_reference import store_kv_reference  # noqa: F401  (its reference)


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, k_scale, v_scale,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_slot,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        mask = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM)
        dst = slot * stride_slot + h[:, None] * HEAD_DIM + d[None, :]
        k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
        v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
        if FP8:
            k = tl.minimum(tl.maximum(k.to(tl.float32) / k_scale, -448.0), 448.0)
            v = tl.minimum(tl.maximum(v.to(tl.float32) / v_scale, -448.0), 448.0)
        tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=mask)
        tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """k, v: [T, num_kv_heads, head_dim] (last dim contiguous); caches [num_blocks, block_size, num_kv_heads, head_dim]."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "k_cache/v_cache must be contiguous"
    assert k.stride(2) == 1 and v.stride(2) == 1, "k/v: head_dim must be contiguous"
    assert slot_mapping.shape[0] == num_tokens, "slot_mapping: one slot per token"
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, float(k_scale), float(v_scale),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(1),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim), FP8=fp8,
        num_warps=4,
    )
