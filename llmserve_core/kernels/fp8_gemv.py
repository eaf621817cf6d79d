"""FP8 GEMV for 1-64 rows: out [M, N] = x [M, K] @ dequant(w [N, K] fp8)^T.

At decode sizes the whole cost of a linear layer is streaming its weight from HBM, so the kernel reads
each FP8 weight byte once. Widening every byte to the activation dtype ("dot", "fma") costs about as much
as the bytes, so where FP8 products exist (Ada, Hopper) the "a8" kernel quantizes x instead: each K tile
of each row gets its own scale (amax / 448, one per 1 x BLOCK_K piece) in the kernel, the tile meets the
loaded FP8 weight on the FP8 tensor cores as it is, and the partial product is scaled back as it is
accumulated (about 1.6 times "dot"'s weight bandwidth on the H200:
benchmarks/results/fp8_a8_sweep_h200_f3f7a22.json). No extra launch: x is only ever a few rows.

The layout is kernels/gemv.py's: one program owns BLOCK_N output columns over a slice of K, the weight
tile is the dot's wide left operand against one row tile of x (rows past M are masked and cost no
traffic), and K is split until about four programs per multiprocessor stream; the split that arrives last
at a column block sums the parked partial tiles, in the same launch, using gemv.py's graph-safe scratch.
Scales are one per output row (applied once per split) or one per scale block (applied per K tile, which
never straddles a block: BLOCK_K divides it). Which kernel runs a shape, and at which tile, is `choose`'s
answer from kernels/configs/fp8_gemv/.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Mapping, NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from llmserve_core.kernels import tuned
from llmserve_core.kernels.gemv import split_k_tile, store_split_k
from llmserve_core.kernels.gemv import _SCRATCH as SPLIT_K_SCRATCH   # shared: calls on one stream never overlap
from llmserve_core.kernels.fp8_format import FP8, FP8_MAX, MIN_SCALE, dequantize_weight
from llmserve_core.kernels.pdl import pdl_launch, pdl_wait_and_release
from llmserve_core.kernels.silu_mul import gated_rows, silu_mul_halves
from llmserve_core.kernels.stream_gemv import stream_tiles

MAX_ROWS = 64


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, y_ptr, part_ptr, count_ptr, M, N, K, stride_x, stride_y, k_per_split,
                     stride_sn, stride_sk, xs_ptr, stride_xs,
                     SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, BLOCK_SCALED: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                     EVEN_K: tl.constexpr, DOT_IEEE: tl.constexpr, QUANT_X: tl.constexpr, X_GROUP: tl.constexpr,
                     FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, PDL: tl.constexpr, W_TMA: tl.constexpr,
                     GATED: tl.constexpr):
    """X_GROUP > 0: x is already e4m3, with a float32 scale per 1 x X_GROUP piece of each row at xs_ptr.
    W_TMA: w_ptr is a [BLOCK_N, BLOCK_K] tensor descriptor of the weight, whose tiles the copy engine (TMA)
    brings into shared memory whole, zero past N and K.
    GATED: the weight is a packed [gate | up] (N = 2 d) and y [M, d] = SiLU(x @ gate^T) * (x @ up^T): a
    program's first BLOCK_N / 2 rows are gate rows, the rest the up rows of the same columns (one K split)."""
    pdl_wait_and_release(PDL)      # x comes from the kernel before
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    if GATED:
        cols, offs_n, n_mask = gated_rows(pid_n, N, BLOCK_N)
    else:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
    rk = tl.arange(0, BLOCK_K)
    dtype = x_ptr.dtype.element_ty
    x_rows = x_ptr + offs_m[:, None] * stride_x
    if not W_TMA:
        w_rows = w_ptr + offs_n[:, None].to(tl.int64) * K
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    k_lo = pid_k * k_per_split
    for k0 in range(k_lo, k_lo + k_per_split, BLOCK_K):
        k = k0 + rk
        if W_TMA:
            w = w_ptr.load([pid_n * BLOCK_N, k0])
        elif EVEN_K:
            w = tl.load(w_rows + k[None, :], mask=n_mask[:, None], other=0.0)
        else:
            w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & (k[None, :] < K), other=0.0)
        if EVEN_K:
            xv = tl.load(x_rows + k[None, :], mask=m_mask[:, None], other=0.0)
        else:
            xv = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & (k[None, :] < K), other=0.0)
        if X_GROUP > 0:
            # W8A8 on an x quantized ahead: no amax pass across the tile, whatever the tile's width.
            x_s = tl.load(xs_ptr + offs_m * stride_xs + k0 // X_GROUP, mask=m_mask & (k0 < K), other=0.0)
            part = tl.dot(w, tl.trans(xv)) * x_s[None, :]
        elif QUANT_X:
            # W8A8: each row's K tile is quantized on the fly with its own scale (one per 1 x BLOCK_K
            # piece), so the FP8 weight meets the tensor cores as it was loaded, never widened.
            xf = xv.to(tl.float32)
            x_s = tl.maximum(tl.max(tl.abs(xf), 1) / FP8_MAX, MIN_SCALE)
            xq = (xf / x_s[:, None]).to(w.dtype)
            part = tl.dot(w, tl.trans(xq)) * x_s[None, :]
        elif DOT_IEEE:    # float32 models: full-precision products, never tf32
            part = tl.dot(w.to(dtype), tl.trans(xv), input_precision="ieee")
        else:
            part = tl.dot(w.to(dtype), tl.trans(xv))
        if BLOCK_SCALED:
            # (a split past the end of K reads no weight, and no scale either)
            s = tl.load(s_ptr + (offs_n // SCALE_N) * stride_sn + (k0 // SCALE_K) * stride_sk,
                        mask=n_mask & (k0 < K), other=0.0)
            acc += part * s[:, None]
        else:
            acc += part
    if not BLOCK_SCALED:
        acc = acc * tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)[:, None]

    if GATED:
        y_ptrs = y_ptr + offs_m[None, :] * stride_y + cols[:, None]
        y_mask = (cols < N // 2)[:, None] & m_mask[None, :]
        tl.store(y_ptrs, silu_mul_halves(acc).to(y_ptrs.dtype.element_ty), mask=y_mask)
    else:
        y_ptrs = y_ptr + offs_m[None, :] * stride_y + offs_n[:, None]
        store_split_k(acc, y_ptrs, n_mask[:, None] & m_mask[None, :], part_ptr, count_ptr, pid_n, pid_k, M,
                      BLOCK_M, BLOCK_N, SPLIT_K)


@triton.jit
def _fp8_gemv_fma_kernel(x_ptr, w_ptr, s_ptr, y_ptr, part_ptr, count_ptr, M, N, K, stride_x, stride_y, k_per_split,
                         stride_sn, stride_sk,
                         SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, BLOCK_SCALED: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                         EVEN_K: tl.constexpr, REDUCE_LATE: tl.constexpr):
    """The same split of work on the CUDA cores, for 1-4 rows: no dot, so no layout conversion of the
    weight tile; each thread widens its contiguous fp8 bytes to float32, multiplies by the broadcast
    row(s) of x and reduces along K. A block scale multiplies x's K slice (BLOCK_N divides the block's N
    side, so one program sees one scale row), which lets BLOCK_K span several scale blocks. REDUCE_LATE
    keeps per-lane partial sums over the whole K slice and reduces across threads once at the end (no
    shuffles in the loop, BLOCK_M times the registers)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + offs_m[:, None] * stride_x
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * K
    s_row = s_ptr + (pid_n * BLOCK_N // SCALE_N) * stride_sn
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    lanes = tl.zeros([BLOCK_N, BLOCK_M, BLOCK_K], dtype=tl.float32)
    k_lo = pid_k * k_per_split
    for k0 in range(k_lo, k_lo + k_per_split, BLOCK_K):
        k = k0 + rk
        if EVEN_K:
            w = tl.load(w_rows + k[None, :], mask=n_mask[:, None], other=0.0)
            xv = tl.load(x_rows + k[None, :], mask=m_mask[:, None], other=0.0).to(tl.float32)
        else:
            w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & (k[None, :] < K), other=0.0)
            xv = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & (k[None, :] < K), other=0.0).to(tl.float32)
        if BLOCK_SCALED:
            xv = xv * tl.load(s_row + (k // SCALE_K) * stride_sk, mask=k < K, other=0.0)[None, :]
        if REDUCE_LATE:
            lanes += w.to(tl.float32)[:, None, :] * xv[None, :, :]
        else:
            acc += tl.sum(w.to(tl.float32)[:, None, :] * xv[None, :, :], axis=2)
    if REDUCE_LATE:
        acc = tl.sum(lanes, axis=2)
    if not BLOCK_SCALED:
        acc = acc * tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)[:, None]

    y_ptrs = y_ptr + offs_m[None, :] * stride_y + offs_n[:, None]
    store_split_k(acc, y_ptrs, n_mask[:, None] & m_mask[None, :], part_ptr, count_ptr, pid_n, pid_k, M,
                  BLOCK_M, BLOCK_N, SPLIT_K)


# Rows that always take a GEMV (the heuristic's tile where nothing was tuned); past them, only a tuned tile
# does (elsewhere the W8A8 GEMM was not measured slower: benchmarks/results/fp8_rows17_64_h100.md).
RULE_MAX_ROWS = 16
X_AHEAD_GROUP = 128      # the 1 x 128 pieces an x quantized ahead comes in (layers/fp8_linear.QuantizedRows)
KERNELS = ("a8", "dot", "fma", "fma_late")


class Choice(NamedTuple):
    """Which kernel runs a call, and its tile: "stream" (kernels/stream_gemv.py, one row, weight-only), or
    this module's "a8" (x quantized per 1 x BLOCK_K piece, FP8 x FP8 on the tensor cores), "dot" (the weight
    widened to x's dtype on the tensor cores), "fma" / "fma_late" (widened on the CUDA cores, 1-4 rows)."""
    kernel: str
    tile: Mapping


def rows_class(m: int) -> int:
    """The tables' row buckets: 1, 2-4, 5-16, 17-32, 33-64."""
    return 1 if m == 1 else 4 if m <= 4 else 16 if m <= 16 else 32 if m <= 32 else 64


@tuned.family("fp8_gemv", ("N", "K", "rows", "scale", "x"))
def _heuristic(device: tuned.Device, N: int, K: int, rows: int, scale: str, x: str) -> dict | None:
    """split_k_tile's tiles in the a8 kernel where FP8 products run, else widening the weight ("dot"); a
    block-scaled weight caps BLOCK_K at the block's K side. x quantized ahead ("fp8") only where tuned."""
    if x != "raw":
        return None
    block_k = 128 if scale == "channel" else min(128, int(scale.split("x")[1]))
    tile = split_k_tile(rows, N, K, device.sms, block_n=64, block_k=block_k, num_warps=4,
                        num_stages=3 if device.fp8_dot else 4)
    return {"kernel": "a8" if device.fp8_dot else "dot", "tile": tile}


@tuned.cached
def choose(device: tuned.Device, rows: int, n: int, k: int, block: tuple[int, int] | None = None, x: str = "raw",
           stream: bool = False) -> Choice | None:
    """The kernel and tile for `rows` (1..MAX_ROWS) rows of an [n, k] FP8 weight (block: its scale block, None
    for one scale a row) on this device; x "fp8": rows quantized ahead per 1 x X_AHEAD_GROUP piece, "raw":
    in the model's dtype. The table's entry where there is one (the stream kernel's only where the caller
    can run it: stream), else up to RULE_MAX_ROWS raw rows the heuristic's. None: no GEMV here (raw rows:
    the W8A8 GEMM; rows quantized ahead: hand them raw)."""
    if not 0 < rows <= MAX_ROWS:
        return None
    shape = dict(N=n, K=k, rows=rows_class(rows), scale=tuned.scale_key(block), x=x)
    entry = tuned.tuned("fp8_gemv", device, **shape)
    if entry is None or (entry["kernel"] == "stream" and not stream):
        entry = _heuristic(device, **shape) if rows <= RULE_MAX_ROWS else None
    if entry is None:
        return None
    if entry["kernel"] == "stream":
        return Choice("stream", stream_tiles(device, n, k, FP8, block))
    return Choice(entry["kernel"], MappingProxyType(dict(entry["tile"])))


def default_choice(device: tuned.Device, rows: int, n: int, k: int, block: tuple[int, int] | None = None) -> Choice:
    """fp8_gemv's kernel and tile where the caller names none: choose's for raw rows off the decode chain,
    else (past RULE_MAX_ROWS, untuned) the heuristic's."""
    choice = choose(device, rows, n, k, block)
    if choice is None:
        entry = _heuristic(device, N=n, K=k, rows=rows_class(rows), scale=tuned.scale_key(block), x="raw")
        choice = Choice(entry["kernel"], MappingProxyType(entry["tile"]))
    return choice


def silu_mul_fits(n: int, choice: Choice) -> bool:
    """Whether fp8_gemv's kernel and tile can end a packed [gate | up] weight of n rows in the SiLU-and-mul:
    an even N, and the a8 or dot kernel at an even BLOCK_N, one K split, no TMA (both halves of a column
    must meet in one program, whole)."""
    tile = choice.tile
    return n % 2 == 0 and choice.kernel in ("a8", "dot") and tile["SPLIT_K"] == 1 and tile["BLOCK_N"] % 2 == 0 \
        and not tile.get("TMA", False)


def fp8_gemv(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None,
             config: Mapping | None = None, pdl: bool = False, x_scale: torch.Tensor | None = None,
             x_group: int = 128, out_dtype: torch.dtype | None = None, silu_mul: bool = False,
             kernel: str | None = None) -> torch.Tensor:
    """x [M <= 64, K] (float), w [N, K] float8_e4m3fn, scale per row [N] or per block -> [M, N] in x.dtype.

    kernel and config: which of KERNELS runs (Choice says what each does; fp8_gemv_a8_reference is the a8
    kernel's arithmetic) at which tile; both None: default_choice's for this device. A tile's "TMA": True
    brings the a8 kernel's weight tiles by tensor descriptor instead of per-thread loads (the same
    arithmetic; benchmarks/fp8_tma_tiles.py measures whether it streams faster). pdl: launch under PDL (the
    tensor-core kernels), as a link of the decode chain.

    x may come quantized already (e4m3, x_scale [M, ceil(K / x_group)] float32, as
    fp8_quant.quantize_activation(x, x_group) makes it; the result in out_dtype): the "a8" kernel then
    skips its amax pass, which every program repeats for its tile (benchmarks/fp8_gemv_sweep.py --a8x
    measures what that pass costs).

    silu_mul: w is a packed [gate | up] and the result [M, N / 2] is SiLU(x @ gate^T) * (x @ up^T), taken
    in float32 before the one rounding (the "a8" or "dot" kernel at a tile that does not split K)."""
    m, k = x.shape
    n = w.shape[0]
    assert 0 < m <= MAX_ROWS, f"fp8_gemv: {m} rows, at most {MAX_ROWS}"
    assert w.shape[1] == k and x.stride(1) == 1 and w.is_contiguous(), "fp8_gemv: rows must be contiguous"
    if config is None:
        assert kernel is None, "fp8_gemv: a kernel comes with its tile (config)"
        kernel, config = default_choice(tuned.device_spec(x.device), m, n, k, block)
    assert kernel in KERNELS, f"fp8_gemv: kernel must be one of {KERNELS} for a tile, not {kernel!r}"
    assert not silu_mul or silu_mul_fits(n, Choice(kernel, config)), \
        "fp8_gemv: silu_mul needs an even N and the a8 or dot kernel at an even BLOCK_N, one K split, no TMA"
    cfg = dict(config)
    block_n, block_k, split = cfg["BLOCK_N"], cfg["BLOCK_K"], cfg.pop("SPLIT_K")
    tma = cfg.pop("TMA", False)
    prequantized = x.dtype == FP8
    if prequantized:
        assert kernel == "a8", "fp8_gemv: an e4m3 x needs the a8 kernel"
        assert x_group > 0 and x_group % block_k == 0, f"fp8_gemv: BLOCK_K must divide x's scale group, not {x_group}"
        assert x_scale is not None and x_scale.shape == (m, triton.cdiv(k, x_group)) and out_dtype is not None, \
            f"fp8_gemv: an e4m3 x takes x_scale [{m}, {triton.cdiv(k, x_group)}] and an out_dtype"
    assert not tma or (kernel == "a8" and k % 16 == 0 and w.data_ptr() % 16 == 0), \
        "fp8_gemv: TMA weight tiles are the a8 kernel's, over a 16-byte aligned weight whose K is a multiple of 16"
    fma = kernel.startswith("fma")
    assert not (pdl and fma), "fp8_gemv: the CUDA-core kernel does not launch under PDL"
    assert m <= cfg["BLOCK_M"], f"fp8_gemv: {m} rows for a {cfg['BLOCK_M']}-row tile"
    if block is not None:
        if fma:
            assert block[0] % block_n == 0, "fp8_gemv: BLOCK_N must divide the scale block's N side"
        else:
            assert block[1] % block_k == 0, "fp8_gemv: BLOCK_K must divide the scale block's K side"
        assert scale.dim() == 2, "fp8_gemv: block scales must be [ceil(N/bn), ceil(K/bk)]"
        stride_sn, stride_sk = scale.stride(0), scale.stride(1)
    else:
        assert scale.shape == (n,), f"fp8_gemv: per-channel scale must be [{n}], got {tuple(scale.shape)}"
        stride_sn, stride_sk = 1, 0
    y = torch.empty(m, n // 2 if silu_mul else n, dtype=out_dtype if prequantized else x.dtype, device=x.device)
    n_blocks = triton.cdiv(n // 2, block_n // 2) if silu_mul else triton.cdiv(n, block_n)
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    parts, counts = SPLIT_K_SCRATCH.get(x.device, n_blocks * split * block_n * cfg["BLOCK_M"] if split > 1 else 0,
                                        n_blocks if split > 1 else 0)
    w_arg = weight_descriptor(w, block_n, block_k) if tma else w
    args = (x, w_arg, scale, y, parts, counts, m, n, k, x.stride(0), y.stride(0), k_per_split, stride_sn, stride_sk)
    common = dict(SCALE_N=block[0] if block else 1, SCALE_K=block[1] if block else 1, BLOCK_SCALED=block is not None,
                  SPLIT_K=split, EVEN_K=k_per_split * split == k)
    if fma:
        _fp8_gemv_fma_kernel[(n_blocks, split)](*args, **common, REDUCE_LATE=kernel == "fma_late", **cfg)
    else:
        xs, stride_xs = (x_scale, x_scale.stride(0)) if prequantized else (x, 0)   # (x: any pointer, unread)
        _fp8_gemv_kernel[(n_blocks, split)](*args, xs, stride_xs, **common, DOT_IEEE=x.dtype == torch.float32,
                                            QUANT_X=kernel == "a8" and not prequantized,
                                            X_GROUP=x_group if prequantized else 0,
                                            FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE, PDL=pdl, W_TMA=tma,
                                            GATED=silu_mul, **cfg, **pdl_launch(pdl))
    return y


def weight_descriptor(w: torch.Tensor, block_n: int, block_k: int) -> TensorDescriptor:
    """The TMA descriptor of a [N, K] weight in [block_n, block_k] tiles."""
    return TensorDescriptor(w, list(w.shape), [w.stride(0), 1], [block_n, block_k])


def fp8_gemv_reference(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                       block: tuple[int, int] | None = None) -> torch.Tensor:
    """Dequantize the weight, multiply in float32."""
    return (x.float() @ dequantize_weight(w, scale, block).t()).to(x.dtype)


def fp8_gemv_a8_reference(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                          block: tuple[int, int] | None = None, group: int = 128) -> torch.Tensor:
    """The "a8" kernel's arithmetic: x quantized per 1 x group piece of each row (dequantized again),
    times the dequantized weight, in float32."""
    from llmserve_core.kernels.fp8_quant import quantize_activation_reference
    q, s = quantize_activation_reference(x, group)
    x_deq = q.float() * s.repeat_interleave(group, 1)[:, :x.shape[1]]
    return (x_deq @ dequantize_weight(w, scale, block).t()).to(x.dtype)
