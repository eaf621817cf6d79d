"""FP8 GEMV for 1-16 rows: out [M, N] = x [M, K] @ dequant(w [N, K] fp8)^T.

At decode sizes the whole cost of a linear layer is streaming its weight from HBM, so the kernel reads
each FP8 weight byte once. Widening every byte to the activation dtype on the CUDA cores costs about as
much as the bytes ("dot", "fma": 1.2-2.3 TB/s of FP8 weight on the H200), so where FP8 products exist
(Ada, Hopper) the "a8" kernel quantizes x instead: each K tile of each row gets its own scale (amax /
448, one per 1 x BLOCK_K piece) in the kernel, the tile meets the loaded FP8 weight on the FP8 tensor
cores as it is, and the partial product is scaled back as it is accumulated (2.3-3.7 TB/s). No extra
launch: x is only ever a few rows.

The layout is kernels/gemv.py's, measured there on the H200 for bf16: one program owns BLOCK_N output
columns over a slice of K, the weight tile is the dot's wide left operand against one 16-row tile of x
(rows past M are masked and cost no traffic), and K is split until about four programs per
multiprocessor stream; the split that arrives last at a column block sums the parked partial tiles, in
the same launch, using gemv.py's graph-safe scratch. Scales are one per output row (applied once per
split) or one per scale block (applied per K tile, which never straddles a block: BLOCK_K divides it).
"""
from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from llmserve_core.kernels.gemv import TABLE_SMS, gemv_config, num_sms, store_split_k
from llmserve_core.kernels.gemv import _SCRATCH as SPLIT_K_SCRATCH   # shared: calls on one stream never overlap
from llmserve_core.kernels.fp8_format import FP8, FP8_MAX, MIN_SCALE, dequantize_weight
from llmserve_core.kernels.pdl import pdl_launch, pdl_wait_and_release
from llmserve_core.kernels.silu_mul import gated_rows, silu_mul_halves

