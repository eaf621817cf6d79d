"""Fused RMSNorm with an optional residual add, one program per row (layers/norm.py semantics).

With a residual, the stream x + residual is rounded to the model dtype (as the eager add does), written
back as the new residual, and normalized in float32; the normalized row is cast to the model dtype before
the weight multiply, as transformers' Qwen3RMSNorm does. One pass instead of four eager kernels.

With a quantization group the row also leaves as e4m3 with a float32 scale per 1 x group piece, exactly as
kernels/fp8_quant.py quantizes the row in the model dtype: the FP8 GEMV after the norm then reads x
quantized once, instead of each of its programs quantizing the slice it reads (which held the one-row
gate_up GEMV at 3.30 TB/s against 3.89 on the H200: benchmarks/results/fp8_h200.md).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmserve_core.kernels.fp8_format import FP8, FP8_MAX, MIN_SCALE
from llmserve_core.kernels.fp8_quant import quantize_pieces
from llmserve_core.kernels.pdl import pdl_launch, pdl_wait_and_release


@triton.jit
def _rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, scale_ptr, stride_x, stride_r, stride_o, stride_ro,
                    stride_s, n_cols, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr,
                    FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    mask = c < n_cols
    w = tl.load(w_ptr + c, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # The residual comes from a kernel further back than the one just before (rmsnorm's contract), so
        # under PDL it is read while that kernel finishes; x comes from it, after the wait.
        r = tl.load(res_ptr + row * stride_r + c, mask=mask, other=0.0)
    pdl_wait_and_release(PDL)
    x = tl.load(x_ptr + row * stride_x + c, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + c, x, mask=mask)
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
        tl.store(scale_ptr + row * stride_s + g, scale, mask=g * GROUP < n_cols)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
            pdl: bool = False, quant_group: int | None = None):
    """x: [N, H]. Returns out, or (out, x + residual) when a residual is given (inputs are not modified).

    quant_group: out is (e4m3 [N, H], float32 scales [N, H / quant_group]) instead, the row quantized per
    1 x quant_group piece (fp8_quant.quantize_activation's arithmetic on the row in x's dtype).
    pdl: launch under PDL. The residual is then read before the wait on the kernel just before, so it must
    come from a kernel further back (in a decoder it is the previous norm's residual output, with at least
    a projection between)."""
    assert x.dim() == 2 and x.stride(1) == 1, "x: must be [N, H] with contiguous rows"
    n_rows, n_cols = x.shape
    group = quant_group or 0
    assert group == 0 or (n_cols % group == 0 and group & (group - 1) == 0), \
        f"rmsnorm: quantization groups of {group} must be a power of 2 dividing {n_cols}"
    out = torch.empty_like(x) if not group else torch.empty(n_rows, n_cols, dtype=FP8, device=x.device)
    scale = torch.empty(n_rows, n_cols // group, dtype=torch.float32, device=x.device) if group else None
    res_out = torch.empty_like(x) if residual is not None else out
    if n_rows:
        res = residual if residual is not None else x
        scales, stride_s = (scale, scale.stride(0)) if group else (out, 1)    # (out: any pointer, unread)
        _rmsnorm_kernel[(n_rows,)](
            x, res, weight, out, res_out, scales, x.stride(0), res.stride(0), out.stride(0), res_out.stride(0),
            stride_s, n_cols, eps, HAS_RESIDUAL=residual is not None,
            BLOCK=triton.next_power_of_2(n_cols), GROUP=group, FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE,
            num_warps=8 if n_cols >= 2048 else 4, PDL=pdl, **pdl_launch(pdl),
        )
    normed = (out, scale) if group else out
    return normed if residual is None else (normed, res_out)


def rmsnorm_reference(x, weight, eps, residual=None):
    if residual is not None:
        x = x + residual
    x32 = x.float()
    y = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y if residual is None else (y, x)


def rmsnorm_quant_reference(x, weight, eps, residual=None, quant_group=128):
    """rmsnorm's quantized output: the reference norm in x's dtype, then fp8_quant's per-piece arithmetic."""
    from llmserve_core.kernels.fp8_quant import quantize_activation_reference
    out = rmsnorm_reference(x, weight, eps, residual)
    normed = out if residual is None else out[0]
    quantized = quantize_activation_reference(normed, quant_group)
    return quantized if residual is None else (quantized, out[1])
