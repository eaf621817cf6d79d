"""The mixture-of-experts router's top-k, and the token-expert pairs sorted by expert into row blocks.

`route` is one launch: the softmax, the k picks and the renormalisation of a batch's rows. As torch ops it
would be five (softmax, topk, sum, divide, the id cast), each a few microseconds of launch inside a CUDA
graph: at batch-1 decode, 48 layers x 4 launches more would cost about a quarter of the step's floor.

`align` lays the pairs out for the grouped GEMM (kernels/moe_gemm.py): pair p = t * k + j (token t's j-th
expert) goes, in pair order within each expert, into its expert's stretch of `sorted_pairs`, every stretch
padded with the sentinel P (no pair) to whole BLOCK_M-row blocks, and `block_expert` names each block's
expert (-1 past the used blocks). Three launches, no host sync, shapes fixed by T alone (so CUDA graphs
capture it): per chunk of pairs a count per expert; one program turns the counts into each chunk's first
slot per expert and each expert's stretch; per chunk again, every pair's slot. The layout is exactly a
stable sort's, so it is the same on every run.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

CHUNK = 128          # pairs per program of the count and place kernels
CHUNK_TILE = 16      # chunks per step of the scan
BLOCK_TILE = 64      # row blocks per step of the scan's block -> expert pass


@triton.jit(do_not_specialize=["T"])
def _route_kernel(logits_ptr, w_ptr, ids_ptr, valid_ptr, T, E, stride_l, first, count, TOP_K: tl.constexpr,
                  RENORMALIZE: tl.constexpr, MASK_ROWS: tl.constexpr, LOCAL: tl.constexpr, BLOCK_T: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.arange(0, BLOCK_E)
    live = (t < T)[:, None] & (e < E)[None, :]
    x = tl.load(logits_ptr + t[:, None].to(tl.int64) * stride_l + e[None, :], mask=live, other=0.0).to(tl.float32)
    x = tl.where((e < E)[None, :], x, float("-inf"))     # (rows past T stay finite: no NaN in their max)
    ex = tl.where((e < E)[None, :], tl.exp(x - tl.max(x, 1)[:, None]), 0.0)
    # Padding columns sit at -1, below every probability; a picked one drops to -2, below them.
    p = tl.where(live, ex / tl.sum(ex, 1)[:, None], -1.0)
    j = tl.arange(0, BLOCK_K)
    top_w = tl.zeros([BLOCK_T, BLOCK_K], tl.float32)
    top_i = tl.zeros([BLOCK_T, BLOCK_K], tl.int32)
    for s in tl.static_range(TOP_K):
        best = tl.max(p, 1)
        # The lowest index among the largest unpicked; a row holding NaN may have none (the max skips NaN, or
        # is NaN): then its lowest unpicked index, as a stable sort puts NaN first.
        pick = tl.min(tl.where((p == best[:, None]) & (p > -2.0), e[None, :], BLOCK_E), 1)
        unpicked = tl.min(tl.where((p != -2.0) & (e < E)[None, :], e[None, :], BLOCK_E), 1)
        pick = tl.where(pick < E, pick, unpicked)
        chosen = e[None, :] == pick[:, None]
        top_w = tl.where(j[None, :] == s, tl.sum(tl.where(chosen, p, 0.0), 1)[:, None], top_w)
        top_i = tl.where(j[None, :] == s, pick[:, None], top_i)
        p = tl.where(chosen, -2.0, p)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, 1)[:, None]      # (columns past TOP_K hold zeros)
    if LOCAL:          # expert parallelism: this rank's experts first .. first + count - 1 as 0 .. count - 1
        top_i = tl.where((top_i >= first) & (top_i < first + count), top_i - first, -1)
    if MASK_ROWS:      # rows past the step's real ones (graph padding) route nowhere
        real = t < tl.load(valid_ptr)
        top_w = tl.where(real[:, None], top_w, 0.0)
        top_i = tl.where(real[:, None], top_i, -1)
    out = t[:, None] * TOP_K + j[None, :]
    mask = (t < T)[:, None] & (j < TOP_K)[None, :]
    tl.store(w_ptr + out, top_w, mask=mask)
    tl.store(ids_ptr + out, top_i, mask=mask)


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool, valid_rows: torch.Tensor | None = None,
          experts: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] (any float dtype) -> (topk_weights [T, k] float32, topk_ids [T, k] int32):
    moe_reference.route_reference's arithmetic and tie rule (equal probabilities lowest expert first).

    valid_rows: an int32 device scalar; rows from it on (a CUDA graph's padding rows) get ids -1 and weights
    0, so fused_moe reads no expert for them (otherwise each padding row adds its k experts' weights).
    experts: (first, count), expert parallelism's share of this rank: ids as indices into it, -1 for an
    expert another rank holds (its weight kept: the ranks' outputs add up to the whole layer's)."""
    if router_logits.dim() != 2 or router_logits.stride(1) != 1:
        raise ValueError(f"route: router_logits must be [T, E] with contiguous rows, got {tuple(router_logits.shape)}")
    t, e = router_logits.shape
    if not 0 < top_k <= e:
        raise ValueError(f"route: top_k must be in 1..{e} (the number of experts), got {top_k}")
    weights = torch.empty(t, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int32, device=router_logits.device)
    if t == 0:
        return weights, ids
    block_e = triton.next_power_of_2(e)
    block_t = max(1, min(16, 2048 // block_e))
    _route_kernel[(triton.cdiv(t, block_t),)](
        router_logits, weights, ids, valid_rows if valid_rows is not None else ids, t, e, router_logits.stride(0),
        *(experts or (0, e)), TOP_K=top_k, RENORMALIZE=renormalize, MASK_ROWS=valid_rows is not None,
        LOCAL=experts is not None, BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k),
        num_warps=4)
    return weights, ids


@triton.jit
def _chunk_hits(ids_ptr, c, P, E, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr):
    """Chunk c's pairs p, their expert ids, and the [CHUNK, BLOCK_E] one-hot of who routes where (ids
    outside [0, E) nowhere)."""
    p = c * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + p, mask=p < P, other=-1)
    e = tl.arange(0, BLOCK_E)
    return p, ids, (ids[:, None] == e[None, :]) & (e < E)[None, :]


