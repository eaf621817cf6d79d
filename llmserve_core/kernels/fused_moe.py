"""The mixture-of-experts layer's kernels behind two calls: `route` (the router's top-k) and `fused_moe` (the
chosen experts' SiLU-gated MLPs, weighted and summed per token), each matching kernels/moe_reference.py.

fused_moe takes the decode path (kernels/moe_decode.py: each selected expert's weights read once, no sort)
or the grouped GEMM (kernels/moe_align.py sorts the pairs by expert into row blocks, kernels/moe_gemm.py
multiplies them and sums each token's k results) as its tiles for the rows bucket say. No atomics add
results, so every run gives the same bits; no host syncs and shapes that depend on the row count only, so
CUDA graphs capture every path.

Tiles are data: the `fused_moe` family of kernels/tuned.py's tables (configs/fused_moe/device=<card>.json,
written by benchmarks/moe_tune.py), keyed by the expert count E, the gate_up weight [N = 2I, K = H], the
rows bucket (a power of two: rows=64 serves 33..64 rows) and the weights' dtype (bf16, fp16, fp32, fp8_w8a8
for per-channel scales, fp8_w8a8_128x128 for block scales):

    "E=128,N=1536,K=2048,rows=1,dtype=bf16": {"path": "decode", "FUSED_SUM": true,
        "gate_up": {"DOT": false, "BLOCK_N": 8, "BLOCK_K": 256, "num_warps": 4, "num_stages": 1}, "down": {...}}
    "E=128,N=1536,K=2048,rows=4096,dtype=bf16": {"path": "grouped", "BLOCK_M": 64,
        "gate_up": {"BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}, "down": {...}}

A card, shape or bucket without an entry gets the heuristic (_heuristic), and so does an entry that does not
fit the call (a decode entry past what moe_decode.fits, a K tile that straddles a scale block): never an
error. Every choice depends on the rows bucket only, never the exact row count, so one call per bucket
compiles every variant (the engine's warm-up runs a step in each: engine/warmup.py).

FP8 experts (float8_e4m3fn, per-channel or block scales, as the reference takes them): the decode path
widens the weight in registers against the rows as they are; the grouped GEMM quantizes its rows
(kernels/fp8_quant.py: per token for per-channel weights, per 1 x bk piece for bn x bk blocks) and runs
on the FP8 tensor cores.
"""
from __future__ import annotations

import logging
from typing import Mapping

import torch
import triton

from llmserve_core.kernels import tuned
from llmserve_core.kernels.fp8_format import FP8
from llmserve_core.kernels.fp8_quant import quantize_activation
from llmserve_core.kernels.moe_align import align, route
from llmserve_core.kernels.moe_decode import MAX_PAIRS, default_decode_config, moe_decode
from llmserve_core.kernels.moe_decode import fits as decode_fits
from llmserve_core.kernels.moe_gemm import moe_gemm, moe_sum

__all__ = ["route", "fused_moe", "moe_config"]

log = logging.getLogger("llmserve.kernels")

