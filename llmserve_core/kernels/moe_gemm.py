"""The mixture-of-experts grouped GEMM, for prefill and large batches, and the per-token sum of the k results.

After kernels/moe_align.py has sorted the token-expert pairs by expert into BLOCK_M-row blocks, one program
owns one block's rows and BLOCK_N output columns of that block's expert: it gathers the rows' inputs (x by
token for gate_up, the activations by pair for down), multiplies them by the expert's weight tile on the
tensor cores and writes its rows back by pair. gate_up's programs take BLOCK_N / 2 gate rows and the same
columns' up rows (silu_mul.gated_rows) and write SiLU(gate) * up; down's write each pair's y in the model
dtype. Blocks past the used ones exit at once. Row blocks are visited GROUP_M at a time per column tile, so
a column tile of one expert's weight is read from HBM about once per group.

FP8 (W8A8): both operands float8_e4m3fn on the FP8 tensor cores, accumulated in float32. Per-channel weights
meet rows quantized per token (both scales applied once, after the loop); 128 x 128 block-scaled weights meet
rows quantized per 1 x 128 piece, and each K tile (inside one scale block) is scaled as it is accumulated.

`moe_sum` then adds each token's k weighted results in slot order in float32 and rounds once, as
moe_reference does: no atomics, so every run gives the same bits.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmserve_core.kernels.silu_mul import column_block, silu_times

NO_QUANT, PER_CHANNEL, PER_BLOCK = 0, 1, 2


@triton.jit(do_not_specialize=["P", "num_blocks"])
def _moe_gemm_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, sorted_ptr, block_expert_ptr, P, num_blocks, N, K,
                     TOP_K, stride_a, stride_as, stride_we, stride_wse, stride_wsn, stride_wsk, stride_out,
                     GATED: tl.constexpr, A_BY_PAIR: tl.constexpr, QUANT: tl.constexpr, SCALE_N: tl.constexpr,
                     SCALE_K: tl.constexpr, DOT_IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """a [rows, K] (x by token, or the activations by pair: A_BY_PAIR), w [E, N, K] (rows contiguous);
    out [P, N / 2] (GATED) or [P, N]. QUANT PER_CHANNEL: as [rows] per row, ws [E, N]; PER_BLOCK: as
    [rows, ceil(K / SCALE_K)], ws [E, ceil(N / SCALE_N), ceil(K / SCALE_K)]."""
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N // 2, BLOCK_N // 2) if GATED else tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    expert = tl.load(block_expert_ptr + pid_m)
    if expert >= 0:
        pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        m_mask = pairs < P
        rows = pairs if A_BY_PAIR else pairs // TOP_K
        cols, offs_n, n_mask = column_block(pid_n, N, BLOCK_N, GATED)
        rk = tl.arange(0, BLOCK_K)
        a_rows = a_ptr + rows.to(tl.int64)[:, None] * stride_a
        w_cols = w_ptr + expert.to(tl.int64) * stride_we + offs_n[None, :].to(tl.int64) * K
        ws_expert = ws_ptr + expert.to(tl.int64) * stride_wse
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + rk
            a = tl.load(a_rows + k[None, :], mask=m_mask[:, None] & (k < K)[None, :], other=0.0)
            w = tl.load(w_cols + k[:, None], mask=(k < K)[:, None] & n_mask[None, :], other=0.0)
            if QUANT == 2:      # K tiles lie inside one scale block
                a_s = tl.load(as_ptr + rows * stride_as + k0 // SCALE_K, mask=m_mask, other=0.0)
                w_s = tl.load(ws_expert + (offs_n // SCALE_N) * stride_wsn + (k0 // SCALE_K) * stride_wsk,
                              mask=n_mask, other=0.0)
                acc += tl.dot(a, w) * a_s[:, None] * w_s[None, :]
            elif DOT_IEEE:      # float32 models: full-precision products, never tf32
                acc = tl.dot(a, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, w, acc)
        if QUANT == 1:
            acc *= tl.load(as_ptr + rows * stride_as, mask=m_mask, other=0.0)[:, None]
            acc *= tl.load(ws_expert + offs_n * stride_wsn, mask=n_mask, other=0.0)[None, :]
        out_rows = out_ptr + pairs.to(tl.int64)[:, None] * stride_out
        if GATED:
            gate, up = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
            tl.store(out_rows + cols[None, :], silu_times(gate, up).to(out_ptr.dtype.element_ty),
                     mask=m_mask[:, None] & (cols < N // 2)[None, :])
        else:
            tl.store(out_rows + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
                     mask=m_mask[:, None] & n_mask[None, :])


def moe_gemm(a: torch.Tensor, a_scale: torch.Tensor | None, w: torch.Tensor, w_scale: torch.Tensor | None,
             out: torch.Tensor, sorted_pairs: torch.Tensor, block_expert: torch.Tensor, num_blocks: int,
             top_k: int, gated: bool, by_pair: bool, block: tuple[int, int] | None, cfg: dict) -> torch.Tensor:
    """One grouped GEMM over the aligned pairs into `out` (see _moe_gemm_kernel); cfg holds BLOCK_M (the
    alignment's), BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages."""
    n, k = w.shape[1], w.shape[2]
    pairs = out.shape[0]
    quant = NO_QUANT if w_scale is None else PER_BLOCK if block is not None else PER_CHANNEL
    if quant == PER_BLOCK:
        ws_strides = (w_scale.stride(0), w_scale.stride(1), w_scale.stride(2))
    elif quant == PER_CHANNEL:
        ws_strides = (w_scale.stride(0), w_scale.stride(1), 0)
    else:
        ws_strides = (0, 0, 0)
    tiles_n = triton.cdiv(n // 2, cfg["BLOCK_N"] // 2) if gated else triton.cdiv(n, cfg["BLOCK_N"])
    _moe_gemm_kernel[(num_blocks * tiles_n,)](
        a, a_scale if a_scale is not None else a, w, w_scale if w_scale is not None else w, out, sorted_pairs,
        block_expert, pairs, num_blocks, n, k, top_k, a.stride(0), a_scale.stride(0) if a_scale is not None else 0,
        w.stride(0), *ws_strides, out.stride(0), GATED=gated, A_BY_PAIR=by_pair, QUANT=quant,
        SCALE_N=block[0] if block else 1, SCALE_K=block[1] if block else 1, DOT_IEEE=a.dtype == torch.float32,
        **cfg)
    return out


@triton.jit
def weighted_sum(y_ptr, w_ptr, ids_ptr, t, t_mask, cols, c_mask, H, E, TOP_K, BLOCK_T: tl.constexpr,
                 BLOCK_H: tl.constexpr):
    """[BLOCK_T, BLOCK_H] float32: for tokens t, sum over j = 0, 1, ... of topk_weights[t, j] * y[t * TOP_K + j]
    at columns cols, skipping ids outside [0, E). y is read through L2 (.cg): under moe_decode's fused sum,
    other programs of the same launch wrote it."""
    acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
    for j in range(TOP_K):
        pair = t * TOP_K + j
        e = tl.load(ids_ptr + pair, mask=t_mask, other=-1)
        ok = t_mask & (e >= 0) & (e < E)
        w = tl.load(w_ptr + pair, mask=ok, other=0.0)
        y = tl.load(y_ptr + pair.to(tl.int64)[:, None] * H + cols[None, :], mask=ok[:, None] & c_mask[None, :],
                    other=0.0, cache_modifier=".cg")
        acc += w[:, None] * y.to(tl.float32)
    return acc


@triton.jit(do_not_specialize=["T"])
def _moe_sum_kernel(y_ptr, w_ptr, ids_ptr, out_ptr, T, H, E, TOP_K, stride_out, BLOCK_T: tl.constexpr,
                    BLOCK_H: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    acc = weighted_sum(y_ptr, w_ptr, ids_ptr, t, t < T, cols, cols < H, H, E, TOP_K, BLOCK_T, BLOCK_H)
    tl.store(out_ptr + t.to(tl.int64)[:, None] * stride_out + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(t < T)[:, None] & (cols < H)[None, :])


def moe_sum(y: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
            out: torch.Tensor) -> torch.Tensor:
    """y [T * k, H] (pair rows) -> out [T, H]: each token's k rows weighted and summed in slot order."""
    t, top_k = topk_ids.shape
    h = y.shape[1]
    block_h = min(1024, triton.next_power_of_2(h))
    _moe_sum_kernel[(triton.cdiv(t, 4), triton.cdiv(h, block_h))](
        y, topk_weights, topk_ids, out, t, h, num_experts, top_k, out.stride(0), BLOCK_T=4, BLOCK_H=block_h,
        num_warps=4)
    return out
