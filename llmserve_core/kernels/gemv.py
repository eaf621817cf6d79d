"""Skinny matmul y = x @ W^T for 1-64 rows: the lm_head of a decode or small verify step, and on Hopper
the decoder's projections for 2-16 rows at the shapes its table has.

At these sizes a linear layer only streams its weight once. One program owns BLOCK_N output columns over
a slice of K; the rows run as one 16-, 32- or 64-row tensor-core tile with the weight tile as the wide
operand (rows past M are masked, so they cost no memory traffic), and K is split across programs when
there are too few column blocks to keep every multiprocessor streaming. Under PDL (kernels/pdl.py) a
call waits for the kernel before it first thing and releases the one after, so a decode layer's chain
of launches overlaps each launch with the tail of the kernel before.

Alone it beats cuBLAS only on the 152k-row lm_head (logits written as float32 straight from the
accumulator); on the decoder's projections cuBLAS is ahead kernel for kernel, but a decode layer of 2-16
rows chained under PDL runs faster with it (benchmarks/results/gemv_h200.md, skinny_gemm_h200.md). Fusing
RMSNorm or SiLU-and-mul into its prologue lost more than it saved. Tiles come from kernels/configs/gemv/
where a card was tuned, else from split_k_tile's rule.

`gemv_argmax` is the greedy decode's lm_head: each program reduces its tile of logits to a (value, index)
per row and folds it into one int64 per row with an atomic max, so the logits are never written out and
no argmax pass reads them back; a one-program kernel then reads each row's winner and re-arms the slot.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from llmserve_core.kernels import tuned
from llmserve_core.kernels.pdl import pdl_launch, pdl_wait_and_release
from llmserve_core.kernels.tiling import fit_gemv_config

MAX_ROWS = 64
ROW_TILES = (16, 32, 64)      # the tensor-core tile a call's rows run in
EMPTY_BEST = tl.constexpr(-2**63)     # an argmax slot before any program has folded into it
PARK_REAL_ROWS = tl.constexpr(4)      # store_split_k parks only the real rows of calls this short


# M is not specialized: a row count compiles no variant of its own (only its row tile does), so the
# warm-up meets every variant a served step can reach with one row count per tile.
@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(x_ptr, w_ptr, y_ptr, part_ptr, count_ptr, best_ptr, M, N, K, stride_x, stride_y, k_per_split,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                 EVEN_K: tl.constexpr, DOT_IEEE: tl.constexpr, ARGMAX: tl.constexpr, PDL: tl.constexpr):
    pdl_wait_and_release(PDL)      # x (and the split-K scratch) come from the kernels before
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rk = tl.arange(0, BLOCK_K)
    dtype = x_ptr.dtype.element_ty
    x_rows = x_ptr + offs_m[:, None] * stride_x
    # The weight tile is the dot's left operand ([BLOCK_N, BLOCK_K] x [BLOCK_K, BLOCK_M]): the wide side
    # of the product is the weight's, which suits the tensor cores when only a few rows come in.
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * K
    k_lo = pid_k * k_per_split
    for k0 in range(k_lo, k_lo + k_per_split, BLOCK_K):
        k = k0 + rk
        if EVEN_K:
            w = tl.load(w_rows + k[None, :], mask=n_mask[:, None], other=0.0)
            xv = tl.load(x_rows + k[None, :], mask=m_mask[:, None], other=0.0)
        else:
            w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & (k[None, :] < K), other=0.0)
            xv = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & (k[None, :] < K), other=0.0)
        if DOT_IEEE:    # float32 models: full-precision products, never tf32
            acc += tl.dot(w.to(dtype), tl.trans(xv), input_precision="ieee")
        else:
            acc += tl.dot(w.to(dtype), tl.trans(xv))

    if ARGMAX:     # SPLIT_K == 1: the tile holds finished logits
        logits = tl.where(n_mask[:, None], acc, float("-inf"))
        col = tl.argmax(logits, 0, tie_break_left=True)
        tl.atomic_max(best_ptr + offs_m, pack_value_index(tl.max(logits, 0), pid_n * BLOCK_N + col), mask=m_mask)
    else:
        y_ptrs = y_ptr + offs_m[None, :] * stride_y + offs_n[:, None]
        store_split_k(acc, y_ptrs, n_mask[:, None] & m_mask[None, :], part_ptr, count_ptr, pid_n, pid_k, M,
                      BLOCK_M, BLOCK_N, SPLIT_K)


@triton.jit
def pack_value_index(value, index):
    """A float32 value and its int32 index as one int64 that orders as (value, then the lower index): the
    value's bits made to order as signed integers (a negative float's magnitude bits flipped) above the
    index's complement, so an integer max keeps the largest value and, on ties, the first index."""
    bits = value.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return (key.to(tl.int64) << 32) | (0xFFFFFFFF - index.to(tl.int64))


