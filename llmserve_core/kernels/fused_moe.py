"""The mixture-of-experts layer's kernels behind two calls: `route` (the router's top-k) and `fused_moe` (the
chosen experts' SiLU-gated MLPs, weighted and summed per token), each matching kernels/moe_reference.py.

fused_moe takes the decode path (kernels/moe_decode.py: each selected expert's weights read once, no sort)
or the grouped GEMM (kernels/moe_align.py sorts the pairs by expert into row blocks, kernels/moe_gemm.py
multiplies them and sums each token's k results) as the tile table (kernels/moe_configs.py) says for the
rows bucket. No atomics add results, so every run gives the same bits; no host syncs and shapes that
depend on the row count only, so CUDA graphs capture every path.

FP8 experts (float8_e4m3fn, per-channel or block scales, as the reference takes them): the decode path
widens the weight in registers against the rows as they are; the grouped GEMM quantizes its rows
(kernels/fp8_quant.py: per token for per-channel weights, per 1 x bk piece for bn x bk blocks) and runs
on the FP8 tensor cores.
"""
from __future__ import annotations

import torch

from llmserve_core.kernels.fp8_format import FP8
from llmserve_core.kernels.fp8_quant import quantize_activation
from llmserve_core.kernels.moe_align import align, route
from llmserve_core.kernels.moe_configs import moe_config, rows_bucket
from llmserve_core.kernels.moe_decode import MAX_PAIRS, moe_decode
from llmserve_core.kernels.moe_decode import fits as decode_fits
from llmserve_core.kernels.moe_gemm import moe_gemm, moe_sum

__all__ = ["route", "fused_moe", "warmup_row_counts", "warm_up"]


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
    contribute nothing). config: the tiles to run (moe_configs' entry format) instead of the table's."""
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


def warmup_row_counts(max_rows: int) -> list[int]:
    """Row counts that meet every kernel variant fused_moe launches for 1..max_rows rows: every choice
    depends on the rows bucket (a power of two) only, so one count per bucket, the bucket's top."""
    counts, bucket = set(), 1
    while bucket < rows_bucket(max_rows):
        counts.add(bucket)
        bucket *= 2
    return sorted(counts | {max_rows})


def warm_up(w13: torch.Tensor, w2: torch.Tensor, top_k: int, max_rows: int, w13_scale: torch.Tensor | None = None,
            w2_scale: torch.Tensor | None = None, block: tuple[int, int] | None = None, renormalize: bool = True,
            dtype: torch.dtype | None = None) -> list[int]:
    """Compile every variant of route and fused_moe for one layer shape up to max_rows rows, on random rows
    (dtype: the activations', needed for FP8 weights, else the weights'). Returns the row counts run."""
    dtype = dtype or w13.dtype
    counts = warmup_row_counts(max_rows)
    gen = torch.Generator(device=w13.device).manual_seed(0)
    for rows in counts:
        x = torch.randn(rows, w13.shape[2], generator=gen, device=w13.device).to(dtype)
        logits = torch.randn(rows, w13.shape[0], generator=gen, device=w13.device).to(dtype)
        weights, ids = route(logits, top_k, renormalize)
        fused_moe(x, w13, w2, weights, ids, w13_scale, w2_scale, block)
    return counts
