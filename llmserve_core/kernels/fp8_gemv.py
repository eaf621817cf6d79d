"""Weight-only FP8 GEMV for 1-16 rows: out [M, N] = x [M, K] @ dequant(w [N, K] fp8)^T.

At decode sizes the whole cost of a linear layer is streaming its weight from HBM, so the kernel reads
each FP8 weight byte once, widens it to the activation dtype in registers and multiplies on the tensor
cores (the 16-row tile pads the few real rows; the MMA is free next to the memory traffic). Activations stay
in bf16: quantizing them would cost a launch and buy nothing here.

Each program owns BLOCK_N output columns over a 1/SPLIT_K slice of K. Small N (few column tiles) splits K
so every SM has weight to stream; the partial sums then meet in a float32 buffer by atomic add.
Scales are either one per output row (applied once at the end) or one per scale-block (applied per K
tile, which never straddles a scale block because BLOCK_K divides the block's K side).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmserve_core.layers.fp8 import dequantize_weight

NUM_SMS = 132            # H200; only sizes the grid, correctness never depends on it
MAX_ROWS = 16


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, out_ptr, M, N, K,
                     stride_xm, stride_wn, stride_om, stride_sn, stride_sk,
                     SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, BLOCK_SCALED: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     SPLIT_K: tl.constexpr, PRECISION: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    n_mask = n < N
    m_mask = m < M
    k_per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    w_rows = w_ptr + n[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < k_hi
        x = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        part = tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=PRECISION)
        if BLOCK_SCALED:
            s = tl.load(s_ptr + (n // SCALE_N) * stride_sn + (k0 // SCALE_K) * stride_sk, mask=n_mask, other=0.0)
            acc += part * s[None, :]
        else:
            acc += part
    if not BLOCK_SCALED:
        acc = acc * tl.load(s_ptr + n, mask=n_mask, other=0.0)[None, :]
    dst = out_ptr + m[:, None] * stride_om + n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(dst, acc, mask=mask)


def choose_gemv_config(n: int, k: int, block: tuple[int, int] | None, num_sms: int = NUM_SMS) -> dict:
    """Narrow column tiles until there are about two programs per SM, then split K if still short.

    At Qwen3-8B's shapes (N 4096-24576) the tiles alone give 256-384 programs, so no split is needed and the
    output is written once in its dtype; split-K serves narrow layers (and the tiny test models).
    """
    block_k = 128 if block is None else min(128, block[1])
    block_n = 16
    for candidate in (64, 32):
        if triton.cdiv(n, candidate) >= 2 * num_sms:
            block_n = candidate
            break
    programs = triton.cdiv(n, block_n)
    split_k = 1
    if programs < num_sms:
        split_k = max(1, min(triton.cdiv(num_sms, programs), k // (4 * block_k), 16))
    return dict(block_n=block_n, block_k=block_k, split_k=split_k, num_warps=4, num_stages=4)


def fp8_gemv(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None,
             *, block_n: int | None = None, block_k: int | None = None, split_k: int | None = None,
             num_warps: int | None = None, num_stages: int | None = None) -> torch.Tensor:
    """x [M <= 16, K] (float), w [N, K] float8_e4m3fn, scale per row [N] or per block -> [M, N] in x.dtype."""
    m, k = x.shape
    n = w.shape[0]
    assert m <= MAX_ROWS, f"fp8_gemv: at most {MAX_ROWS} rows, got {m}"
    assert w.shape[1] == k and x.stride(1) == 1 and w.stride(1) == 1
    cfg = choose_gemv_config(n, k, block)
    block_n = block_n or cfg["block_n"]
    block_k = block_k or cfg["block_k"]
    split_k = split_k or cfg["split_k"]
    if block is not None:
        assert block[1] % block_k == 0, "fp8_gemv: BLOCK_K must divide the scale block's K side"
        stride_sn, stride_sk = scale.stride(0), scale.stride(1)
    else:
        assert scale.shape == (n,), f"fp8_gemv: per-channel scale must be [{n}], got {tuple(scale.shape)}"
        stride_sn, stride_sk = 1, 0
    out = torch.zeros(m, n, dtype=torch.float32, device=x.device) if split_k > 1 else \
        torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.to(x.dtype)
    _fp8_gemv_kernel[(triton.cdiv(n, block_n), split_k)](
        x, w, scale, out, m, n, k, x.stride(0), w.stride(0), out.stride(0), stride_sn, stride_sk,
        SCALE_N=block[0] if block else 1, SCALE_K=block[1] if block else 1, BLOCK_SCALED=block is not None,
        BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=num_warps or cfg["num_warps"], num_stages=num_stages or cfg["num_stages"],
    )
    return out.to(x.dtype) if split_k > 1 else out


def fp8_gemv_reference(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                       block: tuple[int, int] | None = None) -> torch.Tensor:
    """Dequantize the weight, multiply in float32."""
    return (x.float() @ dequantize_weight(w, scale, block).t()).to(x.dtype)
