"""Qwen3's per-head q/k RMSNorm and neox rotary, fused into one kernel over the packed qkv output.

Eagerly this is about two dozen tiny kernels per layer (two norms in float32, two rotations, copies);
at decode batch sizes each costs more in launch latency than in work. One program per (token, head)
reads the head from the qkv row, normalizes it (float32 statistics, rounded to the model dtype before
the weight multiply, as transformers does), rotates it in float32 and writes q or k contiguously.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmserve_core.kernels.rotary import rotary_reference


@triton.jit
def _qk_norm_rope_kernel(qkv_ptr, pos_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, stride_qkv,
                         stride_cos, eps, NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr,
                         HEAD_DIM: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    HALF: tl.constexpr = HEAD_DIM // 2
    i = tl.arange(0, HALF)
    is_q = h < NUM_Q_HEADS
    src = qkv_ptr + t * stride_qkv + h * HEAD_DIM     # q heads, then k heads, are adjacent in the row
    x1 = tl.load(src + i).to(tl.float32)
    x2 = tl.load(src + HALF + i).to(tl.float32)
    inv = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / HEAD_DIM + eps)
    if is_q:
        w1 = tl.load(qw_ptr + i).to(tl.float32)
        w2 = tl.load(qw_ptr + HALF + i).to(tl.float32)
    else:
        w1 = tl.load(kw_ptr + i).to(tl.float32)
        w2 = tl.load(kw_ptr + HALF + i).to(tl.float32)
    dtype = q_ptr.dtype.element_ty
    y1 = (x1 * inv).to(dtype).to(tl.float32) * w1
    y2 = (x2 * inv).to(dtype).to(tl.float32) * w2
    y1 = y1.to(dtype).to(tl.float32)
    y2 = y2.to(dtype).to(tl.float32)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos = tl.load(cos_ptr + pos * stride_cos + i).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_cos + i).to(tl.float32)
    o1 = (y1 * cos - y2 * sin).to(dtype)
    o2 = (y2 * cos + y1 * sin).to(dtype)
    if is_q:
        dst = q_ptr + (t * NUM_Q_HEADS + h) * HEAD_DIM
    else:
        dst = k_ptr + (t * NUM_K_HEADS + (h - NUM_Q_HEADS)) * HEAD_DIM
    tl.store(dst + i, o1)
    tl.store(dst + HALF + i, o2)


def qk_norm_rope(qkv: torch.Tensor, positions: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, eps: float, num_q_heads: int, num_k_heads: int,
                 head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """qkv: [T, (Hq + 2 Hk) * D] -> q [T, Hq, D], k [T, Hk, D], normed and rotated; v is left in qkv."""
    assert qkv.stride(1) == 1 and head_dim & (head_dim - 1) == 0, "qkv: rows contiguous, head_dim a power of 2"
    assert cos.shape[1] * 2 == head_dim and cos.stride(1) == 1 and cos.stride() == sin.stride()
    T = qkv.shape[0]
    q = torch.empty(T, num_q_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(T, num_k_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if T:
        _qk_norm_rope_kernel[(T, num_q_heads + num_k_heads)](
            qkv, positions, q_weight, k_weight, cos, sin, q, k, qkv.stride(0), cos.stride(0), eps,
            NUM_Q_HEADS=num_q_heads, NUM_K_HEADS=num_k_heads, HEAD_DIM=head_dim, num_warps=1)
    return q, k


def qk_norm_rope_reference(qkv, positions, q_weight, k_weight, cos, sin, eps, num_q_heads, num_k_heads, head_dim):
    """The unfused composition: RMSNorm each head as the model's RMSNorm does, then rotate in float32."""
    T = qkv.shape[0]

    def norm(x, w):
        x32 = x.float()
        return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    q = qkv[:, :num_q_heads * head_dim].reshape(T, num_q_heads, head_dim)
    k = qkv[:, num_q_heads * head_dim:(num_q_heads + num_k_heads) * head_dim].reshape(T, num_k_heads, head_dim)
    return rotary_reference(norm(q, q_weight), norm(k, k_weight), positions, cos, sin)
