"""Neox-style rotary embedding applied in place to q and k, one program per token.

cos/sin: [max_positions, head_dim // 2] (layers/rotary.py's buffers). The pair (i, i + head_dim/2) is
rotated in float32 and rounded once, instead of the several rounded eager ops and the q/k copies.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr, stride_qt, stride_qh, stride_kt, stride_kh,
                   stride_cos, NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HALF: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    h = tl.arange(0, BLOCK_H)
    i_mask = i < HALF
    cos = tl.load(cos_ptr + pos * stride_cos + i, mask=i_mask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + pos * stride_cos + i, mask=i_mask, other=0.0).to(tl.float32)[None, :]

    mask = (h[:, None] < NUM_Q_HEADS) & i_mask[None, :]
    p = q_ptr + t * stride_qt + h[:, None] * stride_qh + i[None, :]
    x1 = tl.load(p, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(p, (x1 * cos - x2 * sin).to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(p + HALF, (x2 * cos + x1 * sin).to(q_ptr.dtype.element_ty), mask=mask)

    mask = (h[:, None] < NUM_K_HEADS) & i_mask[None, :]
    p = k_ptr + t * stride_kt + h[:, None] * stride_kh + i[None, :]
    x1 = tl.load(p, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(p, (x1 * cos - x2 * sin).to(k_ptr.dtype.element_ty), mask=mask)
    tl.store(p + HALF, (x2 * cos + x1 * sin).to(k_ptr.dtype.element_ty), mask=mask)


def rotary_inplace(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor) -> None:
    """q: [T, num_heads, head_dim], k: [T, num_kv_heads, head_dim] (views allowed), rotated in place."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    assert q.stride(2) == 1 and k.stride(2) == 1 and cos.stride(1) == 1 and cos.stride() == sin.stride()
    assert cos.shape[1] * 2 == head_dim, "cos/sin: must be [max_positions, head_dim // 2]"
    if num_tokens == 0:
        return
    _rotary_kernel[(num_tokens,)](
        q, k, positions, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
        NUM_Q_HEADS=num_q_heads, NUM_K_HEADS=num_k_heads, HALF=head_dim // 2,
        BLOCK_H=triton.next_power_of_2(max(num_q_heads, num_k_heads)),
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2), num_warps=4,
    )


def rotary_reference(q, k, positions, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated copies of q and k, computed in float32."""
    c = cos[positions].float().unsqueeze(1)
    s = sin[positions].float().unsqueeze(1)

    def rot(x):
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)
    return rot(q), rot(k)
