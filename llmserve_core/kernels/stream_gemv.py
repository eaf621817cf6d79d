"""y = x @ W^T for one row, streaming W through registers: the decoder's projections at batch-1 decode.

At batch 1 a projection is a pure weight stream (qkv 50 MB, o_proj 34 MB, down 101 MB in bf16 at the
Qwen3-8B shape), and what it loses against the copy bandwidth is its start and its end: cuBLAS's skinny
kernels launch one wave of 96-128 programs, so a third of the multiprocessors idle on qkv. Here every
program owns BLOCK_N whole rows of W (no split-K, so no second pass), there are enough programs to fill
every multiprocessor several times over, and each keeps the next [BLOCK_N, BLOCK_K] tile in flight while
it multiplies the current one in float32 on the CUDA cores (a GEMV has no use for tensor cores).

With PDL (programmatic dependent launch, Hopper and later) the kernel starts before the one it follows
has finished: it loads its first weight tile, which no earlier kernel writes, then waits on the grid
dependency before it reads x, and lets the kernel after it launch at once. So a decode layer's chain of
launches overlaps each kernel's ramp with its predecessor's tail. Weights may be float8_e4m3fn with one
float32 scale per output row (applied once, after the reduction) or per 128 x 128 block (Qwen's FP8
checkpoints: a program's 8 rows share their block row, so each column's scale multiplies x).

The small kernels between the projections can ride in the reading of x (the "prologue"): the residual
add + RMSNorm before qkv_proj and gate_up_proj, and SiLU-and-mul before down_proj. Each program then
computes its x from the inputs of the kernel it replaces (a few KB of L2 reads for the norm's statistic,
while its first weight tile is in flight), so a batch-1 layer launches three fewer kernels, each of which
was a short serial step between two weight streams.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmserve_core.kernels.fp8_format import dequantize_weight
from llmserve_core.kernels.gemv import num_sms
from llmserve_core.kernels.pdl import pdl_launch, pdl_wait_and_release

MIN_BLOCK_K = 64     # a K that this does not divide has no tile
ROWS_PER_PROGRAM = 8


# What the kernel reads as x (PROLOGUE): the row itself; RMSNorm of the row (plus a residual), the norm
# that precedes qkv_proj and gate_up_proj; or SiLU(gate) * up of a packed [gate | up] row, before down_proj.
PLAIN, NORM, SILU = 0, 1, 2


@triton.jit
def _x_tile(x_ptr, res_ptr, res_out_ptr, norm_w_ptr, k, K, rstd, write_residual,
            PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """x[k] in float32, rounded as the separate kernels round it (kernels/rmsnorm.py, kernels/silu_mul.py),
    so the fused chain computes what the unfused one does."""
    dtype = x_ptr.dtype.element_ty
    if PROLOGUE == 2:
        gate = tl.load(x_ptr + k).to(tl.float32)
        up = tl.load(x_ptr + K + k).to(tl.float32)
        return (gate / (1.0 + tl.exp(-gate)) * up).to(dtype).to(tl.float32)
    x = tl.load(x_ptr + k)
    if PROLOGUE == 1:
        if HAS_RESIDUAL:
            x = (x.to(tl.float32) + tl.load(res_ptr + k).to(tl.float32)).to(dtype)
            tl.store(res_out_ptr + k, x, mask=write_residual)
        y = (x.to(tl.float32) * rstd).to(dtype)
        return (y.to(tl.float32) * tl.load(norm_w_ptr + k).to(tl.float32)).to(dtype).to(tl.float32)
    return x.to(tl.float32)


@triton.jit
def _stream_gemv_kernel(x_ptr, w_ptr, scale_ptr, y_ptr, res_ptr, res_out_ptr, norm_w_ptr, eps, N, K, stride_sn,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROW_SCALED: tl.constexpr,
                        BLOCK_SCALED: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr,
                        PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rk = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * K + rk[None, :]
    # The first tile is read before the grid dependency resolves: no kernel before this one writes W.
    w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)
    pdl_wait_and_release(PDL)
    rstd = 1.0
    if PROLOGUE == 1:
        # The norm's statistic needs the whole row first: every program reads it (from L2, a few KB) while
        # its first weight tile is in flight. Program 0 alone writes the residual stream back.
        squares = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_ptr + k0 + rk)
            if HAS_RESIDUAL:
                x = (x.to(tl.float32) + tl.load(res_ptr + k0 + rk).to(tl.float32)).to(x_ptr.dtype.element_ty)
            x32 = x.to(tl.float32)
            squares += x32 * x32
        rstd = 1.0 / tl.sqrt(tl.sum(squares, 0) / K + eps)
    write_residual = (rk < BLOCK_K) & (pid == 0)
    # Block scales: BLOCK_N divides SCALE_N, so a program's rows share one row of scales, and each
    # column's scale folds into x.
    s_row = scale_ptr + (pid * BLOCK_N // SCALE_N) * stride_sn
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        # K is a multiple of BLOCK_K (stream_gemv_config): only the last prefetch would run past the end.
        nxt = k0 + BLOCK_K
        w_next = tl.load(w_ptrs + nxt, mask=n_mask[:, None] & (nxt < K), other=0.0)
        xk = _x_tile(x_ptr, res_ptr, res_out_ptr, norm_w_ptr, k0 + rk, K, rstd, write_residual,
                     PROLOGUE, HAS_RESIDUAL)
        if BLOCK_SCALED:
            xk = xk * tl.load(s_row + (k0 + rk) // SCALE_K)
        acc += w.to(tl.float32) * xk[None, :]
        w = w_next
    y = tl.sum(acc, 1)
    if ROW_SCALED:
        y = y * tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_mask)


def stream_gemv_config(n: int, k: int, block_n: int = ROWS_PER_PROGRAM, sms: int = 132) -> dict | None:
    """Tiles for an [n, k] weight, or None where no tile width divides K. Measured on the H200
    (benchmarks/pdl_chain_bench.py, bf16 and FP8): 8 rows x 512 columns a program, except where the
    programs would overfill one wave of about four per multiprocessor (qkv's 768 on 132): there half-width
    tiles hold fewer registers, so the whole grid stays resident at once. Long rows (down_proj's 12,288)
    stream faster under PDL with 8 warps a program (25.1 against 27.3 us)."""
    block_k = 512 if -(-n // block_n) <= 4 * sms else 256
    num_warps = 8 if k >= 8192 else 4
    while block_k > MIN_BLOCK_K and k % block_k:
        block_k //= 2
    if k % block_k:
        return None
    return dict(BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=1)


def stream_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
                block: tuple[int, int] | None = None, out_dtype: torch.dtype | None = None, pdl: bool = False,
                config: dict | None = None, *, norm: tuple[torch.Tensor, float] | None = None,
                residual: torch.Tensor | None = None, silu: bool = False):
    """x [1, K], weight [N, K] -> [1, N]. The weight is x's dtype, or float8_e4m3fn with float32 scales:
    one per row ([N]) or, with block (bn, bk), one per bn x bk tile ([ceil(N / bn), ceil(K / bk)]).

    norm (weight, eps): x is the residual stream's input instead, and the projection reads RMSNorm(x +
    residual) (RMSNorm(x) without a residual); returns (y, x + residual), the new residual stream (x itself
    without one). silu: x is a packed [1, 2K] [gate | up] row and the projection reads SiLU(gate) * up."""
    n, k = weight.shape
    assert not (silu and norm is not None) and (residual is None or norm is not None), \
        "stream_gemv: one prologue, and a residual only with the norm"
    assert x.shape == (1, 2 * k if silu else k) and x.stride(1) == 1 and weight.is_contiguous(), \
        "stream_gemv: one contiguous row"
    assert (scale is None) == (weight.dtype == x.dtype), "stream_gemv: a scale comes with an FP8 weight, and only then"
    cfg = config or stream_gemv_config(n, k, sms=num_sms(x.device))
    assert cfg is not None and k % cfg["BLOCK_K"] == 0, f"stream_gemv: no tile for a [{n}, {k}] weight"
    if block is not None:
        assert block[0] % cfg["BLOCK_N"] == 0, f"stream_gemv: {cfg['BLOCK_N']} rows a program split a {block} scale block"
        assert scale.shape == (-(-n // block[0]), -(-k // block[1])) and scale.stride(1) == 1, \
            "stream_gemv: block scales must be [ceil(N / bn), ceil(K / bk)], rows contiguous"
    elif scale is not None:
        assert scale.shape == (n,), f"stream_gemv: row scales must be [{n}], got {tuple(scale.shape)}"
    if norm is not None:
        assert norm[0].shape == (k,) and (residual is None or (residual.shape == x.shape and residual.stride(1) == 1)), \
            "stream_gemv: the norm's weight is [K] and the residual is a row like x"
    y = torch.empty(1, n, dtype=out_dtype or x.dtype, device=x.device)
    res_out = torch.empty_like(x) if residual is not None else x
    _stream_gemv_kernel[(triton.cdiv(n, cfg["BLOCK_N"]),)](
        x, weight, scale if scale is not None else weight, y, residual if residual is not None else x, res_out,
        norm[0] if norm is not None else x, norm[1] if norm is not None else 0.0, n, k,
        scale.stride(0) if block else 0,
        ROW_SCALED=scale is not None and block is None, BLOCK_SCALED=block is not None,
        SCALE_N=block[0] if block else 1, SCALE_K=block[1] if block else 1,
        PROLOGUE=SILU if silu else NORM if norm is not None else PLAIN, HAS_RESIDUAL=residual is not None,
        PDL=pdl, **cfg, **pdl_launch(pdl))
    return y if norm is None else (y, res_out)


def stream_gemv_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
                          block: tuple[int, int] | None = None, out_dtype: torch.dtype | None = None, *,
                          norm: tuple[torch.Tensor, float] | None = None, residual: torch.Tensor | None = None,
                          silu: bool = False):
    """The separate kernels' references (RMSNorm, SiLU-and-mul), then the weight widened (times its
    scales) and the product in float32."""
    from llmserve_core.kernels.rmsnorm import rmsnorm_reference
    from llmserve_core.kernels.silu_mul import silu_mul_reference
    stream = x
    if silu:
        x = silu_mul_reference(x)
    elif norm is not None:
        x, stream = (rmsnorm_reference(x, norm[0], norm[1]), x) if residual is None else \
            rmsnorm_reference(x, norm[0], norm[1], residual)
    w = weight.float() if scale is None else dequantize_weight(weight, scale, block)
    y = (x.float() @ w.t()).to(out_dtype or x.dtype)
    return y if norm is None else (y, stream)
