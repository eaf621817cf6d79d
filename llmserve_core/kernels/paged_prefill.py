"""Prefill / extend attention over the paged KV cache (varlen, causal, GQA), with an optional tree mask.

Sequence i owns query rows query_start_loc[i]:query_start_loc[i+1], its last query_len positions; the
first seq_len - query_len positions are a cached prefix every query sees. One program handles BLOCK_M
query rows of one head and walks K/V tiles through the block table in two phases: tiles every row of the
program sees in full (no mask, the bulk of the work), then the tiles on the diagonal, masked causally or,
with a tree mask, by the tree among the step's own tokens.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmserve_core.kernels import tuned
from llmserve_core.kernels.attention_tile import attend_tile
from llmserve_core.kernels.fp8_format import multiplies_fp8_cache_in_f16
from llmserve_core.kernels.f16_query import f16_query
from llmserve_core.kernels.tiling import TileConfig, first_fitting

# Tiles best first (the first that fits the device's shared memory is taken, tiling.first_fitting): 128 x 128
# over 8 warps and 2 stages led on long extends, and short queries (tree verify, small chunks) keep 64-row
# tiles so few rows are padding (results/kernels_h200_run1.md); the rest are for wider elements and heads.
LONG_TILES = [TileConfig(128, 128, 8, 2), TileConfig(128, 64, 8, 2), TileConfig(64, 64, 4, 2), TileConfig(64, 32, 4, 2)]
SHORT_TILES = [TileConfig(64, 64, 4, 3), TileConfig(64, 64, 4, 2), TileConfig(64, 32, 4, 2)]
SHORT_QUERY = 64       # the most query rows a sequence brings for the short tiles (any tree takes them)


# Triton compiles a variant per int argument that is 1 or divisible by 16. These vary with each step's
# shape (tile count, block-table width, tree width) but do not touch the inner loop: one variant serves all,
# so nothing compiles after start-up whatever the lengths.
@triton.jit(do_not_specialize=["num_m_tiles", "stride_bt", "stride_tree"])
def _prefill_kernel(q_ptr, kc_ptr, vc_ptr, out_ptr, bt_ptr, qsl_ptr, seq_lens_ptr, tree_ptr,
                    sm_scale_log2, v_scale, num_m_tiles,
                    stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_bt,
                    stride_tree,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    HAS_TREE: tl.constexpr, PRECISION: tl.constexpr, DOT_F16: tl.constexpr):
    # The longest (last) query tiles go first so the tail of the grid is short work.
    mt = num_m_tiles - 1 - tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    kvh = h // GROUP

    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + b)
    ctx_len = seq_len - q_len
    m_lo = mt * BLOCK_M
    # An empty tile (past this sequence's queries) runs no loop iteration and stores nothing.
    live = m_lo < q_len

    m = m_lo + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    m_mask = m < q_len
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + (q_start + m)[:, None].to(tl.int64) * stride_qt + h * stride_qh + d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    if DOT_F16:     # an FP8 cache: both dots in float16 (fp8_format.multiplies_fp8_cache_in_f16)
        q, sm_scale_log2 = f16_query(q, sm_scale_log2)

    if HAS_TREE:
        full_end = ctx_len
        diag_end = seq_len
    else:
        full_end = ctx_len + m_lo
        diag_end = tl.minimum(seq_len, ctx_len + m_lo + BLOCK_M)
    full_end = tl.where(live, full_end // BLOCK_N * BLOCK_N, 0)
    diag_end = tl.where(live, diag_end, 0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    kv_head = kvh * stride_ch
    rows = (q_start + m).to(tl.int64)       # the query rows' rows of the tree mask
    limit = ctx_len + m + 1                 # causal: the keys row m sees end here

    for n0 in range(0, full_end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        phys = tl.load(bt_row + n // BLOCK_SIZE).to(tl.int64)
        off = phys * stride_cb + (n % BLOCK_SIZE) * stride_cs + kv_head
        k = tl.load(kc_ptr + off[:, None] + d[None, :], mask=d_mask[None, :], other=0.0).to(q.dtype)
        v = tl.load(vc_ptr + off[:, None] + d[None, :], mask=d_mask[None, :], other=0.0).to(q.dtype)
        m_i, l_i, acc = attend_tile(q, k, v, n, m_mask, rows, m_mask, ctx_len, limit, tree_ptr, stride_tree,
                                    sm_scale_log2, m_i, l_i, acc, True, HAS_TREE, PRECISION, False)

    for n0 in range(full_end, diag_end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < seq_len
        phys = tl.load(bt_row + n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        off = phys * stride_cb + (n % BLOCK_SIZE) * stride_cs + kv_head
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(kc_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        v = tl.load(vc_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        # Causal: row m sits at position ctx_len + m; a tree mask's rows are the step's own tokens.
        m_i, l_i, acc = attend_tile(q, k, v, n, n_mask, rows, m_mask, ctx_len, limit, tree_ptr, stride_tree,
                                    sm_scale_log2, m_i, l_i, acc, True, HAS_TREE, PRECISION, True)

    o = acc * (v_scale / tl.maximum(l_i, 1e-30))[:, None]
    tl.store(out_ptr + (q_start + m)[:, None].to(tl.int64) * stride_ot + h * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


@tuned.family("paged_prefill", ("head_dim", "dtype", "query"))
def _heuristic(device: tuned.Device, head_dim: int, dtype: str, query: str) -> dict:
    tile = first_fitting(SHORT_TILES if query == "short" else LONG_TILES, triton.next_power_of_2(head_dim),
                         tuned.key_dtype(dtype).itemsize, device.smem)
    return dict(BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, num_warps=tile.num_warps, num_stages=tile.num_stages)


def prefill_tiles(device: tuned.Device, head_dim: int, dtype: torch.dtype, short: bool) -> TileConfig:
    """The tile for queries of this head size and dtype on this device: its table's, else the first of the
    short or long tiles that fits its shared memory."""
    cfg = tuned.lookup("paged_prefill", device, head_dim=head_dim, dtype=tuned.dtype_key(dtype),
                       query="short" if short else "long")
    return TileConfig(cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["num_warps"], cfg["num_stages"])


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, query_start_loc: torch.Tensor,
                  seq_lens: torch.Tensor, block_tables: torch.Tensor, max_query_len: int, scale: float,
                  tree_mask: torch.Tensor | None = None, out: torch.Tensor | None = None,
                  block_m: int | None = None, block_n: int | None = None,
                  num_warps: int | None = None, num_stages: int | None = None,
                  k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """q: [T, num_heads, head_dim] packed by query_start_loc; K/V of every position already in the cache.

    An FP8 cache is widened as it is read (to float16 for a 16-bit q: `multiplies_fp8_cache_in_f16`), its
    k_scale folded into the softmax scale and its v_scale into the output; other caches ignore both."""
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and q.stride(2) == 1
    if out is None:
        out = torch.empty_like(q)
    batch = seq_lens.shape[0]
    if num_tokens == 0 or batch == 0 or max_query_len == 0:
        return out
    if q.is_cuda:
        cfg = prefill_tiles(tuned.device_spec(q.device), head_dim, q.dtype,
                            short=tree_mask is not None or max_query_len <= SHORT_QUERY)
        block_m, block_n = block_m or cfg.block_m, block_n or cfg.block_n
        num_warps, num_stages = num_warps or cfg.num_warps, num_stages or cfg.num_stages
    else:
        block_m, block_n, num_warps, num_stages = block_m or 16, block_n or 16, 4, 1
    if tree_mask is not None:
        assert tree_mask.shape[0] == num_tokens and tree_mask.shape[1] >= max_query_len, \
            "tree_mask: must be [num_tokens, max_query_len]"
        tree = tree_mask.view(torch.uint8) if tree_mask.dtype == torch.bool else tree_mask
    else:
        tree = q  # never read
    num_m_tiles = triton.cdiv(max_query_len, block_m)
    if k_cache.dtype != torch.float8_e4m3fn:
        k_scale = v_scale = 1.0
    _prefill_kernel[(num_m_tiles, batch, num_heads)](
        q, k_cache, v_cache, out, block_tables, query_start_loc, seq_lens, tree,
        scale * k_scale * 1.4426950408889634, v_scale, num_m_tiles,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        tree.stride(0) if tree_mask is not None else 0,
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_SIZE=block_size, HAS_TREE=tree_mask is not None,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        DOT_F16=multiplies_fp8_cache_in_f16(q.dtype, k_cache.dtype),
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
