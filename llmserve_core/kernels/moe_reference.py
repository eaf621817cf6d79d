"""Torch references for the mixture-of-experts layer, looping over experts: routing and the experts'
weighted sum. kernels/fused_moe.py's Triton kernels are tested against these.

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
    """router_logits [T, E] -> (topk_weights [T, k] float32, topk_ids [T, k] int32): the softmax in float32, its
    k largest, largest first, renormalised to sum to one when `renormalize` (config.json's norm_topk_prob).

    Equal probabilities are taken lowest expert first (a stable sort). torch.topk, which transformers calls,
    picks the same experts wherever no tie straddles the k-th place, but orders ties (and on the CPU picks
    among them) by its partial sort's internals, which no kernel can reproduce; in bf16 such ties do happen."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, ids = weights[:, :top_k], ids[:, :top_k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def _expert_matmul(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, block) -> torch.Tensor:
    """x @ w.T in x.dtype: a weight in the model dtype as F.linear does, an FP8 one dequantized, in float32."""
    if scale is None:
        return F.linear(x, w)
    return (x.float() @ dequantize_weight(w, scale, block).t()).to(x.dtype)


def fused_moe_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, w13_scale: torch.Tensor | None = None,
                        w2_scale: torch.Tensor | None = None, block=None) -> torch.Tensor:
    """x [T, H] -> [T, H] in x.dtype: the sum over k of topk_weights[t, k] * expert topk_ids[t, k]'s
    down(silu(gate(x)) * up(x)). Each expert's products run in x.dtype; the weighted results are summed in
    float32 in slot order (k = 0, 1, ...) and cast once. An id outside [0, E) (under expert parallelism, an
    expert another rank holds) contributes nothing."""
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    per_slot = torch.zeros(*topk_ids.shape, w2.shape[1], dtype=torch.float32, device=x.device)
    ids = topk_ids.long()
    for e in range(num_experts):
        tokens, slots = torch.nonzero(ids == e, as_tuple=True)
        if tokens.numel() == 0:
            continue
        gate_up = _expert_matmul(x[tokens], w13[e], None if w13_scale is None else w13_scale[e], block)
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = _expert_matmul(act, w2[e], None if w2_scale is None else w2_scale[e], block)
        per_slot[tokens, slots] = y.float() * topk_weights[tokens, slots].float()[:, None]
    total = per_slot[:, 0]
    for slot in range(1, topk_ids.shape[1]):
        total = total + per_slot[:, slot]
    return total.to(x.dtype)