# The measured tables' rows: layers/fp8_linear.py runs 1-16 here always, 17-64 where a table names a tile for
# the shape, and otherwise quantizes x for a W8A8 GEMM.
MAX_ROWS = 64


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, y_ptr, part_ptr, count_ptr, M, N, K, stride_x, stride_y, k_per_split,
                     stride_sn, stride_sk, xs_ptr, stride_xs,
                     SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, BLOCK_SCALED: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                     EVEN_K: tl.constexpr, DOT_IEEE: tl.constexpr, QUANT_X: tl.constexpr, X_GROUP: tl.constexpr,
                     FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, PDL: tl.constexpr, W_TMA: tl.constexpr,
                     GATED: tl.constexpr):
    """X_GROUP > 0: x is already e4m3, with a float32 scale per 1 x X_GROUP piece of each row at xs_ptr.
    W_TMA: w_ptr is a [BLOCK_N, BLOCK_K] tensor descriptor of the weight, whose tiles the copy engine (TMA)
    brings into shared memory whole, zero past N and K.
    GATED: the weight is a packed [gate | up] (N = 2 d) and y [M, d] = SiLU(x @ gate^T) * (x @ up^T): a
    program's first BLOCK_N / 2 rows are gate rows, the rest the up rows of the same columns (one K split)."""
    pdl_wait_and_release(PDL)      # x comes from the kernel before
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    if GATED:
        cols, offs_n, n_mask = gated_rows(pid_n, N, BLOCK_N)
    else:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
    rk = tl.arange(0, BLOCK_K)
    dtype = x_ptr.dtype.element_ty
    x_rows = x_ptr + offs_m[:, None] * stride_x
    if not W_TMA:
        w_rows = w_ptr + offs_n[:, None].to(tl.int64) * K
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    k_lo = pid_k * k_per_split
    for k0 in range(k_lo, k_lo + k_per_split, BLOCK_K):
        k = k0 + rk
        if W_TMA:
            w = w_ptr.load([pid_n * BLOCK_N, k0])
        elif EVEN_K:
            w = tl.load(w_rows + k[None, :], mask=n_mask[:, None], other=0.0)
        else:
            w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & (k[None, :] < K), other=0.0)
        if EVEN_K:
            xv = tl.load(x_rows + k[None, :], mask=m_mask[:, None], other=0.0)
        else:
            xv = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & (k[None, :] < K), other=0.0)
        if X_GROUP > 0:
            # W8A8 on an x quantized ahead: no amax pass across the tile, whatever the tile's width.
            x_s = tl.load(xs_ptr + offs_m * stride_xs + k0 // X_GROUP, mask=m_mask & (k0 < K), other=0.0)
            part = tl.dot(w, tl.trans(xv)) * x_s[None, :]
        elif QUANT_X:
            # W8A8: each row's K tile is quantized on the fly with its own scale (one per 1 x BLOCK_K
            # piece), so the FP8 weight meets the tensor cores as it was loaded, never widened.
            xf = xv.to(tl.float32)
            x_s = tl.maximum(tl.max(tl.abs(xf), 1) / FP8_MAX, MIN_SCALE)
            xq = (xf / x_s[:, None]).to(w.dtype)
            part = tl.dot(w, tl.trans(xq)) * x_s[None, :]
        elif DOT_IEEE:    # float32 models: full-precision products, never tf32
            part = tl.dot(w.to(dtype), tl.trans(xv), input_precision="ieee")
        else:
            part = tl.dot(w.to(dtype), tl.trans(xv))
        if BLOCK_SCALED:
            # (a split past the end of K reads no weight, and no scale either)
            s = tl.load(s_ptr + (offs_n // SCALE_N) * stride_sn + (k0 // SCALE_K) * stride_sk,
                        mask=n_mask & (k0 < K), other=0.0)
            acc += part * s[:, None]
        else:
            acc += part
    if not BLOCK_SCALED:
        acc = acc * tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)[:, None]

    if GATED:
        y_ptrs = y_ptr + offs_m[None, :] * stride_y + cols[:, None]
        y_mask = (cols < N // 2)[:, None] & m_mask[None, :]
        tl.store(y_ptrs, silu_mul_halves(acc).to(y_ptrs.dtype.element_ty), mask=y_mask)
    else:
        y_ptrs = y_ptr + offs_m[None, :] * stride_y + offs_n[:, None]
        store_split_k(acc, y_ptrs, n_mask[:, None] & m_mask[None, :], part_ptr, count_ptr, pid_n, pid_k, M,
                      BLOCK_M, BLOCK_N, SPLIT_K)


@triton.jit
def _fp8_gemv_fma_kernel(x_ptr, w_ptr, s_ptr, y_ptr, part_ptr, count_ptr, M, N, K, stride_x, stride_y, k_per_split,
                         stride_sn, stride_sk,
                         SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, BLOCK_SCALED: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                         EVEN_K: tl.constexpr, REDUCE_LATE: tl.constexpr):
    """The same split of work on the CUDA cores, for 1-4 rows: no dot, so no layout conversion of the
    weight tile; each thread widens its contiguous fp8 bytes to float32, multiplies by the broadcast
    row(s) of x and reduces along K. A block scale multiplies x's K slice (BLOCK_N divides the block's N
    side, so one program sees one scale row), which lets BLOCK_K span several scale blocks. REDUCE_LATE
    keeps per-lane partial sums over the whole K slice and reduces across threads once at the end (no
    shuffles in the loop, BLOCK_M times the registers)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + offs_m[:, None] * stride_x
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * K
    s_row = s_ptr + (pid_n * BLOCK_N // SCALE_N) * stride_sn
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    lanes = tl.zeros([BLOCK_N, BLOCK_M, BLOCK_K], dtype=tl.float32)
    k_lo = pid_k * k_per_split
    for k0 in range(k_lo, k_lo + k_per_split, BLOCK_K):
        k = k0 + rk
        if EVEN_K:
            w = tl.load(w_rows + k[None, :], mask=n_mask[:, None], other=0.0)
            xv = tl.load(x_rows + k[None, :], mask=m_mask[:, None], other=0.0).to(tl.float32)
        else:
            w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & (k[None, :] < K), other=0.0)
            xv = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & (k[None, :] < K), other=0.0).to(tl.float32)
        if BLOCK_SCALED:
            xv = xv * tl.load(s_row + (k // SCALE_K) * stride_sk, mask=k < K, other=0.0)[None, :]
        if REDUCE_LATE:
            lanes += w.to(tl.float32)[:, None, :] * xv[None, :, :]
        else:
            acc += tl.sum(w.to(tl.float32)[:, None, :] * xv[None, :, :], axis=2)
    if REDUCE_LATE:
        acc = tl.sum(lanes, axis=2)
    if not BLOCK_SCALED:
        acc = acc * tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)[:, None]

    y_ptrs = y_ptr + offs_m[None, :] * stride_y + offs_n[:, None]
    store_split_k(acc, y_ptrs, n_mask[:, None] & m_mask[None, :], part_ptr, count_ptr, pid_n, pid_k, M,
                  BLOCK_M, BLOCK_N, SPLIT_K)


# Measured defaults per (N, K, rows class, scale kind): rows class 1, 4 (2-4 rows), 16 (5-16 rows), 32
# (17-32) or 64 (33-64), scale kind "channel" or "block" (128x128). From
# benchmarks/results/fp8_gemv_sweep_h200_f3f7a22.json (`--a8`, each tile timed under PDL, as the decode
# chain launches it), TB/s of FP8 weight at one row, copy 4.22:
# qkv 2.31 / 2.41 (the stream kernel 1.80 / 1.77), o_proj's stream kernel 2.16 / 2.14 (a8 1.87 / 1.75),
# gate_up 3.68 / 3.41 (2.76 / 2.89), down 2.88 / 2.79 (2.70 / 2.60); "dot" (the weight widened to bf16)
# read 1.2-2.3. The 16-row class was not timed and takes the 4-row tiles (the tile holds 16 rows either way).
# {"KERNEL": "stream"} names kernels/stream_gemv.py, for one row where a caller can run it: qkv and o_proj,
# whose 4,096-column rows it reads whole, one tile a program, before its PDL wait (on an H100, us per channel /
# block scales: qkv 10.5 / 10.9 against the a8 tile on x quantized ahead 12.1 / 12.2; the whole batch-1 FP8
# step 3.5-4.7% faster with both; benchmarks/results/fp8_whole_rows_h100.md). 2-16 rows of qkv keep the a8
# tiles. Since gate_up's GEMV ends in the SiLU-and-mul (models/qwen3.py; benchmarks/results/fp8_fold_silu_h100.md,
# whole batch-1 FP8 steps on an H100), down follows gate_up directly, and down's one row streams: the stream
# kernel's first tile, read before the wait, overlaps gate_up's last wave where the a8 kernel waits first
# (3.559 / 3.577 -> 3.536 / 3.544 ms per channel, 3.563 -> 3.530 with blocks). gate_up's row then streams
# too, on whole rows, ending in the SiLU-and-mul there: per channel 3.545 / 3.550 / 3.541 -> 3.474 / 3.471 /
# 3.473 ms, and in another call 3.541 -> 3.468; with blocks 3.532 / 3.536 -> 3.426 / 3.433 (before the fold,
# whole rows read faster alone but left the step 0.2-0.4% slower).
_A8_QKV = dict(KERNEL="a8", BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, SPLIT_K=4, num_warps=4, num_stages=3)
_A8_O = dict(KERNEL="a8", BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, SPLIT_K=8, num_warps=8, num_stages=4)
_A8_GATE_UP = {"channel": dict(KERNEL="a8", BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, SPLIT_K=1, num_warps=4, num_stages=5),
               "block": dict(KERNEL="a8", BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, SPLIT_K=1, num_warps=8, num_stages=4)}
_A8_DOWN = dict(KERNEL="a8", BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, SPLIT_K=8, num_warps=8, num_stages=4)
# 17-32 and 33-64 rows (rows classes 32 and 64), from benchmarks/fp8_skinny_gemm.py on an H100 (132 SMs, as
# the H200; benchmarks/results/fp8_rows17_64_h100.md), each against what the engine ran there before: x
# quantized in a launch of its own, then cuBLAS's FP8 GEMM through torch._scaled_mm, whose 128 x 128 tiles
# leave most multiprocessors idle at these rows (qkv: 48 programs on 132). us at 17 / 32 rows, per-channel
# (block) scales: qkv 15.7 / 16.0 against 21.5 / 20.0 (16.9 / 16.1 against 16.8 / 17.2), o_proj 11.8 / 11.8
# against 16.3 / 16.2 (12.8 / 12.0 against 16.2 / 16.5), down 24.7 / 25.0 against 43.0 / 40.9 (27.0 / 26.1
# against 26.2 / 38.0); gate_up per channel 41.1 / 42.0 against 48.6 / 47.9 with the K unsplit. At 64 rows the
# in-kernel quantization of a 64-row tile loses (down 37.9 against 38.8, qkv 29.5 against 18.3): that class
# only takes x quantized ahead (X_AHEAD_CONFIGS), and o_proj's 33-64 rows stay with cuBLAS.
_A8_32 = dict(KERNEL="a8", BLOCK_M=32, BLOCK_N=128, BLOCK_K=128, SPLIT_K=4, num_warps=8, num_stages=4)
DEFAULT_CONFIGS: dict[tuple[int, int, int, str], dict] = {
    **{(6144, 4096, rows, kind): _A8_QKV for rows in (4, 16) for kind in ("channel", "block")},
    **{(n, k, 1, kind): dict(KERNEL="stream")
       for n, k in ((6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)) for kind in ("channel", "block")},
    **{(4096, 4096, rows, kind): _A8_O for rows in (4, 16) for kind in ("channel", "block")},
    **{(24576, 4096, rows, kind): _A8_GATE_UP[kind] for rows in (4, 16) for kind in ("channel", "block")},
    **{(4096, 12288, rows, kind): _A8_DOWN for rows in (4, 16) for kind in ("channel", "block")},
    **{(n, k, 32, kind): _A8_32 for n, k in ((6144, 4096), (4096, 4096), (4096, 12288))
       for kind in ("channel", "block")},
    (24576, 4096, 32, "channel"): dict(_A8_32, SPLIT_K=1),
}


# Tiles for an x that comes quantized already (e4m3 per 1 x 128 piece, from the RMSNorm before:
# layers/fp8_linear.py's QuantizedRows), where that beat the a8 kernel quantizing x itself. One row under PDL,
# TB/s (benchmarks/results/fp8_a8x_sweep_h200_0395de5.json, `fp8_gemv_sweep.py --a8x`, copy 4.22), per channel
# / block scales: qkv 2.54 / 2.50 against 2.28 / 2.29, gate_up 3.89 / 3.87 against 3.30 / 3.38. down and
# o_proj read slower that way (2.63 against 2.84; o_proj's stream kernel 2.22 against 2.00) and are not here.
# One row of qkv and of gate_up now streams through kernels/stream_gemv.py instead (DEFAULT_CONFIGS' note).
# 2-16 rows take these tiles (16-row x tiles either way): on the H100 qkv 13.1 / 13.4 us against the
# in-kernel tile's 13.6 / 14.0 at 4 / 16 rows, gate_up 35.8 / 37.0 against 37.7 / 38.9; whole FP8 steps at
# batch 4 / 8 / 16 0.8% / 0.7% / 0% faster (benchmarks/results/fp8_rows17_64_h100.md).
# 17-64 rows (fp8_skinny_gemm.py on the H100, us at 17 / 32 / 64 rows, the GEMM alone, against the table's
# in-kernel tile and cuBLAS after its own quantization), per channel: qkv 14.2 / 14.9 / 16.8 (15.7 / 16.0;
# 21.5 / 20.0 / 18.3), gate_up 37.6 / 38.5 / 41.0 (41.1 / 42.0; 48.6 / 47.9 / 50.4), down 23.8 / 24.0 / 26.9
# (24.7 / 25.0; 43.0 / 40.9 / 38.8); per block: qkv 14.1 / 14.7 / 17.1 (cuBLAS 16.8 / 17.2 / 18.1), gate_up
# 38.1 / 38.3 / 40.5 (43.7 / 44.3 / 44.9), down 23.5 / 24.1 / 27.0 (26.2 / 38.0 / 40.7). down's x comes
# quantized from the SiLU-and-mul before it.
X_AHEAD_GROUP = 128
_A8X = dict(KERNEL="a8", BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4)     # 17-64 rows; K split per shape
X_AHEAD_CONFIGS: dict[tuple[int, int, int, str], dict] = {
    **{(6144, 4096, rows, kind): _A8_QKV for rows in (4, 16) for kind in ("channel", "block")},
    **{(24576, 4096, rows, kind): dict(KERNEL="a8", BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, SPLIT_K=1, num_warps=2,
                                       num_stages=4) for rows in (4, 16) for kind in ("channel", "block")},
    **{(n, k, rows, kind): dict(_A8X, BLOCK_M=rows, SPLIT_K=split)
       for (n, k), split in (((6144, 4096), 2), ((24576, 4096), 1), ((4096, 12288), 4))
       for rows in (32, 64) for kind in ("channel", "block")},
}


def _table_tile(table: dict, m: int, n: int, k: int, block: tuple[int, int] | None, sms: int,
                fp8_dot: bool) -> dict | None:
    """`table`'s tile for m rows of this shape, on a card like the one measured (TABLE_SMS multiprocessors,
    FP8 tensor cores), or None."""
    if sms != TABLE_SMS or not fp8_dot or not 0 < m <= MAX_ROWS:
        return None
    cfg = table.get((n, k, rows_class(m), _scale_kind(block)))
    return None if cfg is None else dict(cfg)


def measured_config(m: int, n: int, k: int, block: tuple[int, int] | None, sms: int, fp8_dot: bool,
                    stream: bool = False) -> dict | None:
    """The measured table's tile for m rows of this shape on a card like the one measured (fp8_dot: one with
    FP8 tensor cores; stream: the caller can run kernels/stream_gemv.py), or None."""
    cfg = _table_tile(DEFAULT_CONFIGS, m, n, k, block, sms, fp8_dot)
    return None if cfg is None or (cfg["KERNEL"] == "stream" and not stream) else cfg


def x_ahead_config(m: int, n: int, k: int, block: tuple[int, int] | None, sms: int, fp8_dot: bool) -> dict | None:
    """The measured tile for x quantized ahead per 1 x X_AHEAD_GROUP piece, on a card like the one measured;
    None where the table names none (the caller then hands x as it is)."""
    return _table_tile(X_AHEAD_CONFIGS, m, n, k, block, sms, fp8_dot)


def _scale_kind(block: tuple[int, int] | None) -> str | None:
    return "channel" if block is None else "block" if tuple(block) == (128, 128) else None


def rows_class(m: int) -> int:
    return 1 if m == 1 else 4 if m <= 4 else 16 if m <= 16 else 32 if m <= 32 else 64


@lru_cache(maxsize=None)
def fp8_dot_supported(device: torch.device) -> bool:
    """FP8 x FP8 tensor-core products (the "a8" kernel): Ada (sm_89) and later."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_gemv_config(m: int, n: int, k: int, block: tuple[int, int] | None, sms: int = 132,
                    fp8_dot: bool = False, stream: bool = False) -> dict:
    """The measured table's entry for this shape on a card like the one measured (fp8_dot: one with FP8
    tensor cores; stream: the caller can run kernels/stream_gemv.py); otherwise gemv.py's tiles and K
    split, in the "a8" kernel where FP8 products run, else widening the weight ("dot"). A block-scaled
    weight caps BLOCK_K at the scale block's K side."""
    measured = measured_config(m, n, k, block, sms, fp8_dot, stream)
    if measured is not None:
        return measured
    block_k = 128 if block is None else min(128, block[1])
    cfg = gemv_config(m, n, k, sms, block_n=64, block_k=block_k, num_warps=4, num_stages=3 if fp8_dot else 4)
    return dict(cfg, KERNEL="a8" if fp8_dot else "dot")


