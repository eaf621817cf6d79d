"""The mixture-of-experts decode path: a few rows, each expert's weights read once whatever rows chose it.

A decode step of T rows picks at most min(T k, E) distinct experts, and its cost is reading their weights.
The grid has one column of programs per possible distinct expert (a slot): each program finds its slot's
expert from topk_ids itself (the slot-th expert in order of first appearance among the T k pairs, so no
sort and no launch before it), finds the rows that chose it, and streams BLOCK_N rows of that expert's
weight once against all of them, as kernels/stream_gemv.py and kernels/gemv.py do for a dense layer: one
row on the CUDA cores (products kept per lane, reduced once at the end), 2-16 rows as one 16-row
tensor-core tile. Slots past the step's distinct experts exit at once; the shapes and the grid depend on T
only, so CUDA graphs capture it.

gate_up ends in the SiLU-and-mul (its programs hold the gate rows and the up rows of the same columns), and
writes each pair's activation row; down writes each pair's y in the model dtype. With FUSED_SUM the down
program that arrives last at a column block (an arrival counter, as gemv.store_split_k's split-K) adds each
token's k results in slot order there, as moe_gemm.moe_sum would in a launch of its own: the counter only
elects who sums, the sum's order is fixed, so the bits are the same every run.

FP8 experts are read as they are stored and widened in registers (per-channel scales applied once at the
end, block scales per K tile, which never straddles a scale block).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmserve_core.kernels.moe_gemm import moe_sum, weighted_sum
from llmserve_core.kernels.silu_mul import column_block, silu_mul_halves

MAX_ROWS = 16      # the dedup tile below is [T k, T k]: up to MAX_PAIRS square (64 registers a thread over 4
MAX_PAIRS = 128    # warps); past it, the grouped GEMM sorts the pairs instead


def fits(rows: int, top_k: int) -> bool:
    """Whether the decode path takes `rows` rows of top_k pairs each."""
    return rows <= MAX_ROWS and triton.next_power_of_2(triton.next_power_of_2(rows) * top_k) <= MAX_PAIRS


@triton.jit
def _slot_expert(ids_ptr, slot, P, E, PP: tl.constexpr):
    """The slot-th distinct expert in [0, E) among the P pairs' ids, in order of first appearance; -1 if the
    pairs name fewer experts."""
    p = tl.arange(0, PP)
    ids = tl.load(ids_ptr + p, mask=p < P, other=-1)
    seen = tl.sum(((ids[:, None] == ids[None, :]) & (p[None, :] < p[:, None])).to(tl.int32), 1)
    first = (ids >= 0) & (ids < E) & (seen == 0)
    rank = tl.cumsum(first.to(tl.int32), 0) - 1
    return tl.max(tl.where(first & (rank == slot), ids, -1), 0)


@triton.jit
def _expert_rows(ids_ptr, expert, T, TOP_K, BLOCK_M: tl.constexpr, BLOCK_J: tl.constexpr):
    """Rows t < BLOCK_M: whether token t chose `expert`, and that pair's index t * TOP_K + j."""
    t = tl.arange(0, BLOCK_M)
    j = tl.arange(0, BLOCK_J)
    ids = tl.load(ids_ptr + t[:, None] * TOP_K + j[None, :], mask=(t < T)[:, None] & (j < TOP_K)[None, :], other=-1)
    hit = ids == expert
    return tl.sum(hit.to(tl.int32), 1) > 0, t * TOP_K + tl.sum(tl.where(hit, j[None, :], 0), 1)


