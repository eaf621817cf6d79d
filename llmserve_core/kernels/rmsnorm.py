"""Fused RMSNorm with an optional residual add, one program per row (layers/norm.py semantics).

With a residual, the stream x + residual is rounded to the model dtype (as the eager add does), written
back as the new residual, and normalized in float32; the normalized row is cast to the model dtype before
the weight multiply, as transformers' Qwen3RMSNorm does. One pass instead of four eager kernels.

With a RowQuant the row also leaves as e4m3 with a float32 scale per 1 x group piece (or one per row),
exactly as kernels/fp8_quant.py quantizes the row in the model dtype, in the layout the FP8 projection after
the norm reads: its GEMV then reads x quantized once, instead of each of its programs quantizing the slice
it reads (which held the one-row gate_up GEMV at 3.30 TB/s against 3.89 on the H200:
benchmarks/results/fp8_h200.md), and its W8A8 GEMM (past 64 rows, and prefill) needs no quantization
launch of its own.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmserve_core.kernels.fp8_format import FP8_MAX, MIN_SCALE, RowQuant, empty_quantized
from llmserve_core.kernels.fp8_quant import piece_width, quantize_pieces
from llmserve_core.kernels.pdl import pdl_launch, pdl_wait_and_release


# The row count and the scales' strides vary with the batch where the scales are M-major (stride_sg is the
# padded row count): not specialized, so no batch compiles anew.
@triton.jit(do_not_specialize=["n_rows", "stride_sm", "stride_sg"])
def _rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, scale_ptr, stride_x, stride_r, stride_o, stride_ro,
                    stride_sm, stride_sg, n_rows, n_cols, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
                    GROUP: tl.constexpr, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    mask = c < n_cols
    # Programs past n_rows fill the padding a quantized output asks for: zeros, with the smallest scale.
    row_mask = mask & (row < n_rows)
    w = tl.load(w_ptr + c, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # The residual comes from a kernel further back than the one just before (rmsnorm's contract), so
        # under PDL it is read while that kernel finishes; x comes from it, after the wait.
        r = tl.load(res_ptr + row * stride_r + c, mask=row_mask, other=0.0)
    pdl_wait_and_release(PDL)
    x = tl.load(x_ptr + row * stride_x + c, mask=row_mask, other=0.0)
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + c, x, mask=row_mask)
    x32 = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, 0) / n_cols + eps)
    y = (x32 * rstd).to(x_ptr.dtype.element_ty)
    y = (y.to(tl.float32) * w.to(tl.float32)).to(x_ptr.dtype.element_ty)
    if GROUP == 0:
        tl.store(out_ptr + row * stride_o + c, y, mask=mask)
    else:
        q, scale = quantize_pieces(y, BLOCK, GROUP, FP8_MAX, MIN_SCALE)    # columns past n_cols are zeros
        tl.store(out_ptr + row * stride_o + c, q.to(out_ptr.dtype.element_ty), mask=mask)
        g = tl.arange(0, BLOCK // GROUP)
        tl.store(scale_ptr + row * stride_sm + g * stride_sg, scale, mask=g * GROUP < n_cols)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
            pdl: bool = False, quant: RowQuant | None = None):
    """x: [N, H]. Returns out, or (out, x + residual) when a residual is given (inputs are not modified).

    quant: out is (e4m3, float32 scales) in quant's layout (fp8_format.empty_quantized) instead, the row
    quantized per 1 x quant.group piece (one piece per row where the group is H), with
    fp8_quant.quantize_activation's arithmetic on the row in x's dtype.
    pdl: launch under PDL. The residual is then read before the wait on the kernel just before, so it must
    come from a kernel further back (in a decoder it is the previous norm's residual output, with at least
    a projection between)."""
    assert x.dim() == 2 and x.stride(1) == 1, "x: must be [N, H] with contiguous rows"
    n_rows, n_cols = x.shape
    block = triton.next_power_of_2(n_cols)
    res_out = torch.empty_like(x) if residual is not None else None
    if quant is None:
        out = scale = torch.empty_like(x)           # (scale: any pointer, unread)
        group, stride_sm, stride_sg = 0, 0, 0
    else:
        # One program holds the whole row, so one scale per row is a piece as wide as the tile.
        group = block if quant.group >= n_cols else piece_width(quant.group, n_cols, "rmsnorm")
        out, scale = empty_quantized(n_rows, n_cols, quant, x.device)
        stride_sm, stride_sg = scale.stride()
    if out.shape[0]:
        res = residual if residual is not None else x
        res_o = res_out if res_out is not None else x    # (unwritten without a residual)
        _rmsnorm_kernel[(out.shape[0],)](
            x, res, weight, out, res_o, scale, x.stride(0), res.stride(0), out.stride(0), res_o.stride(0),
            stride_sm, stride_sg, n_rows, n_cols, eps, HAS_RESIDUAL=residual is not None,
            BLOCK=block, GROUP=group, FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE,
            num_warps=8 if n_cols >= 2048 else 4, PDL=pdl, **pdl_launch(pdl),
        )
    normed = out if quant is None else (out, scale)
    return normed if residual is None else (normed, res_out)


def rmsnorm_reference(x, weight, eps, residual=None):
    if residual is not None:
        x = x + residual
    x32 = x.float()
    y = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y if residual is None else (y, x)


def rmsnorm_quant_reference(x, weight, eps, residual=None, quant_group=128):
    """rmsnorm's quantized output (unpadded, scales row-major): the reference norm in x's dtype, then
    fp8_quant's per-piece arithmetic."""
    from llmserve_core.kernels.fp8_quant import quantize_activation_reference
    out = rmsnorm_reference(x, weight, eps, residual)
    normed = out if residual is None else out[0]
    quantized = quantize_activation_reference(normed, quant_group)
    return quantized if residual is None else (quantized, out[1])
