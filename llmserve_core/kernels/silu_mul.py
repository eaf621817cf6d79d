"""SiLU-and-multiply over a packed [gate | up] row: one read of each half and one write, float32 math.

With a RowQuant the row also leaves as e4m3 with a float32 scale per 1 x group piece (or one per row),
exactly as kernels/fp8_quant.py quantizes the row in the model dtype, in the layout the FP8 down_proj
reads: one launch fewer than quantizing it on its own. Per piece, each program quantizes the pieces of the
tile it computes; one scale per row needs the whole row's amax first, so one program holds a row (rows
wider than its tile are computed twice, the second pass reading gate and up from L2).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from llmserve_core.kernels.fp8_format import FP8_MAX, MIN_SCALE, RowQuant, empty_quantized
from llmserve_core.kernels.fp8_quant import piece_width, quantize_pieces
from llmserve_core.kernels.pdl import pdl_launch, pdl_wait_and_release


@triton.jit
def silu_times(gate, up):
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def _silu_mul_tile(x_ptr, row, c, d, stride_x, mask):
    """SiLU(gate) * up for columns c of a row, rounded to the model dtype (zeros where masked)."""
    gate = tl.load(x_ptr + row * stride_x + c, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + c, mask=mask, other=0.0).to(tl.float32)
    return silu_times(gate, up).to(x_ptr.dtype.element_ty)


# A GEMV over the packed [gate | up] weight can end in the SiLU-and-mul itself (its GATED variants, which
# the decode MLP takes where down_proj wants its input as it is): each program owns BLOCK_N / 2 output
# columns and reads their gate rows and their up rows, so both halves of every column meet in one program.
@triton.jit
def gated_rows(pid, n, BLOCK_N: tl.constexpr):
    """Program pid's output columns [BLOCK_N / 2] and its weight rows [BLOCK_N] of a packed [gate | up]
    weight of n = 2 d rows (the columns' gate rows, then their up rows), with the rows' mask."""
    i = tl.arange(0, BLOCK_N)
    col = pid * (BLOCK_N // 2) + i % (BLOCK_N // 2)
    cols = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    return cols, col + (i // (BLOCK_N // 2)) * (n // 2), col < n // 2


@triton.jit
def column_block(pid, n, BLOCK_N: tl.constexpr, GATED: tl.constexpr):
    """Program pid's weight rows [BLOCK_N] and their mask, and the output columns they make: gated_rows' over a
    packed [gate | up] weight (GATED), else BLOCK_N rows in a row, each its own column."""
    if GATED:
        cols, offs_n, n_mask = gated_rows(pid, n, BLOCK_N)
    else:
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < n
        cols = offs_n
    return cols, offs_n, n_mask


@triton.jit
def silu_mul_halves(acc):
    """[BLOCK_N, M] float32 products over gated_rows' rows -> [BLOCK_N / 2, M] SiLU(gate) * up."""
    gate, up = tl.split(tl.permute(tl.reshape(acc, (2, acc.shape[0] // 2, acc.shape[1])), (1, 2, 0)))
    return silu_times(gate, up)


# The row count and the scales' strides vary with the batch where the scales are M-major (stride_sg is the
# padded row count): not specialized, so no batch compiles anew.
@triton.jit(do_not_specialize=["n_rows", "stride_sm", "stride_sg"])
def _silu_mul_kernel(x_ptr, out_ptr, scale_ptr, stride_x, stride_o, stride_sm, stride_sg, n_rows, d,
                     BLOCK: tl.constexpr, GROUP: tl.constexpr, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
                     PDL: tl.constexpr):
    pdl_wait_and_release(PDL)      # everything this kernel reads comes from the kernel before
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < d
    y = _silu_mul_tile(x_ptr, row, c, d, stride_x, mask & (row < n_rows))    # padding rows: zeros
    if GROUP == 0:
        tl.store(out_ptr + row * stride_o + c, y, mask=mask)
    else:
        # BLOCK is a multiple of GROUP, and columns past d are zeros
        q, scale = quantize_pieces(y, BLOCK, GROUP, FP8_MAX, MIN_SCALE)
        tl.store(out_ptr + row * stride_o + c, q.to(out_ptr.dtype.element_ty), mask=mask)
        g = tl.program_id(1) * (BLOCK // GROUP) + tl.arange(0, BLOCK // GROUP)
        tl.store(scale_ptr + row * stride_sm + g * stride_sg, scale, mask=g * GROUP < d)


@triton.jit(do_not_specialize=["n_rows", "stride_s"])
def _silu_mul_row_scale_kernel(x_ptr, out_ptr, scale_ptr, stride_x, stride_o, stride_s, n_rows, d,
                               BLOCK: tl.constexpr, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
                               PDL: tl.constexpr):
    pdl_wait_and_release(PDL)
    row = tl.program_id(0).to(tl.int64)
    live = row < n_rows
    if d <= BLOCK:      # the row in one tile: one read of gate and up, all of it in flight at once
        c = tl.arange(0, BLOCK)
        y = _silu_mul_tile(x_ptr, row, c, d, stride_x, (c < d) & live)     # zeros past d
        q, piece = quantize_pieces(y, BLOCK, BLOCK, FP8_MAX, MIN_SCALE)       # the row is one piece
        scale = tl.max(piece, 0)
        tl.store(out_ptr + row * stride_o + c, q.to(out_ptr.dtype.element_ty), mask=c < d)
    else:               # wider rows: the amax over the row's tiles, then the tiles again (from L2), quantized
        amax = tl.zeros([BLOCK], tl.float32)
        for c0 in range(0, d, BLOCK):
            c = c0 + tl.arange(0, BLOCK)
            y = _silu_mul_tile(x_ptr, row, c, d, stride_x, (c < d) & live)
            amax = tl.maximum(amax, tl.abs(y.to(tl.float32)))
        scale = tl.maximum(tl.max(amax, 0) / FP8_MAX, MIN_SCALE)
        for c0 in range(0, d, BLOCK):
            c = c0 + tl.arange(0, BLOCK)
            y = _silu_mul_tile(x_ptr, row, c, d, stride_x, (c < d) & live).to(tl.float32)
            q = tl.minimum(tl.maximum(y / scale, -FP8_MAX), FP8_MAX)
            tl.store(out_ptr + row * stride_o + c, q.to(out_ptr.dtype.element_ty), mask=c < d)
    tl.store(scale_ptr + row * stride_s, scale)


# One program per row quantized per token: 16 warps over a tile of up to 16,384 columns hold a Qwen3-8B
# row (12,288) in one read; 4 warps looping over 1,024-column tiles took 12.4 us a row at 128 rows (H100),
# more than the plain SiLU-and-mul and a quantization launch together.
ROW_SCALE_BLOCK, ROW_SCALE_WARPS = 16384, 16


def silu_mul(x: torch.Tensor, pdl: bool = False, quant: RowQuant | None = None):
    """x: [N, 2 * d] as [gate | up] -> [N, d] in x's dtype, or with quant (e4m3, float32 scales) in quant's
    layout (fp8_format.empty_quantized): the row quantized per 1 x quant.group piece (one piece per row
    where the group is d), fp8_quant.quantize_activation's arithmetic on the row in x's dtype."""
    assert x.dim() == 2 and x.stride(1) == 1 and x.shape[1] % 2 == 0, "x: must be [N, 2 * d], rows contiguous"
    n, d = x.shape[0], x.shape[1] // 2
    block = min(1024, triton.next_power_of_2(d))
    consts = dict(FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE, num_warps=4, PDL=pdl, **pdl_launch(pdl))
    if quant is None:
        out = torch.empty(n, d, dtype=x.dtype, device=x.device)
        if n:
            _silu_mul_kernel[(n, triton.cdiv(d, block))](x, out, out, x.stride(0), out.stride(0), 0, 0, n, d,
                                                         BLOCK=block, GROUP=0, **consts)   # (out: unread scales)
        return out
    out, scale = empty_quantized(n, d, quant, x.device)
    if out.shape[0] == 0:
        return out, scale
    if quant.group >= d:
        assert scale.shape[1] == 1
        _silu_mul_row_scale_kernel[(out.shape[0],)](x, out, scale, x.stride(0), out.stride(0), scale.stride(0), n, d,
                                                    BLOCK=min(ROW_SCALE_BLOCK, triton.next_power_of_2(d)),
                                                    **dict(consts, num_warps=ROW_SCALE_WARPS))
    else:
        group = piece_width(quant.group, d, "silu_mul")
        assert block % group == 0, f"silu_mul: quantization groups of {group} wider than a {block}-column tile"
        _silu_mul_kernel[(out.shape[0], triton.cdiv(d, block))](
            x, out, scale, x.stride(0), out.stride(0), *scale.stride(), n, d, BLOCK=block, GROUP=group, **consts)
    return out, scale


def silu_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)