@triton.jit(do_not_specialize=["P"])
def _count_kernel(ids_ptr, counts_ptr, P, E, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr):
    c = tl.program_id(0)
    _, _, hits = _chunk_hits(ids_ptr, c, P, E, CHUNK, BLOCK_E)
    tl.store(counts_ptr + c * BLOCK_E + tl.arange(0, BLOCK_E), tl.sum(hits.to(tl.int32), 0))


@triton.jit(do_not_specialize=["P", "num_chunks", "num_blocks"])
def _scan_kernel(counts_ptr, start_ptr, sorted_ptr, block_expert_ptr, P, E, num_chunks, num_blocks,
                 BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK_TILE: tl.constexpr, BLOCK_TILE: tl.constexpr):
    e = tl.arange(0, BLOCK_E)
    total = tl.zeros([BLOCK_E], tl.int32)
    for c0 in range(0, num_chunks, CHUNK_TILE):
        c = c0 + tl.arange(0, CHUNK_TILE)
        ptrs = counts_ptr + c[:, None] * BLOCK_E + e[None, :]
        tile = tl.load(ptrs, mask=(c < num_chunks)[:, None], other=0)
        # each chunk's count becomes the rank of its first pair within each expert
        tl.store(ptrs, tl.cumsum(tile, 0) - tile + total[None, :], mask=(c < num_chunks)[:, None])
        total += tl.sum(tile, 0)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end = tl.cumsum(padded, 0)
    start = end - padded
    tl.store(start_ptr + e, start)
    r = tl.arange(0, BLOCK_M)
    tl.store(sorted_ptr + start[:, None] + total[:, None] + r[None, :], tl.zeros([BLOCK_E, BLOCK_M], tl.int32) + P,
             mask=r[None, :] < (padded - total)[:, None])
    # A block's expert: the number of experts whose stretch ends at or before the block's first slot.
    for b0 in range(0, num_blocks, BLOCK_TILE):
        b = b0 + tl.arange(0, BLOCK_TILE)
        before = (end[None, :] <= (b * BLOCK_M)[:, None]) & (e < E)[None, :]
        owner = tl.sum(before.to(tl.int32), 1)
        tl.store(block_expert_ptr + b, tl.where(owner < E, owner, -1), mask=b < num_blocks)


