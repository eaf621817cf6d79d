"""SiLU-and-multiply over a packed [gate | up] row: one read of each half and one write, float32 math."""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from llmserve_core.kernels.pdl import pdl_launch, pdl_wait_and_release


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, d, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_wait_and_release(PDL)      # everything this kernel reads comes from the kernel before
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < d
    gate = tl.load(x_ptr + row * stride_x + c, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + c, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_o + c, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(x: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """x: [N, 2 * d] as [gate | up] -> [N, d]."""
    assert x.dim() == 2 and x.stride(1) == 1 and x.shape[1] % 2 == 0, "x: must be [N, 2 * d], rows contiguous"
    n, d = x.shape[0], x.shape[1] // 2
    out = torch.empty(n, d, dtype=x.dtype, device=x.device)
    if n:
        block = min(1024, triton.next_power_of_2(d))
        _silu_mul_kernel[(n, triton.cdiv(d, block))](x, out, x.stride(0), out.stride(0), d, BLOCK=block,
                                                     num_warps=4, PDL=pdl, **pdl_launch(pdl))
    return out


def silu_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)
