"""Between the qkv projection and attention, in one kernel: Qwen3's per-head q/k RMSNorm, neox rotary,
and the store of this step's K and V into the paged cache.

Eagerly this is about two dozen tiny kernels per layer (two norms in float32, two rotations, copies, the
cache store); at decode batch sizes each costs more in launch latency than in work, and even as two
Triton kernels (norm + rotary, then the store) the second launch and k's round trip through memory cost
as much as the work. One program per (token, block of HEADS_PER_PROGRAM q or kv heads) reads its heads
from the packed qkv row (a program a head, one warp each, left the multiprocessors scheduling ten
thousand programs at batch 256: 13 us a layer):
- q heads are normalized, rotated and written to q [T, Hq, D], the one output attention reads;
- kv heads are normalized and rotated as k, and written with their v heads straight into the caches at
  the token's slot (slot = block * block_size + offset; -1: store nothing, as for graph padding).
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

HEADS_PER_PROGRAM = 8


@triton.jit
def _norm_rope(src, w_ptr, cos, sin, heads, i, mask, eps, dtype, HALF: tl.constexpr, HEAD_DIM: tl.constexpr,
               HAS_NORM: tl.constexpr):
    """A block of heads of the qkv row ([BLOCK_H] head offsets into src) -> their two rotated halves
    [BLOCK_H, BLOCK_HALF] in float32 (each already a model-dtype value)."""
    base = src + heads[:, None] * HEAD_DIM + i[None, :]
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        inv = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM + eps)[:, None]
        w1 = tl.load(w_ptr + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
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
                               BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr, HAS_NORM: tl.constexpr,
                               FP8: tl.constexpr, PDL: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    HALF: tl.constexpr = HEAD_DIM // 2
    Q_BLOCKS: tl.constexpr = (NUM_Q_HEADS + BLOCK_H - 1) // BLOCK_H
    i = tl.arange(0, BLOCK_HALF)
    dtype = q_ptr.dtype.element_ty
    row = qkv_ptr + t * stride_qkv          # q heads, k heads, v heads, each HEAD_DIM wide
    # The positions and slots come from kernels further back than the projection just before (the step's
    # input copy, or device-built batches), and the tables are static: under PDL their dependent loads
    # (position, then cos/sin) overlap the projection's tail. qkv comes from that projection: after the wait.
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos = tl.load(cos_ptr + pos * stride_cos + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + pos * stride_cos + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
    slot = tl.load(slot_ptr + t).to(tl.int64)
    pdl_wait_and_release(PDL)
    if hb < Q_BLOCKS:
        heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = (heads < NUM_Q_HEADS)[:, None] & (i < HALF)[None, :]
        o1, o2 = _norm_rope(row, qw_ptr, cos, sin, heads, i, mask, eps, dtype, HALF, HEAD_DIM, HAS_NORM)
        dst = q_ptr + (t * NUM_Q_HEADS + heads[:, None]) * HEAD_DIM + i[None, :]
        tl.store(dst, o1.to(dtype), mask=mask)
        tl.store(dst + HALF, o2.to(dtype), mask=mask)
    else:
        if slot >= 0:
            kh = (hb - Q_BLOCKS) * BLOCK_H + tl.arange(0, BLOCK_H)
            mask = (kh < NUM_K_HEADS)[:, None] & (i < HALF)[None, :]
            # v is asked for with k: read after k's stores (which the compiler cannot tell from v's row) it
            # was a second memory round trip in the program that ends the kernel.
            v_src = row + (NUM_Q_HEADS + NUM_K_HEADS) * HEAD_DIM + kh[:, None] * HEAD_DIM + i[None, :]
            v1 = tl.load(v_src, mask=mask, other=0.0).to(tl.float32)
            v2 = tl.load(v_src + HALF, mask=mask, other=0.0).to(tl.float32)
            o1, o2 = _norm_rope(row + NUM_Q_HEADS * HEAD_DIM, kw_ptr, cos, sin, kh, i, mask, eps, dtype, HALF,
                                HEAD_DIM, HAS_NORM)
            dst = (slot * NUM_K_HEADS + kh[:, None]) * HEAD_DIM + i[None, :]
            cache_dtype = kc_ptr.dtype.element_ty
            tl.store(kc_ptr + dst, _to_cache(o1, k_scale, FP8).to(cache_dtype), mask=mask)
            tl.store(kc_ptr + dst + HALF, _to_cache(o2, k_scale, FP8).to(cache_dtype), mask=mask)
            tl.store(vc_ptr + dst, _to_cache(v1, v_scale, FP8).to(cache_dtype), mask=mask)
            tl.store(vc_ptr + dst + HALF, _to_cache(v2, v_scale, FP8).to(cache_dtype), mask=mask)


def qk_norm_rope_store(qkv: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                       q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, cos: torch.Tensor,
                       sin: torch.Tensor, eps: float, num_q_heads: int, num_k_heads: int, head_dim: int,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: float = 1.0,
                       v_scale: float = 1.0, pdl: bool = False) -> torch.Tensor:
    """qkv [T, (Hq + 2 Hk) * D] -> q [T, Hq, D] normed and rotated; k (normed, rotated) and v are written
    into k_cache / v_cache [num_blocks, block_size, Hk, D] at slot_mapping [T]. q_weight / k_weight None:
    no q/k norm. cos/sin: the whole tables [max_positions, D / 2].

    pdl: launch under PDL. The positions and slots are then read before the wait on the kernel just
    before (the projection that writes qkv), so they must come from a kernel further back."""
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
        block_h = min(HEADS_PER_PROGRAM, triton.next_power_of_2(max(num_q_heads, num_k_heads)))
        blocks = triton.cdiv(num_q_heads, block_h) + triton.cdiv(num_k_heads, block_h)
        _qk_norm_rope_store_kernel[(T, blocks)](
            qkv, positions, slot_mapping, q_weight if has_norm else cos, k_weight if has_norm else cos, cos, sin,
            q, k_cache, v_cache, qkv.stride(0), cos.stride(0), eps, float(k_scale) if fp8 else 1.0,
            float(v_scale) if fp8 else 1.0, NUM_Q_HEADS=num_q_heads, NUM_K_HEADS=num_k_heads, HEAD_DIM=head_dim,
            BLOCK_HALF=triton.next_power_of_2(head_dim // 2), BLOCK_H=block_h, HAS_NORM=has_norm, FP8=fp8,
            num_warps=4, PDL=pdl, **pdl_launch(pdl))
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
