"""SiLU-and-multiply over a packed [gate | up] row: one read of each half and one write, float32 math.

With a quantization group the row also leaves as e4m3 with a float32 scale per 1 x group piece, exactly as
kernels/fp8_quant.py quantizes the row in the model dtype, for an FP8 down_proj whose measured tile reads x
quantized ahead (kernels/fp8_gemv.X_AHEAD_CONFIGS): one launch fewer than quantizing it on its own.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from llmserve_core.kernels.fp8_format import FP8, FP8_MAX, MIN_SCALE
from llmserve_core.kernels.fp8_quant import quantize_pieces
from llmserve_core.kernels.pdl import pdl_launch, pdl_wait_and_release


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, scale_ptr, stride_x, stride_o, stride_s, d, BLOCK: tl.constexpr,
                     GROUP: tl.constexpr, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, PDL: tl.constexpr):
    pdl_wait_and_release(PDL)      # everything this kernel reads comes from the kernel before
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < d
    gate = tl.load(x_ptr + row * stride_x + c, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + c, mask=mask, other=0.0).to(tl.float32)
    y = (gate / (1.0 + tl.exp(-gate)) * up).to(x_ptr.dtype.element_ty)
    if GROUP == 0:
        tl.store(out_ptr + row * stride_o + c, y, mask=mask)
    else:
        # BLOCK is a multiple of GROUP, and columns past d are zeros
        q, scale = quantize_pieces(y, BLOCK, GROUP, FP8_MAX, MIN_SCALE)
        tl.store(out_ptr + row * stride_o + c, q.to(out_ptr.dtype.element_ty), mask=mask)
        g = tl.program_id(1) * (BLOCK // GROUP) + tl.arange(0, BLOCK // GROUP)
        tl.store(scale_ptr + row * stride_s + g, scale, mask=g * GROUP < d)


def silu_mul(x: torch.Tensor, pdl: bool = False, quant_group: int | None = None):
    """x: [N, 2 * d] as [gate | up] -> [N, d] in x's dtype, or with quant_group (e4m3 [N, d], float32 scales
    [N, d / quant_group]): the row quantized per 1 x quant_group piece, fp8_quant.quantize_activation's
    arithmetic on the row in x's dtype."""
    assert x.dim() == 2 and x.stride(1) == 1 and x.shape[1] % 2 == 0, "x: must be [N, 2 * d], rows contiguous"
    n, d = x.shape[0], x.shape[1] // 2
    group = quant_group or 0
    assert group == 0 or (d % group == 0 and group & (group - 1) == 0), \
        f"silu_mul: quantization groups of {group} must be a power of 2 dividing {d}"
    out = torch.empty(n, d, dtype=FP8 if group else x.dtype, device=x.device)
    scale = torch.empty(n, d // group, dtype=torch.float32, device=x.device) if group else None
    if n:
        block = min(1024, triton.next_power_of_2(d))
        scales, stride_s = (scale, scale.stride(0)) if group else (out, 0)   # (out: any pointer, unread)
        _silu_mul_kernel[(n, triton.cdiv(d, block))](x, out, scales, x.stride(0), out.stride(0), stride_s, d,
                                                     BLOCK=block, GROUP=group, FP8_MAX=FP8_MAX,
                                                     MIN_SCALE=MIN_SCALE, num_warps=4, PDL=pdl,
                                                     **pdl_launch(pdl))
    return (out, scale) if group else out


def silu_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)
