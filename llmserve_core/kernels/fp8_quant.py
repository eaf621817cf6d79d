"""Dynamic FP8 activation quantization: one scale per token (row), or per 1 x group piece of a row."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmserve_core.kernels.fp8_format import FP8_MAX, MIN_SCALE, RowQuant, empty_quantized, to_fp8


# stride_sg is the row count where the scales are M-major: not specialized, so no row count compiles anew.
@triton.jit(do_not_specialize=["M", "stride_sm", "stride_sg"])
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, M, K, group, stride_xm, stride_qm, stride_sm, stride_sg,
                          FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    """One program per (row, group of `group` columns): amax pass, then the scaled, saturating cast. Rows
    past M (padding) read as zeros."""
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    lo = g * group
    hi = tl.minimum(lo + group, K)
    hi_x = tl.where(row < M, hi, lo)     # a padding row reads nothing
    amax = tl.zeros([BLOCK], tl.float32)
    for k0 in range(lo, hi, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_xm + k, mask=k < hi_x, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, 0) / FP8_MAX, MIN_SCALE)
    tl.store(s_ptr + row * stride_sm + g * stride_sg, scale)
    for k0 in range(lo, hi, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_xm + k, mask=k < hi_x, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(x / scale, -FP8_MAX), FP8_MAX)
        tl.store(q_ptr + row * stride_qm + k, q.to(q_ptr.dtype.element_ty), mask=k < hi)


@triton.jit
def quantize_pieces(y, BLOCK: tl.constexpr, GROUP: tl.constexpr, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr):
    """A [BLOCK] row tile (already in the model dtype) quantized per 1 x GROUP piece with this module's
    arithmetic: (float32 codes in e4m3 range [BLOCK], scales [BLOCK // GROUP]). For the kernels that hand an
    FP8 GEMV its rows quantized ahead (kernels/rmsnorm.py, kernels/silu_mul.py); elements past the row must
    be zeros."""
    pieces = tl.reshape(y.to(tl.float32), (BLOCK // GROUP, GROUP))
    scale = tl.maximum(tl.max(tl.abs(pieces), 1) / FP8_MAX, MIN_SCALE)
    q = tl.minimum(tl.maximum(pieces / scale[:, None], -FP8_MAX), FP8_MAX)
    return tl.reshape(q, (BLOCK,)), scale


def piece_width(group: int, width: int, who: str) -> int:
    """A quantization group a row-producing kernel can take as a constexpr piece of its row tile: a power of
    2 dividing the row's width."""
    assert group >= 1 and width % group == 0 and group & (group - 1) == 0, \
        f"{who}: quantization groups of {group} must be a power of 2 dividing {width}"
    return group


def quantize_activation(x: torch.Tensor, group: int | None = None, m_major: bool = False,
                        pad_rows_to: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic activation quantization: x [M, K] -> (fp8 [M, K], float32 scales [M, ceil(K/group)]).

    group None: one scale per token (row), as compressed-tensors' per-token scheme; group 128: one per
    1 x 128 piece of a row, what a 128 x 128 block-scaled weight is multiplied against. m_major: the scales
    are laid out row index fastest (strides (1, rows)), the layout cuBLAS's 1 x 128 block scaling reads.
    pad_rows_to: the rows come padded to a multiple of it, zeros (with the smallest scale) past M.
    """
    m, k = x.shape
    assert x.stride(1) == 1, "x: last dim must be contiguous"
    group = group or k
    q, scale = empty_quantized(m, k, RowQuant(group, m_major, pad_rows_to), x.device)
    rows, num_groups = scale.shape
    if rows == 0:
        return q, scale
    _quantize_rows_kernel[(rows, num_groups)](
        x, q, scale, m, k, group, x.stride(0), q.stride(0), scale.stride(0), scale.stride(1),
        FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE, BLOCK=min(1024, triton.next_power_of_2(group)), num_warps=4)
    return q, scale


def quantize_activation_reference(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = x.shape
    group = group or k
    num_groups = triton.cdiv(k, group)
    padded = torch.zeros(m, num_groups * group, dtype=torch.float32, device=x.device)
    padded[:, :k] = x.float()
    pieces = padded.view(m, num_groups, group)
    scale = (pieces.abs().amax(dim=2) / FP8_MAX).clamp_min(MIN_SCALE)
    q = to_fp8(pieces / scale[:, :, None]).view(m, -1)[:, :k].contiguous()
    return q, scale