@triton.jit
def _argmax_unpack_kernel(best_ptr, out_ptr, M, BLOCK_M: tl.constexpr):
    offs = tl.arange(0, BLOCK_M)
    mask = offs < M
    packed = tl.load(best_ptr + offs, mask=mask, other=0)
    tl.store(out_ptr + offs, 0xFFFFFFFF - (packed & 0xFFFFFFFF), mask=mask)
    tl.store(best_ptr + offs, tl.full([BLOCK_M], EMPTY_BEST, tl.int64), mask=mask)


@triton.jit
def store_split_k(acc, y_ptrs, y_mask, part_ptr, count_ptr, pid_n, pid_k, M,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr):
    """Write a program's [BLOCK_N, BLOCK_M] float32 tile of y, summing the K splits when there are several."""
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(y_ptrs.dtype.element_ty), mask=y_mask)
    else:
        # Split-K without a second launch: every split parks its partial tile, and the split that
        # arrives last at this column block sums them, writes y and re-arms the counter for the next call.
        # Up to PARK_REAL_ROWS rows, only the real rows are parked and summed, each row's columns
        # contiguous (at one row, 1/16 of the tile through L2); past it, the whole tile as the
        # accumulator holds it, which stores wider: masked, 16 rows stepped slower (benchmarks/results/LOG.md).
        parts = part_ptr + pid_n * SPLIT_K * BLOCK_N * BLOCK_M
        rows_major = tl.arange(0, BLOCK_M)[None, :] * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
        cols_major = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
        few_rows = M <= PARK_REAL_ROWS     # a runtime branch: M compiles no variant of its own
        if few_rows:
            tl.store(parts + pid_k * BLOCK_N * BLOCK_M + rows_major, acc, mask=y_mask)
        else:
            tl.store(parts + pid_k * BLOCK_N * BLOCK_M + cols_major, acc)
        # The counter's acq_rel increment is one thread's: it publishes the stores that thread has seen,
        # so the barrier first makes every thread's part of the tile one it has seen (as paged_decode does).
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + pid_n, 1)
        if arrived == SPLIT_K - 1:
            total = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            if few_rows:
                for s in range(SPLIT_K):
                    total += tl.load(parts + s * BLOCK_N * BLOCK_M + rows_major, mask=y_mask, other=0.0,
                                     cache_modifier=".cg")
            else:
                for s in range(SPLIT_K):
                    total += tl.load(parts + s * BLOCK_N * BLOCK_M + cols_major, cache_modifier=".cg")
            tl.store(y_ptrs, total.to(y_ptrs.dtype.element_ty), mask=y_mask)
            tl.atomic_xchg(count_ptr + pid_n, 0)


def row_tile(m: int) -> int:
    """The smallest tensor-core row tile that holds m rows."""
    return next(t for t in ROW_TILES if m <= t)


# A decoder projection takes this kernel for 2..16 rows only where its table has the shape: it beat cuBLAS
# there in a decode layer's chain of launches under PDL (at 32 and 64 rows cuBLAS stays ahead).
PROJECTION_MAX_ROWS = 16