@triton.jit
def _rows_times_expert(a_rows, a_mask, w_rows, n_mask, s_rows, stride_sk, K, ROW_SCALED: tl.constexpr,
                       BLOCK_SCALED: tl.constexpr, SCALE_K: tl.constexpr, DOT: tl.constexpr,
                       DOT_IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_N, BLOCK_M] float32: weight rows (pointers w_rows [BLOCK_N]) times input rows (a_rows [BLOCK_M]),
    the weight widened to the input's dtype (FP8: times its scales, at s_rows [BLOCK_N]). The next weight tile
    is asked for before the current one is multiplied (stream_gemv's DEPTH 1): two tiles in flight a program."""
    rk = tl.arange(0, BLOCK_K)
    w = tl.load(w_rows[:, None] + rk[None, :], mask=n_mask[:, None] & (rk < K)[None, :], other=0.0)
    if DOT:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    elif BLOCK_M == 1:
        lanes = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        w_next = tl.load(w_rows[:, None] + (k + BLOCK_K)[None, :], mask=n_mask[:, None] & (k + BLOCK_K < K)[None, :],
                         other=0.0)
        a = tl.load(a_rows[:, None] + k[None, :], mask=a_mask[:, None] & (k < K)[None, :], other=0.0)
        if BLOCK_SCALED:
            s = tl.load(s_rows + (k0 // SCALE_K) * stride_sk, mask=n_mask, other=0.0)
        if DOT:
            if DOT_IEEE:
                part = tl.dot(w.to(a.dtype), tl.trans(a), input_precision="ieee")
            else:
                part = tl.dot(w.to(a.dtype), tl.trans(a))
            if BLOCK_SCALED:
                part = part * s[:, None]
            acc += part
        else:
            wf = w.to(tl.float32)
            if BLOCK_SCALED:
                wf = wf * s[:, None]
            if BLOCK_M == 1:
                lanes += wf * a.to(tl.float32)
            else:
                acc += tl.sum(wf[:, None, :] * a.to(tl.float32)[None, :, :], 2)
        w = w_next
    if not DOT and BLOCK_M == 1:
        acc = tl.reshape(tl.sum(lanes, 1), (BLOCK_N, 1))
    if ROW_SCALED:
        acc = acc * tl.load(s_rows, mask=n_mask, other=0.0)[:, None]
    return acc


@triton.jit(do_not_specialize=["T"])
def _moe_decode_kernel(a_ptr, w_ptr, s_ptr, ids_ptr, out_ptr, tw_ptr, sum_ptr, count_ptr, T, E, N, K, TOP_K,
                       stride_a, stride_we, stride_se, stride_sn, stride_sk, stride_out, stride_sum,
                       GATED: tl.constexpr, A_BY_PAIR: tl.constexpr, FUSED_SUM: tl.constexpr,
                       ROW_SCALED: tl.constexpr, BLOCK_SCALED: tl.constexpr, SCALE_N: tl.constexpr,
                       SCALE_K: tl.constexpr, DOT: tl.constexpr, DOT_IEEE: tl.constexpr, PP: tl.constexpr,
                       BLOCK_J: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (column block, slot). a: x [T, K] by token, or (A_BY_PAIR) the activations [T k, K] by pair;
    w [E, N, K]; out [T k, N / 2] (GATED) or [T k, N]. FUSED_SUM: also sum [T, N] from out (= y)."""
    pid_n = tl.program_id(0)
    expert = _slot_expert(ids_ptr, tl.program_id(1), T * TOP_K, E, PP)
    if expert >= 0:
        chose, pair = _expert_rows(ids_ptr, expert, T, TOP_K, BLOCK_M, BLOCK_J)
        cols, offs_n, n_mask = column_block(pid_n, N, BLOCK_N, GATED)
        rows = pair if A_BY_PAIR else tl.arange(0, BLOCK_M)
        a_rows = a_ptr + rows.to(tl.int64) * stride_a
        w_rows = w_ptr + expert.to(tl.int64) * stride_we + offs_n.to(tl.int64) * K
        s_rows = s_ptr + expert.to(tl.int64) * stride_se + (offs_n // SCALE_N) * stride_sn
        acc = _rows_times_expert(a_rows, chose, w_rows, n_mask, s_rows, stride_sk, K, ROW_SCALED, BLOCK_SCALED,
                                 SCALE_K, DOT, DOT_IEEE, BLOCK_M, BLOCK_N, BLOCK_K)
        out_rows = out_ptr + pair.to(tl.int64)[None, :] * stride_out
        if GATED:
            tl.store(out_rows + cols[:, None], silu_mul_halves(acc).to(out_ptr.dtype.element_ty),
                     mask=(cols < N // 2)[:, None] & chose[None, :])
        else:
            tl.store(out_rows + offs_n[:, None], acc.to(out_ptr.dtype.element_ty), mask=n_mask[:, None] & chose[None, :])
    if FUSED_SUM:
        # Every slot's program arrives, its own rows stored (the barrier makes all its threads' stores ones the
        # counter's release publishes); the last one sums this column block for every token.
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + pid_n, 1)
        if arrived == tl.num_programs(1) - 1:
            t = tl.arange(0, BLOCK_M)
            c = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            total = weighted_sum(out_ptr, tw_ptr, ids_ptr, t, t < T, c, c < N, N, E, TOP_K, BLOCK_M, BLOCK_N)
            tl.store(sum_ptr + t.to(tl.int64)[:, None] * stride_sum + c[None, :], total.to(sum_ptr.dtype.element_ty),
                     mask=(t < T)[:, None] & (c < N)[None, :])
            tl.atomic_xchg(count_ptr + pid_n, 0)


class _Arrivals:
    """The fused sum's arrival counters, one per column block, per device: allocated once, zeroed, and
    re-armed by the kernel, so CUDA graphs keep a valid pointer."""
    SIZE = 8192

    def __init__(self):
        self.buffers: dict[torch.device, torch.Tensor] = {}

    def get(self, device: torch.device, blocks: int) -> torch.Tensor:
        if blocks > self.SIZE:
            raise ValueError(f"moe_decode: {blocks} column blocks, the arrival counters hold {self.SIZE}")
        if device not in self.buffers:
            self.buffers[device] = torch.zeros(self.SIZE, dtype=torch.int32, device=device)
        return self.buffers[device]


_ARRIVALS = _Arrivals()


def decode_rows_tile(rows: int, dot: bool) -> int:
    """The row tile of a decode launch: the rows' power of two on the CUDA cores, 16 on the tensor cores."""
    return 16 if dot else triton.next_power_of_2(rows)


def _launch(a, w, scale, block, topk_ids, out, cfg, gated, by_pair, sums=None):
    """One decode launch over slots x column blocks (cfg: the gate_up or down part of a decode config)."""
    t, top_k = topk_ids.shape
    e, n, k = w.shape
    slots = min(t * top_k, e)
    blocks = triton.cdiv(n // 2, cfg["BLOCK_N"] // 2) if gated else triton.cdiv(n, cfg["BLOCK_N"])
    fused = sums is not None
    y_sum, weights = sums if fused else (out, out)
    counts = _ARRIVALS.get(a.device, blocks) if fused else topk_ids
    if block is not None:
        s_strides = scale.stride()
    elif scale is not None:
        s_strides = (scale.stride(0), scale.stride(1), 0)
    else:
        s_strides = (0, 0, 0)
    tile = {key: cfg[key] for key in ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages")}
    bucket = triton.next_power_of_2(t)
    _moe_decode_kernel[(blocks, slots)](
        a, w, scale if scale is not None else w, topk_ids, out, weights, y_sum, counts, t, e, n, k, top_k,
        a.stride(0), w.stride(0), *s_strides, out.stride(0), y_sum.stride(0), GATED=gated, A_BY_PAIR=by_pair,
        FUSED_SUM=fused, ROW_SCALED=scale is not None and block is None, BLOCK_SCALED=block is not None,
        SCALE_N=block[0] if block else 1, SCALE_K=block[1] if block else 1, DOT=cfg["DOT"],
        DOT_IEEE=a.dtype == torch.float32, PP=triton.next_power_of_2(bucket * top_k),
        BLOCK_J=triton.next_power_of_2(top_k), BLOCK_M=decode_rows_tile(t, cfg["DOT"]), **tile)


def moe_decode(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, block, cfg, out):
    """fused_moe for T <= MAX_ROWS rows on the decode path, into out [T, H]. cfg: {"gate_up": tile,
    "down": tile, "FUSED_SUM": bool}, each tile {"DOT", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages"}."""
    t, top_k = topk_ids.shape
    inter, hidden = w13.shape[1] // 2, w2.shape[1]
    act = torch.empty(t * top_k, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(t * top_k, hidden, dtype=x.dtype, device=x.device)
    _launch(x, w13, w13_scale, block, topk_ids, act, cfg["gate_up"], gated=True, by_pair=False)
    if cfg.get("FUSED_SUM", False):
        _launch(act, w2, w2_scale, block, topk_ids, y, cfg["down"], gated=False, by_pair=True,
                sums=(out, topk_weights))
        return out
    _launch(act, w2, w2_scale, block, topk_ids, y, cfg["down"], gated=False, by_pair=True)
    return moe_sum(y, topk_weights, topk_ids, w13.shape[0], out)


def default_decode_config(rows: int, weight_bytes: int, block: tuple[int, int] | None) -> dict:
    """Untuned tiles: one row on the CUDA cores in 4 KB weight tiles (16-bit: 8 rows x 256 columns over 4
    warps, FP8 16 x 256 or, in 128-column scale blocks, 32 x 128 over 8), 16-32 float32 lanes a thread:
    with the next tile in flight, 55-80 registers on sm_90 (benchmarks/sm90_compile.py --sets moe), so 4-8
    programs share a multiprocessor with 32-64 KB of weight in flight; more rows as one 16-row tensor-core
    tile against 32-row weight tiles. Block scales cap BLOCK_K at the block's K side."""
    if rows > 1:
        tile = dict(DOT=True, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=1)
    else:
        block_k = 256 if block is None else min(256, block[1])
        tile = dict(DOT=False, BLOCK_N=4096 // (weight_bytes * block_k), BLOCK_K=block_k,
                    num_warps=4 if weight_bytes >= 2 else 8, num_stages=1)
    if block is not None:
        tile["BLOCK_K"] = min(tile["BLOCK_K"], block[1])
    return {"path": "decode", "gate_up": dict(tile), "down": dict(tile), "FUSED_SUM": True}