KEYS = ("E", "N", "K", "rows", "dtype")
DECODE_ROWS = 8      # the heuristic's decode path: up to this many rows; a table may take it to moe_decode.MAX_ROWS
ROUTED = 8           # the heuristic sizes row blocks for Qwen3-MoE's top-8 (a table key has no top-k)
GROUPED_KEYS = ("BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")
DECODE_KEYS = ("DOT", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")


def rows_bucket(rows: int) -> int:
    return triton.next_power_of_2(max(1, rows))


def dtype_key(weight_dtype: torch.dtype, block: tuple[int, int] | None) -> str:
    """The table's dtype field: bf16 / fp16 / fp32, fp8_w8a8 (per-channel scales), fp8_w8a8_128x128 (blocks)."""
    if weight_dtype == FP8:
        return "fp8_w8a8" if block is None else f"fp8_w8a8_{block[0]}x{block[1]}"
    return tuned.dtype_key(weight_dtype)


def _key_block(dtype: str) -> tuple[tuple[int, int] | None, int]:
    """(block, weight bytes) of a table dtype field."""
    if not dtype.startswith("fp8"):
        return None, tuned.key_dtype(dtype).itemsize
    scales = dtype.removeprefix("fp8_w8a8").lstrip("_")
    return (tuple(int(v) for v in scales.split("x")) if scales else None), 1


def grouped_config(bucket: int, num_experts: int, weight_bytes: int, block: tuple[int, int] | None,
                   top_k: int = ROUTED) -> dict:
    """The grouped GEMM in row blocks sized to the rows each expert gets on average (16 to 64: FP8 block
    scales spill at 128), with vLLM's style of tiles (untuned here). Block scales keep a scaled partial
    product beside the accumulator: a 64 x 128 tile took 248 registers over 4 warps on sm_90, so they get 8."""
    per_expert = bucket * top_k / num_experts
    block_m = 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64
    tile = dict(BLOCK_N=64 if block_m == 16 else 128, BLOCK_K=64 if weight_bytes >= 2 else 128,
                GROUP_M=1 if block_m == 16 else 8, num_warps=4, num_stages=3)
    if block is not None:
        tile["BLOCK_K"] = min(tile["BLOCK_K"], block[1])
        tile["num_warps"] = 8 if block_m >= 64 else 4
    return {"path": "grouped", "BLOCK_M": block_m, "gate_up": dict(tile), "down": dict(tile)}


def default_config(bucket: int, num_experts: int, weight_bytes: int, block: tuple[int, int] | None,
                   top_k: int = ROUTED) -> dict:
    """The heuristic: the decode path up to DECODE_ROWS rows (where moe_decode.fits the top-k), the grouped
    GEMM past it."""
    if bucket <= DECODE_ROWS and decode_fits(bucket, top_k):
        return default_decode_config(bucket, weight_bytes, block)
    return grouped_config(bucket, num_experts, weight_bytes, block, top_k)


@tuned.family("fused_moe", KEYS)
def _heuristic(device: tuned.Device, E: int, N: int, K: int, rows: int, dtype: str) -> dict:
    block, weight_bytes = _key_block(dtype)
    return default_config(rows, E, weight_bytes, block)


def usable(cfg: Mapping, rows: int, top_k: int, block: tuple[int, int] | None) -> bool:
    """Whether a config fits a call of `rows` rows: a known path with every tile key, a decode config only
    where moe_decode.fits, even column tiles (gate_up pairs gate and up rows), K tiles inside a scale block."""
    try:
        keys = DECODE_KEYS if cfg["path"] == "decode" else GROUPED_KEYS
        if cfg["path"] not in ("decode", "grouped") or (cfg["path"] == "decode" and not decode_fits(rows, top_k)):
            return False
        if cfg["path"] == "grouped" and cfg["BLOCK_M"] not in (16, 32, 64, 128):
            return False
        for part in (cfg["gate_up"], cfg["down"]):
            if any(key not in part for key in keys) or part["BLOCK_N"] % 2:
                return False
            if block is not None and block[1] % part["BLOCK_K"]:
                return False
        return True
    except (KeyError, TypeError):
        return False


def fit_to_device(cfg: Mapping, a_bytes: int, w_bytes: int, smem_limit: int) -> dict:
    """A plain copy of cfg; a grouped one with fewer pipeline stages (down to 1) where its operand tiles
    would overfill the card's shared memory per block (smem_limit 0: no CUDA card, nothing to fit)."""
    cfg = {**cfg, "gate_up": dict(cfg["gate_up"]), "down": dict(cfg["down"])}
    if cfg["path"] != "grouped" or not smem_limit:
        return cfg
    for part in (cfg["gate_up"], cfg["down"]):
        per_stage = part["BLOCK_K"] * (cfg["BLOCK_M"] * a_bytes + part["BLOCK_N"] * w_bytes)
        while part["num_stages"] > 1 and part["num_stages"] * per_stage > smem_limit:
            part["num_stages"] -= 1
    return cfg


def moe_config(rows: int, num_experts: int, n: int, k: int, top_k: int, weight_dtype: torch.dtype,
               act_dtype: torch.dtype, block: tuple[int, int] | None, device: torch.device) -> dict:
    """The tiles for a fused_moe call of `rows` rows: tuned.lookup's for the rows bucket (the card's table
    entry, else the heuristic), the heuristic for this top-k where that does not fit the call; fitted to
    the card."""
    return _config(rows_bucket(rows), num_experts, n, k, top_k, weight_dtype, act_dtype, block,
                   tuned.device_spec(device))


@tuned.cached
def _config(bucket: int, num_experts: int, n: int, k: int, top_k: int, weight_dtype: torch.dtype,
            act_dtype: torch.dtype, block: tuple[int, int] | None, card: tuned.Device) -> dict:
    shape = dict(E=num_experts, N=n, K=k, rows=bucket, dtype=dtype_key(weight_dtype, block))
    cfg = tuned.lookup("fused_moe", card, **shape)
    weight_bytes = weight_dtype.itemsize
    if not usable(cfg, bucket, top_k, block):
        if tuned.tuned("fused_moe", card, **shape) is not None:
            log.warning("fused_moe: the table entry for %s does not fit a top-%d call (%s); using the default",
                        shape, top_k, dict(cfg))
        cfg = default_config(bucket, num_experts, weight_bytes, block, top_k)
    a_bytes = 1 if weight_dtype == FP8 else act_dtype.itemsize
    return fit_to_device(cfg, a_bytes, weight_bytes, card.smem)


def _check(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, block) -> None:
    """Shapes and dtypes as moe_reference's contract has them, or a ValueError naming the argument."""
    def need(ok: bool, what: str):
        if not ok:
            raise ValueError(f"fused_moe: {what}")
    need(x.dim() == 2 and x.stride(1) == 1, f"x must be [T, H] with contiguous rows, got {tuple(x.shape)}")
    need(w13.dim() == 3 and w13.is_contiguous() and w13.shape[1] % 2 == 0 and w13.shape[2] == x.shape[1],
         f"w13 must be a contiguous [E, 2I, H={x.shape[1]}], got {tuple(w13.shape)}")
    num_experts, two_i, hidden = w13.shape
    need(w2.is_contiguous() and tuple(w2.shape) == (num_experts, hidden, two_i // 2),
         f"w2 must be a contiguous [E, H, I] = {(num_experts, hidden, two_i // 2)}, got {tuple(w2.shape)}")
    need(topk_ids.dim() == 2 and topk_ids.shape[0] == x.shape[0] and topk_ids.dtype == torch.int32
         and topk_ids.is_contiguous(), f"topk_ids must be a contiguous int32 [T={x.shape[0]}, k]")
    need(topk_weights.shape == topk_ids.shape and topk_weights.dtype == torch.float32
         and topk_weights.is_contiguous(), "topk_weights must be a contiguous float32 tensor shaped as topk_ids")
    fp8 = w13.dtype == FP8
    need(w2.dtype == w13.dtype and (fp8 or w13.dtype == x.dtype),
         f"w13 and w2 must both be x's dtype ({x.dtype}) or float8_e4m3fn, got {w13.dtype} and {w2.dtype}")
    need(fp8 == (w13_scale is not None) == (w2_scale is not None), "FP8 weights take w13_scale and w2_scale, "
         "and only they do")
    need(block is None or fp8, "block scales are for FP8 weights")
    if not fp8:
        return
    inter = two_i // 2
    if block is None:
        shapes = ((num_experts, two_i), (num_experts, hidden))
    else:
        bn, bk = block
        shapes = ((num_experts, -(-two_i // bn), -(-hidden // bk)), (num_experts, -(-hidden // bn), -(-inter // bk)))
    for name, scale, shape in (("w13_scale", w13_scale, shapes[0]), ("w2_scale", w2_scale, shapes[1])):
        need(tuple(scale.shape) == shape and scale.dtype == torch.float32 and scale.stride(-1) == 1,
             f"{name} must be float32 {shape} with its last dim contiguous, got {tuple(scale.shape)} {scale.dtype}")


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
              block: tuple[int, int] | None = None, config: dict | None = None) -> torch.Tensor:
    """x [T, H] -> [T, H] in x.dtype: moe_reference.fused_moe_reference's result (ids outside [0, E)
    contribute nothing). config: the tiles to run (a table entry's format) instead of the table's."""
    block = tuple(block) if block is not None else None
    _check(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, block)
    rows, top_k = topk_ids.shape
    out = torch.empty(rows, w2.shape[1], dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    cfg = config or moe_config(rows, w13.shape[0], w13.shape[1], w13.shape[2], top_k, w13.dtype, x.dtype, block,
                               x.device)
    if cfg["path"] == "decode":
        if not decode_fits(rows, top_k):
            raise ValueError(f"fused_moe: the decode path takes up to {MAX_PAIRS} pairs' dedup tile, not "
                             f"{rows} rows x top-{top_k}")
        return moe_decode(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, block, cfg, out)
    return _grouped(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, block, cfg, out)


def _grouped(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, block, cfg, out):
    rows, top_k = topk_ids.shape
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    block_m = cfg["BLOCK_M"]
    aligned = align(topk_ids, num_experts, block_m)
    fp8 = w13.dtype == FP8
    group = block[1] if block is not None else None      # per 1 x bk piece, or one scale per row
    a, a_scale = quantize_activation(x, group) if fp8 else (x, None)
    act = torch.empty(rows * top_k, inter, dtype=x.dtype, device=x.device)
    moe_gemm(a, a_scale, w13, w13_scale, act, aligned.sorted_pairs, aligned.block_expert, aligned.num_blocks,
             top_k, gated=True, by_pair=False, block=block, cfg=dict(cfg["gate_up"], BLOCK_M=block_m))
    a, a_scale = quantize_activation(act, group) if fp8 else (act, None)
    y = torch.empty(rows * top_k, w2.shape[1], dtype=x.dtype, device=x.device)
    moe_gemm(a, a_scale, w2, w2_scale, y, aligned.sorted_pairs, aligned.block_expert, aligned.num_blocks,
             top_k, gated=False, by_pair=True, block=block, cfg=dict(cfg["down"], BLOCK_M=block_m))
    return moe_sum(y, topk_weights, topk_ids, num_experts, out)

