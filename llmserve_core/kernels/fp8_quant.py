"""FP8 (e4m3) quantization helpers shared by the FP8 GEMMs, the FP8 linear layer and the loader.

Scales follow the checkpoints' convention: real value = fp8 value * scale, with scale = amax / 448 so the
largest magnitude of each group lands on e4m3's largest finite value. Every conversion clamps first:
e4m3fn has no infinity, and an out-of-range value must saturate, not turn into NaN.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

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
    padded = torch.zeros(triton.cdiv(n, bn) * bn, triton.cdiv(k, bk) * bk, dtype=torch.float32, device=w.device)
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


def from_cache(cached: torch.Tensor, scale: float) -> torch.Tensor:
    """Cached K or V rows back in float32 (the inverse of to_cache_dtype)."""
    return cached.float() * scale if cached.dtype == torch.float8_e4m3fn else cached.float()


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, group, stride_xm, stride_qm, stride_sm,
                          FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    """One program per (row, group of `group` columns): amax pass, then the scaled, saturating cast."""
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    lo = g * group
    hi = tl.minimum(lo + group, K)
    amax = tl.zeros([BLOCK], tl.float32)
    for k0 in range(lo, hi, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_xm + k, mask=k < hi, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, 0) / FP8_MAX, MIN_SCALE)
    tl.store(s_ptr + row * stride_sm + g, scale)
    for k0 in range(lo, hi, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_xm + k, mask=k < hi, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(x / scale, -FP8_MAX), FP8_MAX)
        tl.store(q_ptr + row * stride_qm + k, q.to(q_ptr.dtype.element_ty), mask=k < hi)


def quantize_activation(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic activation quantization: x [M, K] -> (fp8 [M, K], float32 scales [M, ceil(K/group)]).

    group None: one scale per token (row), as compressed-tensors' per-token scheme; group 128: one per
    1 x 128 piece of a row, what a 128 x 128 block-scaled weight is multiplied against.
    """
    m, k = x.shape
    assert x.stride(1) == 1, "x: last dim must be contiguous"
    group = group or k
    num_groups = triton.cdiv(k, group)
    q = torch.empty(m, k, dtype=FP8, device=x.device)
    scale = torch.empty(m, num_groups, dtype=torch.float32, device=x.device)
    if m == 0:
        return q, scale
    _quantize_rows_kernel[(m, num_groups)](
        x, q, scale, k, group, x.stride(0), q.stride(0), scale.stride(0),
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
