"""Torch references for the mixture-of-experts layer: routing and the experts' weighted sum, looping over
experts. kernels/fused_moe.py's Triton kernels are tested against these, and the model runs them off the
fast path (the CPU, the torch attention backend).

Weights are stacked per layer, rows = output features: w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I].
FP8 weights carry float32 scales (real = stored * scale): per output channel (w13_scale [E, 2I], w2_scale
[E, H]) or, with `block` (bn, bk), per bn x bk tile (w13_scale [E, ceil(2I/bn), ceil(H/bk)], w2_scale
[E, ceil(H/bn), ceil(I/bk)]).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from llmserve_core.kernels.fp8_format import dequantize_weight


def route_reference(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (topk_weights [T, k] float32, topk_ids [T, k] int32): the softmax in float32,
    its k largest (ties as torch.topk breaks them, as transformers' router does), renormalised to sum to one
    when `renormalize` (config.json's norm_topk_prob)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def expert_weight(w: torch.Tensor, scale: torch.Tensor | None, e: int, block) -> torch.Tensor:
    """Expert e's [N, K] weight as the reference multiplies it: as stored, or dequantized to float32."""
    return w[e] if scale is None else dequantize_weight(w[e], scale[e], block)


def _matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T in x.dtype: a float weight in the model dtype as F.linear does; a dequantized FP8 weight in
    float32 (layers/fp8_linear.py's reference)."""
    if w.dtype == x.dtype:
        return F.linear(x, w)
    return (x.float() @ w.t()).to(x.dtype)


def fused_moe_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, w13_scale: torch.Tensor | None = None,
                        w2_scale: torch.Tensor | None = None, block=None) -> torch.Tensor:
    """x [T, H] -> [T, H] in x.dtype: sum over k of topk_weights[t, k] * expert topk_ids[t, k]'s
    down(silu(gate(x)) * up(x)). Each expert's products run in x.dtype; the weighted results are summed
    in float32 in slot order (k = 0, 1, ...) and cast once. An id outside [0, E) (expert parallelism's -1:
    an expert another rank holds) contributes nothing."""
    T, k = topk_ids.shape
    E, two_i, _ = w13.shape
    inter = two_i // 2
    out = torch.zeros(T, k, w2.shape[1], dtype=torch.float32, device=x.device)
    ids = topk_ids.long()
    for e in torch.unique(ids).tolist():
        if not 0 <= e < E:
            continue
        tokens, slots = torch.nonzero(ids == e, as_tuple=True)
        gate_up = _matmul(x[tokens], expert_weight(w13, w13_scale, e, block))
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = _matmul(act, expert_weight(w2, w2_scale, e, block))
        out[tokens, slots] = y.float() * topk_weights[tokens, slots].float()[:, None]
    total = out[:, 0]
    for slot in range(1, k):
        total = total + out[:, slot]
    return total.to(x.dtype)
