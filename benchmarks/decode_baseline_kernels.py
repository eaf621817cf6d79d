"""The decode kernels between the qkv projection and o_proj as they were before the fusion (commit
9cc7c46), frozen here as the baseline benchmarks/decode_layer_bench.py times the fused ones against:
q/k norm + rotary into q and k, a separate K/V store, and split-KV decode in two launches (pieces, then a
log-sum-exp reduction). Not used by the engine; kept verbatim so the comparison runs in one call.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmserve_core.kernels.paged_decode import MAX_SPLITS, MAX_TILE_ROWS, DecodeScratch
from llmserve_core.kernels.tiling import decode_config, smem_limit_for

_SCRATCH = DecodeScratch()


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


def baseline_num_splits(batch_size: int, num_kv_heads: int, num_sms: int = 132) -> int:
    """The split count the two-launch kernel was tuned with: about four programs per SM."""
    programs = batch_size * num_kv_heads
    if programs >= 2 * num_sms:
        return 1
    return min(MAX_SPLITS, triton.next_power_of_2(triton.cdiv(4 * num_sms, max(1, programs))))


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


# The split count, block-table width and tree width vary with the batch; none is worth a compiled variant
# per value class (Triton specializes ints that are 1 or divisible by 16), so one variant serves them all.
@triton.jit(do_not_specialize=["stride_bt", "stride_tree", "num_splits"])
def _decode_split_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, seq_lens_ptr, tree_ptr, out_ptr, mid_o_ptr, mid_lse_ptr,
                         sm_scale_log2, v_scale,
                         stride_qb, stride_qh, stride_cb, stride_cs, stride_ch, stride_bt, stride_tree,
                         stride_ob, stride_oh, num_splits,
                         GROUP: tl.constexpr, ROWS: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                         SINGLE: tl.constexpr, MIN_SPLIT: tl.constexpr, HAS_TREE: tl.constexpr,
                         PRECISION: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1) * GROUP

    seq_len = tl.load(seq_lens_ptr + b)
    split_len = tl.maximum(tl.cdiv(seq_len, num_splits), MIN_SPLIT)
    split_len = tl.cdiv(split_len, BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    # Tile row i is query row j = i // GROUP of this sequence (its last ROWS positions), head i % GROUP of
    # the KV group: every query row of the sequence shares each K/V tile read.
    i = tl.arange(0, BLOCK_G)
    j = i // GROUP
    heads = kvh * GROUP + i % GROUP
    rows = b * ROWS + j
    d = tl.arange(0, BLOCK_D)
    g_mask = i < ROWS * GROUP
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + rows[:, None] * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    prefix = seq_len - ROWS          # positions every query row sees
    limit = prefix + j + 1           # causal: query row j sits at position prefix + j

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < end
        phys = tl.load(bt_row + n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        off = phys * stride_cb + (n % BLOCK_SIZE) * stride_cs + kvh * stride_ch
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(kc_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * sm_scale_log2
        if HAS_TREE:
            # Among the last ROWS positions a row sees what its tree-mask row allows (its ancestors).
            own = (n[None, :] >= prefix) & n_mask[None, :] & g_mask[:, None]
            bit = tl.load(tree_ptr + rows[:, None] * stride_tree + (n[None, :] - prefix), mask=own, other=0)
            visible = n_mask[None, :] & ((n[None, :] < prefix) | (bit != 0))
        elif ROWS == 1:
            visible = n_mask[None, :]
        else:
            visible = n_mask[None, :] & (n[None, :] < limit[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that sees nothing in this tile yet keeps m at -inf: shift by 0 there instead of NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(vc_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    out_mask = g_mask[:, None] & d_mask[None, :]
    # An empty piece (past the end of its sequence, or of a row's view) leaves l_i == 0: write zeros and
    # a -inf weight.
    o = acc * (v_scale / tl.maximum(l_i, 1e-30))[:, None]
    if SINGLE:
        tl.store(out_ptr + rows[:, None] * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        mid = (rows * num_heads + heads) * num_splits + split        # mid_o [T, H, S, D], mid_lse [T, H, S]
        tl.store(mid_o_ptr + mid[:, None] * HEAD_DIM + d[None, :], o, mask=out_mask)
        lse = tl.where(l_i > 0, m_i + tl.math.log2(tl.maximum(l_i, 1e-30)), float("-inf"))
        tl.store(mid_lse_ptr + mid, lse, mask=g_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(mid_o_ptr, mid_lse_ptr, out_ptr, stride_ob, stride_oh, num_splits,
                          HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    row = b * tl.num_programs(1) + h
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < num_splits
    lse = tl.load(mid_lse_ptr + row * num_splits + s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)      # an empty sequence (graph padding) yields zeros, not NaN
    w = tl.math.exp2(lse - m)
    o = tl.load(mid_o_ptr + (row * num_splits + s)[:, None] * HEAD_DIM + d[None, :],
                mask=s_mask[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    o = tl.sum(o * w[:, None], 0) / tl.maximum(tl.sum(w, 0), 1e-30)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def paged_decode_two_launches(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                 num_splits: int | None = None, scratch=None,
                 block_n: int | None = None, num_warps: int = 4, num_stages: int = 2,
                 rows_per_seq: int = 1, tree_mask: torch.Tensor | None = None,
                 k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """q: [B * rows_per_seq, num_heads, head_dim]: each sequence's last rows_per_seq positions, in order
    (one for a plain decode; a speculative verify's last token and drafts); seq_lens: [B] context length
    including them. Row j of a sequence sees its prefix and, causally, rows 0..j, or with tree_mask
    [B * rows, >= rows] the rows its mask row allows.

    An FP8 cache is widened to q's dtype as it is read; its per-tensor k_scale folds into the softmax scale
    and v_scale into the output. Other caches ignore both."""
    tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and q.stride(2) == 1
    group = num_heads // num_kv_heads
    assert tokens % rows_per_seq == 0 and rows_per_seq * group <= MAX_TILE_ROWS, \
        f"paged_decode: {tokens} rows are not {rows_per_seq} per sequence, or too many for one tile"
    batch = tokens // rows_per_seq
    if tree_mask is not None:
        assert tree_mask.shape[0] == tokens and tree_mask.shape[1] >= rows_per_seq, "tree_mask: [T, >= rows_per_seq]"
        tree = tree_mask.view(torch.uint8) if tree_mask.dtype == torch.bool else tree_mask
    else:
        tree = seq_lens   # never read
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    if num_splits is None:
        num_splits = baseline_num_splits(batch, num_kv_heads)
    if block_n is None:
        block_n = (32 if num_splits >= 32 else 64) if q.is_cuda else 16     # the tiles of its day
    block_g = max(16, triton.next_power_of_2(rows_per_seq * group))   # the tile's query rows
    if q.is_cuda:
        # float32 or head_dim 256 can ask for more shared memory than the chip has: fewer stages, shorter tiles.
        cfg = decode_config(block_g, block_n, triton.next_power_of_2(head_dim), q.element_size(),
                            smem_limit_for(q), num_warps, num_stages)
        block_n, num_warps, num_stages = cfg.block_n, cfg.num_warps, cfg.num_stages
    mid_o, mid_lse, _ = (scratch or _SCRATCH).get(tokens * num_heads * num_splits, head_dim, 0, q.device)
    if k_cache.dtype != torch.float8_e4m3fn:
        k_scale = v_scale = 1.0
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, tree, out, mid_o, mid_lse,
        scale * k_scale * 1.4426950408889634, v_scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), tree.stride(0) if tree_mask is not None else 0, out.stride(0), out.stride(1),
        num_splits, GROUP=group, ROWS=rows_per_seq, BLOCK_G=block_g,
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_N=block_n, BLOCK_SIZE=block_size,
        SINGLE=num_splits == 1, MIN_SPLIT=block_n, HAS_TREE=tree_mask is not None,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages,
    )
    if num_splits > 1:
        _decode_reduce_kernel[(tokens, num_heads)](
            mid_o, mid_lse, out, out.stride(0), out.stride(1), num_splits,
            HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
            BLOCK_S=triton.next_power_of_2(num_splits), num_warps=4,
        )
    return out