def split_k_tile(m: int, n: int, k: int, sms: int, block_n: int = 64, block_k: int = 128, num_warps: int = 4,
                 num_stages: int = 4, programs_per_sm: int = 4) -> dict:
    """Tiles for m <= MAX_ROWS rows: one row tile, column blocks of the weight, and K split until about
    programs_per_sm programs per multiprocessor are streaming (fewer would leave bandwidth unused)."""
    n_blocks = -(-n // block_n)
    split = 1
    while n_blocks * split < programs_per_sm * sms and k % (2 * split * block_k) == 0 and split < 16:
        split *= 2
    return dict(BLOCK_M=row_tile(m), BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, num_warps=num_warps,
                num_stages=num_stages)


@tuned.family("gemv", ("N", "K", "rows", "dtype"))
def _heuristic(device: tuned.Device, N: int, K: int, rows: int, dtype: str) -> dict:
    """split_k_tile's rule, its tile defaults from benchmarks/gemv_bench.py's sweep on the H200."""
    return split_k_tile(rows, N, K, device.sms)


def gemv_tiles(device: tuned.Device, rows: int, n: int, k: int, dtype: torch.dtype,
               x_dtype: torch.dtype | None = None) -> Mapping:
    """The tiles a call of `rows` rows of an [n, k] weight in dtype (x in x_dtype, default the same) runs by
    default on this device: the table's for its row tile, else the heuristic's, fitted to the device's
    shared memory (tables hold bf16 tiles; float32 doubles every tile)."""
    return _fitted(device, row_tile(rows), n, k, dtype, x_dtype or dtype, False)


def projection_tiles(device: tuned.Device, rows: int, n: int, k: int, dtype: torch.dtype,
                     x_dtype: torch.dtype | None = None) -> Mapping | None:
    """The tiles for `rows` rows of a decoder projection where this kernel runs them (2..PROJECTION_MAX_ROWS
    rows of a shape its table has: measured faster than cuBLAS in the decode chain); None: cuBLAS."""
    if not 1 < rows <= PROJECTION_MAX_ROWS:
        return None
    return _fitted(device, row_tile(rows), n, k, dtype, x_dtype or dtype, True)


@tuned.cached
def _fitted(device: tuned.Device, tile: int, n: int, k: int, dtype: torch.dtype, x_dtype: torch.dtype,
            tuned_only: bool) -> Mapping | None:
    shape = dict(N=n, K=k, rows=tile, dtype=tuned.dtype_key(dtype))
    cfg = tuned.tuned("gemv", device, **shape) if tuned_only else tuned.lookup("gemv", device, **shape)
    if cfg is None or not device.smem:
        return cfg
    return MappingProxyType(fit_gemv_config(cfg, dtype.itemsize, x_dtype.itemsize, device.smem))


class _ArgmaxSlots:
    """One int64 slot per row for gemv_argmax, per device, allocated once (and re-armed by the kernel)."""

    def __init__(self):
        self.buffers: dict[torch.device, torch.Tensor] = {}

    def get(self, device: torch.device) -> torch.Tensor:
        if device not in self.buffers:
            self.buffers[device] = torch.full((MAX_ROWS,), EMPTY_BEST.value, dtype=torch.int64, device=device)
        return self.buffers[device]


_SLOTS = _ArgmaxSlots()


class _SplitKScratch:
    """Partial tiles and arrival counters for split-K, one set per device, allocated at the first call and
    never resized, so CUDA graphs keep valid pointers. A split call has at most 8 programs per
    multiprocessor (split_k_tile splits only while there are fewer than 4; the tuned tables stay under
    8), each parking at most a 128-column x MAX_ROWS tile: that bounds both buffers. The kernel re-arms
    the counters to zero itself."""

    def __init__(self):
        self.buffers: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, device: torch.device, part_elems: int, n_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self.buffers:
            programs = 8 * tuned.device_spec(device).sms
            self.buffers[device] = (torch.empty(programs * 128 * MAX_ROWS, dtype=torch.float32, device=device),
                                    torch.zeros(programs, dtype=torch.int32, device=device))
        parts, counts = self.buffers[device]
        if part_elems > parts.numel() or n_blocks > counts.numel():
            raise ValueError(f"gemv: split-K over {n_blocks} column blocks needs {part_elems} partial elements, "
                             f"the scratch holds {parts.numel()} for {counts.numel()} blocks")
        return parts, counts


_SCRATCH = _SplitKScratch()


def gemv(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None,
         config: dict | None = None, pdl: bool = False) -> torch.Tensor:
    """x [M, K], weight [N, K] -> y [M, N] (in out_dtype, default x's). M must be at most MAX_ROWS.
    pdl: launch under PDL, as a link of the decode chain."""
    m = x.shape[0]
    n, k = weight.shape
    assert 0 < m <= MAX_ROWS, f"gemv: {m} rows, at most {MAX_ROWS}"
    assert x.stride(-1) == 1 and weight.is_contiguous(), "gemv: rows must be contiguous"
    assert x.shape[1] == k, "gemv: x does not match the weight"
    y = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    cfg = dict(config if config is not None else _default_tiles(x, weight))
    assert cfg["BLOCK_M"] >= m, f"gemv: {m} rows for a {cfg['BLOCK_M']}-row tile"
    block_n, block_k, split = cfg["BLOCK_N"], cfg["BLOCK_K"], cfg.pop("SPLIT_K")
    n_blocks = triton.cdiv(n, block_n)
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    parts, counts = _SCRATCH.get(x.device, n_blocks * split * block_n * cfg["BLOCK_M"] if split > 1 else 0,
                                 n_blocks if split > 1 else 0)
    _gemv_kernel[(n_blocks, split)](
        x, weight, y, parts, counts, counts, m, n, k, x.stride(0), y.stride(0), k_per_split, SPLIT_K=split,
        EVEN_K=k % block_k == 0, DOT_IEEE=x.dtype == torch.float32, ARGMAX=False, PDL=pdl, **cfg, **pdl_launch(pdl))
    return y


def gemv_argmax(x: torch.Tensor, weight: torch.Tensor, config: dict | None = None, pdl: bool = False) -> torch.Tensor:
    """argmax over N of x @ W^T in float32, for x [M <= MAX_ROWS, K]: int64 [M], the first index on ties
    (as torch.argmax), without writing the [M, N] product out."""
    m = x.shape[0]
    n, k = weight.shape
    assert 0 < m <= MAX_ROWS and x.shape[1] == k, f"gemv_argmax: {m} rows of {x.shape[1]}, weight [{n}, {k}]"
    assert x.stride(-1) == 1 and weight.is_contiguous(), "gemv_argmax: rows must be contiguous"
    cfg = dict(config if config is not None else _default_tiles(x, weight))
    assert cfg["BLOCK_M"] >= m, f"gemv_argmax: {m} rows for a {cfg['BLOCK_M']}-row tile"
    cfg.pop("SPLIT_K")          # one program sees a whole column block's K: its logits are final
    best = _SLOTS.get(x.device)
    out = torch.empty(m, dtype=torch.int64, device=x.device)
    _gemv_kernel[(triton.cdiv(n, cfg["BLOCK_N"]), 1)](
        x, weight, best, best, best, best, m, n, k, x.stride(0), 0, k, SPLIT_K=1,
        EVEN_K=k % cfg["BLOCK_K"] == 0, DOT_IEEE=x.dtype == torch.float32, ARGMAX=True, PDL=pdl, **cfg,
        **pdl_launch(pdl))
    _argmax_unpack_kernel[(1,)](best, out, m, BLOCK_M=MAX_ROWS)
    return out


def _default_tiles(x: torch.Tensor, weight: torch.Tensor) -> Mapping:
    return gemv_tiles(tuned.device_spec(x.device), x.shape[0], *weight.shape, weight.dtype, x.dtype)


def gemv_reference(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    y = F.linear(x, weight)
    return y if out_dtype is None else y.to(out_dtype)
