"""y = x @ W^T for one row, streaming W through registers: the decoder's projections at batch-1 decode.

At batch 1 a projection is a pure weight stream (qkv 50 MB, o_proj 34 MB, down 101 MB in bf16 at the
Qwen3-8B shape), and what it loses against the copy bandwidth is its start and its end: cuBLAS's skinny
kernels launch one wave of 96-128 programs, so a third of the multiprocessors idle on qkv. Here every
program owns BLOCK_N whole rows of W (no split-K, so no second pass), there are enough programs to fill
every multiprocessor several times over, and each keeps the next [BLOCK_N, BLOCK_K] tile (16-bit weights:
the next two) in flight while it multiplies the current one in float32 on the CUDA cores (a GEMV has no
use for tensor cores).

With PDL (programmatic dependent launch, Hopper and later) the kernel starts before the one it follows
has finished: it loads its first weight tiles, which no earlier kernel writes, then waits on the grid
dependency before it reads x, and lets the kernel after it launch at once. So a decode layer's chain of
launches overlaps each kernel's ramp with its predecessor's tail. FP8 rows of up to 4,096 columns go
further: a program's 8 whole rows are one tile (32 KB, 56 registers a thread over 8 warps), all of it
asked for before the wait, so o_proj streams its weight while the decode attention before it runs, and
each program keeps 8x the bytes in flight that a 512-column tile did (longer rows with row scales, as
down_proj's 12,288, are read whole in up to four such pieces, over 4 rows). Weights may be float8_e4m3fn with one
float32 scale per output row (applied once, after the reduction) or per 128 x 128 block (Qwen's FP8
checkpoints: a program's 8 rows share their block row, so each column's scale multiplies x). Over the packed
gate_up a program may take 4 gate rows and their 4 up rows and write SiLU(gate) * up (silu_mul=True), so the
decode MLP launches no SiLU-and-mul between its two projections.
"""
from __future__ import annotations

from typing import Mapping

import torch
import triton
import triton.language as tl

from llmserve_core.kernels import tuned
from llmserve_core.kernels.fp8_format import dequantize_weight
from llmserve_core.kernels.pdl import pdl_launch, pdl_wait_and_release
from llmserve_core.kernels.silu_mul import gated_rows, silu_mul_halves

MIN_BLOCK_K = 64     # a K that this does not divide has no tile
ROWS_PER_PROGRAM = 8
# FP8 rows are read whole before the wait (8 x 4096 bytes over 8 warps: 56 registers) in power-of-two tiles
# of up to WHOLE_ROW_K columns: one, or with row scales up to MAX_PIECES side by side, over fewer rows a program
# where 8 rows would come to more than WHOLE_ROW_BYTES (down_proj's 12,288 columns: 3 x 4,096, 4 rows).
WHOLE_ROW_K = 4096
MAX_PIECES = 4
WHOLE_ROW_BYTES = 48 * 1024


