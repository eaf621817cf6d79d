"""W8A8 FP8 GEMM for prefill and large batches: out [M, N] = dequant(a [M, K]) @ dequant(w [N, K])^T.

Both operands are float8_e4m3fn and meet on Hopper's FP8 tensor cores with float32 accumulation. Two
scale layouts:
- per channel: a has one scale per row (token), w one per output row. torch._scaled_mm runs this with
  row-wise scales (torch >= 2.5, sm89+, bf16 out, N and K multiples of 16); the Triton kernel covers the rest.
- per block: a has one scale per 1 x bk piece of a row, w one per bn x bk tile (Qwen's FP8 checkpoints,
  128 x 128). cuBLASLt runs 1 x 128 by 128 x 128 scales on sm90 (CUDA >= 12.9, through torch._scaled_mm
  since torch 2.9), reading a's scales M-major; elsewhere the Triton kernel, whose K tiles each lie in one
  scale block, so its partial product is scaled as it is accumulated (the DeepSeek-V3 scheme).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmserve_core.kernels.fp8_format import FP8, RowQuant, dequantize_weight
from llmserve_core.kernels.fp8_quant import quantize_activation


@triton.jit
def _w8a8_kernel(a_ptr, w_ptr, as_ptr, ws_ptr, out_ptr, M, N, K,
                 stride_am, stride_wn, stride_om, stride_asm, stride_ask, stride_wsn, stride_wsk,
                 SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, BLOCK_SCALED: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    # Grouped tile order: GROUP_M row tiles share each column tile while it is hot in L2.
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = m < M
    n_mask = n < N
    a_rows = a_ptr + m[:, None].to(tl.int64) * stride_am
    w_cols = w_ptr + n[None, :].to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        a = tl.load(a_rows + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_cols + k[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if BLOCK_SCALED:
            a_s = tl.load(as_ptr + m * stride_asm + (k0 // SCALE_K) * stride_ask, mask=m_mask, other=0.0)
            w_s = tl.load(ws_ptr + (n // SCALE_N) * stride_wsn + (k0 // SCALE_K) * stride_wsk, mask=n_mask, other=0.0)
            acc += tl.dot(a, w) * a_s[:, None] * w_s[None, :]
        else:
            acc = tl.dot(a, w, acc)
    if not BLOCK_SCALED:
        a_s = tl.load(as_ptr + m * stride_asm, mask=m_mask, other=0.0)
        w_s = tl.load(ws_ptr + n, mask=n_mask, other=0.0)
        acc = acc * a_s[:, None] * w_s[None, :]
    tl.store(out_ptr + m[:, None].to(tl.int64) * stride_om + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


# GPU tiles (BLOCK_M, BLOCK_N, warps, stages), by (more than 64 rows, per-block scales). Keyed so that
# benchmarks/fp8_block_gemm_tiles.py can time a candidate in the engine's own prefill step. Per-block scales
# keep the 64-row tile at every row count: a 128-row tile over 4 warps holds each K step's scaled partial
# product beside the accumulator and spills (255 registers, a 296-byte stack), which ran 2.7-7x slower at
# Qwen3-8B's projections (65-246 TFLOP/s against 416-676, 256 to 8,192 rows, H100) and made a 4 x 2,048-token
# prefill step 2.13x slower (benchmarks/results/fp8_block_gemm_h100.md). Per-channel scales multiply once
# after the loop, so the 128-row tile fits there.
GPU_TILES = {
    (False, False): (64, 128, 4, 4),
    (True, False): (128, 128, 4, 3),
    (False, True): (64, 128, 4, 4),
    (True, True): (64, 128, 4, 4),
}


def w8a8_gemm_triton(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                     block: tuple[int, int] | None, out_dtype: torch.dtype, *, block_m: int | None = None,
                     block_n: int | None = None, block_k: int | None = None, num_warps: int | None = None,
                     num_stages: int | None = None) -> torch.Tensor:
    """a [M, K] fp8 with a_scale [M, 1] (per channel) or [M, ceil(K/bk)] (per block); w [N, K] fp8 with
    w_scale [N] or [ceil(N/bn), ceil(K/bk)]."""
    m, k = a.shape
    n = w.shape[0]
    assert a.dtype == FP8 and w.dtype == FP8 and w.shape[1] == k and a.stride(1) == 1 and w.stride(1) == 1
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0:
        return out
    if a.is_cuda:
        tile_m, tile_n, tile_warps, tile_stages = GPU_TILES[(m > 64, block is not None)]
        block_m, block_n = block_m or tile_m, block_n or tile_n
        # A K tile never straddles a scale block: checkpoints with blocks narrower than 128 get narrower tiles.
        block_k = block_k or (128 if block is None else min(128, block[1]))
        num_warps, num_stages = num_warps or tile_warps, num_stages or tile_stages
    else:
        block_m, block_n, block_k = block_m or 16, block_n or 16, block_k or 16
        num_warps, num_stages = 4, 1
    if block is not None:
        assert block[1] % block_k == 0, "w8a8_gemm: BLOCK_K must divide the scale block's K side"
        assert a_scale.shape == (m, triton.cdiv(k, block[1])), "a_scale: one per row and K block"
        ws_strides = (w_scale.stride(0), w_scale.stride(1))
    else:
        assert w_scale.shape == (n,), f"w_scale: per-channel scale must be [{n}], got {tuple(w_scale.shape)}"
        ws_strides = (1, 0)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _w8a8_kernel[grid](
        a, w, a_scale, w_scale, out, m, n, k, a.stride(0), w.stride(0), out.stride(0),
        a_scale.stride(0), a_scale.stride(1) if a_scale.dim() == 2 else 0, *ws_strides,
        SCALE_N=block[0] if block else 1, SCALE_K=block[1] if block else 1, BLOCK_SCALED=block is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8, num_warps=num_warps, num_stages=num_stages)
    return out


def _version(text: str | None) -> tuple[int, int]:
    return tuple(int(p) for p in (text or "0.0").split("+")[0].split(".")[:2])


TORCH_VERSION, CUDA_VERSION = _version(torch.__version__), _version(torch.version.cuda)


def scaled_mm_supported(device: torch.device, n: int, k: int, out_dtype: torch.dtype,
                        block: tuple[int, int] | None = None) -> bool:
    """Whether torch._scaled_mm runs this layer's scales here, bf16 out. Row-wise (block None): torch >= 2.5,
    an sm89+ card, N and K 16-aligned. 1 x 128 by 128 x 128 blocks: torch >= 2.9 over CUDA >= 12.9 on
    sm90 (torch refuses the layout on other cards), N a whole number of blocks, and K a whole number of
    four blocks (cuBLAS pads the weight's scale rows to four; unpadded rows then need no copy)."""
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm") or out_dtype != torch.bfloat16:
        return False
    if block is None:
        return TORCH_VERSION >= (2, 5) and torch.cuda.get_device_capability(device) >= (8, 9) \
            and n % 16 == 0 and k % 16 == 0
    return (tuple(block) == (128, 128) and TORCH_VERSION >= (2, 9) and CUDA_VERSION >= (12, 9)
            and torch.cuda.get_device_capability(device) == (9, 0) and n % 128 == 0 and k % 512 == 0)


def w8a8_gemm_per_channel(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                          out_dtype: torch.dtype) -> torch.Tensor:
    """Per-token x per-channel: cuBLASLt's FP8 GEMM through torch._scaled_mm where it takes row-wise scales."""
    if scaled_mm_supported(a.device, w.shape[0], a.shape[1], out_dtype):
        return torch._scaled_mm(a, w.t(), scale_a=a_scale.view(-1, 1), scale_b=w_scale.view(1, -1),
                                out_dtype=out_dtype)
    return w8a8_gemm_triton(a, a_scale.view(-1, 1), w, w_scale, None, out_dtype)


# cuBLASLt takes 1 x 128 scales (M-major, a column of scales per K block) only for a row count that is a
# multiple of 4: on an H100 with CUDA 13.0 every count from 20 to 48 in steps of 4 ran, and 1,000 and 1,004,
# while 17-19, 21-23, ... and 1,001 got CUBLAS_STATUS_NOT_SUPPORTED. The block-scaled path pads the rows
# (zeros) to a multiple of this and drops the padding from the output.
CUBLAS_BLOCK_ROWS = 4


def w8a8_block_input(w: torch.Tensor, w_scale: torch.Tensor, block: tuple[int, int], out_dtype: torch.dtype) -> RowQuant:
    """How x is quantized for a block-scaled weight: per 1 x bk piece, with the scales M-major and the rows
    padded as cuBLASLt's block-scaled FP8 GEMM (torch._scaled_mm) reads them where scaled_mm_supported says
    it runs this layer, else row-major for the Triton kernel."""
    if w_scale.is_contiguous() and scaled_mm_supported(w.device, w.shape[0], w.shape[1], out_dtype, block):
        return RowQuant(block[1], m_major=True, pad_rows=CUBLAS_BLOCK_ROWS)
    return RowQuant(block[1])


def w8a8_block_gemm(a: torch.Tensor, a_scale: torch.Tensor, quant: RowQuant, w: torch.Tensor,
                    w_scale: torch.Tensor, block: tuple[int, int], out_dtype: torch.dtype) -> torch.Tensor:
    """a [M', K] e4m3 with a_scale as w8a8_block_input(...) == quant laid them out (M' the padded rows)
    @ dequant(w [N, K], per bn x bk tile)^T -> [M', N]: cuBLASLt on M-major scales (which
    w8a8_block_input asks for only where cuBLASLt runs the layer), else Triton."""
    if quant.m_major:
        return torch._scaled_mm(a, w.t(), scale_a=a_scale, scale_b=w_scale.t(), out_dtype=out_dtype)
    return w8a8_gemm_triton(a, a_scale, w, w_scale, block, out_dtype)


def w8a8_block_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, block: tuple[int, int],
                      out_dtype: torch.dtype) -> torch.Tensor:
    """x [M, K] (16-bit) @ dequant(w [N, K], per bn x bk tile)^T, x quantized here as w8a8_block_input says."""
    quant = w8a8_block_input(w, w_scale, block, out_dtype)
    a, a_scale = quantize_activation(x, quant.group, quant.m_major, quant.pad_rows)
    return w8a8_block_gemm(a, a_scale, quant, w, w_scale, block, out_dtype)[:x.shape[0]]


def w8a8_gemm_reference(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                        block: tuple[int, int] | None, out_dtype: torch.dtype) -> torch.Tensor:
    """Dequantize both operands, multiply in float32."""
    if block is None:
        a_deq = a.float() * a_scale.float().view(-1, 1)
    else:
        a_deq = a.float() * a_scale.float().repeat_interleave(block[1], 1)[:, :a.shape[1]]
    return (a_deq @ dequantize_weight(w, w_scale, block).t()).to(out_dtype)
