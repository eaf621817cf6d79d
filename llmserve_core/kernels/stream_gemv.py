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
float32 scale per output row (applied once, after the reduction).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmserve_core.kernels.gemv import num_sms
from llmserve_core.kernels.pdl import pdl_launch

MIN_BLOCK_K = 64     # a K that this does not divide has no tile


@triton.jit
def _stream_gemv_kernel(x_ptr, w_ptr, scale_ptr, y_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        HAS_SCALE: tl.constexpr, PDL: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rk = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * K + rk[None, :]
    # The first tile is read before the grid dependency resolves: no kernel before this one writes W.
    w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)
    if PDL:     # (kernels/pdl.py)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        # K is a multiple of BLOCK_K (stream_gemv_config): only the last prefetch would run past the end.
        nxt = k0 + BLOCK_K
        w_next = tl.load(w_ptrs + nxt, mask=n_mask[:, None] & (nxt < K), other=0.0)
        acc += w.to(tl.float32) * tl.load(x_ptr + k0 + rk).to(tl.float32)[None, :]
        w = w_next
    y = tl.sum(acc, 1)
    if HAS_SCALE:
        y = y * tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_mask)


def stream_gemv_config(n: int, k: int, block_n: int = 8, sms: int = 132) -> dict | None:
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
                out_dtype: torch.dtype | None = None, pdl: bool = False, config: dict | None = None) -> torch.Tensor:
    """x [1, K], weight [N, K] (x's dtype, or float8_e4m3fn with scale [N] float32) -> [1, N]."""
    n, k = weight.shape
    assert x.shape == (1, k) and x.stride(1) == 1 and weight.is_contiguous(), "stream_gemv: one contiguous row"
    assert (scale is None) == (weight.dtype == x.dtype), "stream_gemv: a scale comes with an FP8 weight, and only then"
    cfg = config or stream_gemv_config(n, k, sms=num_sms(x.device))
    assert cfg is not None and k % cfg["BLOCK_K"] == 0, f"stream_gemv: no tile for a [{n}, {k}] weight"
    y = torch.empty(1, n, dtype=out_dtype or x.dtype, device=x.device)
    _stream_gemv_kernel[(triton.cdiv(n, cfg["BLOCK_N"]),)](
        x, weight, scale if scale is not None else weight, y, n, k, HAS_SCALE=scale is not None, PDL=pdl,
        **cfg, **pdl_launch(pdl))
    return y


def stream_gemv_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
                          out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Widen the weight (times its row scale), multiply in float32."""
    w = weight.float() if scale is None else weight.float() * scale.float()[:, None]
    return (x.float() @ w.t()).to(out_dtype or x.dtype)
