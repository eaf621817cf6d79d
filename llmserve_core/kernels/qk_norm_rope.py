"""Between the qkv projection and attention, in one kernel: Qwen3's per-head q/k RMSNorm, neox rotary,
and the store of this step's K and V into the paged cache.

Eagerly this is about two dozen tiny kernels per layer (two norms in float32, two rotations, copies, the
cache store); at decode batch sizes each costs more in launch latency than in work, and even as two
Triton kernels (norm + rotary, then the store) the second launch and k's round trip through memory cost
as much as the work. One program per (token, q or kv head) reads its head from the packed qkv row:
- a q head is normalized, rotated and written to q [T, Hq, D], the one output attention reads;
- a kv head is normalized and rotated as k, and written with its v head straight into the caches at the
  token's slot (slot = block * block_size + offset; -1: store nothing, as for graph padding).
Normalization takes float32 statistics and rounds to the model dtype before the weight multiply, as
transformers does; rotation is in float32, rounded once. Models without q/k norm (an EAGLE-3 draft)
skip it. An FP8 (e4m3) cache stores k / k_scale and v / v_scale, saturated to e4m3's range.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmserve_core.kernels.attention_reference import store_kv_reference
from llmserve_core.kernels.pdl import pdl_launch, pdl_wait_and_release
from llmserve_core.kernels.rmsnorm import rmsnorm_reference
from llmserve_core.kernels.rotary import rotary_reference


@triton.jit
def _norm_rope(src, w_ptr, cos, sin, i, mask, eps, dtype, HALF: tl.constexpr, HEAD_DIM: tl.constexpr,
               HAS_NORM: tl.constexpr):
    """One head of the qkv row -> its two rotated halves in float32 (each already a model-dtype value)."""
    x1 = tl.load(src + i, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + i, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        inv = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / HEAD_DIM + eps)
        w1 = tl.load(w_ptr + i, mask=mask, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + i, mask=mask, other=0.0).to(tl.float32)
        x1 = ((x1 * inv).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        x2 = ((x2 * inv).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    return (x1 * cos - x2 * sin).to(dtype).to(tl.float32), (x2 * cos + x1 * sin).to(dtype).to(tl.float32)


@triton.jit
def _to_cache(x, scale, FP8: tl.constexpr):
    if FP8:
        x = tl.minimum(tl.maximum(x / scale, -448.0), 448.0)
    return x


@triton.jit
def _qk_norm_rope_store_kernel(qkv_ptr, pos_ptr, slot_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, q_ptr, kc_ptr,
                               vc_ptr, stride_qkv, stride_cos, eps, k_scale, v_scale,
                               NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                               BLOCK_HALF: tl.constexpr, HAS_NORM: tl.constexpr, FP8: tl.constexpr,
                               PDL: tl.constexpr):
    pdl_wait_and_release(PDL)      # qkv, the positions and the slots all come from earlier kernels
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    HALF: tl.constexpr = HEAD_DIM // 2
    i = tl.arange(0, BLOCK_HALF)
    mask = i < HALF
    dtype = q_ptr.dtype.element_ty
    row = qkv_ptr + t * stride_qkv          # q heads, k heads, v heads, each HEAD_DIM wide
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos = tl.load(cos_ptr + pos * stride_cos + i, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_cos + i, mask=mask, other=0.0).to(tl.float32)
    if h < NUM_Q_HEADS:
        o1, o2 = _norm_rope(row + h * HEAD_DIM, qw_ptr, cos, sin, i, mask, eps, dtype, HALF, HEAD_DIM, HAS_NORM)
        dst = q_ptr + (t * NUM_Q_HEADS + h) * HEAD_DIM
        tl.store(dst + i, o1.to(dtype), mask=mask)
        tl.store(dst + HALF + i, o2.to(dtype), mask=mask)
    else:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            kh = h - NUM_Q_HEADS
            o1, o2 = _norm_rope(row + h * HEAD_DIM, kw_ptr, cos, sin, i, mask, eps, dtype, HALF, HEAD_DIM,
                                HAS_NORM)
            dst = (slot * NUM_K_HEADS + kh) * HEAD_DIM
            cache_dtype = kc_ptr.dtype.element_ty
            tl.store(kc_ptr + dst + i, _to_cache(o1, k_scale, FP8).to(cache_dtype), mask=mask)
            tl.store(kc_ptr + dst + HALF + i, _to_cache(o2, k_scale, FP8).to(cache_dtype), mask=mask)
            v_src = row + (NUM_Q_HEADS + NUM_K_HEADS + kh) * HEAD_DIM
            v1 = tl.load(v_src + i, mask=mask, other=0.0).to(tl.float32)
            v2 = tl.load(v_src + HALF + i, mask=mask, other=0.0).to(tl.float32)
            tl.store(vc_ptr + dst + i, _to_cache(v1, v_scale, FP8).to(cache_dtype), mask=mask)
            tl.store(vc_ptr + dst + HALF + i, _to_cache(v2, v_scale, FP8).to(cache_dtype), mask=mask)


def qk_norm_rope_store(qkv: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                       q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, cos: torch.Tensor,
                       sin: torch.Tensor, eps: float, num_q_heads: int, num_k_heads: int, head_dim: int,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: float = 1.0,
                       v_scale: float = 1.0, pdl: bool = False) -> torch.Tensor:
    """qkv [T, (Hq + 2 Hk) * D] -> q [T, Hq, D] normed and rotated; k (normed, rotated) and v are written
    into k_cache / v_cache [num_blocks, block_size, Hk, D] at slot_mapping [T]. q_weight / k_weight None:
    no q/k norm. cos/sin: the whole tables [max_positions, D / 2]."""
    T = qkv.shape[0]
    assert qkv.stride(1) == 1 and qkv.shape[1] == (num_q_heads + 2 * num_k_heads) * head_dim, \
        "qkv: rows of (num_q_heads + 2 * num_k_heads) * head_dim, contiguous"
    assert head_dim % 2 == 0 and cos.shape[1] * 2 == head_dim and cos.stride(1) == 1 and cos.stride() == sin.stride()
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape[2:] == (num_k_heads, head_dim), \
        "k_cache/v_cache: contiguous [num_blocks, block_size, num_kv_heads, head_dim]"
    assert slot_mapping.shape[0] == T and positions.shape[0] == T, "slot_mapping/positions: one per token"
    assert (q_weight is None) == (k_weight is None), "q_weight/k_weight: both or neither"
    q = torch.empty(T, num_q_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if T:
        fp8 = k_cache.dtype == torch.float8_e4m3fn
        has_norm = q_weight is not None
        _qk_norm_rope_store_kernel[(T, num_q_heads + num_k_heads)](
            qkv, positions, slot_mapping, q_weight if has_norm else cos, k_weight if has_norm else cos, cos, sin,
            q, k_cache, v_cache, qkv.stride(0), cos.stride(0), eps, float(k_scale) if fp8 else 1.0,
            float(v_scale) if fp8 else 1.0, NUM_Q_HEADS=num_q_heads, NUM_K_HEADS=num_k_heads, HEAD_DIM=head_dim,
            BLOCK_HALF=triton.next_power_of_2(head_dim // 2), HAS_NORM=has_norm, FP8=fp8, num_warps=1,
            PDL=pdl, **pdl_launch(pdl))
    return q


def qk_norm_rope_store_reference(qkv, positions, slot_mapping, q_weight, k_weight, cos, sin, eps, num_q_heads,
                                 num_k_heads, head_dim, k_cache, v_cache, k_scale=1.0, v_scale=1.0):
    """The unfused composition: RMSNorm each head, rotate in float32, store K/V with the cache reference."""
    T = qkv.shape[0]
    q, k, v = qkv.split([num_q_heads * head_dim, num_k_heads * head_dim, num_k_heads * head_dim], dim=-1)
    q = q.reshape(T, num_q_heads, head_dim)
    k = k.reshape(T, num_k_heads, head_dim)
    if q_weight is not None:
        q, k = rmsnorm_reference(q, q_weight, eps), rmsnorm_reference(k, k_weight, eps)
    q, k = rotary_reference(q, k, positions, cos, sin)
    store_kv_reference(k, v.reshape(T, num_k_heads, head_dim), k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q
