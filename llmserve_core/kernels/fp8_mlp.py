"""A decode row's whole FP8 MLP in one launch: y = down(silu(x @ gate^T) * (x @ up^T)) for 1-4 rows.

At one row the MLP is three launches (gate_up, SiLU-and-mul, down), and on the H200 each GEMV loses about
5 us to its fill and drain against the 12-27 us its weight takes to stream (benchmarks/results/fp8_h200.md).
Here program p owns the intermediate features [p * BLOCK_I, (p + 1) * BLOCK_I): it streams those gate and up
rows over all of K (x quantized per 1 x BLOCK_K piece in the kernel and multiplied FP8 by FP8 on the
tensor cores, as fp8_gemv's "a8" kernel does), forms h = silu(g) * u in float32, quantizes h per row over
its BLOCK_I features, and multiplies it by the same BLOCK_I columns of down: one K slice of a split-K down
projection, its partial parked per output chunk. The program that arrives last at a chunk sums the parked
partials in program order (deterministic, whatever the arrival order) and writes y. A program arrives at
ARRIVE chunks' counters at once (one round trip, not one per chunk). Programs walk the chunks from an
offset of their own, so different programs arrive last at different chunks and the merges run side by
side at the end instead of in one program.

Down's columns are read as [BLOCK_H, BLOCK_I] tiles of its row-major [H, I] weight: BLOCK_I bytes per row,
a whole 128-byte line at BLOCK_I 128. Scales: one per output row of each projection, or one per 128 x 128
block (BLOCK_I and BLOCK_K then divide 128 and BLOCK_H is 128, so every tile sees one scale).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from llmserve_core.kernels.fp8_format import FP8, FP8_MAX, MIN_SCALE, dequantize_weight
from llmserve_core.kernels.fp8_gemv import fp8_dot_supported
from llmserve_core.kernels.gemv import TABLE_SMS, num_sms
from llmserve_core.kernels.gemv import _SCRATCH as SPLIT_K_SCRATCH   # shared: calls on one stream never overlap
from llmserve_core.kernels.pdl import pdl_launch, pdl_wait_and_release

MAX_ROWS = 4          # the parked partials grow with the rows; past a few, the three-launch chain is cheaper
SCALE_BLOCK = 128     # the block-scaled checkpoints' 128 x 128 blocks
DEFAULT_CONFIG = dict(BLOCK_I=128, BLOCK_K=128, BLOCK_H=128, MERGE_P=32, ARRIVE=8, num_warps=8, num_stages=3)
# (rows, scale kind) -> tiles where the one launch beat the three-launch chain, measured on the H200 at the
# Qwen3-8B shape (benchmarks/fp8_mlp_bench.py, benchmarks/results/fp8_mlp_h200.md); other row counts run the chain.
MEASURED = {(1, "channel"): DEFAULT_CONFIG, (1, "block"): DEFAULT_CONFIG}


@triton.jit
def _fp8_mlp_kernel(x_ptr, wgu_ptr, sgu_ptr, wd_ptr, sd_ptr, y_ptr, part_ptr, count_ptr, acc_ptr,
                    M, H, I, stride_x, stride_y, stride_sgu, stride_sd,
                    BLOCK_SCALED: tl.constexpr, SB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr,
                    BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr, MERGE_P: tl.constexpr, ATOMIC: tl.constexpr,
                    ARRIVE: tl.constexpr,
                    FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, PDL: tl.constexpr):
    pdl_wait_and_release(PDL)      # x comes from the kernel before
    p = tl.program_id(0)
    num_p = tl.num_programs(0)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    offs_i = p * BLOCK_I + tl.arange(0, BLOCK_I)
    rk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + offs_m[:, None] * stride_x
    g_rows = wgu_ptr + offs_i[:, None].to(tl.int64) * H
    u_rows = wgu_ptr + (I + offs_i)[:, None].to(tl.int64) * H
    acc_g = tl.zeros([BLOCK_I, BLOCK_M], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_I, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k = k0 + rk
        wg = tl.load(g_rows + k[None, :])
        wu = tl.load(u_rows + k[None, :])
        xf = tl.load(x_rows + k[None, :], mask=m_mask[:, None], other=0.0).to(tl.float32)
        x_s = tl.maximum(tl.max(tl.abs(xf), 1) / FP8_MAX, MIN_SCALE)
        xq = (xf / x_s[:, None]).to(wg.dtype)
        part_g = tl.dot(wg, tl.trans(xq)) * x_s[None, :]
        part_u = tl.dot(wu, tl.trans(xq)) * x_s[None, :]
        if BLOCK_SCALED:     # the program's gate rows lie in one scale block row, its up rows in another
            acc_g += part_g * tl.load(sgu_ptr + (p * BLOCK_I // SB) * stride_sgu + k0 // SB)
            acc_u += part_u * tl.load(sgu_ptr + ((I + p * BLOCK_I) // SB) * stride_sgu + k0 // SB)
        else:
            acc_g += part_g
            acc_u += part_u
    if not BLOCK_SCALED:
        acc_g = acc_g * tl.load(sgu_ptr + offs_i)[:, None]
        acc_u = acc_u * tl.load(sgu_ptr + I + offs_i)[:, None]

    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u                       # [BLOCK_I, BLOCK_M]
    h_s = tl.maximum(tl.max(tl.abs(h), 0) / FP8_MAX, MIN_SCALE)       # one scale per row over these features
    hq = (h / h_s[None, :]).to(wd_ptr.dtype.element_ty)

    rh = tl.arange(0, BLOCK_H)
    n_chunks = H // BLOCK_H
    d_cols = wd_ptr + offs_i[None, :]
    part_tile = offs_m[None, :] * BLOCK_H + rh[:, None]               # a chunk's [BLOCK_H, rows] partial
    tile_mask = m_mask[None, :] & (rh[:, None] < BLOCK_H)
    rg = tl.arange(0, ARRIVE)
    for c0 in range(0, n_chunks, ARRIVE):
        for j in tl.static_range(ARRIVE):
            chunk = (c0 + j + p) % n_chunks
            offs_n = chunk * BLOCK_H + rh
            wd = tl.load(d_cols + offs_n[:, None].to(tl.int64) * I)     # [BLOCK_H, BLOCK_I]
            part = tl.dot(wd, hq) * h_s[None, :]                          # [BLOCK_H, BLOCK_M]
            if BLOCK_SCALED:
                part = part * tl.load(sd_ptr + (offs_n // SB) * stride_sd + p * BLOCK_I // SB)[:, None]
            else:
                part = part * tl.load(sd_ptr + offs_n)[:, None]
            if ATOMIC:
                # float32 sums in L2, fire-and-forget (the order varies from call to call)
                tl.atomic_add(acc_ptr + offs_m[None, :] * H + offs_n[:, None], part, mask=tile_mask, sem="relaxed")
            else:
                # Partials of a chunk: [num_p, M, BLOCK_H], each row's BLOCK_H floats contiguous.
                slot = part_ptr + (chunk * num_p + p) * M * BLOCK_H
                tl.store(slot + part_tile, part, mask=tile_mask)
        if not ATOMIC:
            # Arrive at ARRIVE chunks' counters in one round trip: a counter's returned value gates a branch,
            # so one arrival per chunk would stall the stream once per chunk.
            tl.debug_barrier()       # every thread's partial stores before the counters' (acq_rel) increments
            arrived = tl.atomic_add(count_ptr + (c0 + rg + p) % n_chunks, 1)
            for j in tl.static_range(ARRIVE):
                if tl.sum(tl.where(rg == j, arrived, 0)) == num_p - 1:
                    _merge_chunk(part_ptr, y_ptr, count_ptr, (c0 + j + p) % n_chunks, num_p, M, stride_y, BLOCK_H,
                                 MERGE_P)
    if ATOMIC:
        tl.debug_barrier()           # every thread's sums before the counter's (acq_rel) increment
        if tl.atomic_add(count_ptr, 1) == num_p - 1:
            # the last program: y from the sums, which it re-arms to zero for the next call
            for m in range(0, M):
                for n0 in range(0, H, BLOCK_H):
                    sums = acc_ptr + m * H + n0 + rh
                    tl.store(y_ptr + m * stride_y + n0 + rh, tl.load(sums, cache_modifier=".cg").to(y_ptr.dtype.element_ty))
                    tl.store(sums, tl.zeros([BLOCK_H], dtype=tl.float32))
            tl.atomic_xchg(count_ptr, 0)


@triton.jit
def _merge_chunk(part_ptr, y_ptr, count_ptr, chunk, num_p, M, stride_y, BLOCK_H: tl.constexpr,
                 MERGE_P: tl.constexpr):
    """The last program at a chunk: sum every program's partial in program order, write y, re-arm the
    counter. The partials are read from L2 (.cg): other programs wrote them."""
    rp = tl.arange(0, MERGE_P)
    rh = tl.arange(0, BLOCK_H)
    base = part_ptr + chunk * num_p * M * BLOCK_H
    for m in range(0, M):
        total = tl.zeros([BLOCK_H], dtype=tl.float32)
        for p0 in range(0, num_p, MERGE_P):
            ps = p0 + rp
            tile = tl.load(base + (ps[:, None] * M + m) * BLOCK_H + rh[None, :], mask=(ps < num_p)[:, None],
                           other=0.0, cache_modifier=".cg")
            total += tl.sum(tile, 0)
        tl.store(y_ptr + m * stride_y + chunk * BLOCK_H + rh, total.to(y_ptr.dtype.element_ty))
    tl.atomic_xchg(count_ptr + chunk, 0)


_SUMS: dict[tuple[torch.device, int], torch.Tensor] = {}


def _float_sums(device: torch.device, hidden: int) -> torch.Tensor:
    """The ATOMIC merge's float32 sums [MAX_ROWS, hidden], zero between calls (the kernel re-arms them);
    allocated once per device and width, so CUDA graphs keep a valid pointer."""
    key = (torch.device(device), hidden)
    if key not in _SUMS:
        _SUMS[key] = torch.zeros(MAX_ROWS * hidden, dtype=torch.float32, device=device)
    return _SUMS[key]


def fp8_mlp_supported(hidden: int, intermediate: int, gate_up_block, down_block, config: dict | None = None) -> bool:
    """Whether the fused kernel takes these shapes and scale layouts: both projections scaled the same way
    (per channel, or 128 x 128 blocks), and the tiles dividing the sizes."""
    cfg = config or DEFAULT_CONFIG
    blocks = {None if b is None else tuple(b) for b in (gate_up_block, down_block)}
    if len(blocks) != 1 or blocks.pop() not in (None, (SCALE_BLOCK, SCALE_BLOCK)):
        return False
    if gate_up_block is not None and not (SCALE_BLOCK % cfg["BLOCK_I"] == 0 and SCALE_BLOCK % cfg["BLOCK_K"] == 0):
        return False
    arrive = cfg.get("ARRIVE", 1)
    return (intermediate % cfg["BLOCK_I"] == 0 and hidden % cfg["BLOCK_K"] == 0 and hidden % cfg["BLOCK_H"] == 0
            and arrive & (arrive - 1) == 0 and (hidden // cfg["BLOCK_H"]) % arrive == 0)


def fp8_mlp_config(m: int, hidden: int, inter: int, gate_up_block, down_block, device: torch.device) -> dict | None:
    """The measured tiles where the fused kernel beat the chain on a card like the one measured (FP8 tensor
    cores, the table's multiprocessor count), for these shapes and scales; None: run the chain."""
    kind = "channel" if gate_up_block is None else "block"
    cfg = MEASURED.get((m, kind))
    if cfg is None or num_sms(device) != TABLE_SMS or not fp8_dot_supported(device):
        return None
    return dict(cfg) if fp8_mlp_supported(hidden, inter, gate_up_block, down_block, cfg) else None


def fp8_mlp(x: torch.Tensor, w_gate_up: torch.Tensor, s_gate_up: torch.Tensor, w_down: torch.Tensor,
            s_down: torch.Tensor, block: tuple[int, int] | None = None, config: dict | None = None,
            pdl: bool = False) -> torch.Tensor:
    """x [M <= 4, H] (16-bit or float32), w_gate_up [2I, H] float8_e4m3fn as [gate | up] with scales per row
    [2I] or per 128 x 128 block, w_down [H, I] likewise -> y [M, H] in x.dtype.

    fp8_mlp_reference is its arithmetic. pdl: launch under PDL, as a link of the decode chain (x comes from
    the kernel before; nothing is read before the wait)."""
    m, hidden = x.shape
    inter = w_down.shape[1]
    cfg = dict(config or DEFAULT_CONFIG)
    assert 0 < m <= MAX_ROWS, f"fp8_mlp: {m} rows, at most {MAX_ROWS}"
    assert w_gate_up.shape == (2 * inter, hidden) and w_down.shape == (hidden, inter), \
        f"fp8_mlp: gate_up {tuple(w_gate_up.shape)} and down {tuple(w_down.shape)} do not fit x's {hidden} features"
    assert x.stride(1) == 1 and w_gate_up.is_contiguous() and w_down.is_contiguous(), "fp8_mlp: rows must be contiguous"
    assert w_gate_up.dtype == FP8 and w_down.dtype == FP8, "fp8_mlp: the weights must be float8_e4m3fn"
    assert fp8_mlp_supported(hidden, inter, block, block, cfg), \
        f"fp8_mlp: tiles {cfg} do not divide H={hidden}, I={inter} with scale blocks {block}"
    if block is None:
        assert s_gate_up.shape == (2 * inter,) and s_down.shape == (hidden,), "fp8_mlp: per-row scales [2I] and [H]"
        stride_sgu = stride_sd = 0
    else:
        assert s_gate_up.dim() == 2 and s_down.dim() == 2, "fp8_mlp: block scales are 2-D"
        stride_sgu, stride_sd = s_gate_up.stride(0), s_down.stride(0)
    block_i, block_h = cfg.pop("BLOCK_I"), cfg["BLOCK_H"]
    programs = inter // block_i
    chunks = hidden // block_h
    y = torch.empty(m, hidden, dtype=x.dtype, device=x.device)
    atomic = cfg.setdefault("ATOMIC", False)
    cfg.setdefault("ARRIVE", 1)
    parts, counts = SPLIT_K_SCRATCH.get(x.device, 0 if atomic else chunks * programs * m * block_h, chunks)
    sums = _float_sums(x.device, hidden) if atomic else parts
    _fp8_mlp_kernel[(programs,)](
        x, w_gate_up, s_gate_up, w_down, s_down, y, parts, counts, sums, m, hidden, inter, x.stride(0), y.stride(0),
        stride_sgu, stride_sd, BLOCK_SCALED=block is not None, SB=SCALE_BLOCK, BLOCK_M=16, BLOCK_I=block_i,
        FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE, PDL=pdl, **cfg, **pdl_launch(pdl))
    return y


def fp8_mlp_reference(x: torch.Tensor, w_gate_up: torch.Tensor, s_gate_up: torch.Tensor, w_down: torch.Tensor,
                      s_down: torch.Tensor, block: tuple[int, int] | None = None, k_group: int = 128,
                      h_group: int = 128) -> torch.Tensor:
    """The kernel's arithmetic in float32: x quantized per 1 x k_group piece of each row (BLOCK_K), both
    projections of the dequantized weights, h = silu(gate) * up quantized per 1 x h_group piece (BLOCK_I)."""
    from llmserve_core.kernels.fp8_quant import quantize_activation_reference

    def dequantized(a: torch.Tensor, group: int) -> torch.Tensor:
        q, s = quantize_activation_reference(a, group)
        return q.float() * s.repeat_interleave(group, 1)[:, :a.shape[1]]

    gate_up = dequantized(x, k_group) @ dequantize_weight(w_gate_up, s_gate_up, block).t()
    gate, up = gate_up.chunk(2, dim=-1)
    h = F.silu(gate) * up
    return (dequantized(h, h_group) @ dequantize_weight(w_down, s_down, block).t()).to(x.dtype)
