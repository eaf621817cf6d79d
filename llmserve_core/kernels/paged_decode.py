"""Decode attention over the paged KV cache: a few query rows per sequence, split-KV (flash-decoding),
in one launch.

A plain decode brings one query row per sequence; a speculative verify (or a padded draft catch-up)
brings the same small number of rows for every sequence, its last positions, seen causally or through a
tree mask. One program covers all of a sequence's rows for one KV head, so verifying 1 + gamma rows
reads the KV once, as a decode does, instead of going through the prefill kernel's wide tiles.

The grid has `num_splits` programs per (sequence, KV head); the program holds every query head of its KV
group, so each K/V tile is read from memory once for the whole group. Each sequence's context is cut into
pieces of at least `min_split` keys, sized from its own length at run time, so a short context uses few
pieces (one program per (sequence, KV head) below min_split keys) and the programs past the last piece
do nothing. With one piece the program writes the output itself; with several, each parks its partial
output and log-sum-exp, and the piece that arrives last (an atomic counter per (sequence, KV head),
re-armed by that program, so a captured CUDA graph replays with the counters at zero) merges them.
A separate reduction launch cost more than the merge at decode sizes: it is latency, not work.

`num_splits` depends only on the batch size (never on the lengths on the device), so the launch shape is
fixed for a CUDA-graph bucket and nothing here reads a tensor back to the host.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmserve_core.kernels.attention_tile import attend_tile
from llmserve_core.kernels.fp8_format import FP8_MAX, MIN_SCALE, RowQuant, empty_quantized, multiplies_fp8_cache_in_f16
from llmserve_core.kernels.fp8_quant import quantize_pieces
from llmserve_core.kernels.f16_query import f16_query
from llmserve_core.kernels.pdl import pdl_launch, pdl_wait_and_release
from llmserve_core.kernels.tiling import decode_config, smem_limit_for

NUM_SMS = 132            # H200; only used to size the grid, correctness never depends on it
MAX_SPLITS = 128
SMALL_BATCH_SPLITS = 32   # the most pieces choose_num_splits picks (its docstring says why)
# Elements of the partial outputs the merging program loads at once ([rows, pieces, head_dim] floats).
MERGE_TILE = 8192
# Keys a decode tile holds, and so the fewest a piece takes: against 32, 64 halves a short context's pieces
# (the merge reads half the partials, and the tile read before the PDL wait is the whole piece), and whole
# steps ran faster at 512 and 4,096 keys (benchmarks/results/LOG.md).
DECODE_BLOCK_N = 64
# One-piece decodes over an FP8 cache: 128 keys (the bytes of a 64-key bf16 tile) over 2 warps and 2 stages,
# fastest at batch 64 and even at 256; split decodes keep 64, whose pieces are shorter
# (benchmarks/results/fp8_kv_decode_h200.md).
FP8_DECODE_BLOCK_N = 128


# The split count, piece length, block-table width and tree width vary with the batch; none is worth a
# compiled variant per value class (Triton specializes ints that are 1 or divisible by 16).
# (A quantized output's row strides and padded row count vary with the batch too.)
@triton.jit(do_not_specialize=["stride_bt", "stride_tree", "num_splits", "min_split", "stride_qo", "stride_qsr",
                               "stride_qsp", "padded_rows"])
def _decode_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, seq_lens_ptr, tree_ptr, out_ptr, mid_o_ptr, mid_lse_ptr,
                   count_ptr, qo_ptr, qs_ptr, sm_scale_log2, v_scale,
                   stride_qb, stride_qh, stride_cb, stride_cs, stride_ch, stride_bt, stride_tree,
                   stride_ob, stride_oh, stride_qo, stride_qsr, stride_qsp, padded_rows, num_splits, min_split,
                   GROUP: tl.constexpr, ROWS: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   SPLIT: tl.constexpr, HAS_TREE: tl.constexpr, BLOCK_R: tl.constexpr, CHUNK_S: tl.constexpr,
                   PRECISION: tl.constexpr, DOT_F16: tl.constexpr, PDL: tl.constexpr, QUANT: tl.constexpr,
                   FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, KV_HEADS: tl.constexpr):
    """QUANT: the output rows leave as e4m3 codes at qo_ptr and one float32 scale per (row, head) at qs_ptr
    (_store_rows), instead of out_ptr's dtype at out_ptr.

    The grid is (sequences x KV heads, pieces), KV heads first: the programs that run together read all
    heads of the same cache rows. (Sequences first, they read one head of every sequence, 256 of each 2,048
    bytes a token, and ran slower at batch 256: benchmarks/results/LOG.md.)"""
    b = tl.program_id(0) // KV_HEADS
    kvh = tl.program_id(0) % KV_HEADS
    split = tl.program_id(1)
    num_kv_heads = KV_HEADS
    last_seq = b == tl.num_programs(0) // KV_HEADS - 1
    num_heads = num_kv_heads * GROUP

    seq_len = tl.load(seq_lens_ptr + b)
    split_len = tl.maximum(tl.cdiv(seq_len, num_splits), min_split)
    split_len = tl.cdiv(split_len, BLOCK_N) * BLOCK_N
    # Pieces that hold keys; an empty sequence (graph padding) still has one, which writes zeros.
    active = tl.maximum(tl.cdiv(seq_len, split_len), 1)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    prefix = seq_len - ROWS          # positions every query row sees; this call's rows come after
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    if SPLIT:
        # A split decode's piece is a tile or a few, so the memory latency of its first tile is most of its
        # time: read the prefix part of that tile before the PDL wait, overlapping the kernel before (which
        # writes q and this call's rows). Read there only what no kernel writes just before this one: the
        # lengths and block tables (the step's input copy, or kernels further back) and the prefix K/V
        # (earlier forwards). A kernel launches only once the one before has passed its own wait, so all
        # work two kernels back is complete. (One-piece decodes stream long pipelined loops: there a peeled
        # tile held in registers slowed batch 64 by 7%.)
        n_first = start + tl.arange(0, BLOCK_N)
        first_mask = (n_first < end) & (split < active)
        first_phys = tl.load(bt_row + n_first // BLOCK_SIZE, mask=first_mask, other=0).to(tl.int64)
        first_off = first_phys * stride_cb + (n_first % BLOCK_SIZE) * stride_cs + kvh * stride_ch
        early = (first_mask & (n_first < prefix))[:, None] & d_mask[None, :]
        k_first = tl.load(kc_ptr + first_off[:, None] + d[None, :], mask=early, other=0.0)
        v_first = tl.load(vc_ptr + first_off[:, None] + d[None, :], mask=early, other=0.0)
    pdl_wait_and_release(PDL)
    if split < active:
        # Tile row i is query row j = i // GROUP of this sequence (its last ROWS positions), head i % GROUP
        # of the KV group: every query row of the sequence shares each K/V tile read.
        i = tl.arange(0, BLOCK_G)
        j = i // GROUP
        heads = kvh * GROUP + i % GROUP
        rows = b * ROWS + j
        g_mask = i < ROWS * GROUP
        q = tl.load(q_ptr + rows[:, None] * stride_qb + heads[:, None] * stride_qh + d[None, :],
                    mask=g_mask[:, None] & d_mask[None, :], other=0.0)
        if DOT_F16:     # an FP8 cache: both dots in float16 (fp8_format.multiplies_fp8_cache_in_f16)
            q, sm_scale_log2 = f16_query(q, sm_scale_log2)
        limit = prefix + j + 1           # causal: query row j sits at position prefix + j

        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        loop_start = start
        if SPLIT:
            # The first tile's own rows (this call's, written by the kernel before) are read now. (Asked for
            # with q instead, the tile's registers were held longer and batch 16 stepped slower:
            # benchmarks/results/LOG.md.)
            late = (first_mask & (n_first >= prefix))[:, None] & d_mask[None, :]
            k_own = tl.load(kc_ptr + first_off[:, None] + d[None, :], mask=late, other=0.0)
            v_own = tl.load(vc_ptr + first_off[:, None] + d[None, :], mask=late, other=0.0)
            m_i, l_i, acc = attend_tile(q, tl.where(late, k_own, k_first).to(q.dtype),
                                        tl.where(late, v_own, v_first).to(q.dtype), n_first, first_mask, rows,
                                        g_mask, prefix, limit, tree_ptr, stride_tree, sm_scale_log2, m_i, l_i, acc,
                                        ROWS > 1, HAS_TREE, PRECISION, True)
            loop_start = start + BLOCK_N
        for n0 in range(loop_start, end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            n_mask = n < end
            phys = tl.load(bt_row + n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
            off = phys * stride_cb + (n % BLOCK_SIZE) * stride_cs + kvh * stride_ch
            kv_mask = n_mask[:, None] & d_mask[None, :]
            k = tl.load(kc_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
            v = tl.load(vc_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
            m_i, l_i, acc = attend_tile(q, k, v, n, n_mask, rows, g_mask, prefix, limit, tree_ptr, stride_tree,
                                        sm_scale_log2, m_i, l_i, acc, ROWS > 1, HAS_TREE, PRECISION, True)

        out_mask = g_mask[:, None] & d_mask[None, :]
        # A piece with nothing visible to a row (past the end of its view) leaves l_i == 0 there: zeros,
        # and a -inf weight in the merge.
        o = acc * (v_scale / tl.maximum(l_i, 1e-30))[:, None]
        if SPLIT:
            if active == 1:
                _store_rows(o, rows, heads, g_mask, d, d_mask, last_seq, out_ptr, stride_ob, stride_oh, qo_ptr,
                            qs_ptr, stride_qo, stride_qsr, stride_qsp, padded_rows, HEAD_DIM, BLOCK_G, BLOCK_D, QUANT,
                            FP8_MAX, MIN_SCALE)
            else:
                mid = (rows * num_heads + heads) * num_splits + split        # mid_o [T, H, S, D], mid_lse [T, H, S]
                tl.store(mid_o_ptr + mid[:, None] * HEAD_DIM + d[None, :], o, mask=out_mask)
                lse = tl.where(l_i > 0, m_i + tl.math.log2(tl.maximum(l_i, 1e-30)), float("-inf"))
                tl.store(mid_lse_ptr + mid, lse, mask=g_mask)
                # Every thread's partial stores come before the counter's release (acq_rel) increment.
                tl.debug_barrier()
                counter = count_ptr + b * num_kv_heads + kvh
                if tl.atomic_add(counter, 1) == active - 1:
                    # (the merge's tile holds the rows unpadded: BLOCK_R of them, not BLOCK_G)
                    merged, m_rows, m_heads, m_mask = _merge_pieces(mid_o_ptr, mid_lse_ptr, b, kvh, num_heads,
                                                                    num_splits, active, GROUP, ROWS, HEAD_DIM,
                                                                    BLOCK_D, BLOCK_R, CHUNK_S)
                    _store_rows(merged, m_rows, m_heads, m_mask, d, d_mask, last_seq, out_ptr, stride_ob,
                                stride_oh, qo_ptr, qs_ptr, stride_qo, stride_qsr, stride_qsp, padded_rows, HEAD_DIM,
                                BLOCK_R, BLOCK_D, QUANT, FP8_MAX, MIN_SCALE)
                    tl.atomic_xchg(counter, 0)
        else:
            _store_rows(o, rows, heads, g_mask, d, d_mask, last_seq, out_ptr, stride_ob, stride_oh, qo_ptr,
                        qs_ptr, stride_qo, stride_qsr, stride_qsp, padded_rows, HEAD_DIM, BLOCK_G, BLOCK_D, QUANT,
                        FP8_MAX, MIN_SCALE)


@triton.jit
def _store_rows(o, rows, heads, r_mask, d, d_mask, last_seq, out_ptr, stride_ob, stride_oh, qo_ptr, qs_ptr,
                stride_qo, stride_qsr, stride_qsp, padded_rows, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr,
                BLOCK_D: tl.constexpr, QUANT: tl.constexpr, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr):
    """Output rows o [R, D] (tile row r: query row rows[r], head heads[r]) in out_ptr's dtype, or with QUANT
    as o_proj's W8A8 GEMM reads them: each (row, head) one piece of fp8_quant's arithmetic on its
    model-dtype values (a head is the GEMM's 1 x head_dim scale group), so the codes and scales are those
    quantize_activation makes of the unquantized output. The last sequence's programs (last_seq) also write the
    rows that pad the quantized output (zeros at the smallest scale)."""
    mask = r_mask[:, None] & d_mask[None, :]
    y = o.to(out_ptr.dtype.element_ty)
    if QUANT:
        y = tl.where(mask, y, 0.0)
        codes, scale = quantize_pieces(tl.reshape(y, (BLOCK_R * BLOCK_D,)), BLOCK_R * BLOCK_D, BLOCK_D, FP8_MAX,
                                       MIN_SCALE)
        codes = tl.reshape(codes, (BLOCK_R, BLOCK_D)).to(qo_ptr.dtype.element_ty)
        tl.store(qo_ptr + rows[:, None].to(tl.int64) * stride_qo + heads[:, None] * HEAD_DIM + d[None, :], codes,
                 mask=mask)
        tl.store(qs_ptr + rows.to(tl.int64) * stride_qsr + heads * stride_qsp, scale, mask=r_mask)
        if last_seq:
            zeros = tl.zeros([BLOCK_R, BLOCK_D], tl.float32).to(qo_ptr.dtype.element_ty)
            floor = tl.full([BLOCK_R], MIN_SCALE, tl.float32)
            n_rows = tl.max(tl.where(r_mask, rows, 0), 0) + 1      # the last sequence's last row, plus one
            for row in range(n_rows, padded_rows):        # (a few rows: the offsets fit 32 bits)
                tl.store(qo_ptr + row * stride_qo + heads[:, None] * HEAD_DIM + d[None, :], zeros, mask=mask)
                tl.store(qs_ptr + row * stride_qsr + heads * stride_qsp, floor, mask=r_mask)
    else:
        tl.store(out_ptr + rows[:, None] * stride_ob + heads[:, None] * stride_oh + d[None, :], y, mask=mask)


@triton.jit
def _merge_pieces(mid_o_ptr, mid_lse_ptr, b, kvh, num_heads, num_splits, active, GROUP: tl.constexpr,
                  ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
                  CHUNK_S: tl.constexpr):
    """The last piece of (sequence b, KV head kvh): merge every piece's partial rows by their log-sum-exp
    (online, CHUNK_S pieces at a time): (output rows [BLOCK_R, BLOCK_D], their query rows, heads, mask).
    Partials are read from L2 (.cg): other programs wrote them."""
    r = tl.arange(0, BLOCK_R)
    r_mask = r < ROWS * GROUP
    rows = b * ROWS + r // GROUP
    heads = kvh * GROUP + r % GROUP
    base = (rows * num_heads + heads) * num_splits
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for c in range(0, active, CHUNK_S):
        s = c + tl.arange(0, CHUNK_S)
        rs_mask = r_mask[:, None] & (s[None, :] < active)
        piece = base[:, None] + s[None, :]                                       # [R, C]
        # Both asked for before either is used: o after the max over lse waited behind its barriers.
        lse = tl.load(mid_lse_ptr + piece, mask=rs_mask, other=float("-inf"), cache_modifier=".cg")
        o = tl.load(mid_o_ptr + piece[:, :, None] * HEAD_DIM + d[None, None, :],
                    mask=rs_mask[:, :, None] & d_mask[None, None, :], other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, tl.max(lse, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m - m_safe)
        w = tl.math.exp2(lse - m_safe[:, None])
        acc = acc * alpha[:, None] + tl.sum(o * w[:, :, None], 1)
        total = total * alpha + tl.sum(w, 1)
        m = m_new
    return acc / tl.maximum(total, 1e-30)[:, None], rows, heads, r_mask


def choose_num_splits(batch_size: int, num_kv_heads: int, num_sms: int = NUM_SMS) -> int:
    """Split only while batch x kv_heads leaves SMs idle; then aim at about four programs per SM, in at
    most SMALL_BATCH_SPLITS pieces.

    At batch 64 one piece beat two and four; the pieces merge inside the same launch, which makes many small
    pieces cost more than a separate reduction did, so a batch of one takes 32, not 128
    (benchmarks/results/kernels_h200_run1.md, decode_layer_h200.md).
    """
    programs = batch_size * num_kv_heads
    if programs >= 2 * num_sms:
        return 1
    return min(SMALL_BATCH_SPLITS, triton.next_power_of_2(triton.cdiv(4 * num_sms, max(1, programs))))


def verify_tiles(rows_per_seq: int, block_g: int, num_splits: int) -> tuple[int, int, int]:
    """(num_splits, block_n, num_warps) for a few query rows per sequence (a verify, a padded catch-up, a
    tree). Each piece's merge grows with the rows, so these want fewer, longer pieces than a decode; and a
    128-row tile (a 32-node tree x a KV group of 4) holds a 128 x head_dim float32 accumulator, 128
    registers a thread over four warps, which spills. These beat the decode tiles at every batch and row
    count measured at Qwen3-8B's heads (benchmarks/results/verify_kernels_h200.md)."""
    if num_splits >= 16:                     # a batch of one or two: eight warps over 64-key tiles
        return num_splits, 64, 8
    warps = 8 if block_g >= 128 else 4
    if num_splits > 1:                       # some dozens of sequences: a quarter (8+ rows) or half the pieces
        return max(1, num_splits // (4 if rows_per_seq >= 8 else 2)), 64, warps
    return 1, 32 if block_g >= 64 else 64, warps


class DecodeScratch:
    """Partial outputs and arrival counters of split decodes, allocated once and only grown, so CUDA graphs
    keep valid pointers. The counters start at zero and the merging program re-arms its own."""

    def __init__(self):
        self.mid_o: torch.Tensor | None = None
        self.mid_lse: torch.Tensor | None = None
        self.counts: torch.Tensor | None = None
        self._retired: list[torch.Tensor] = []   # old buffers a captured graph may still point at

    def get(self, pieces: int, head_dim: int, counters: int, device) -> tuple[torch.Tensor, ...]:
        device = torch.device(device)
        if self.mid_o is None or self.mid_o.shape[0] < pieces or self.mid_o.shape[1] != head_dim \
                or self.mid_o.device != device:
            if self.mid_o is not None:
                self._retired += [self.mid_o, self.mid_lse]
            pieces = max(pieces, 4096)
            self.mid_o = torch.empty(pieces, head_dim, dtype=torch.float32, device=device)
            self.mid_lse = torch.empty(pieces, dtype=torch.float32, device=device)
        if self.counts is None or self.counts.shape[0] < counters or self.counts.device != device:
            if self.counts is not None:
                self._retired.append(self.counts)
            self.counts = torch.zeros(max(counters, 4096), dtype=torch.int32, device=device)
        return self.mid_o, self.mid_lse, self.counts


_default_scratch = DecodeScratch()


# Query rows per sequence x heads per KV group that one program's tile holds at most.
MAX_TILE_ROWS = 128


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                 num_splits: int | None = None, scratch: DecodeScratch | None = None,
                 block_n: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                 rows_per_seq: int = 1, tree_mask: torch.Tensor | None = None,
                 k_scale: float = 1.0, v_scale: float = 1.0, min_split: int | None = None,
                 pdl: bool = False, quant: RowQuant | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """q: [B * rows_per_seq, num_heads, head_dim]: each sequence's last rows_per_seq positions, in order
    (one for a plain decode; a speculative verify's last token and drafts); seq_lens: [B] context length
    including them. Row j of a sequence sees its prefix and, causally, rows 0..j, or with tree_mask
    [B * rows, >= rows] the rows its mask row allows.

    num_splits: programs per (sequence, KV head), by default from the batch size; min_split: the fewest
    keys a piece takes (default one K/V tile), so shorter contexts run in fewer pieces.
    An FP8 cache is widened as it is read (to float16 for a 16-bit q: `multiplies_fp8_cache_in_f16`); its
    per-tensor k_scale folds into the softmax scale and v_scale into the output. Other caches ignore both.

    pdl: launch under PDL. A split decode then reads the lengths, the block tables and its first tile's
    prefix K/V (positions before this call's rows) before the wait on the kernel just before, so those
    must come from kernels further back; q and the rows' own K/V may come from the kernel just before.

    quant (one row per sequence, quant.group == head_dim): return the output [B, num_heads * head_dim] as an
    FP8 GEMM asks for it (fp8_format.empty_quantized's (e4m3 codes, scales), a head a scale group), the
    codes and scales quantize_activation would make of the plain output, instead of the plain output."""
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
    if quant is not None:
        assert rows_per_seq == 1 and quant.group == head_dim and out is None, \
            f"paged_decode: quantized rows are a decode's, one scale a head ({head_dim}), not {quant}"
        codes, scales = empty_quantized(tokens, num_heads * head_dim, quant, q.device)
        out = q                       # never written: its dtype is what the codes quantize, the model's
    else:
        out = torch.empty_like(q) if out is None else out
        codes = scales = q            # never written
    if batch == 0:
        return out if quant is None else (codes, scales)
    block_g = max(16, triton.next_power_of_2(rows_per_seq * group))   # the tile's query rows
    splits, tile_n, warps = choose_num_splits(batch, num_kv_heads), None, 4
    if rows_per_seq > 1:
        splits, tile_n, warps = verify_tiles(rows_per_seq, block_g, splits)
    num_splits = num_splits if num_splits is not None else splits
    one_piece = num_splits == 1 and rows_per_seq == 1
    fp8_tiles = one_piece and k_cache.dtype == torch.float8_e4m3fn
    if block_n is None:
        block_n = (tile_n or (FP8_DECODE_BLOCK_N if fp8_tiles else DECODE_BLOCK_N)) if q.is_cuda else 16
    num_warps = num_warps if num_warps is not None else (2 if fp8_tiles else warps)
    if num_stages is None:
        # One piece per (sequence, KV head), 64-key tiles: a third K/V tile in flight read faster at batch 64
        # and 256 (benchmarks/results/decode_sweep_h200_f3f7a22.md). Split decodes keep 2, and so do FP8
        # caches' 128-key tiles.
        num_stages = 3 if one_piece and not fp8_tiles else 2
    if q.is_cuda:
        # float32 or head_dim 256 can ask for more shared memory than the chip has: fewer stages, shorter tiles.
        cfg = decode_config(block_g, block_n, triton.next_power_of_2(head_dim), q.element_size(),
                            smem_limit_for(q), num_warps, num_stages)
        block_n, num_warps, num_stages = cfg.block_n, cfg.num_warps, cfg.num_stages
    scratch = scratch or _default_scratch
    mid_o, mid_lse, counts = scratch.get(tokens * num_heads * num_splits, head_dim, batch * num_kv_heads, q.device)
    if k_cache.dtype != torch.float8_e4m3fn:
        k_scale = v_scale = 1.0
    block_d = triton.next_power_of_2(head_dim)
    block_r = triton.next_power_of_2(rows_per_seq * group)      # the merge's rows: no padding to 16
    _decode_kernel[(batch * num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, tree, out, mid_o, mid_lse, counts, codes, scales,
        scale * k_scale * 1.4426950408889634, v_scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), tree.stride(0) if tree_mask is not None else 0,
        out.stride(0), out.stride(1), codes.stride(0), scales.stride(0), scales.stride(1), codes.shape[0],
        num_splits, max(block_n, min_split or 0), GROUP=group, ROWS=rows_per_seq, BLOCK_G=block_g,
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=block_n, BLOCK_SIZE=block_size,
        SPLIT=num_splits > 1, HAS_TREE=tree_mask is not None, BLOCK_R=block_r,
        CHUNK_S=max(1, MERGE_TILE // (block_r * block_d)),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        DOT_F16=multiplies_fp8_cache_in_f16(q.dtype, k_cache.dtype),
        num_warps=num_warps, num_stages=num_stages, PDL=pdl, QUANT=quant is not None, FP8_MAX=FP8_MAX,
        MIN_SCALE=MIN_SCALE, KV_HEADS=num_kv_heads, **pdl_launch(pdl),
    )
    return out if quant is None else (codes, scales)