def silu_mul_fits(n: int, cfg: dict) -> bool:
    """Whether fp8_gemv at tile cfg can end a packed [gate | up] weight of n rows in the SiLU-and-mul: an
    even N, and the a8 or dot kernel at an even BLOCK_N, one K split, no TMA (both halves of a column must
    meet in one program, whole)."""
    return n % 2 == 0 and cfg.get("KERNEL", "dot") in ("a8", "dot") and cfg["SPLIT_K"] == 1 \
        and cfg["BLOCK_N"] % 2 == 0 and not cfg.get("TMA", False)


def fp8_gemv(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None,
             config: dict | None = None, pdl: bool = False, x_scale: torch.Tensor | None = None,
             x_group: int = 128, out_dtype: torch.dtype | None = None, silu_mul: bool = False) -> torch.Tensor:
    """x [M <= 16, K] (float), w [N, K] float8_e4m3fn, scale per row [N] or per block -> [M, N] in x.dtype.

    config KERNEL "a8" quantizes x per 1 x BLOCK_K piece of each row in the kernel and multiplies FP8 by
    FP8 (fp8_gemv_a8_reference is its arithmetic); "dot" and "fma" widen the weight instead. "TMA": True
    brings the a8 kernel's weight tiles by tensor descriptor instead of per-thread loads (the same
    arithmetic; benchmarks/fp8_tma_tiles.py measures whether it streams faster). pdl: launch under PDL (the
    tensor-core kernels), as a link of the decode chain.

    x may come quantized already (e4m3, x_scale [M, ceil(K / x_group)] float32, as
    fp8_quant.quantize_activation(x, x_group) makes it; the result in out_dtype): the "a8" kernel then
    skips its amax pass, which every program repeats for its tile (benchmarks/fp8_gemv_sweep.py --a8x
    measures what that pass costs).

    silu_mul: w is a packed [gate | up] and the result [M, N / 2] is SiLU(x @ gate^T) * (x @ up^T), taken
    in float32 before the one rounding (the "a8" or "dot" kernel at a tile that does not split K)."""
    m, k = x.shape
    n = w.shape[0]
    assert 0 < m <= MAX_ROWS, f"fp8_gemv: {m} rows, at most {MAX_ROWS}"
    assert w.shape[1] == k and x.stride(1) == 1 and w.is_contiguous(), "fp8_gemv: rows must be contiguous"
    cfg = dict(config or fp8_gemv_config(m, n, k, block, num_sms(x.device), fp8_dot_supported(x.device)))
    assert not silu_mul or silu_mul_fits(n, cfg), \
        "fp8_gemv: silu_mul needs an even N and the a8 or dot kernel at an even BLOCK_N, one K split, no TMA"
    block_n, block_k, split = cfg["BLOCK_N"], cfg["BLOCK_K"], cfg.pop("SPLIT_K")
    kernel = cfg.pop("KERNEL", "dot")
    tma = cfg.pop("TMA", False)
    assert kernel in ("dot", "a8", "fma", "fma_late"), f"fp8_gemv: unknown KERNEL {kernel!r}"
    prequantized = x.dtype == FP8
    if prequantized:
        assert kernel == "a8", "fp8_gemv: an e4m3 x needs the a8 kernel"
        assert x_group > 0 and x_group % block_k == 0, f"fp8_gemv: BLOCK_K must divide x's scale group, not {x_group}"
        assert x_scale is not None and x_scale.shape == (m, triton.cdiv(k, x_group)) and out_dtype is not None, \
            f"fp8_gemv: an e4m3 x takes x_scale [{m}, {triton.cdiv(k, x_group)}] and an out_dtype"
    assert not tma or (kernel == "a8" and k % 16 == 0 and w.data_ptr() % 16 == 0), \
        "fp8_gemv: TMA weight tiles are the a8 kernel's, over a 16-byte aligned weight whose K is a multiple of 16"
    fma = kernel.startswith("fma")
    assert not (pdl and fma), "fp8_gemv: the CUDA-core kernel does not launch under PDL"
    assert m <= cfg["BLOCK_M"], f"fp8_gemv: {m} rows for a {cfg['BLOCK_M']}-row tile"
    if block is not None:
        if fma:
            assert block[0] % block_n == 0, "fp8_gemv: BLOCK_N must divide the scale block's N side"
        else:
            assert block[1] % block_k == 0, "fp8_gemv: BLOCK_K must divide the scale block's K side"
        assert scale.dim() == 2, "fp8_gemv: block scales must be [ceil(N/bn), ceil(K/bk)]"
        stride_sn, stride_sk = scale.stride(0), scale.stride(1)
    else:
        assert scale.shape == (n,), f"fp8_gemv: per-channel scale must be [{n}], got {tuple(scale.shape)}"
        stride_sn, stride_sk = 1, 0
    y = torch.empty(m, n // 2 if silu_mul else n, dtype=out_dtype if prequantized else x.dtype, device=x.device)
    n_blocks = triton.cdiv(n // 2, block_n // 2) if silu_mul else triton.cdiv(n, block_n)
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    parts, counts = SPLIT_K_SCRATCH.get(x.device, n_blocks * split * block_n * cfg["BLOCK_M"] if split > 1 else 0,
                                        n_blocks if split > 1 else 0)
    w_arg = weight_descriptor(w, block_n, block_k) if tma else w
    args = (x, w_arg, scale, y, parts, counts, m, n, k, x.stride(0), y.stride(0), k_per_split, stride_sn, stride_sk)
    common = dict(SCALE_N=block[0] if block else 1, SCALE_K=block[1] if block else 1, BLOCK_SCALED=block is not None,
                  SPLIT_K=split, EVEN_K=k_per_split * split == k)
    if fma:
        _fp8_gemv_fma_kernel[(n_blocks, split)](*args, **common, REDUCE_LATE=kernel == "fma_late", **cfg)
    else:
        xs, stride_xs = (x_scale, x_scale.stride(0)) if prequantized else (x, 0)   # (x: any pointer, unread)
        _fp8_gemv_kernel[(n_blocks, split)](*args, xs, stride_xs, **common, DOT_IEEE=x.dtype == torch.float32,
                                            QUANT_X=kernel == "a8" and not prequantized,
                                            X_GROUP=x_group if prequantized else 0,
                                            FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE, PDL=pdl, W_TMA=tma,
                                            GATED=silu_mul, **cfg, **pdl_launch(pdl))
    return y


def weight_descriptor(w: torch.Tensor, block_n: int, block_k: int) -> TensorDescriptor:
    """The TMA descriptor of a [N, K] weight in [block_n, block_k] tiles."""
    return TensorDescriptor(w, list(w.shape), [w.stride(0), 1], [block_n, block_k])


def fp8_gemv_reference(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                       block: tuple[int, int] | None = None) -> torch.Tensor:
    """Dequantize the weight, multiply in float32."""
    return (x.float() @ dequantize_weight(w, scale, block).t()).to(x.dtype)


def fp8_gemv_a8_reference(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                          block: tuple[int, int] | None = None, group: int = 128) -> torch.Tensor:
    """The "a8" kernel's arithmetic: x quantized per 1 x group piece of each row (dequantized again),
    times the dequantized weight, in float32."""
    from llmserve_core.kernels.fp8_quant import quantize_activation_reference
    q, s = quantize_activation_reference(x, group)
    x_deq = q.float() * s.repeat_interleave(group, 1)[:, :x.shape[1]]
    return (x_deq @ dequantize_weight(w, scale, block).t()).to(x.dtype)
