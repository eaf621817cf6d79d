"""Fused RMSNorm with an optional residual add, one program per row (layers/norm.py semantics).

With a residual, the stream x + residual is rounded to the model dtype (as the eager add does), written
back as the new residual, and normalized in float32; the normalized row is cast to the model dtype before
the weight multiply, as transformers' Qwen3RMSNorm does. One pass instead of four eager kernels.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmserve_core.kernels.pdl import pdl_launch, pdl_wait_and_release


@triton.jit
def _rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_r, stride_o, stride_ro,
                    n_cols, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
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
    tl.store(out_ptr + row * stride_o + c, (y.to(tl.float32) * w.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=mask)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
            pdl: bool = False):
    """x: [N, H]. Returns out, or (out, x + residual) when a residual is given (inputs are not modified).

    pdl: launch under PDL. The residual is then read before the wait on the kernel just before, so it must
    come from a kernel further back (in a decoder it is the previous norm's residual output, with at least
    a projection between)."""
    assert x.dim() == 2 and x.stride(1) == 1, "x: must be [N, H] with contiguous rows"
    n_rows, n_cols = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else out
    if n_rows:
        res = residual if residual is not None else x
        _rmsnorm_kernel[(n_rows,)](
            x, res, weight, out, res_out, x.stride(0), res.stride(0), out.stride(0), res_out.stride(0),
            n_cols, eps, HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(n_cols),
            num_warps=8 if n_cols >= 2048 else 4, PDL=pdl, **pdl_launch(pdl),
        )
    return out if residual is None else (out, res_out)


def rmsnorm_reference(x, weight, eps, residual=None):
    if residual is not None:
        x = x + residual
    x32 = x.float()
    y = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y if residual is None else (y, x)