@triton.jit
def _stream_gemv_kernel(x_ptr, w_ptr, scale_ptr, y_ptr, N, K, stride_sn, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, ROW_SCALED: tl.constexpr, BLOCK_SCALED: tl.constexpr,
                        SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, PDL: tl.constexpr, DEPTH: tl.constexpr,
                        GATED: tl.constexpr, PIECES: tl.constexpr, SPAN: tl.constexpr):
    """DEPTH: weight tiles in flight ahead of the one being multiplied (1 or 2), or 0 where a program's whole
    slice of W is read before the wait: PIECES (1-4) tiles of BLOCK_K columns side by side, K = PIECES x BLOCK_K
    (rows whose length is no power of two, as down_proj's 12,288 = 3 x 4,096, in power-of-two tiles; SPAN is
    PIECES rounded up to a power of two, the pieces' axis of one [BLOCK_N, SPAN, BLOCK_K] tile).
    GATED: W is a packed [gate | up] (N = 2 d) and y [d] = SiLU(x @ gate^T) * (x @ up^T) (silu_mul.gated_rows)."""
    pid = tl.program_id(0)
    if GATED:
        cols, offs_n, n_mask = gated_rows(pid, N, BLOCK_N)
    else:
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
    rk = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * K + rk[None, :]
    # The first tiles are read before the grid dependency resolves: no kernel before this one writes W.
    # K is a multiple of BLOCK_K (every tile's): only prefetches past the last tile are masked off.
    if PIECES >= 2:
        # Pieces side by side as one tile, so that x below is one load too: loaded a piece at a time, each
        # piece's x waited behind the last one's layout change (a shared-memory round trip after its load).
        rp = tl.arange(0, SPAN)
        w = tl.load(w_ptrs[:, None, :] + rp[None, :, None] * BLOCK_K,
                    mask=n_mask[:, None, None] & (rp < PIECES)[None, :, None], other=0.0)
    else:
        w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)
    if DEPTH == 2:
        w1 = tl.load(w_ptrs + BLOCK_K, mask=n_mask[:, None] & (BLOCK_K < K), other=0.0)
    # Scales are static too. Asked for after the reduction, as the arithmetic uses them, a row scale
    # was one more memory round trip at the end of every program (the barriers of the cross-warp sum keep
    # the load behind them).
    if ROW_SCALED:
        row_scale = tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0)
    if DEPTH == 0 and GATED and BLOCK_SCALED:
        kb = tl.arange(0, BLOCK_K // SCALE_K)
        s = tl.load(scale_ptr + (offs_n // SCALE_N)[:, None] * stride_sn + kb[None, :], mask=n_mask[:, None],
                    other=0.0)
    pdl_wait_and_release(PDL)
    # Block scales: BLOCK_N divides SCALE_N, so a program's rows share one row of scales, and each
    # column's scale folds into x. A GATED program's gate rows and up rows lie in two block rows: each row
    # sums its products per scale block, then weighs those sums by its own block row (whole rows only).
    s_row = scale_ptr + (pid * BLOCK_N // SCALE_N) * stride_sn
    if DEPTH == 0 and GATED and BLOCK_SCALED:
        xk = tl.load(x_ptr + rk).to(tl.float32)
        per_block = tl.sum(tl.reshape(w.to(tl.float32) * xk[None, :], (BLOCK_N, BLOCK_K // SCALE_K, SCALE_K)), 2)
        y = tl.sum(per_block * s, 1)
    elif DEPTH == 0 and PIECES >= 2:
        ks = rp[:, None] * BLOCK_K + rk[None, :]
        xs = tl.load(x_ptr + ks, mask=(rp < PIECES)[:, None], other=0.0)
        if BLOCK_SCALED:
            xs = xs.to(tl.float32) * tl.load(s_row + ks // SCALE_K, mask=(rp < PIECES)[:, None], other=0.0)
        y = tl.sum(tl.sum(w.to(tl.float32) * xs.to(tl.float32)[None, :, :], 2), 1)
    elif DEPTH == 0:
        y = tl.sum(w.to(tl.float32) * _x_columns(x_ptr, s_row, rk, BLOCK_SCALED, SCALE_K)[None, :], 1)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            nxt = k0 + DEPTH * BLOCK_K
            w_next = tl.load(w_ptrs + nxt, mask=n_mask[:, None] & (nxt < K), other=0.0)
            acc += w.to(tl.float32) * _x_columns(x_ptr, s_row, k0 + rk, BLOCK_SCALED, SCALE_K)[None, :]
            if DEPTH == 2:
                w, w1 = w1, w_next
            else:
                w = w_next
        y = tl.sum(acc, 1)
    if ROW_SCALED:
        y = y * row_scale
    if GATED:
        y = tl.reshape(silu_mul_halves(tl.reshape(y, (BLOCK_N, 1))), (BLOCK_N // 2,))
        tl.store(y_ptr + cols, y.to(y_ptr.dtype.element_ty), mask=cols < N // 2)
    else:
        tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _x_columns(x_ptr, s_row, cols, BLOCK_SCALED: tl.constexpr, SCALE_K: tl.constexpr):
    """x at the columns cols in float32, each times its scale block's column scale (from the program's
    block row s_row) where the weight is block-scaled."""
    xk = tl.load(x_ptr + cols).to(tl.float32)
    if BLOCK_SCALED:
        xk = xk * tl.load(s_row + cols // SCALE_K)
    return xk


@tuned.family("stream_gemv", ("N", "K", "dtype", "scale"))
def _heuristic(device: tuned.Device, N: int, K: int, dtype: str, scale: str) -> dict | None:
    """Tiles for an [N, K] weight of dtype ("fp8" with scale "channel" or "<bn>x<bk>"), or None where no
    tile width divides K.

    16-bit weights: 8 rows x 512 columns a program over 4 warps, two tiles in flight ahead of the one
    being multiplied (a third read no faster). FP8 rows of up to WHOLE_ROW_K columns (a power of two):
    each program's 8 rows whole, one tile read before the PDL wait, over 8 warps, so the weight streams
    while the kernel before runs. Longer FP8 rows with row scales that up to MAX_PIECES power-of-two tiles
    make up are read whole too, in pieces side by side, over fewer rows a program; under block scales
    every column of x would be scaled in twice the programs (slower), so there only rows of one piece are.
    Other weights (FP8 read slower with two tiles ahead): 8 rows x 512 columns, half-width tiles where
    the programs would overfill one wave of about four per multiprocessor, 8 warps on long rows.
    (benchmarks/results/stream_depth_sweep_h100_3576f60.json; the whole steps in benchmarks/results/LOG.md)"""
    weight_bytes = 1 if dtype == "fp8" else 4 if dtype == "fp32" else 2
    block_scaled = scale not in ("none", "channel")
    if weight_bytes == 1:
        piece = min(K & -K, WHOLE_ROW_K)                # the longest power-of-two tile that divides K
        if piece >= MIN_BLOCK_K and K // piece <= (1 if block_scaled else MAX_PIECES):
            rows = ROWS_PER_PROGRAM
            while rows > 2 and rows * K > WHOLE_ROW_BYTES:
                rows //= 2
            return dict(BLOCK_N=rows, BLOCK_K=piece, num_warps=8, num_stages=1, DEPTH=0, PIECES=K // piece)
    sixteen_bit = weight_bytes == 2
    block_k = 512 if sixteen_bit or -(-N // ROWS_PER_PROGRAM) <= 4 * device.sms else 256
    num_warps = 8 if K >= 8192 and not sixteen_bit else 4
    while block_k > MIN_BLOCK_K and K % block_k:
        block_k //= 2
    if K % block_k:
        return None
    return dict(BLOCK_N=ROWS_PER_PROGRAM, BLOCK_K=block_k, num_warps=num_warps, num_stages=1,
                DEPTH=2 if sixteen_bit else 1)


def stream_tiles(device: tuned.Device, n: int, k: int, dtype: torch.dtype,
                 block: tuple[int, int] | None = None) -> Mapping | None:
    """The tile for an [n, k] weight of dtype (FP8: with block scales where block is given) on this device:
    its table's, else the heuristic's (None: no tile divides K)."""
    scale = tuned.scale_key(block) if dtype == torch.float8_e4m3fn else "none"
    return tuned.lookup("stream_gemv", device, N=n, K=k, dtype=tuned.dtype_key(dtype), scale=scale)


def silu_mul_fits(n: int, cfg: dict, block: tuple[int, int] | None) -> bool:
    """Whether the tile cfg can end a packed [gate | up] weight of n rows in the SiLU-and-mul: an even N and
    BLOCK_N; over block scales, whole rows in one piece (DEPTH 0) that a whole number of scale blocks spans."""
    return n % 2 == 0 and cfg["BLOCK_N"] % 2 == 0 and (
        block is None or (cfg.get("DEPTH") == 0 and cfg.get("PIECES", 1) == 1 and cfg["BLOCK_K"] % block[1] == 0))


def stream_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
                block: tuple[int, int] | None = None, out_dtype: torch.dtype | None = None, pdl: bool = False,
                config: dict | None = None, silu_mul: bool = False) -> torch.Tensor:
    """x [1, K], weight [N, K] -> [1, N]. The weight is x's dtype, or float8_e4m3fn with float32 scales:
    one per row ([N]) or, with block (bn, bk), one per bn x bk tile ([ceil(N / bn), ceil(K / bk)]).
    silu_mul: the weight is a packed [gate | up] and the result [1, N / 2] is SiLU(x @ gate^T) * (x @ up^T),
    taken in float32 before the one rounding (with block scales, on whole rows only: a program's gate rows
    and up rows lie in two block rows, and each row weighs its per-block sums by its own)."""
    n, k = weight.shape
    assert x.shape == (1, k) and x.stride(1) == 1 and weight.is_contiguous(), "stream_gemv: one contiguous row"
    assert (scale is None) == (weight.dtype == x.dtype), "stream_gemv: a scale comes with an FP8 weight, and only then"
    cfg = config or stream_tiles(tuned.device_spec(weight.device), n, k, weight.dtype, block)
    assert cfg is not None and k % cfg["BLOCK_K"] == 0, f"stream_gemv: no tile for a [{n}, {k}] weight"
    cfg = dict(cfg)
    cfg.setdefault("DEPTH", 1)
    cfg.setdefault("PIECES", 1)
    whole = cfg["DEPTH"] == 0 and cfg["BLOCK_K"] * cfg["PIECES"] == k and 1 <= cfg["PIECES"] <= MAX_PIECES
    assert whole or (cfg["DEPTH"] in (1, 2) and cfg["PIECES"] == 1), \
        "stream_gemv: 1 or 2 weight tiles in flight, or one tile of all K (1-4 pieces side by side)"
    if block is not None:
        assert block[0] % cfg["BLOCK_N"] == 0, f"stream_gemv: {cfg['BLOCK_N']} rows a program split a {block} scale block"
        assert scale.shape == (-(-n // block[0]), -(-k // block[1])) and scale.stride(1) == 1, \
            "stream_gemv: block scales must be [ceil(N / bn), ceil(K / bk)], rows contiguous"
    elif scale is not None:
        assert scale.shape == (n,), f"stream_gemv: row scales must be [{n}], got {tuple(scale.shape)}"
    assert not silu_mul or silu_mul_fits(n, cfg, block), \
        "stream_gemv: silu_mul needs an even N and BLOCK_N, and over block scales whole rows of whole blocks"
    y = torch.empty(1, n // 2 if silu_mul else n, dtype=out_dtype or x.dtype, device=x.device)
    programs = triton.cdiv(n // 2, cfg["BLOCK_N"] // 2) if silu_mul else triton.cdiv(n, cfg["BLOCK_N"])
    _stream_gemv_kernel[(programs,)](
        x, weight, scale if scale is not None else weight, y, n, k, scale.stride(0) if block else 0,
        ROW_SCALED=scale is not None and block is None, BLOCK_SCALED=block is not None,
        SCALE_N=block[0] if block else 1, SCALE_K=block[1] if block else 1, PDL=pdl, GATED=silu_mul,
        SPAN=triton.next_power_of_2(cfg["PIECES"]), **cfg,
        **pdl_launch(pdl))
    return y


def stream_gemv_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
                          block: tuple[int, int] | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Widen the weight (times its scales), multiply in float32."""
    w = weight.float() if scale is None else dequantize_weight(weight, scale, block)
    return (x.float() @ w.t()).to(out_dtype or x.dtype)