@triton.jit(do_not_specialize=["P"])
def _place_kernel(ids_ptr, counts_ptr, start_ptr, sorted_ptr, P, E, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr):
    c = tl.program_id(0)
    p, ids, hits = _chunk_hits(ids_ptr, c, P, E, CHUNK, BLOCK_E)
    hits = hits.to(tl.int32)
    rank = tl.sum(hits * tl.cumsum(hits, 0), 1) - 1          # among the chunk's pairs of the same expert
    valid = (ids >= 0) & (ids < E) & (p < P)
    first = tl.load(counts_ptr + c * BLOCK_E + ids, mask=valid, other=0)
    start = tl.load(start_ptr + ids, mask=valid, other=0)
    tl.store(sorted_ptr + start + first + rank, p, mask=valid)


class Alignment(NamedTuple):
    sorted_pairs: torch.Tensor     # [num_blocks * BLOCK_M] int32: pair indices by expert, P where padding
    block_expert: torch.Tensor     # [num_blocks] int32: each block's expert, -1 past the used ones
    num_blocks: int                # the most blocks T's pairs can need (the grouped GEMM's grid)


def max_blocks(pairs: int, num_experts: int, block_m: int) -> int:
    """Blocks of block_m rows that `pairs` pairs can fill at most: each expert that has any pads its last
    block, and at most min(pairs, E) experts have any."""
    return triton.cdiv(pairs, block_m) + min(pairs, num_experts)


def align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """topk_ids [T, k] int32 (contiguous) -> the pairs sorted by expert and padded to blocks of block_m rows."""
    pairs = topk_ids.numel()
    block_e = triton.next_power_of_2(num_experts)
    chunks = triton.cdiv(pairs, CHUNK)
    blocks = max_blocks(pairs, num_experts, block_m)
    device = topk_ids.device
    counts = torch.empty(chunks, block_e, dtype=torch.int32, device=device)
    start = torch.empty(block_e, dtype=torch.int32, device=device)
    sorted_pairs = torch.empty(blocks * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=device)
    _count_kernel[(chunks,)](topk_ids, counts, pairs, num_experts, CHUNK=CHUNK, BLOCK_E=block_e, num_warps=4)
    _scan_kernel[(1,)](counts, start, sorted_pairs, block_expert, pairs, num_experts, chunks, blocks,
                       BLOCK_M=block_m, BLOCK_E=block_e, CHUNK_TILE=CHUNK_TILE, BLOCK_TILE=BLOCK_TILE, num_warps=4)
    _place_kernel[(chunks,)](topk_ids, counts, start, sorted_pairs, pairs, num_experts, CHUNK=CHUNK,
                             BLOCK_E=block_e, num_warps=4)
    return Alignment(sorted_pairs, block_expert, blocks)


def align_reference(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[list[int], list[int]]:
    """The used part of align's layout from a stable sort: (sorted_pairs, block_expert) as lists."""
    flat = topk_ids.flatten().long().cpu()
    slots, owners = [], []
    for e in range(num_experts):
        mine = torch.nonzero(flat == e).flatten().tolist()
        blocks = triton.cdiv(len(mine), block_m)
        slots += mine + [flat.numel()] * (blocks * block_m - len(mine))
        owners += [e] * blocks
    return slots, owners
