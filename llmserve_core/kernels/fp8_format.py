"""The FP8 (e4m3) number format in plain torch: scale conventions, saturating casts, (de)quantization.

Scales follow the checkpoints' convention: real value = fp8 value * scale, with scale = amax / 448 so the
largest magnitude of each group lands on e4m3's largest finite value. Every conversion clamps first:
e4m3fn has no infinity, and an out-of-range value must saturate, not turn into NaN. Torch only, so the
CPU reference paths (and a machine without Triton) use it; the FP8 kernels' references build on it too.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)   # 448
# A floor for scales so an all-zero group divides by something finite and quantizes to zeros.
MIN_SCALE = 1e-12


def to_fp8(x: torch.Tensor) -> torch.Tensor:
    """Saturating cast of an already-scaled float tensor."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (fp8 [N, K], float32 scales [N]): one scale per output row."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp_min(MIN_SCALE)
    return to_fp8(w / scale[:, None]), scale


def quantize_per_block(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (fp8 [N, K], float32 scales [ceil(N/bn), ceil(K/bk)]): one scale per bn x bk tile."""
    bn, bk = block
    n, k = w.shape
    padded = torch.zeros(-(-n // bn) * bn, -(-k // bk) * bk, dtype=torch.float32, device=w.device)
    padded[:n, :k] = w
    tiles = padded.view(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)
    scale = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp_min(MIN_SCALE)
    q = to_fp8(tiles / scale[:, None, :, None]).view(padded.shape)[:n, :k].contiguous()
    return q, scale


def dequantize_weight(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """fp8 [N, K] and its scales (per channel [N], or per block) -> float32 [N, K]."""
    if block is None:
        return w.float() * scale.float()[:, None]
    bn, bk = block
    n, k = w.shape
    full = scale.float().repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]
    return w.float() * full


def to_cache_dtype(x: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """What a cache of cache_dtype stores for x: FP8 keeps x / scale, saturated (e4m3fn has no infinity)."""
    if cache_dtype != torch.float8_e4m3fn:
        return x.to(cache_dtype)
    limit = torch.finfo(cache_dtype).max
    return (x.float() / scale).clamp(-limit, limit).to(cache_dtype)


def multiplies_fp8_cache_in_f16(q_dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Whether the attention kernels multiply a 16-bit query against an FP8 cache in float16.

    Every e4m3 value is exact in float16 (and subnormal e4m3 values are normal there). The card widens two
    e4m3 bytes to two float16 in one instruction (`cvt.rn.f16x2.e4m3x2`); bfloat16 products need a second
    conversion from there, which made an FP8 cache slower to read than a bf16 one
    (benchmarks/results/fp8_kv_decode_h200.md). A bfloat16 query past float16's range is scaled by a power
    of two first (`kernels.f16_query`); float32 queries keep float32."""
    return cache_dtype == FP8 and q_dtype in (torch.bfloat16, torch.float16)


class RowQuant(NamedTuple):
    """How an FP8 GEMM wants its activation rows quantized: a float32 scale per 1 x group piece of a row
    (group = the row's width: one scale per token). m_major: the scales laid out row index fastest and the
    rows padded (zeros, with the smallest scale) to a multiple of pad_rows, as cuBLAS's 1 x 128 block
    scaling reads them. The kernels that quantize a row they produce (kernels/rmsnorm.py,
    kernels/silu_mul.py) take one, as quantize_activation does."""
    group: int
    m_major: bool = False
    pad_rows: int = 1


def empty_quantized(rows: int, k: int, quant: RowQuant, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialized (e4m3 [padded rows, k], float32 scales [padded rows, ceil(k / group)]) in quant's
    layout; padded rows = rows rounded up to a multiple of quant.pad_rows."""
    assert quant.group >= 1 and quant.pad_rows >= 1, f"{quant}: a positive group and row multiple"
    padded = -(-rows // quant.pad_rows) * quant.pad_rows
    groups = -(-k // quant.group)
    q = torch.empty(padded, k, dtype=FP8, device=device)
    if quant.m_major:
        return q, torch.empty(groups, padded, dtype=torch.float32, device=device).t()
    return q, torch.empty(padded, groups, dtype=torch.float32, device=device)
